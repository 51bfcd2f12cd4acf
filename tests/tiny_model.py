"""Test helpers (not product code): a tiny random Llama model, its byte-level BPE tokenizer, and writers
that store them as a GGUF file (the way llama.cpp's converter does) or as a Hugging Face directory.

    weights = make_tiny_weights(seed=0)                  # float32; fmt='q8_0' etc. quantizes the same floats
    tok = make_tiny_tokenizer()
    write_tiny_gguf(tmp_path / "tiny.gguf", weights, tok)
    write_tiny_safetensors(tmp_path / "tiny", weights, tok)
"""
from __future__ import annotations

import os

import gguf
import numpy as np

from models.config import ModelConfig
from models.formats import K_FORMATS
from models.quant import GGML_TYPE, QuantTensor
from models.safetensors_file import write_safetensors_dir
from models.tokenizer import BYTE_TO_UNICODE, TOKEN_CONTROL, TOKEN_NORMAL, Tokenizer
from models.weights import LayerWeights, ModelWeights

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM2
# merges in rank order; each joins two tokens that exist by then. ("ð", "Ł") is the first half of the UTF-8
# of most emoji (F0 9F), so an emoji encodes as a 2-byte token plus single bytes.
MERGES = [
    ("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"), ("Ġ", "s"),
    ("r", "e"), ("a", "t"), ("Ġ", "c"), ("o", "r"), ("e", "n"), ("i", "s"), ("Ġ", "i"), ("Ġi", "s"),
    ("Ġc", "at"), ("Ġ", "Ġ"), ("ð", "Ł"), ("Ġ", "w"), ("Ġa", "n"), ("Ġan", "d"), ("in", "g"), ("Ċ", "Ċ"),
    ("1", "2"),  # never applies under the 'smollm' pre-tokenizer, which splits every digit
]
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a tiny test model.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tiny_tokenizer_fields() -> dict:
    """GGUF `tokenizer.*` fields (without the prefix) of the tiny tokenizer."""
    tokens = SPECIAL_TOKENS + [BYTE_TO_UNICODE[b] for b in range(256)]
    for a, b in MERGES:
        assert a in tokens and b in tokens, (a, b)
        tokens.append(a + b)
    assert len(set(tokens)) == len(tokens)
    return {
        "ggml.model": "gpt2",
        "ggml.pre": "smollm",
        "ggml.tokens": tokens,
        "ggml.token_type": [TOKEN_CONTROL] * len(SPECIAL_TOKENS) + [TOKEN_NORMAL] * (len(tokens) - len(SPECIAL_TOKENS)),
        "ggml.merges": [f"{a} {b}" for a, b in MERGES],
        "ggml.bos_token_id": 1,
        "ggml.eos_token_id": 2,
        "ggml.unknown_token_id": 0,
        "ggml.padding_token_id": 2,
        "ggml.add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }


TINY_VOCAB = len(tiny_tokenizer_fields()["ggml.tokens"])


def make_tiny_tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(tiny_tokenizer_fields())


def make_tiny_weights(
    seed: int = 0,
    fmt: str = "f32",
    vocab: int = TINY_VOCAB,
    hidden: int | None = None,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int | None = None,
    head_dim: int | None = None,
    tie_embeddings: bool = True,
    rope_theta: float = 10000.0,
    rms_norm_eps: float = 1e-5,
    max_position: int = 512,
) -> ModelWeights:
    """Random weights of sensible scale (matrices ~ N(0, 1/fan_in), embeddings ~ N(0, 0.25), norms ~ 1 +- 0.1).

    The floats depend only on the seed and shapes, so fmt='q8_0' is the q8_0 encoding of fmt='f32'.
    hidden and ffn default to 64 and 128, or to 256 and 256 for a K-quant (rows of 256 values).
    """
    kquant = fmt in K_FORMATS
    hidden = hidden or (256 if kquant else 64)
    ffn = ffn or (256 if kquant else 128)
    head_dim = head_dim or hidden // heads
    cfg = ModelConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_layers=layers, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim, rope_theta=rope_theta, rms_norm_eps=rms_norm_eps,
        max_position=max_position, tie_embeddings=tie_embeddings, bos_token_id=1, eos_token_id=2,
    )
    rng = np.random.default_rng(seed)

    def mat(rows, cols, scale=None):
        w = rng.standard_normal((rows, cols)) * (scale if scale is not None else cols ** -0.5)
        return QuantTensor.from_float(w.astype(np.float32), fmt)

    def norm():
        return (1.0 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)

    embed = mat(vocab, hidden, scale=0.5)
    layer_list = []
    for _ in range(layers):
        layer_list.append(LayerWeights(
            attn_norm=norm(),
            q=mat(cfg.q_size, hidden), k=mat(cfg.kv_size, hidden), v=mat(cfg.kv_size, hidden),
            o=mat(hidden, cfg.q_size),
            ffn_norm=norm(),
            gate=mat(ffn, hidden), up=mat(ffn, hidden), down=mat(hidden, ffn),
        ))
    final_norm = norm()
    lm_head = None if tie_embeddings else mat(vocab, hidden)
    return ModelWeights(config=cfg, embed=embed, layers=layer_list, final_norm=final_norm, lm_head=lm_head,
                        metadata={"name": f"tiny-llama-{seed}"})


