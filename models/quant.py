"""Weight formats: a QuantTensor keeps a matrix in its stored format (float or GGML block-quantized).

Block formats follow GGML byte for byte, one row of the matrix after another:
  q8_0  blocks of 32: f16 scale d, 32 x int8 q            -> w = d * q
  q4_0  blocks of 32: f16 scale d, 16 bytes of nibbles    -> w = d * (q - 8)
  q4_1  blocks of 32: f16 scale d, f16 min m, 16 bytes     -> w = d * q + m
  q5_0  blocks of 32: f16 scale d, 4 bytes of 5th bits, 16 bytes -> w = d * (q - 16)
  q5_1  blocks of 32: f16 scale d, f16 min m, 4 + 16 bytes  -> w = d * q + m
  q4_k, q5_k, q6_k  super-blocks of 256 (models/kquants.py)
Nibble j of a block (j < 16) is the low half of byte j, nibble j + 16 its high half; bit j of q5's 32-bit
word is the 5th bit of value j. Encoding and decoding go through the `gguf` package, the reference
implementation of these formats, except the K-quant encoder, which gguf lacks (models/kquants.py).

Every block format is affine per group of values (`QuantTensor.affine`): w = scale * code + offset with
an unsigned integer code and exact float32 scale and offset per group of 32 values (16 for q6_k); the
backends repack from that one view.
"""
from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np

from models import kquants
from models.formats import BLOCK_FORMATS, FLOAT_FORMATS, FORMATS, K_FORMATS  # noqa: F401 (re-exported)

QK = 32  # values per block of the legacy formats, and per scale group of the kernels' layouts

