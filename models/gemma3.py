"""The Gemma 3 forward pass, written top to bottom as a sequence of backend ops.

What differs from Llama (models/llama.py, whose step input, KV cache layout and helpers it shares): the
embedding scaled by sqrt(hidden); RMSNorm of every q and k head; RMSNorm of the attention and MLP outputs
before they join the residual stream; a GELU-tanh gated MLP; local layers that attend over a sliding window
and rotate with their own RoPE base, every sliding_window_pattern-th layer global. Norm weights are the
(1 + w) factors (models/weights.py).

The KV cache holds groups of `group_size` layers (the global layers' group, then the local layers' groups;
engine/kv_cache.py): a local group's blocks leave the cache once out of the window, so a long sequence
holds the local layers' K/V for its last window positions only.
"""
from __future__ import annotations

from dataclasses import dataclass

from models.config import ModelConfig
from models.llama import LlamaModel, RunState, StepInput
from models.weights import ModelWeights


class Gemma3RunState(RunState):
    """RunState plus the attention or MLP output before its post-norm."""

    def __init__(self, backend, cfg: ModelConfig, capacity: int):
        super().__init__(backend, cfg, capacity)
        self.branch = backend.zeros((capacity, cfg.hidden_size))   # Wo attn, or the MLP's down projection


class Gemma3Model(LlamaModel):
    group_size = 0   # set by _group_layers (an attribute here, LlamaModel's is a property)

    def __init__(self, weights: ModelWeights, backend):
        cfg = self.config = weights.config
        b = self.backend = backend
        tables = {theta: b.rope_tables(cfg.max_position, cfg.head_dim, theta)   # one (cos, sin) per RoPE base
                  for theta in {cfg.layer_rope_theta(i) for i in range(cfg.num_layers)}}
        self.embed = b.linear([weights.embed])
        self.lm_head = self.embed if weights.lm_head is None else b.linear([weights.lm_head])
        self.layers = [
            _Gemma3Layer(
                attn_norm=b.vector(lw.attn_norm), q_norm=b.vector(lw.q_norm), k_norm=b.vector(lw.k_norm),
                qkv=b.linear([lw.q, lw.k, lw.v]), o=b.linear([lw.o]), post_attn_norm=b.vector(lw.post_attn_norm),
                ffn_norm=b.vector(lw.ffn_norm), gate_up=b.linear([lw.gate, lw.up]), down=b.linear([lw.down]),
                post_ffn_norm=b.vector(lw.post_ffn_norm), window=cfg.layer_window(i),
                rope=tables[cfg.layer_rope_theta(i)],
            )
            for i, lw in enumerate(weights.layers)
        ]
        self._group_layers(cfg)
        # the layer loop as one backend call where the backend has one for these layers; None: op by op
        self.layer_stack = backend.gemma3_layer_stack(self.layers, self.layer_kv)
        self.final_norm = b.vector(weights.final_norm)
        self.scale = cfg.head_dim ** -0.5
        self.nbytes = sum(m.nbytes for m in self._linears()) \
            + 4 * (cfg.hidden_size * (4 * cfg.num_layers + 1) + 2 * cfg.head_dim * cfg.num_layers)
        self._state: Gemma3RunState | None = None

    def _group_layers(self, cfg: ModelConfig) -> None:
        """layer_kv[i] = (group, slot): group 0 holds the global layers, 1.. the local ones, group_size each."""
        local = [i for i in range(cfg.num_layers) if cfg.is_local(i)]
        full = [i for i in range(cfg.num_layers) if not cfg.is_local(i)]
        if not local or not full or len(local) % len(full):
            # one group: nothing to free apart, no table for the globals, or local layers that do not
            # split into groups as large as the global one (Gemma 3 1B's 22 and 4): no saving, still right
            self.group_size, self.window_groups = cfg.num_layers, 0
            self.layer_kv = [(0, i) for i in range(cfg.num_layers)]
            return
        self.group_size = len(full)   # every group as large as the global layers' (kv_cache_shape reads it)
        self.window_groups = len(local) // self.group_size
        self.layer_kv = [None] * cfg.num_layers
        for j, i in enumerate(full):
            self.layer_kv[i] = (0, j)
        for j, i in enumerate(local):
            self.layer_kv[i] = (1 + j // self.group_size, j % self.group_size)

    def _run_state(self, ntok: int) -> Gemma3RunState:
        if self._state is None or self._state.capacity < ntok:
            self._state = Gemma3RunState(self.backend, self.config, max(ntok, 16))
        return self._state

    def forward(self, step: StepInput, k_cache, v_cache):
        """Logits [len(logits_indices), V] for one engine step; writes the step's K/V into the cache."""
        b, cfg = self.backend, self.config
        if self.window_groups and step.window_block_tables is None:
            raise ValueError("a step of a sliding-window model needs the local layer groups' block tables")
        t = len(step.tokens)
        rs = self._run_state(t)
        h, qkv, attn, gate_up, branch = (a[:t] for a in (rs.h, rs.qkv, rs.attn, rs.gate_up, rs.branch))
        H, Hkv, eps = cfg.num_heads, cfg.num_kv_heads, cfg.rms_norm_eps

        b.embedding(self.embed, step.tokens, h)                                   # h = E[tokens] * sqrt(D)
        b.scale(h, cfg.embed_scale)
        if self.layer_stack is not None:                                          # the loop below, in one call
            self.layer_stack.run(h, qkv, attn, gate_up, branch, step, k_cache, v_cache, H, Hkv, self.scale, eps)
            return self.head(h[step.logits_indices])
        for i, ly in enumerate(self.layers):
            group, slot = self.layer_kv[i]
            slots, tables = step.slot_mapping, step.block_tables
            if group:
                slots, tables = step.window_slot_mapping[group - 1], step.window_block_tables[group - 1]
            b.rmsnorm_matmul(h, ly.attn_norm, eps, ly.qkv, qkv)                   # q|k|v = rmsnorm(h) Wqkv^T
            b.head_rmsnorm(qkv, ly.q_norm, ly.k_norm, H, Hkv, eps)                # q, k = rmsnorm per head
            cos, sin = ly.rope
            b.rope_attention(qkv, step.positions, cos, sin, k_cache[slot], v_cache[slot],  # RoPE(q, k) at this
                             slots, tables, step.token_seq,                          # layer's base; cache k, v;
                             H, Hkv, self.scale, attn, next_linear=ly.o,             # over the window (local) or
                             window=ly.window)                                       # everything (global)
            b.matmul(attn, ly.o, branch)                                          # branch = attn Wo^T
            b.rmsnorm_add(branch, ly.post_attn_norm, eps, h)                      # h += rmsnorm(branch)
            b.rmsnorm_matmul(h, ly.ffn_norm, eps, ly.gate_up, gate_up)            # gate|up = rmsnorm(h) Wgu^T
            b.gelu_mul_matmul(gate_up, ly.down, branch)                           # branch = gelu(gate)*up Wdown^T
            b.rmsnorm_add(branch, ly.post_ffn_norm, eps, h)                       # h += rmsnorm(branch)

        return self.head(h[step.logits_indices])


@dataclass
class _Gemma3Layer:
    attn_norm: object
    q_norm: object
    k_norm: object
    qkv: object
    o: object
    post_attn_norm: object
    ffn_norm: object
    gate_up: object
    down: object
    post_ffn_norm: object
    window: int          # attention window in positions; 0: global
    rope: tuple          # (cos, sin) at this layer's RoPE base
