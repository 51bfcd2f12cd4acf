"""The names of the weight formats, on their own so that the gateway can check a catalog's
quantization without loading gguf or numpy (models/quant.py holds the formats themselves)."""

FLOAT_FORMATS = ("f32", "f16", "bf16")
# GGML's legacy formats (blocks of 32 values) and its K-quants (super-blocks of 256)
LEGACY_FORMATS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
K_FORMATS = ("q4_k", "q5_k", "q6_k")
BLOCK_FORMATS = LEGACY_FORMATS + K_FORMATS
FORMATS = FLOAT_FORMATS + BLOCK_FORMATS
