"""numpy float64 reference of every op and of the whole Llama and Gemma 3 forward passes.

Every op also runs in another dtype (`dtype=np.float32`): the same math rounded as a plain float32
evaluation rounds it, to tell how much float32 error an input brings by itself.

This is the contract every backend is checked against. Layouts (shared by all backends):
  activations      [T, features] row-major, T = tokens in the step (all sequences flattened)
  weights          [out, in] (Hugging Face orientation); y = x @ W.T
  qkv              [T, (H + 2*Hkv) * Dh]: q heads, then k heads, then v heads
  KV cache         k_cache, v_cache of one layer: [num_blocks, block_size, Hkv, Dh]
  slot_mapping     [T] int64: block * block_size + offset where token t's K/V is written
  block_tables     [S, max_blocks] int32, seq_lens [S] (context length after this step),
  query_start_loc  [S + 1] int32: sequence s owns tokens query_start_loc[s] : query_start_loc[s+1],
                   which are its last (query_len) positions; a token attends to every position <= its own.
RoPE is the rotate-half form of Hugging Face Llama (pairs (i, i + Dh/2)).
"""
from __future__ import annotations

import numpy as np


def rmsnorm(x, w, eps, dtype=np.float64):
    x = np.asarray(x, dtype)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + dtype(eps)) * np.asarray(w, dtype)


def rope_cos_sin(positions, head_dim, theta):
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    ang = np.asarray(positions, np.float64)[:, None] * inv_freq[None, :]
    return np.cos(ang), np.sin(ang)  # [T, Dh/2]