def permute_rope_rows(t: QuantTensor, num_heads: int) -> QuantTensor:
    """llama.cpp's converter permutation of attn_q / attn_k rows (the inverse of unpermute_rope_rows):
    each head's rows go from Hugging Face's (half, i) order to (i, half)."""
    rows = t.shape[0]
    dh = rows // num_heads
    index = np.arange(rows).reshape(num_heads, 2, dh // 2).swapaxes(1, 2).reshape(-1)
    return t.rows(index)


def write_tiny_gguf(path, weights: ModelWeights, tokenizer: Tokenizer | None = None,
                    raw_tensors: dict | None = None, extra=None) -> str:
    """Write `weights` + tokenizer as a llama GGUF, q/k rows permuted as llama.cpp's converter does.

    raw_tensors: {gguf tensor name: (uint8 blocks, GGMLQuantizationType)} stored instead of that tensor
    (to make files with types we do not support). extra: called with the writer after the metadata (to add
    keys or tensors of other models' files).
    """
    path = os.fspath(path)
    raw_tensors = raw_tensors or {}

    def _add_matrix(writer: gguf.GGUFWriter, name: str, t: QuantTensor):
        if name in raw_tensors:
            data, qtype = raw_tensors[name]
            writer.add_tensor(name, data, raw_dtype=qtype)
        else:
            writer.add_tensor(name, np.ascontiguousarray(t.data), raw_dtype=GGML_TYPE[t.format])

    tokenizer = tokenizer or make_tiny_tokenizer()
    cfg = weights.config
    w = gguf.GGUFWriter(path, "llama")
    w.add_name(weights.metadata.get("name") or "tiny-llama")
    w.add_vocab_size(cfg.vocab_size)
    add_shape_metadata(w, cfg)
    w.add_rope_dimension_count(cfg.head_dim)

    f = tokenizer.to_gguf_fields()
    w.add_tokenizer_model(f["ggml.model"])
    w.add_tokenizer_pre(f["ggml.pre"])
    w.add_token_list(f["ggml.tokens"])
    w.add_token_types(f["ggml.token_type"])
    w.add_token_merges(f["ggml.merges"])
    for key, add in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id),
                     ("unknown", w.add_unk_token_id), ("padding", w.add_pad_token_id)):
        if f"ggml.{key}_token_id" in f:
            add(f[f"ggml.{key}_token_id"])
    w.add_add_bos_token(f["ggml.add_bos_token"])
    w.add_add_eos_token(f["ggml.add_eos_token"])
    if "chat_template" in f:
        w.add_chat_template(f["chat_template"])
    if extra is not None:
        extra(w)

    _add_matrix(w, "token_embd.weight", weights.embed)
    for i, lw in enumerate(weights.layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.asarray(lw.attn_norm, np.float32))
        _add_matrix(w, p + "attn_q.weight", permute_rope_rows(lw.q, cfg.num_heads))
        _add_matrix(w, p + "attn_k.weight", permute_rope_rows(lw.k, cfg.num_kv_heads))
        _add_matrix(w, p + "attn_v.weight", lw.v)
        _add_matrix(w, p + "attn_output.weight", lw.o)
        w.add_tensor(p + "ffn_norm.weight", np.asarray(lw.ffn_norm, np.float32))
        _add_matrix(w, p + "ffn_gate.weight", lw.gate)
        _add_matrix(w, p + "ffn_up.weight", lw.up)
        _add_matrix(w, p + "ffn_down.weight", lw.down)
    w.add_tensor("output_norm.weight", np.asarray(weights.final_norm, np.float32))
    if weights.lm_head is not None:
        _add_matrix(w, "output.weight", weights.lm_head)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def add_shape_metadata(w: gguf.GGUFWriter, cfg: ModelConfig) -> None:
    """The `{arch}.*` keys of a model's shape, as llama.cpp's converter writes them."""
    w.add_context_length(cfg.max_position)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)


def write_tiny_safetensors(directory, weights: ModelWeights, tokenizer: Tokenizer | None = None) -> str:
    """Write `weights` + tokenizer as a Hugging Face directory (config.json, model.safetensors, tokenizer)."""
    directory = os.fspath(directory)
    write_safetensors_dir(directory, weights)
    (tokenizer or make_tiny_tokenizer()).save_hf(directory)
    return directory
