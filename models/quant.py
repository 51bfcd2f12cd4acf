"""Weight formats: a QuantTensor keeps a matrix in its stored format (float or GGML block-quantized).

Block formats follow GGML byte for byte, one row of the matrix after another:
  q8_0  blocks of 32: f16 scale d, 32 x int8 q            -> w = d * q
  q4_0  blocks of 32: f16 scale d, 16 bytes of nibbles    -> w = d * (q - 8)
  q4_1  blocks of 32: f16 scale d, f16 min m, 16 bytes     -> w = d * q + m
Nibble j of a block (j < 16) is the low half of byte j, nibble j + 16 its high half.
Encoding and decoding go through the `gguf` package, the reference implementation of these formats.
"""
from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np

from models.formats import BLOCK_FORMATS, FLOAT_FORMATS, FORMATS  # noqa: F401 (re-exported)

QK = 32

GGML_TYPE = {
    "f32": gguf.GGMLQuantizationType.F32,
    "f16": gguf.GGMLQuantizationType.F16,
    "bf16": gguf.GGMLQuantizationType.BF16,
    "q8_0": gguf.GGMLQuantizationType.Q8_0,
    "q4_0": gguf.GGMLQuantizationType.Q4_0,
    "q4_1": gguf.GGMLQuantizationType.Q4_1,
}
FORMAT_OF_GGML = {v: k for k, v in GGML_TYPE.items()}
# bytes of one stored block of QK values (GGML's own table; float formats store one value a "block")
BLOCK_BYTES = {f: gguf.GGML_QUANT_SIZES[t][1] for f, t in GGML_TYPE.items() if f in BLOCK_FORMATS}


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
        if self.format in BLOCK_FORMATS and self.shape[-1] % QK:
            raise ValueError(f"{self.format} needs a row length divisible by {QK}, got {self.shape}")

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

    def block_fields(self) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """A block format's fields per (row, block): scales d float16 [N, nb], mins m float16 [N, nb]
        (q4_1; None otherwise) and the quant bytes uint8 [N, nb, 16 or 32], as GGML lays a block out."""
        if self.format not in BLOCK_FORMATS:
            raise ValueError(f"{self.format} is not a block format")
        n, k = self.shape
        blocks = np.asarray(self.data).reshape(n, k // QK, BLOCK_BYTES[self.format])
        d = np.ascontiguousarray(blocks[:, :, 0:2]).view(np.float16)[..., 0]
        if self.format == "q4_1":
            return d, np.ascontiguousarray(blocks[:, :, 2:4]).view(np.float16)[..., 0], blocks[:, :, 4:]
        return d, None, blocks[:, :, 2:]

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
        if fmt is None or fmt == self.format:
            return self
        return QuantTensor.from_float(self.dequantize(), fmt)
