"""The backend contract: every op that the models (models/llama.py, models/gemma3.py) and the runner call on a backend,
and the types that cross the boundary. Implemented by `cpu` (engine/backends/cpu.py) and `cuda`
(cuda/backend.py); cuda/ imports from engine this module only.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np

from engine.backends.sampling_batch import RowSpec, SampleResult, SamplingBatch
from engine.backends.stacked_linear import LinearPart, StackedLinear
from engine.sampling import SamplingParams
from models.llama import StepInput
from models.quant import QuantTensor
from models.rope import rope_tables

__all__ = ["Backend", "ComposedOps", "FusedDecodeStep", "Gemma3LayerLoop", "LayerLoop", "LinearPart", "QuantTensor", "RowSpec", "SampleResult",
           "SamplingBatch", "SamplingParams", "StackedLinear", "StepInput", "rope_tables"]


class LayerLoop(Protocol):
    """Every decoder layer of a step in one call (what Backend.layer_stack returns)."""

    def run(self, h, qkv, attn, gate_up, step: StepInput, k_cache, v_cache, cos, sin, num_heads: int,
            num_kv_heads: int, scale: float, eps: float) -> None:
        """The forward's layer loop: h (the residual stream) in and out, K/V written into the caches."""


class Gemma3LayerLoop(Protocol):
    """Every Gemma 3 decoder layer of a step in one call (what Backend.gemma3_layer_stack returns)."""

    def run(self, h, qkv, attn, gate_up, branch, step: StepInput, k_cache, v_cache, num_heads: int,
            num_kv_heads: int, scale: float, eps: float) -> None:
        """models/gemma3.py's layer loop: h (the residual stream) in and out, K/V written into the caches."""


class FusedDecodeStep(Protocol):
    """What Backend.fused_decode returns: forward and sampling of a pure decode step in one call."""

    def bucket(self, num_seqs: int) -> int | None:
        """The batch bucket that holds num_seqs sequences, or None (too many: the per-op path serves it)."""

    def run(self, step: StepInput, batch: SamplingBatch) -> SampleResult:
        """One token for each sequence of step (token t belongs to block-table row t), K/V written."""


