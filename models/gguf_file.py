"""Load a Llama-family GGUF file (through the `gguf` package) into ModelWeights."""
from __future__ import annotations

import gguf
import numpy as np
from gguf import GGUFValueType

from models.config import ModelConfig
from models.quant import QuantTensor, format_of_ggml
from models.weights import LayerWeights, ModelWeights

_LAYER_TENSORS = {
    "attn_norm": "attn_norm", "ffn_norm": "ffn_norm",
    "q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output",
    "gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down",
}


class ModelFileError(ValueError):
    pass


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


class FastGGUFReader(gguf.GGUFReader):
    """gguf.GGUFReader with a one-pass parser for metadata arrays of strings and numbers.

    The base class reads each array element with two numpy views built one at a time; here the string
    lengths are read from one memoryview and the parts are sliced from one base array. The resulting
    ReaderFields are identical (same parts, dtypes, data indexes and types), so contents() and all other
    uses behave the same.
    """

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        itype, n = GGUFValueType(int(raw_itype[0])), int(alen[0])
        offs = orig_offs + int(raw_itype.nbytes + alen.nbytes)
        parts: list = [raw_itype, alen]
        base = self.data.view(np.ndarray)
        if itype == GGUFValueType.STRING:
            mv = memoryview(base)
            u64 = np.dtype(np.uint64)
            for _ in range(n):
                length = int.from_bytes(mv[offs:offs + 8], "little")
                parts.append(base[offs:offs + 8].view(u64))
                parts.append(base[offs + 8:offs + 8 + length])
                offs += 8 + length
            if offs > len(base):
                raise ValueError("string array runs past the end of the file")
            idxs = list(range(3, 2 + 2 * n, 2))
        else:
            nptype = self.gguf_scalar_to_np.get(itype)
            if nptype is None:  # nested arrays: the general parser
                return super()._get_field_parts(orig_offs, raw_type)
            size = np.dtype(nptype).itemsize
            if offs + n * size > len(base):
                raise ValueError("array runs past the end of the file")
            arr = base[offs:offs + n * size].view(nptype)
            parts += [arr[i:i + 1] for i in range(n)]
            offs += n * size
            idxs = list(range(2, 2 + n))
        types = [GGUFValueType.ARRAY] + ([itype] if n else [])
        return offs - orig_offs, parts, idxs, types


def open_gguf(path: str) -> FastGGUFReader:
    """A reader over a GGUF file; ModelFileError naming the file when it is not one."""
    try:
        return FastGGUFReader(path)
    except (FileNotFoundError, IsADirectoryError):
        raise
    except Exception as e:
        raise ModelFileError(f"{path}: not a GGUF model file ({e})") from None


def read_gguf(path: str) -> tuple[ModelWeights, dict]:
    """Returns the weights and the GGUF metadata the tokenizer needs."""
    reader = open_gguf(path)

    arch = _field(reader, "general.architecture")
    if arch not in ("llama",):
        raise ModelFileError(f"{path}: unsupported architecture {arch!r} (supported: llama)")

    def meta(key, default=None):
        return _field(reader, f"{arch}.{key}", default)

    heads = int(meta("attention.head_count"))
    hidden = int(meta("embedding_length"))
    tensors = {t.name: t for t in reader.tensors}

    def matrix(name: str) -> QuantTensor:
        t = tensors.get(name)
        if t is None:
            raise ModelFileError(f"{path}: tensor {name} is missing")
        fmt = format_of_ggml(t.tensor_type)
        # gguf lists dims input-first; our matrices are [out, in]
        shape = tuple(int(d) for d in reversed([int(x) for x in t.shape]))
        return QuantTensor.from_raw(fmt, shape, t.data)

    def vector(name: str) -> np.ndarray:
        t = tensors.get(name)
        if t is None:
            raise ModelFileError(f"{path}: tensor {name} is missing")
        return QuantTensor.from_raw(format_of_ggml(t.tensor_type), (1, int(t.shape[0])), t.data).dequantize()[0].copy()

    vocab = meta("vocab_size")
    embed = matrix("token_embd.weight")
    kv_heads = int(meta("attention.head_count_kv", heads))
    config = ModelConfig(
        vocab_size=int(vocab if vocab is not None else embed.shape[0]),
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_layers=int(meta("block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(meta("attention.key_length", meta("rope.dimension_count", hidden // heads))),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position=int(meta("context_length", 2048)),
        tie_embeddings="output.weight" not in tensors,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
    )
    layers = []
    for i in range(config.num_layers):
        p = f"blk.{i}."
        parts = {}
        for ours, theirs in _LAYER_TENSORS.items():
            name = p + theirs + ".weight"
            parts[ours] = vector(name) if ours.endswith("norm") else matrix(name)
        parts["q"] = unpermute_rope_rows(parts["q"], heads)
        parts["k"] = unpermute_rope_rows(parts["k"], kv_heads)
        layers.append(LayerWeights(**parts))
    weights = ModelWeights(
        config=config,
        embed=embed,
        layers=layers,
        final_norm=vector("output_norm.weight"),
        lm_head=None if config.tie_embeddings else matrix("output.weight"),
        metadata={"name": _field(reader, "general.name", ""), "source": path, "format": "gguf"},
    )
    tok = {
        key[len("tokenizer."):]: _field(reader, key)
        for key in reader.fields
        if key.startswith("tokenizer.")
    }
    return weights, tok
