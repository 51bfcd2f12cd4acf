"""Load a Llama-family or Gemma 3 GGUF file (through the `gguf` package) into ModelWeights.

A tensor stored in a GGML type the engine has no kernel for is dequantized to float32 with the `gguf`
package's own dequantization, so a file in any type the package reads loads and runs (more slowly).
"""
from __future__ import annotations

import math
import weakref
from collections.abc import Mapping
from functools import cached_property

import gguf
import numpy as np
from gguf import GGUFValueType
from gguf.gguf_reader import ReaderField
from numba import njit

from models.config import ModelConfig
from models.quant import QuantTensor, UnsupportedFormat, format_of_ggml
from models.safetensors_file import check_shapes
from models.weights import LayerWeights, ModelFileError, ModelWeights

_LAYER_TENSORS = {
    "attn_norm": "attn_norm", "ffn_norm": "ffn_norm",
    "q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output",
    "gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down",
}
_GEMMA3_TENSORS = {
    "q_norm": "attn_q_norm", "k_norm": "attn_k_norm",
    "post_attn_norm": "post_attention_norm", "post_ffn_norm": "post_ffw_norm",
}
_MODEL_TENSORS = {"embed": "token_embd.weight", "final_norm": "output_norm.weight", "lm_head": "output.weight"}
ARCHITECTURES = ("llama", "gemma3")
# What llama.cpp takes as Gemma 3's defaults, absent from its GGUF files: every 6th layer is global,
# and local layers rotate with base 1e4 (the file's rope.freq_base is the global layers').
GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_LOCAL_ROPE_THETA = 10000.0


def _swa_pattern(path: str, value) -> int:
    """The file's sliding_window_pattern (every n-th layer global), else Gemma 3's default."""
    if value is None:
        return GEMMA3_SLIDING_WINDOW_PATTERN
    if isinstance(value, int):
        return value
    raise ModelFileError(f"{path}: a per-layer sliding_window_pattern is not supported")


def tensor_from_gguf(t) -> QuantTensor:
    """A GGUF reader tensor as a QuantTensor [out, in]: kept in its stored format where the engine has
    kernels for it, else dequantized to float32 by the `gguf` package."""
    # gguf lists dims input-first; our matrices are [out, in]
    shape = tuple(int(d) for d in reversed([int(x) for x in t.shape]))
    try:
        fmt = format_of_ggml(t.tensor_type)
    except UnsupportedFormat:
        try:
            dense = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        except NotImplementedError:
            raise UnsupportedFormat(f"tensor {t.name}: GGML type {t.tensor_type.name} cannot be read") from None
        return QuantTensor("f32", shape, np.ascontiguousarray(dense.reshape(shape), dtype=np.float32))
    return QuantTensor.from_raw(fmt, shape, t.data)