def rope(x, positions, theta, dtype=np.float64):
    """x: [T, heads, Dh]."""
    x = np.asarray(x, dtype)
    half = x.shape[-1] // 2
    cos, sin = rope_cos_sin(positions, x.shape[-1], theta)
    cos, sin = cos[:, None, :].astype(dtype), sin[:, None, :].astype(dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def silu_mul(gate_up, dtype=np.float64):
    """gate_up: [T, 2F] = [gate | up]."""
    g, u = np.split(np.asarray(gate_up, dtype), 2, axis=-1)
    return g / (dtype(1) + np.exp(-g)) * u


def gelu_tanh_mul(gate_up, dtype=np.float64):
    """gate_up: [T, 2F] = [gate | up] -> gelu(gate) * up, GELU in its tanh approximation."""
    g, u = np.split(np.asarray(gate_up, dtype), 2, axis=-1)
    return dtype(0.5) * g * (dtype(1) + np.tanh(dtype(np.sqrt(2 / np.pi)) * (g + dtype(0.044715) * g ** 3))) * u


def causal_attention(q, k, v, scale, dtype=np.float64, window=0):
    """q: [Tq, H, Dh] at the last Tq positions of k/v: [Tk, Hkv, Dh]. window > 0: a query at position p
    sees the keys at p - window < position <= p only (a sliding window)."""
    q, k, v = (np.asarray(a, dtype) for a in (q, k, v))
    scale = dtype(scale)
    tq, h, _ = q.shape
    tk, hkv, _ = k.shape
    group = h // hkv
    out = np.zeros_like(q)
    for head in range(h):
        kh, vh = k[:, head // group], v[:, head // group]
        s = q[:, head] @ kh.T * scale  # [Tq, Tk]
        qpos = np.arange(tk - tq, tk)[:, None]
        kpos = np.arange(tk)[None, :]
        visible = (kpos <= qpos) & ((kpos > qpos - window) if window > 0 else True)
        s = np.where(visible, s, -np.inf)
        s = np.exp(s - s.max(axis=1, keepdims=True))
        out[:, head] = (s / s.sum(axis=1, keepdims=True)) @ vh
    return out


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, window=0):
    """The paged form: gathers each sequence's K/V through its block table."""
    q = np.asarray(q, np.float64)
    out = np.zeros_like(q)
    bs = k_cache.shape[1]
    for s in range(len(seq_lens)):
        n = int(seq_lens[s])
        nblk = -(-n // bs)
        blocks = block_tables[s, :nblk]
        k = k_cache[blocks].reshape(-1, *k_cache.shape[2:])[:n]
        v = v_cache[blocks].reshape(-1, *v_cache.shape[2:])[:n]
        a, b = query_start_loc[s], query_start_loc[s + 1]
        out[a:b] = causal_attention(q[a:b], k, v, scale, window=window)
    return out


def paged_kv_case(rng, seqs, h, hkv, dh, bs, spare_blocks=5) -> dict:
    """A random step over a paged cache: sequences `seqs` ((first position, tokens) each), their K/V of
    earlier positions already in randomly ordered blocks (plus `spare_blocks` unused), a random qkv."""
    ctx = [start + n for start, n in seqs]
    nblocks = sum(-(-c // bs) for c in ctx) + spare_blocks
    perm = rng.permutation(nblocks).astype(np.int32)
    tables = np.zeros((len(seqs), -(-max(ctx) // bs)), np.int32)
    used = 0
    for i, c in enumerate(ctx):
        nb = -(-c // bs)
        tables[i, :nb] = perm[used:used + nb]
        used += nb
    kc = rng.standard_normal((nblocks, bs, hkv, dh)).astype(np.float32)
    vc = rng.standard_normal((nblocks, bs, hkv, dh)).astype(np.float32)
    positions = np.concatenate([np.arange(start, start + n) for start, n in seqs]).astype(np.int32)
    token_seq = np.concatenate([[i] * n for i, (_, n) in enumerate(seqs)]).astype(np.int32)
    slot = tables[token_seq, positions // bs].astype(np.int64) * bs + positions % bs
    qkv = rng.standard_normal((len(positions), (h + 2 * hkv) * dh)).astype(np.float32)
    qsl = np.concatenate([[0], np.cumsum([n for _, n in seqs])]).astype(np.int32)
    return dict(h=h, hkv=hkv, dh=dh, ctx=np.array(ctx), qsl=qsl, tables=tables, kc=kc, vc=vc,
                positions=positions, token_seq=token_seq, slot=slot, qkv=qkv)


def rope_store_kv(case, theta):
    """RoPE of a paged_kv_case's q and k, and its caches after its K/V are written: (q, k, k cache,
    v cache), float64."""
    t, h, hkv, dh = len(case["positions"]), case["h"], case["hkv"], case["dh"]
    qkv = case["qkv"]
    q = rope(qkv[:, :h * dh].reshape(t, h, dh), case["positions"], theta)
    k = rope(qkv[:, h * dh:(h + hkv) * dh].reshape(t, hkv, dh), case["positions"], theta)
    v = qkv[:, (h + hkv) * dh:].reshape(t, hkv, dh)
    kc, vc = case["kc"].astype(np.float64), case["vc"].astype(np.float64)
    kc.reshape(-1, hkv, dh)[case["slot"]] = k
    vc.reshape(-1, hkv, dh)[case["slot"]] = v
    return q, k, kc, vc


class _Dense:
    """A matrix dequantized to float64 once, with QuantTensor's dequantize() interface."""

    def __init__(self, qt):
        self.value = qt.dequantize().astype(np.float64)

    def dequantize(self):
        return self.value


def densify(weights):
    """The same ModelWeights with every matrix dequantized to float64 once (for repeated forwards)."""
    import copy

    d = copy.copy(weights)
    d.embed = _Dense(weights.embed)
    d.lm_head = None if weights.lm_head is None else _Dense(weights.lm_head)
    d.layers = []
    for lw in weights.layers:
        c = copy.copy(lw)
        for name in ("q", "k", "v", "o", "gate", "up", "down"):
            setattr(c, name, _Dense(getattr(lw, name)))
        d.layers.append(c)
    return d


def forward(weights, tokens, positions=None, dtype=np.float64):
    """Reference Llama forward for one sequence from position 0; returns logits [T, V] (in dtype).

    `weights` is models.weights.ModelWeights (or densify(weights)); matrices are used in dtype.
    """
    tokens = np.asarray(tokens)
    positions = np.arange(len(tokens)) if positions is None else np.asarray(positions)
    x = _matrix(weights.embed, dtype)[tokens]
    for lw in weights.layers:
        x = layer(x, lw, weights.config, positions, dtype)
    return head(x, weights, dtype)


def _matrix(qt, dtype):
    return np.asarray(qt.dequantize(), dtype=dtype)


def layer(x, lw, cfg, positions, dtype=np.float64):
    """One decoder layer over a whole sequence's hidden states x [T, D] (positions from 0)."""
    t = len(x)
    x = np.asarray(x, dtype)
    h, hkv, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    a = rmsnorm(x, lw.attn_norm, cfg.rms_norm_eps, dtype)
    q = (a @ _matrix(lw.q, dtype).T).reshape(t, h, dh)
    k = (a @ _matrix(lw.k, dtype).T).reshape(t, hkv, dh)
    v = (a @ _matrix(lw.v, dtype).T).reshape(t, hkv, dh)
    q, k = rope(q, positions, cfg.rope_theta, dtype), rope(k, positions, cfg.rope_theta, dtype)
    o = causal_attention(q, k, v, dh ** -0.5, dtype).reshape(t, h * dh)
    x = x + o @ _matrix(lw.o, dtype).T
    m = rmsnorm(x, lw.ffn_norm, cfg.rms_norm_eps, dtype)
    gu = np.concatenate([m @ _matrix(lw.gate, dtype).T, m @ _matrix(lw.up, dtype).T], axis=-1)
    return x + silu_mul(gu, dtype) @ _matrix(lw.down, dtype).T


def head(x, weights, dtype=np.float64):
    """Logits of the last hidden states: the final norm, then the LM head (the embedding when tied)."""
    x = rmsnorm(x, weights.final_norm, weights.config.rms_norm_eps, dtype)
    lm = weights.lm_head if weights.lm_head is not None else weights.embed
    return x @ _matrix(lm, dtype).T


def gemma3_forward(weights, tokens, dtype=np.float64, window=None, pattern=None, local_theta=None,
                   last_only=False):
    """Reference Gemma 3 forward for one sequence from position 0; returns logits [T, V] (in dtype), or
    [1, V] for the last token only (last_only: a long prompt's logits cost more than the rest).

    From the architecture (Gemma 3's technical report and the Hugging Face modeling code): the embedding
    times sqrt(hidden); per layer x += postnorm(attention(prenorm(x))), x += postnorm(mlp(prenorm(x)))
    with q and k normalized per head before RoPE; layer i is global when (i + 1) % pattern == 0, else it
    attends over the last `window` positions with RoPE base `local_theta`; GELU-tanh gating; tied head.
    Norm weights are the factors (1 + w). window / pattern / local_theta default to the config's.
    """
    cfg = weights.config
    window = cfg.sliding_window if window is None else window
    pattern = cfg.sliding_window_pattern if pattern is None else pattern
    local_theta = cfg.rope_local_theta if local_theta is None else local_theta
    tokens = np.asarray(tokens)
    t = len(tokens)
    positions = np.arange(t)
    dense = lambda qt: np.asarray(qt.dequantize(), dtype=dtype)  # noqa: E731
    eps = cfg.rms_norm_eps
    h, hkv, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    x = dense(weights.embed)[tokens] * dtype(np.sqrt(cfg.hidden_size))
    for i, lw in enumerate(weights.layers):
        is_global = pattern > 0 and (i + 1) % pattern == 0 or window == 0
        theta = cfg.rope_theta if is_global else local_theta
        a = rmsnorm(x, lw.attn_norm, eps, dtype)
        q = rmsnorm((a @ dense(lw.q).T).reshape(t, h, dh), lw.q_norm, eps, dtype)
        k = rmsnorm((a @ dense(lw.k).T).reshape(t, hkv, dh), lw.k_norm, eps, dtype)
        v = (a @ dense(lw.v).T).reshape(t, hkv, dh)
        q, k = rope(q, positions, theta, dtype), rope(k, positions, theta, dtype)
        o = causal_attention(q, k, v, dh ** -0.5, dtype, window=0 if is_global else window).reshape(t, h * dh)
        x = x + rmsnorm(o @ dense(lw.o).T, lw.post_attn_norm, eps, dtype)
        m = rmsnorm(x, lw.ffn_norm, eps, dtype)
        gu = np.concatenate([m @ dense(lw.gate).T, m @ dense(lw.up).T], axis=-1)
        x = x + rmsnorm(gelu_tanh_mul(gu, dtype) @ dense(lw.down).T, lw.post_ffn_norm, eps, dtype)
    x = rmsnorm(x[-1:] if last_only else x, weights.final_norm, eps, dtype)
    head = weights.lm_head if weights.lm_head is not None else weights.embed
    return x @ dense(head).T


def log_softmax(logits):
    z = np.asarray(logits, np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