GGML_TYPE = {
    "f32": gguf.GGMLQuantizationType.F32,
    "f16": gguf.GGMLQuantizationType.F16,
    "bf16": gguf.GGMLQuantizationType.BF16,
    "q8_0": gguf.GGMLQuantizationType.Q8_0,
    "q4_0": gguf.GGMLQuantizationType.Q4_0,
    "q4_1": gguf.GGMLQuantizationType.Q4_1,
    "q5_0": gguf.GGMLQuantizationType.Q5_0,
    "q5_1": gguf.GGMLQuantizationType.Q5_1,
    "q4_k": gguf.GGMLQuantizationType.Q4_K,
    "q5_k": gguf.GGMLQuantizationType.Q5_K,
    "q6_k": gguf.GGMLQuantizationType.Q6_K,
}
FORMAT_OF_GGML = {v: k for k, v in GGML_TYPE.items()}
# bytes of one stored block of QK values (GGML's own table; float formats store one value a "block")
BLOCK_BYTES = {f: gguf.GGML_QUANT_SIZES[t][1] for f, t in GGML_TYPE.items() if f in BLOCK_FORMATS}
BLOCK_VALUES = {f: gguf.GGML_QUANT_SIZES[t][0] for f, t in GGML_TYPE.items() if f in BLOCK_FORMATS}
# formats whose offset is a fixed multiple of the scale: w = d * (code - CODE_ZERO)
CODE_ZERO = {"q8_0": 128, "q4_0": 8, "q5_0": 16, "q6_k": 32}
# the scales are float16 per group as stored (else d * sub-block scale: exact in float32, not in float16)
HALF_SCALES = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
# what a K-quant becomes for a matrix whose rows are not a multiple of 256 (llama.cpp's own choice)
K_FALLBACK = {"q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}


# Bytes per weight in each backend's kernel layout (docs/quantization.md): what a loaded matrix takes, and
# what a node's memory budget counts before a load. The CPU pads a matrix's rows to a multiple of
# LAYOUT_TILE_ROWS (CUDA does not; the count pads them anyway). CUDA's codes of 5 and 6 bits take a byte.
LAYOUT_TILE_ROWS = 16
LAYOUT_BYTES_PER_WEIGHT = {
    "cpu": {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 1.0625, "q4_0": 0.5625, "q4_1": 0.625, "q5_0": 0.6875,
            "q5_1": 0.75, "q4_k": 0.578125, "q5_k": 0.703125, "q6_k": 1.078125},
    "cuda": {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 1.0625, "q4_0": 0.625, "q4_1": 0.625, "q5_0": 1.0625,
             "q5_1": 1.25, "q4_k": 0.75, "q5_k": 1.25, "q6_k": 1.25},
}


def converted_format(fmt: str | None, row_length: int) -> str | None:
    """The format a matrix with rows of row_length takes when converted to `fmt`: a K-quant's fallback where
    its super-blocks do not divide the rows, and f16 where no block of the format does (llama.cpp's rule)."""
    if fmt in K_FALLBACK and row_length % BLOCK_VALUES[fmt]:
        fmt = K_FALLBACK[fmt]
    if fmt in BLOCK_VALUES and row_length % BLOCK_VALUES[fmt]:
        return "f16"
    return fmt


def bytes_per_weight(fmt: str) -> float:
    """Stored bytes per matrix element of format `fmt` (block formats include their scales)."""
    if fmt not in GGML_TYPE:
        raise UnsupportedFormat(f"unsupported weight format {fmt!r}")
    block, nbytes = gguf.GGML_QUANT_SIZES[GGML_TYPE[fmt]]
    return nbytes / block


class UnsupportedFormat(ValueError):
    pass


def format_of_ggml(qtype) -> str:
    try:
        return FORMAT_OF_GGML[gguf.GGMLQuantizationType(qtype)]
    except (KeyError, ValueError):
        name = getattr(qtype, "name", str(qtype))
        raise UnsupportedFormat(
            f"unsupported GGUF tensor type {name} (supported: {', '.join(f.upper() for f in FORMATS)})"
        ) from None


@dataclass
class QuantTensor:
    """A weight matrix (rows = outputs, cols = inputs) held in its stored format.

    data: float32 / float16 arrays of `shape`; bf16 as uint16 of `shape`;
          block formats as uint8 of (rows, bytes per row).
    """
    format: str
    shape: tuple[int, ...]
    data: np.ndarray

    def __post_init__(self):
        if self.format not in FORMATS:
            raise UnsupportedFormat(f"unsupported weight format {self.format!r}")
        self.shape = tuple(int(s) for s in self.shape)
        if self.format in BLOCK_FORMATS and self.shape[-1] % BLOCK_VALUES[self.format]:
            raise ValueError(f"{self.format} needs a row length divisible by {BLOCK_VALUES[self.format]}, "
                             f"got {self.shape}")

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def dequantize(self) -> np.ndarray:
        """The matrix as float32."""
        if self.format == "f32":
            return np.asarray(self.data, dtype=np.float32)
        if self.format == "f16":
            return self.data.astype(np.float32)
        if self.format == "bf16":
            return (self.data.astype(np.uint32) << 16).view(np.float32)
        flat = gguf.quants.dequantize(np.ascontiguousarray(self.data), GGML_TYPE[self.format])
        return flat.reshape(self.shape).astype(np.float32, copy=False)

    def affine(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """A block format as (codes uint8 [N, K], scale float32 [N, K/g], offset float32 [N, K/g], g):
        w[n, k] = scale[n, k // g] * codes[n, k] + offset[n, k // g] exactly (g = 32; 16 for q6_k)."""
        if self.format not in BLOCK_FORMATS:
            raise ValueError(f"{self.format} is not a block format")
        n, k = self.shape
        if self.format in K_FORMATS:
            fields = self.k_fields()
            scale, offset = fields.scales(self.format)
            g = kquants.SUB[self.format]
            return fields.q.reshape(n, k), scale.reshape(n, k // g), offset.reshape(n, k // g), g
        blocks = np.asarray(self.data).reshape(n, k // QK, BLOCK_BYTES[self.format])
        d = np.ascontiguousarray(blocks[:, :, 0:2]).view(np.float16)[..., 0].astype(np.float32)
        if self.format == "q8_0":
            codes = (blocks[:, :, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        else:
            has_min = self.format in ("q4_1", "q5_1")
            qs = blocks[:, :, -16:]
            codes = np.concatenate([qs & 15, qs >> 4], axis=-1)
            if self.format in ("q5_0", "q5_1"):
                at = 4 if has_min else 2
                qh = np.ascontiguousarray(blocks[:, :, at:at + 4]).view(np.uint32)  # [N, nb, 1]
                codes = codes | (((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4)
        if self.format in CODE_ZERO:
            offset = d * np.float32(-CODE_ZERO[self.format])
        else:
            offset = np.ascontiguousarray(blocks[:, :, 2:4]).view(np.float16)[..., 0].astype(np.float32)
        return codes.reshape(n, k), d, offset, QK

    def k_fields(self) -> kquants.KFields:
        """A K-quant's integer fields, its super-blocks in row-major order (K / 256 a row)."""
        return kquants.unpack(self.format, np.asarray(self.data).reshape(-1, BLOCK_BYTES[self.format]))

    def rows(self, index: np.ndarray) -> "QuantTensor":
        """A new tensor holding the selected rows (row reordering never splits a block)."""
        return QuantTensor(self.format, (len(index),) + self.shape[1:], np.ascontiguousarray(self.data[index]))

    @classmethod
    def from_float(cls, w: np.ndarray, fmt: str) -> "QuantTensor":
        """Encode a float matrix in `fmt`."""
        w = np.ascontiguousarray(w, dtype=np.float32)
        if fmt == "f32":
            return cls(fmt, w.shape, w)
        if fmt == "f16":
            return cls(fmt, w.shape, w.astype(np.float16))
        if fmt == "bf16":
            u = w.view(np.uint32)
            # round to nearest even, as torch and gguf do
            rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
            return cls(fmt, w.shape, rounded)
        if fmt not in BLOCK_FORMATS:
            raise UnsupportedFormat(f"unsupported weight format {fmt!r}")
        if w.shape[-1] % BLOCK_VALUES[fmt]:
            raise ValueError(f"{fmt} needs a row length divisible by {BLOCK_VALUES[fmt]}, got {w.shape}")
        if fmt in K_FORMATS:
            return cls(fmt, w.shape, kquants.quantize(fmt, w))
        return cls(fmt, w.shape, gguf.quants.quantize(w, GGML_TYPE[fmt]))

    @classmethod
    def from_raw(cls, fmt: str, shape, raw: np.ndarray) -> "QuantTensor":
        """Wrap bytes as stored in a GGUF or safetensors file."""
        shape = tuple(int(s) for s in shape)
        if fmt == "f32":
            data = np.asarray(raw).view(np.float32).reshape(shape)
        elif fmt == "f16":
            data = np.asarray(raw).view(np.float16).reshape(shape)
        elif fmt == "bf16":
            data = np.asarray(raw).view(np.uint16).reshape(shape)
        else:
            block, nbytes = gguf.GGML_QUANT_SIZES[GGML_TYPE[fmt]]
            data = np.asarray(raw).view(np.uint8).reshape(shape[0], shape[1] // block * nbytes)
        return cls(fmt, shape, data)

    def convert(self, fmt: str | None) -> "QuantTensor":
        """This matrix in `fmt` (a K-quant falls back as llama.cpp does where rows are not a multiple of 256)."""
        fmt = converted_format(fmt, self.shape[-1])
        if fmt is None or fmt == self.format:
            return self
        return QuantTensor.from_float(self.dequantize(), fmt)
