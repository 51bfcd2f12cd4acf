"""The Llama-family forward pass, written top to bottom as a sequence of backend ops.

One call runs one engine step: any mix of prefill chunks and decode tokens from many sequences,
flattened into T tokens, against the paged KV cache (layouts: tests/reference.py). The ops are those of
the backend contract (engine/backends/contract.py), called by name on whatever backend is given.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from models.config import ModelConfig
from models.weights import ModelWeights


@dataclass
class StepInput:
    tokens: np.ndarray          # [T] int32 token ids
    positions: np.ndarray       # [T] int32 position of each token in its sequence
    token_seq: np.ndarray       # [T] int32 row of block_tables that token t belongs to
    slot_mapping: np.ndarray    # [T] int64 cache slot (block * block_size + offset) for token t's K/V
    block_tables: np.ndarray    # [S, max_blocks] int32
    logits_indices: np.ndarray  # [S'] int32 tokens whose next-token logits are wanted
    # sliding-window models (models/gemma3.py): the slots and tables of each group of local layers
    window_slot_mapping: np.ndarray | None = None   # [G, T] int64
    window_block_tables: np.ndarray | None = None   # [G, S, max_blocks] int32 (blocks out of the window: 0)

    def arrays(self) -> tuple:
        """The fields in order, None for those a model without sliding windows leaves out."""
        return tuple(vars(self).values())


class RunState:
    """Scratch activations for up to `capacity` tokens, allocated once and reused every step."""

    def __init__(self, backend, cfg: ModelConfig, capacity: int):
        z = backend.zeros
        qkv = cfg.q_size + 2 * cfg.kv_size
        self.capacity = capacity
        self.h = z((capacity, cfg.hidden_size))                    # residual stream
        self.qkv = z((capacity, qkv))                              # q | k | v
        self.attn = z((capacity, cfg.q_size))                      # attention output
        self.gate_up = z((capacity, 2 * cfg.intermediate_size))    # gate | up


class LlamaModel:
    window_groups = 0   # groups of sliding-window layers with K/V blocks of their own (models/gemma3.py)

    def __init__(self, weights: ModelWeights, backend):
        cfg = self.config = weights.config
        b = self.backend = backend
        self.embed = b.linear([weights.embed])
        self.lm_head = self.embed if weights.lm_head is None else b.linear([weights.lm_head])
        self.layers = [
            _Layer(
                attn_norm=b.vector(lw.attn_norm),
                qkv=b.linear([lw.q, lw.k, lw.v]),
                o=b.linear([lw.o]),
                ffn_norm=b.vector(lw.ffn_norm),
                gate_up=b.linear([lw.gate, lw.up]),
                down=b.linear([lw.down]),
            )
            for lw in weights.layers
        ]
        # the layer loop as one backend call where the backend has one for these layers; None: op by op
        self.layer_stack = backend.layer_stack(self.layers)
        self.final_norm = b.vector(weights.final_norm)
        self.rope_cos, self.rope_sin = b.rope_tables(cfg.max_position, cfg.head_dim, cfg.rope_theta)
        self.scale = cfg.head_dim ** -0.5
        self.nbytes = sum(m.nbytes for m in self._linears()) + 4 * cfg.hidden_size * (2 * cfg.num_layers + 1)
        self._state: RunState | None = None

    def _linears(self):
        seen = {id(self.embed): self.embed, id(self.lm_head): self.lm_head}
        for ly in self.layers:
            for m in (ly.qkv, ly.o, ly.gate_up, ly.down):
                seen[id(m)] = m
        return seen.values()

    @property
    def group_size(self) -> int:
        """Layers whose K/V one pool block holds (every layer here; a group of them in models/gemma3.py)."""
        return self.config.num_layers

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        c = self.config
        return (self.group_size, num_blocks, block_size, c.num_kv_heads, c.head_dim)

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Bytes of one pool block: its layers' K and V for block_size positions."""
        c = self.config
        return 2 * 4 * self.group_size * block_size * c.num_kv_heads * c.head_dim

    def allocate_kv_cache(self, num_blocks: int, block_size: int):
        shape = self.kv_cache_shape(num_blocks, block_size)
        return self.backend.zeros(shape), self.backend.zeros(shape)

    def _run_state(self, ntok: int) -> RunState:
        if self._state is None or self._state.capacity < ntok:
            self._state = RunState(self.backend, self.config, max(ntok, 16))
        return self._state

    def forward(self, step: StepInput, k_cache, v_cache):
        """Logits [len(logits_indices), V] for one engine step; writes the step's K/V into the cache."""
        b, cfg = self.backend, self.config
        t = len(step.tokens)
        rs = self._run_state(t)
        h, qkv, attn, gate_up = (a[:t] for a in (rs.h, rs.qkv, rs.attn, rs.gate_up))
        H, Hkv, eps = cfg.num_heads, cfg.num_kv_heads, cfg.rms_norm_eps

        b.embedding(self.embed, step.tokens, h)                                    # h = E[tokens]
        if self.layer_stack is not None:                                           # the loop below, in one call
            self.layer_stack.run(h, qkv, attn, gate_up, step, k_cache, v_cache, self.rope_cos, self.rope_sin,
                                 H, Hkv, self.scale, eps)
        else:
            for i in range(len(self.layers)):
                self.layer(i, step, h, qkv, attn, gate_up, k_cache, v_cache)

        return self.head(h[step.logits_indices])

    def head(self, last):
        """Logits of the last hidden states."""
        logits = self.backend.zeros((len(last), self.config.vocab_size))
        self.backend.rmsnorm_matmul(last, self.final_norm, self.config.rms_norm_eps, self.lm_head,
                                    logits)                                        # logits = rmsnorm(h) E^T (tied)
        return logits

    def layer(self, i: int, step: StepInput, h, qkv, attn, gate_up, k_cache, v_cache) -> None:
        """Decoder layer i over the step's hidden states h, in place."""
        b, cfg, ly = self.backend, self.config, self.layers[i]
        H, Hkv, eps = cfg.num_heads, cfg.num_kv_heads, cfg.rms_norm_eps
        b.rmsnorm_matmul(h, ly.attn_norm, eps, ly.qkv, qkv)                        # q|k|v = rmsnorm(h) Wqkv^T
        b.rope_attention(qkv, step.positions, self.rope_cos, self.rope_sin,        # RoPE(q, k); cache k, v;
                         k_cache[i], v_cache[i], step.slot_mapping,                # attn = softmax(q K^T / sqrt(d)) V
                         step.block_tables, step.token_seq, H, Hkv, self.scale, attn,
                         next_linear=ly.o)                                         # (a hint: Wo comes next)
        b.matmul(attn, ly.o, h, accumulate=True)                                   # h += attn Wo^T
        b.rmsnorm_matmul(h, ly.ffn_norm, eps, ly.gate_up, gate_up)                 # gate|up = rmsnorm(h) Wgu^T
        b.silu_mul_matmul(gate_up, ly.down, h, accumulate=True)                    # h += (silu(gate) * up) Wdown^T


@dataclass
class _Layer:
    attn_norm: object
    qkv: object
    o: object
    ffn_norm: object
    gate_up: object
    down: object
