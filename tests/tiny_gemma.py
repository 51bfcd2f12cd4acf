"""Test helpers (not product code): a tiny random Gemma 3 model, a small SentencePiece vocabulary, and a
writer that stores them as a GGUF file the way llama.cpp's converter stores Gemma 3 (norms with the 1
added, q/k rows unpermuted, no chat template). write_tiny_safetensors (tests/tiny_model.py) writes the
same weights as a Hugging Face directory.

    weights = make_tiny_gemma_weights(seed=0)
    write_tiny_gemma_gguf(tmp_path / "tiny-gemma.gguf", weights)
"""
from __future__ import annotations

import os

import gguf
import numpy as np

from models.config import ModelConfig
from models.quant import GGML_TYPE, QuantTensor
from models.tokenizer import TOKEN_BYTE, TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_USER_DEFINED, Tokenizer
from models.weights import LayerWeights, ModelWeights
from tests.tiny_model import add_shape_metadata

SPM_CONTROL = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]  # ids 0-5 as in Gemma
SPM_USER_DEFINED = ["\n", "\n\n", "  "]
# normal pieces, best (highest score) first; each longer piece is made of two earlier-or-later pieces
SPM_PIECES = (
    ["▁"] + list("abcdefghijklmnopqrstuvwxyzTHW.,?!:'") + list("0123456789")
    + ["th", "he", "▁t", "▁the", "in", "at", "▁c", "▁cat", "is", "▁is", "an", "▁a", "nd", "▁and", "er", "on",
       "▁s", "at▁", "▁on", "▁o", "ing", "▁w", "▁wh", "ha", "▁wha", "▁what", "▁▁", "▁The", "Th", "ca", "cat",
       "▁ca", "it", "al", "▁it", "es", "re", "ou", "▁y", "▁you", "yo"]
)
TINY_GEMMA_WINDOW = 8      # small enough that short test prompts cross it
TINY_GEMMA_LAYERS = 6      # layer 5 is global (every 6th, as the GGUF loader assumes for Gemma 3)


def tiny_spm_fields() -> dict:
    """GGUF `tokenizer.*` fields (without the prefix) of the tiny SentencePiece vocabulary."""
    tokens = SPM_CONTROL + [f"<0x{b:02X}>" for b in range(256)] + SPM_USER_DEFINED + SPM_PIECES
    types = ([TOKEN_CONTROL] * len(SPM_CONTROL) + [TOKEN_BYTE] * 256 + [TOKEN_USER_DEFINED] * len(SPM_USER_DEFINED)
             + [TOKEN_NORMAL] * len(SPM_PIECES))
    assert len(set(tokens)) == len(tokens)
    n_special = len(tokens) - len(SPM_PIECES)
    scores = [0.0] * n_special + [-float(i) for i in range(len(SPM_PIECES))]
    return {
        "ggml.model": "llama", "ggml.pre": "default", "ggml.tokens": tokens, "ggml.scores": scores,
        "ggml.token_type": types, "ggml.bos_token_id": 2, "ggml.eos_token_id": 1, "ggml.unknown_token_id": 3,
        "ggml.padding_token_id": 0, "ggml.add_bos_token": True, "ggml.add_eos_token": False,
        "ggml.add_space_prefix": False,
    }


def make_tiny_spm_tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(tiny_spm_fields())


TINY_GEMMA_VOCAB = len(tiny_spm_fields()["ggml.tokens"])