def _field(reader: gguf.GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def unpermute_rope_rows(t: QuantTensor, num_heads: int) -> QuantTensor:
    """Undo llama.cpp's converter permutation of attn_q / attn_k rows.

    The converter reorders each head's rows from Hugging Face's (half, i) to (i, half), so that a
    pairwise RoPE on (2i, 2i+1) equals the rotate-half RoPE on (i, i + Dh/2). Whole rows move, so
    quantized blocks are reordered untouched.
    """
    rows = t.shape[0]
    dh = rows // num_heads
    i = np.arange(dh // 2)
    within = np.concatenate([2 * i, 2 * i + 1])  # HF row (half, i) comes from converter row 2*i + half
    index = (np.arange(num_heads)[:, None] * dh + within[None, :]).reshape(-1)
    return t.rows(index)


class _LazyArrayField:
    """A metadata array of strings or numbers, decoded when asked for.

    gguf.GGUFReader builds two numpy views per element of every array as it opens a file, holding the
    GIL (a cold load beside running models, whose tokenizer is already built, needs none of it). Here
    opening costs one scan of the string lengths without the GIL; contents() decodes straight from the
    file. `parts` and `data`, which nothing here reads, are those of the gguf package's own parser, built
    on first use.
    """

    def __init__(self, reader: "FastGGUFReader", offset: int, name: str, head: list, value_offs: int,
                 itype: GGUFValueType, n: int, starts: np.ndarray | None):
        # a weak reference: the reader holds its fields, and a cycle would keep the file's mapping (every
        # page a load read) until a collection, which the node's gc.freeze() after a load defers to an eviction
        self._reader, self.offset, self.name = weakref.proxy(reader), offset, name
        self._head, self._value_offs = head, value_offs   # parts of the key and type; where the value starts
        self._itype, self._n = itype, n
        self._starts = starts    # string arrays: where each string's length field begins, and the end
        self.types = [GGUFValueType.ARRAY] + ([itype] if n else [])

    def contents(self, index_or_slice: int | slice = slice(None)):
        which = range(self._n)[index_or_slice]
        base = self._reader.data
        if self._starts is None:
            dtype = np.dtype(self._reader.gguf_scalar_to_np[self._itype])
            start = self._value_offs + 12   # after the element type and the count
            return base[start:start + self._n * dtype.itemsize].view(dtype)[index_or_slice].tolist()
        raw = memoryview(base)
        s = self._starts
        if isinstance(which, int):
            return str(raw[s[which] + 8:s[which + 1]], "utf-8")
        return [str(raw[s[i] + 8:s[i + 1]], "utf-8") for i in which]

    @cached_property
    def _parsed(self) -> ReaderField:
        size, parts, idxs, types = gguf.GGUFReader._get_field_parts(self._reader, self._value_offs,
                                                                    GGUFValueType.ARRAY)
        h = len(self._head)
        return ReaderField(self.offset, self.name, self._head + parts, [i + h for i in idxs], types)

    @property
    def parts(self) -> list:
        return self._parsed.parts

    @property
    def data(self) -> list:
        return self._parsed.data


@njit(cache=True, nogil=True)
def _string_starts(buf: np.ndarray, offs: int, n: int) -> np.ndarray:
    """Where each of n length-prefixed strings from offs begins, then where the last one ends; empty when
    they run past the end of buf."""
    starts = np.empty(n + 1, np.int64)
    for i in range(n):
        if offs + 8 > buf.size:
            return starts[:0]
        length = np.int64(0)
        for b in range(8):
            length |= np.int64(buf[offs + b]) << (8 * b)
        if length < 0 or offs + 8 + length > buf.size:
            return starts[:0]
        starts[i] = offs
        offs += 8 + length
    starts[n] = offs
    return starts


class FastGGUFReader(gguf.GGUFReader):
    """gguf.GGUFReader whose metadata arrays are _LazyArrayFields: the same offsets, names, types,
    contents, parts and data, read when used rather than on open."""

    def _build_fields(self, offs: int, count: int) -> int:
        if self.byte_order != "I":
            return super()._build_fields(offs, count)
        base = self.data.view(np.ndarray)
        for _ in range(count):
            orig_offs = offs
            klen, kdata = self._get_str(offs)
            raw_type = self._get(offs + 8 + int(klen[0]), np.uint32)
            head = [klen, kdata, raw_type]
            offs += 12 + int(klen[0])
            name = str(bytes(kdata), encoding="utf-8")
            if int(raw_type[0]) == GGUFValueType.ARRAY:
                raw_itype, alen = self._get(offs, np.uint32), self._get(offs + 4, np.uint64)
                itype, n = GGUFValueType(int(raw_itype[0])), int(alen[0])
                start = offs + 12
                if itype == GGUFValueType.STRING:
                    starts = _string_starts(base, start, n) if n <= (len(base) - start) // 8 else base[:0]
                    if len(starts) != n + 1:
                        raise ValueError(f"{name}: string array runs past the end of the file")
                    self._push_field(_LazyArrayField(self, orig_offs, name, head, offs, itype, n, starts),
                                     skip_sum=True)
                    offs = int(starts[n])
                    continue
                nptype = self.gguf_scalar_to_np.get(itype)
                if nptype is not None:
                    end = start + n * np.dtype(nptype).itemsize
                    if end > len(base):
                        raise ValueError(f"{name}: array runs past the end of the file")
                    self._push_field(_LazyArrayField(self, orig_offs, name, head, offs, itype, n, None),
                                     skip_sum=True)
                    offs = end
                    continue
            size, parts, idxs, types = self._get_field_parts(offs, raw_type[0])
            self._push_field(ReaderField(orig_offs, name, head + parts, [i + len(head) for i in idxs], types),
                             skip_sum=True)
            offs += size
        return offs

    def _build_tensors(self, start_offs: int, fields: list[ReaderField]) -> None:
        # a partial download: say so, where numpy's views of the missing bytes would say "cannot reshape"
        size = len(self.data)
        for field in fields:
            _, name, _, dims, raw_type, offset = field.parts
            block, type_size = gguf.GGML_QUANT_SIZES.get(int(raw_type[0]), (1, 0))   # an unknown type: the parent raises
            end = start_offs + int(offset[0]) + math.prod(int(d) for d in dims) * type_size // block
            if end > size:
                raise ModelFileError(f"the file is truncated: tensor {str(bytes(name), 'utf-8', 'replace')} "
                                     f"needs {end} bytes, the file has {size}")
        super()._build_tensors(start_offs, fields)


def open_gguf(path: str) -> FastGGUFReader:
    """A reader over a GGUF file; ModelFileError naming the file when it is not one."""
    try:
        return FastGGUFReader(path)
    except (FileNotFoundError, IsADirectoryError):
        raise
    except ModelFileError as e:
        raise ModelFileError(f"{path}: {e}") from None
    except Exception as e:
        raise ModelFileError(f"{path}: not a GGUF model file ({e})") from None


class Metadata(Mapping):
    """A reader's metadata keys under a prefix (the prefix removed), each value decoded when read: a cold
    load of a model whose tokenizer is built already decodes none of its ~100k token strings."""

    def __init__(self, reader: gguf.GGUFReader, prefix: str):
        self._reader, self._prefix = reader, prefix
        self._keys = [k[len(prefix):] for k in reader.fields if k.startswith(prefix)]

    def __getitem__(self, key: str):
        field = self._reader.fields.get(self._prefix + key)
        if field is None:
            raise KeyError(key)
        return field.contents()

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def read_gguf(path: str) -> tuple[ModelWeights, Metadata]:
    """Returns the weights and the GGUF metadata the tokenizer needs (`tokenizer.*`, read on use)."""
    reader = open_gguf(path)

    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelFileError(f"{path}: unsupported architecture {arch!r} (supported: {', '.join(ARCHITECTURES)})")
    gemma = arch == "gemma3"

    def meta(key, default=None):
        return _field(reader, f"{arch}.{key}", default)

    def number(key, default=None, kind=int):
        """A positive number of the metadata (its default when absent); ModelFileError naming the key
        when it is missing or not one (a per-layer array, a count of 0)."""
        value = meta(key, default)
        if value is None:
            raise ModelFileError(f"{path}: {arch}.{key} is missing")
        if value is default:
            return value
        if isinstance(value, list):
            raise ModelFileError(f"{path}: {arch}.{key} holds per-layer values, which are not supported")
        if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int) or value <= 0:
            raise ModelFileError(f"{path}: {arch}.{key} is {value!r}, expected a positive {kind.__name__}")
        return kind(value)

    heads = number("attention.head_count")
    hidden = number("embedding_length")
    tensors = {t.name: t for t in reader.tensors}
    # RoPE scaling (linear, YaRN, Llama 3's frequency factors in rope_freqs.weight) is not implemented:
    # served without it, such a model's outputs would be silently wrong
    scaling = meta("rope.scaling.type")
    if (scaling not in (None, "none") and float(meta("rope.scaling.factor", 1.0)) != 1.0) or \
            "rope_freqs.weight" in tensors:
        raise ModelFileError(f"{path}: RoPE scaling ({scaling or 'rope_freqs.weight'}) is not supported")

    def matrix(name: str) -> QuantTensor:
        t = tensors.get(name)
        if t is None:
            raise ModelFileError(f"{path}: tensor {name} is missing")
        return tensor_from_gguf(t)

    def vector(name: str) -> np.ndarray:
        t = tensors.get(name)
        if t is None:
            raise ModelFileError(f"{path}: tensor {name} is missing")
        return tensor_from_gguf(t).dequantize().reshape(-1).copy()

    embed = matrix("token_embd.weight")
    shape = dict(
        vocab_size=number("vocab_size", embed.shape[0]),
        hidden_size=hidden,
        intermediate_size=number("feed_forward_length"),
        num_layers=number("block_count"),
        num_heads=heads,
        num_kv_heads=number("attention.head_count_kv", heads),
        head_dim=number("attention.key_length", number("rope.dimension_count", hidden // heads)),
        rope_theta=number("rope.freq_base", 10000.0, float),
        rms_norm_eps=number("attention.layer_norm_rms_epsilon", 1e-5, float),
        max_position=number("context_length", 2048),
        **(dict(architecture="gemma3", sliding_window=number("attention.sliding_window", 0),
                sliding_window_pattern=_swa_pattern(path, meta("attention.sliding_window_pattern")),
                rope_local_theta=GEMMA3_LOCAL_ROPE_THETA)
           if gemma else {}),
    )
    try:
        config = ModelConfig(**shape, tie_embeddings="output.weight" not in tensors,
                             bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
                             eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"))
    except ValueError as e:   # sizes that disagree with each other (heads and kv heads, an odd head_dim)
        raise ModelFileError(f"{path}: {e}") from None
    names = dict(_LAYER_TENSORS, **(_GEMMA3_TENSORS if gemma else {}))
    layers = []
    for i in range(config.num_layers):
        p = f"blk.{i}."
        parts = {}
        for ours, theirs in names.items():
            name = p + theirs + ".weight"
            parts[ours] = vector(name) if ours.endswith("norm") else matrix(name)
        layers.append(LayerWeights(**parts))
    weights = ModelWeights(
        config=config,
        embed=embed,
        layers=layers,
        final_norm=vector("output_norm.weight"),
        lm_head=None if config.tie_embeddings else matrix("output.weight"),
        metadata={"name": _field(reader, "general.name", ""), "source": path, "format": "gguf"},
    )

    def name_in_file(where: tuple) -> str:
        return f"blk.{where[1]}.{names[where[2]]}.weight" if where[0] == "layer" else _MODEL_TENSORS[where[0]]

    # the kernels trust the config's shapes: a file whose metadata disagrees with its tensors stops here
    check_shapes(weights, path, name_in_file)
    if not gemma:   # Gemma's converter leaves q/k rows in Hugging Face's order
        for lw in layers:
            lw.q = unpermute_rope_rows(lw.q, config.num_heads)
            lw.k = unpermute_rope_rows(lw.k, config.num_kv_heads)
    return weights, Metadata(reader, "tokenizer.")
