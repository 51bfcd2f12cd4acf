"""The names of the weight formats, on their own so that the gateway can check a catalog's
quantization without loading gguf or numpy (models/quant.py holds the formats themselves)."""

FLOAT_FORMATS = ("f32", "f16", "bf16")
BLOCK_FORMATS = ("q8_0", "q4_0", "q4_1")
FORMATS = FLOAT_FORMATS + BLOCK_FORMATS
