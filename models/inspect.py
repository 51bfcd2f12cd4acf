"""What a model file says before it is loaded (tensor shapes and formats, no weights), and which
quantization a model is served in: the one place that decides it."""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

from models.quant import (BLOCK_FORMATS, FLOAT_FORMATS, FORMATS, LAYOUT_BYTES_PER_WEIGHT, LAYOUT_TILE_ROWS,
                          UnsupportedFormat, bytes_per_weight, converted_format, format_of_ggml)

# A model stored in mixed formats is named by its most compact one (a Q4_1 GGUF keeps its embedding in q8_0;
# a Q4_K_M GGUF mixes q4_k, q5_0, q6_k and q8_0, and is named q4_k).
FORMAT_ORDER = ("q4_0", "q4_k", "q4_1", "q5_0", "q5_k", "q5_1", "q6_k", "q8_0", "bf16", "f16", "f32")
assert set(FORMAT_ORDER) == set(BLOCK_FORMATS + FLOAT_FORMATS)


def check_quantization(quantization: str | None) -> str | None:
    """`quantization` if it names a format weights can be served in (None: keep the stored formats)."""
    if quantization is not None and quantization not in FORMATS:
        raise UnsupportedFormat(f"quantization must be one of {', '.join(FORMATS)}; got {quantization!r}")
    return quantization


def resolve_quantization(requested: str | None, stored_format: str,
                         loads_dequantized: bool = False) -> tuple[str, str | None]:
    """(the label a model is served under, the format its weights are converted to or None to keep
    the file's): a request without a quantization, or for the file's own, keeps the stored weights,
    unless some of them load dequantized (a type without kernels), which a requested format re-encodes."""
    label = check_quantization(requested) or stored_format
    keep = label == stored_format and not (loads_dequantized and requested is not None)
    return label, None if keep else label


@dataclass
class ModelFileInfo:
    """What the file says before loading: its matrices' formats and shapes, and its sizes."""
    matrices: dict[tuple[str, int], int]   # elements per (stored format, row length), rows padded to tiles
    vector_bytes: int            # 1-D tensors (norms) stay float32
    stored_bytes: int            # tensor bytes as loaded with the stored formats kept
    version: str                 # a content fingerprint, the same on every node with the same file
    loads_dequantized: bool = False   # some matrices are in a type without kernels: they load as float32

    @property
    def stored_format(self) -> str:
        """The most compact of the matrices' formats (FORMAT_ORDER)."""
        return min((f for f, _ in self.matrices), key=FORMAT_ORDER.index, default="f32")

    def weight_bytes(self, convert_to: str | None, backend: str) -> int:
        """What the weights take once loaded, in the kernel layouts of `backend` (cpu, cuda): the stored
        formats, or every matrix converted to `convert_to`."""
        per_weight = LAYOUT_BYTES_PER_WEIGHT[backend]
        return int(sum(n * per_weight[converted_format(convert_to, length) or fmt]
                       for (fmt, length), n in self.matrices.items())) + self.vector_bytes


def inspect_model(path: str) -> ModelFileInfo:
    """Read tensor shapes and types only (no weights) from a GGUF file or a safetensors directory."""
    from models.loader import locate_model
    kind, p = locate_model(path)
    if kind == "gguf":
        files = [p]
        matrices, vector_bytes, stored, dequantized = _gguf_counts(p)
    else:
        files = sorted(os.path.join(p, f) for f in os.listdir(p) if f.endswith(".safetensors"))
        matrices, vector_bytes, stored = _safetensors_counts(files)
        dequantized = False
    return ModelFileInfo(matrices, vector_bytes, stored, _fingerprint(files), dequantized)


def _add_matrix(matrices: dict[tuple[str, int], int], fmt: str, n: int, row_length: int) -> None:
    """Count a matrix of n elements in rows of row_length, its rows padded to tiles as the layouts pad them."""
    padded = -(-(n // row_length) // LAYOUT_TILE_ROWS) * LAYOUT_TILE_ROWS * row_length
    matrices[(fmt, row_length)] = matrices.get((fmt, row_length), 0) + padded


def _gguf_counts(path: str) -> tuple[dict[tuple[str, int], int], int, int, bool]:
    """(the matrices' elements per format and row length, vector bytes as float32, bytes as loaded, whether
    some matrices load dequantized to float32: a type the engine has no kernels for)."""
    from models.gguf_file import open_gguf
    matrices: dict[tuple[str, int], int] = {}
    vector_bytes, stored, dequantized = 0, 0, False
    for t in open_gguf(path).tensors:
        n = int(t.n_elements)
        if len(t.shape) >= 2 and int(min(t.shape)) > 1:
            try:
                fmt = format_of_ggml(t.tensor_type)
            except ValueError:
                fmt, dequantized = "f32", True
            _add_matrix(matrices, fmt, n, int(t.shape[0]))   # GGUF lists the row length first
            stored += 4 * n if fmt == "f32" else int(t.n_bytes)
        else:
            stored += int(t.n_bytes)
            vector_bytes += 4 * n
    return matrices, vector_bytes, stored, dequantized


def _safetensors_counts(files: list[str]) -> tuple[dict[tuple[str, int], int], int, int]:
    from models.safetensors_file import _FLOAT_DTYPES, _read_header, quant_specs
    matrices: dict[tuple[str, int], int] = {}
    vector_bytes, stored = 0, 0
    for f in files:
        header = _read_header(f)
        quant = quant_specs(f, header)
        for name, entry in header.items():
            if name.startswith("__") or not isinstance(entry, dict):
                continue   # __metadata__, and the data offset _read_header adds
            if name in quant and entry["dtype"] == "U8":   # raw GGML blocks: format and shape in the metadata
                shape, fmt = quant[name]["shape"], quant[name]["format"]
            else:
                shape, fmt = entry["shape"], _FLOAT_DTYPES.get(entry["dtype"], "f32")
            n = 1
            for s in shape:
                n *= int(s)
            stored += int(n * bytes_per_weight(fmt))
            if len(shape) >= 2:
                _add_matrix(matrices, fmt, n, int(shape[-1]))
            else:
                vector_bytes += 4 * n
    return matrices, vector_bytes, stored


def _fingerprint(files: list[str]) -> str:
    """sha256 over the sizes and the first and last MiB of the files: cheap, and stable across copies."""
    h = hashlib.sha256()
    for f in files:
        size = os.path.getsize(f)
        h.update(str(size).encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            if size > 2 << 20:
                fh.seek(size - (1 << 20))
                h.update(fh.read(1 << 20))
    return h.hexdigest()[:12]