@runtime_checkable
class Backend(Protocol):
    """The ops of one target. Arrays are the backend's own (host numpy arrays, device arrays)."""

    name: str

    # --- weights and buffers
    def linear(self, tensors: list[QuantTensor]) -> StackedLinear:
        """A linear layer y = x @ W.T over `tensors` stacked along the output (q|k|v, gate|up)."""

    def vector(self, v: np.ndarray) -> Any:
        """A float32 vector (a norm's weights) in the backend's memory."""

    def zeros(self, shape, dtype=np.float32) -> Any:
        """A zero-filled array in the backend's memory."""

    def upload(self, a: np.ndarray) -> Any:
        """A host array (per-step metadata) in the backend's memory."""

    def download(self, a) -> np.ndarray:
        """A backend array as a host numpy array."""

    def rope_tables(self, max_position: int, head_dim: int, theta: float) -> tuple[Any, Any]:
        """cos, sin [max_position, head_dim/2] (models/rope.py) in the backend's memory."""

    def share_cpu(self, sharing: bool) -> None:
        """Leave a CPU core to other work while `sharing` (nothing to do where kernels run off the CPU)."""

    # --- the forward pass
    def embedding(self, table: StackedLinear, tokens, out) -> None:
        """out[t] = row tokens[t] of the table's matrix."""

    def rmsnorm_matmul(self, x, w, eps: float, lin: StackedLinear, out, accumulate: bool = False) -> None:
        """out (+)= (rmsnorm(x) * w) @ W.T"""

    def rope_attention(self, qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, block_tables, token_seq,
                       num_heads: int, num_kv_heads: int, scale: float, out,
                       next_linear: StackedLinear | None = None, window: int = 0) -> None:
        """RoPE on q and k inside qkv, k and v into the paged cache, out = causal attention over it
        (window > 0: a query at position p attends to positions p - window + 1 .. p only)."""

    def matmul(self, x, lin: StackedLinear, out, accumulate: bool = False) -> None:
        """out (+)= x @ W.T"""

    def silu_mul_matmul(self, gate_up, lin: StackedLinear, out, accumulate: bool = False) -> None:
        """out (+)= (silu(gate) * up) @ W.T with gate_up = [gate | up]"""

    # --- what Gemma 3 adds
    def scale(self, x, factor: float) -> None:
        """x *= factor, in place (Gemma's embedding scale)."""

    def head_rmsnorm(self, qkv, q_w, k_w, num_heads: int, num_kv_heads: int, eps: float) -> None:
        """In place: every q head inside qkv = rmsnorm(head) * q_w, every k head = rmsnorm(head) * k_w."""

    def rmsnorm_add(self, x, w, eps: float, out) -> None:
        """out += rmsnorm(x) * w (x may be overwritten): a post-norm branch into the residual stream."""

    def gelu_mul_matmul(self, gate_up, lin: StackedLinear, out, accumulate: bool = False) -> None:
        """out (+)= (gelu_tanh(gate) * up) @ W.T with gate_up = [gate | up]"""

    def layer_stack(self, layers: list) -> LayerLoop | None:
        """The layer loop as one call for these layers, or None (not supported): the forward then runs it op by op."""

    def gemma3_layer_stack(self, layers: list, layer_kv: list) -> Gemma3LayerLoop | None:
        """Gemma 3's layer loop as one call (layer_kv: each layer's cache group and slot), or None (not
        supported): the forward then runs it op by op."""

    def fused_decode(self, model, k_cache, v_cache) -> FusedDecodeStep | None:
        """A pure decode step (one new token per sequence) of this model as one device call, or None (not
        supported): the runner then takes the forward and `sample` for every step."""

    # --- sampling
    def sample(self, logits, batch: SamplingBatch) -> SampleResult:
        """One token per row of logits [S, V] (engine/sampling.py's semantics), ids and logprobs on the host."""


class ComposedOps:
    """The contract's fused ops composed from a backend's basic ones, for a backend without fused kernels:
    rmsnorm then matmul, rope_store_kv then attention, silu_mul (gelu_mul) then matmul. The intermediate goes into
    a grow-only scratch of the backend's own."""

    def _composed_scratch(self, name: str, rows: int, cols: int):
        bufs = self.__dict__.setdefault("_composed_buffers", {})
        buf = bufs.get(name)
        if buf is None or buf.shape[0] < rows or buf.shape[1] != cols:
            buf = bufs[name] = self.zeros((max(rows, 16), cols))
        return buf[:rows]

    def rmsnorm_matmul(self, x, w, eps, lin, out, accumulate: bool = False) -> None:
        normed = self._composed_scratch("normed", x.shape[0], x.shape[1])
        self.rmsnorm(x, w, eps, normed)
        self.matmul(normed, lin, out, accumulate=accumulate)

    def rope_attention(self, qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, block_tables, token_seq,
                       num_heads, num_kv_heads, scale, out, next_linear=None, window: int = 0) -> None:
        self.rope_store_kv(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads)
        self.attention(qkv, k_cache, v_cache, block_tables, positions, token_seq, num_heads, num_kv_heads,
                       scale, out, window=window)

    def silu_mul_matmul(self, gate_up, lin, out, accumulate: bool = False) -> None:
        mlp = self._composed_scratch("mlp", gate_up.shape[0], gate_up.shape[1] // 2)
        self.silu_mul(gate_up, mlp)
        self.matmul(mlp, lin, out, accumulate=accumulate)

    def gelu_mul_matmul(self, gate_up, lin, out, accumulate: bool = False) -> None:
        mlp = self._composed_scratch("mlp", gate_up.shape[0], gate_up.shape[1] // 2)
        self.gelu_mul(gate_up, mlp)
        self.matmul(mlp, lin, out, accumulate=accumulate)