def make_tiny_gemma_weights(seed: int = 0, fmt: str = "f32", hidden: int = 64, heads: int = 2, kv_heads: int = 1,
                            head_dim: int = 64, ffn: int = 96, layers: int = TINY_GEMMA_LAYERS,
                            window: int = TINY_GEMMA_WINDOW, max_position: int = 256,
                            pattern: int = 6) -> ModelWeights:
    """Random Gemma 3 weights of sensible scale; q projects hidden -> heads * head_dim (not hidden), as in
    the real model. Norm factors (1 + w) ~ 1 +- 0.1; embeddings small, as the sqrt(hidden) scale expects."""
    cfg = ModelConfig(
        vocab_size=TINY_GEMMA_VOCAB, hidden_size=hidden, intermediate_size=ffn, num_layers=layers, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim, rope_theta=1e6, rms_norm_eps=1e-6, max_position=max_position,
        tie_embeddings=True, bos_token_id=2, eos_token_id=1, architecture="gemma3", sliding_window=window,
        sliding_window_pattern=pattern, rope_local_theta=1e4,
    )
    rng = np.random.default_rng(seed)

    def mat(rows, cols, scale=None):
        w = rng.standard_normal((rows, cols)) * (scale if scale is not None else cols ** -0.5)
        return QuantTensor.from_float(w.astype(np.float32), fmt)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    embed = mat(cfg.vocab_size, hidden, scale=hidden ** -0.5)
    layer_list = [
        LayerWeights(
            attn_norm=norm(hidden), q=mat(cfg.q_size, hidden), k=mat(cfg.kv_size, hidden),
            v=mat(cfg.kv_size, hidden), o=mat(hidden, cfg.q_size), ffn_norm=norm(hidden),
            gate=mat(ffn, hidden), up=mat(ffn, hidden), down=mat(hidden, ffn),
            q_norm=norm(head_dim), k_norm=norm(head_dim), post_attn_norm=norm(hidden), post_ffn_norm=norm(hidden),
        )
        for _ in range(layers)
    ]
    return ModelWeights(config=cfg, embed=embed, layers=layer_list, final_norm=norm(hidden),
                        metadata={"name": f"tiny-gemma-{seed}"})


def write_tiny_gemma_gguf(path, weights: ModelWeights, fields: dict | None = None) -> str:
    """Write `weights` + a SentencePiece vocabulary as a gemma3 GGUF (no sliding_window_pattern key: the
    loader's Gemma 3 default applies, as for the real file)."""
    path = os.fspath(path)
    f = fields or tiny_spm_fields()
    cfg = weights.config
    w = gguf.GGUFWriter(path, "gemma3")
    w.add_name(weights.metadata.get("name") or "tiny-gemma")
    add_shape_metadata(w, cfg)
    w.add_sliding_window(cfg.sliding_window)
    w.add_tokenizer_model(f["ggml.model"])
    w.add_tokenizer_pre(f["ggml.pre"])
    w.add_token_list(f["ggml.tokens"])
    w.add_token_scores(f["ggml.scores"])
    w.add_token_types(f["ggml.token_type"])
    w.add_bos_token_id(f["ggml.bos_token_id"])
    w.add_eos_token_id(f["ggml.eos_token_id"])
    w.add_unk_token_id(f["ggml.unknown_token_id"])
    w.add_pad_token_id(f["ggml.padding_token_id"])
    w.add_add_bos_token(f["ggml.add_bos_token"])
    w.add_add_eos_token(f["ggml.add_eos_token"])
    w.add_add_space_prefix(f["ggml.add_space_prefix"])

    def matrix(name: str, t: QuantTensor):
        w.add_tensor(name, np.ascontiguousarray(t.data), raw_dtype=GGML_TYPE[t.format])

    def vector(name: str, v):
        w.add_tensor(name, np.asarray(v, np.float32))

    matrix("token_embd.weight", weights.embed)
    for i, lw in enumerate(weights.layers):
        p = f"blk.{i}."
        vector(p + "attn_norm.weight", lw.attn_norm)
        matrix(p + "attn_q.weight", lw.q)
        matrix(p + "attn_k.weight", lw.k)
        matrix(p + "attn_v.weight", lw.v)
        vector(p + "attn_q_norm.weight", lw.q_norm)
        vector(p + "attn_k_norm.weight", lw.k_norm)
        matrix(p + "attn_output.weight", lw.o)
        vector(p + "post_attention_norm.weight", lw.post_attn_norm)
        vector(p + "ffn_norm.weight", lw.ffn_norm)
        matrix(p + "ffn_gate.weight", lw.gate)
        matrix(p + "ffn_up.weight", lw.up)
        matrix(p + "ffn_down.weight", lw.down)
        vector(p + "post_ffw_norm.weight", lw.post_ffn_norm)
    vector("output_norm.weight", weights.final_norm)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
