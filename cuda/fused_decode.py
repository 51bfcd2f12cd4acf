"""The fused decode step of one model on the cuda backend: a pure decode step (one new token for each sequence)
in one launch of `decode_step`, one upload and one download.

Built once when the model loads (`CudaBackend.fused_decode`): each weight role (embedding, qkv, o, gate_up, down,
LM head) is stacked over layers into one device array per field (the layers' own arrays become views of it, so
the weights are held once); activations, logits, the sampler's scratch and the split-attention partials are
allocated for the largest batch bucket; the per-step upload and the results are packed buffers (decode_state.py)
laid out per bucket. `run` takes the runner's StepInput and SamplingBatch and returns a SampleResult.

Modes: "cooperative" launches decode_step once per step (the grid: the cooperative occupancy limit, at most
blocks_per_sm per SM; one block in the simulator, whose grid sync is only a block barrier); "phased" launches
decode_phase once per phase on any grid: how the simulator checks the phases on grids of many blocks. (A GPU
without cooperative launches gets no FusedDecode: the per-op path serves it, CudaBackend.fused_decode.)
"""
from __future__ import annotations

import dataclasses
import logging
from typing import NamedTuple

import numpy as np

from cuda import launch
from cuda.decode_state import PackedBuffer, StepCounters, fill_inputs, input_fields, output_fields
from cuda.kernels import decode_step as step_k
from cuda.kernels.common import SIMULATOR
from cuda.kernels.decode_phases import DecodeSpec, phase_plan
from engine.backends.contract import SampleResult

log = logging.getLogger(__name__)


class Unsupported(Exception):
    """This model cannot take the fused decode step (the per-op path serves it)."""


def _role_family(linears, role: str) -> str:
    """The one weight family of a role over all its layers (and fused parts), or Unsupported."""
    fams = {p.family for lin in linears for p in lin.parts}
    if len(fams) != 1 or any(len(lin.parts) != 1 for lin in linears):
        raise Unsupported(f"{role}: the fused step needs one weight format per role, found {sorted(fams)}")
    return fams.pop()


def _stack(backend, linears) -> tuple:
    """The role's arrays stacked over layers ([L, ...] each); every layer's part now views its slice."""
    parts = [lin.parts[0] for lin in linears]
    stacked = []
    for i, a in enumerate(parts[0].arrays):
        s = backend.empty((len(parts),) + tuple(a.shape), a.dtype)
        for li, p in enumerate(parts):
            s[li].copy_to_device(p.arrays[i])
        stacked.append(s)
    for li, p in enumerate(parts):
        p.arrays = tuple(s[li] for s in stacked)
    return tuple(stacked)


class PreparedStep(NamedTuple):
    """A step packed for its launch: the decode_step variant, its phase plan, the kernel's arguments, the
    packed inputs (host side filled, uploaded by FusedDecode.upload) and the output buffer."""
    spec: DecodeSpec
    plan: object
    args: tuple
    inputs: PackedBuffer
    out: PackedBuffer


class FusedDecode:
    def __init__(self, backend, model, k_cache, v_cache, mode: str = "cooperative", grid: int | None = None):
        cfg, c = model.config, backend.config
        self.backend, self.mode, self.counters = backend, mode, StepCounters()
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.scale, self.eps = np.float32(model.scale), np.float32(cfg.rms_norm_eps)
        if cfg.architecture != "llama" or cfg.sliding_window:
            raise Unsupported(f"{cfg.architecture}: the fused step runs the Llama layer without a sliding window")
        group = cfg.num_heads // cfg.num_kv_heads
        if group > c.attn_rows:
            raise Unsupported(f"{group} query heads per KV head exceed attn_rows={c.attn_rows}")
        if cfg.head_dim > launch.ATTN_HEAD_DIM:
            raise Unsupported(f"head_dim {cfg.head_dim} > {launch.ATTN_HEAD_DIM}")
        layers = model.layers
        roles = {"embedding": [model.embed], "qkv": [ly.qkv for ly in layers], "o": [ly.o for ly in layers],
                 "gate_up": [ly.gate_up for ly in layers], "down": [ly.down for ly in layers],
                 "lm_head": [model.lm_head]}
        families = tuple(_role_family(lins, role) for role, lins in roles.items())
        self.spec = DecodeSpec.for_config(c, families, cfg.head_dim)
        # decode_step's two variants: GEMV matmul phases, and tiled ones past the GEMV's batch (as the per-op path)
        self.specs = {False: self.spec, True: dataclasses.replace(self.spec, tiled=True)}
        vec = backend.vector
        self.weights = (
            *model.embed.parts[0].arrays, vec(np.stack([backend.download(ly.attn_norm) for ly in layers])),
            *_stack(backend, roles["qkv"]), *_stack(backend, roles["o"]),
            vec(np.stack([backend.download(ly.ffn_norm) for ly in layers])), *_stack(backend, roles["gate_up"]),
            *_stack(backend, roles["down"]), model.final_norm, *model.lm_head.parts[0].arrays,
            model.rope_cos, model.rope_sin, k_cache, v_cache)
        self.buckets = tuple(sorted(c.decode_buckets))
        self.max_batch = self.buckets[-1]
        self._allocate_state(cfg, self.max_batch)
        self.plans = {(split, tiled): backend.upload(phase_plan(cfg.num_layers, split, tiled))
                      for split in (False, True) for tiled in (False, True)}
        self.head_dim, self.vocab = cfg.head_dim, cfg.vocab_size
        self._inputs: dict[int, PackedBuffer] = {}
        self._outputs: dict[int, PackedBuffer] = {}
        for b in self.buckets:  # laid out now; a step that needs more room lays its bucket out again, larger
            self._input_buffer(b, 8, 64)
            self._output_buffer(b, 1)
        self._grid = grid
        self._launchers: dict = {}  # spec -> decode_step configured for its grid
        self.grids: dict = {}       # spec -> its cooperative grid (blocks)
        self._part_views: dict = {}

    def _allocate_state(self, cfg, b: int) -> None:
        z, c = self.backend.zeros, self.backend.config
        qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        # split-K partials: a step of n sequences splits into at most ceil(target / (n Hkv)) parts
        most_splits = -(-c.attn_target_blocks // cfg.num_kv_heads)
        self._parts = z((b + most_splits) * cfg.num_heads * (cfg.head_dim + 2))
        self.state_arrays = [z((b, cfg.hidden_size)), z((b, qkv)), z((b, cfg.q_size)), z((b, cfg.intermediate_size)),
                             z((b, cfg.vocab_size)), None, None, z((b, cfg.vocab_size)),
                             z((b, cfg.vocab_size), np.int32), z(b), z(b), z((b, 2 * cfg.intermediate_size))]

    # --- buckets and buffers
    def bucket(self, n: int) -> int | None:
        """The smallest bucket that holds n sequences, or None (more than the largest: the per-op path)."""
        return next((b for b in self.buckets if b >= n), None)

    def variant_batches(self, most: int) -> tuple[int, ...]:
        """A batch size that takes each decode_step variant this model runs with at most `most` sequences a
        step (GEMV; tiled past the GEMV's)."""
        tiled = self.backend.config.gemv_max_tokens + 1
        return (1, tiled) if tiled <= min(most, self.max_batch) else (1,)

    def _input_buffer(self, bucket: int, width: int, csr: int, mask_shape: tuple = (1, 1)) -> PackedBuffer:
        buf = self._inputs.get(bucket)
        masks = buf.host["allowed_mask"].shape if buf else (1, 1)
        if (buf is None or buf.host["block_tables"].shape[1] < width or len(buf.host["hist_token_ids"]) < csr
                or masks[0] < mask_shape[0] or masks[1] < mask_shape[1]):
            old = (buf.host["block_tables"].shape[1], len(buf.host["hist_token_ids"])) if buf else (8, 64)
            # mask rows grow to what a step needs, not doubled: every step uploads the whole region
            buf = self._inputs[bucket] = PackedBuffer(input_fields(
                bucket, max(width, 2 * old[0]), max(csr, 2 * old[1]),
                (max(mask_shape[0], masks[0]), max(mask_shape[1], masks[1]))))
        return buf

    def _output_buffer(self, bucket: int, k: int) -> PackedBuffer:
        buf = self._outputs.get(bucket)
        if buf is None or buf.host["top_token_ids"].shape[1] < k:
            buf = self._outputs[bucket] = PackedBuffer(output_fields(bucket, max(k, 1)))
        return buf

    def _partials(self, ntok: int, nsplit: int):
        """part_acc [ntok, H, nsplit, Dh] and part_ml [ntok, H, nsplit, 2], views of one buffer (cached)."""
        key = (ntok, nsplit)
        if self._part_views.get("key") != key:
            dh = self.head_dim
            n = ntok * self.num_heads * nsplit
            self._part_views = {"key": key, "views": (self._parts[:n * dh].reshape(ntok, self.num_heads, nsplit, dh),
                                                      self._parts[n * dh:n * (dh + 2)].reshape(ntok, self.num_heads,
                                                                                               nsplit, 2))}
        return self._part_views["views"]

    # --- the step
    def run(self, step, batch) -> SampleResult:
        """Sample one token for each sequence of a pure decode step (token t belongs to block-table row t)."""
        prepared = self.prepare(step, batch)
        self.upload(prepared)
        self.launch(prepared)
        return self.download(prepared, batch)

    def prepare(self, step, batch) -> PreparedStep:
        """The step's inputs packed into its bucket's host buffer, and what its launch takes."""
        n = len(step.tokens)
        bucket = self.bucket(n)
        if bucket is None or n != batch.num_rows:
            raise ValueError(f"a fused decode step takes 1..{self.max_batch} sequences, one token each")
        batch.check_logits_shape((n, self.vocab))  # token ids of the sampler's lists inside the vocabulary
        self.counters.reset()
        csr = max(len(batch.bias_token_ids), len(batch.mask_token_ids), len(batch.hist_token_ids))
        inp = self._input_buffer(bucket, step.block_tables.shape[1], csr,
                                 batch.allowed_mask.shape if batch.constrained else (1, 1))
        out = self._output_buffer(bucket, batch.max_num_logprobs)
        fill_inputs(inp, step, batch)
        nsplit, split = self.backend.split_plan(n * self.num_kv_heads, int(np.max(step.positions)) + 1)
        state = list(self.state_arrays)
        state[5], state[6] = self._partials(n, nsplit)
        names = [f[0] for f in input_fields(1, 1, 1)]
        args = (n, nsplit, split, self.num_heads, self.num_kv_heads, self.scale, self.eps,
                tuple(inp.device[f] for f in names), self.weights, tuple(state),
                tuple(out.device[f[0]] for f in output_fields(1, 1)))
        # past the GEMV's batch the matmul phases are tiled GEMMs, as the per-op path switches to its GEMM
        tiled = n > self.backend.config.gemv_max_tokens
        return PreparedStep(self.specs[tiled], self.plans[nsplit > 1, tiled], args, inp, out)

    def upload(self, p: PreparedStep) -> None:
        """The step's one host-to-device copy."""
        p.inputs.upload()
        self.counters.uploads += 1

    def launch(self, p: PreparedStep) -> None:
        if self.mode == "cooperative":
            self._cooperative(p)
        else:
            kern = step_k.decode_phase(p.spec)
            for s in range(p.plan.shape[0]):
                kern[self._grid or self.backend.config.sm_count, p.spec.threads](p.plan, s, s + 1, *p.args)
                self.counters.launches += 1

    def download(self, p: PreparedStep, batch) -> SampleResult:
        """The step's one device-to-host copy (it waits for the step), as a SampleResult."""
        p.out.download()
        self.counters.downloads += 1
        return self._result(p.out.host, batch.num_rows, batch)

    def grid(self, spec: DecodeSpec) -> int | None:
        """The blocks decode_step of this variant runs on (None before its first cooperative launch)."""
        return 1 if SIMULATOR else self.grids.get(spec)

    def _cooperative(self, p: PreparedStep) -> None:
        kern = step_k.decode_step(p.spec)
        if SIMULATOR:  # the simulator's grid sync is a block barrier: one block only
            kern[1, p.spec.threads](p.plan, 0, p.plan.shape[0], *p.args)
        else:
            if p.spec not in self._launchers:
                self._launchers[p.spec] = self._configure(kern, p)
            self._launchers[p.spec](p.plan, 0, p.plan.shape[0], *p.args)
        self.counters.launches += 1

    def _configure(self, kern, p: PreparedStep):
        """decode_step specialized for these argument types, on the largest co-resident grid (at most
        blocks_per_sm per SM, and the driver's cooperative limit for its registers and shared memory)."""
        special = kern.specialize(p.plan, 0, p.plan.shape[0], *p.args)
        compiled = next(iter(special.overloads.values()))
        limit = compiled.max_cooperative_grid_blocks(p.spec.threads)
        c = self.backend.config
        grid = min(limit, c.sm_count * c.decode_blocks_per_sm)
        if self._grid:
            grid = min(grid, self._grid)
        if grid < 1:
            raise Unsupported("decode_step does not fit one block on an SM")
        log.info("decode_step%s: %d blocks of %d threads (cooperative limit %d)", " (tiled)" if p.spec.tiled else "",
                 grid, p.spec.threads, limit)
        self.grids[p.spec] = grid
        return special[grid, p.spec.threads]

    @staticmethod
    def _result(host, n: int, batch) -> SampleResult:
        k = batch.max_num_logprobs
        res = SampleResult.empty(n, k)
        res.token_ids[:] = host["token_ids"][:n]
        res.logprobs[:] = host["logprobs"][:n]
        if k:
            own = np.arange(k)[None, :] < np.asarray(batch.num_logprobs)[:, None]
            res.top_token_ids[own] = host["top_token_ids"][:n, :k][own]
            res.top_logprobs[own] = host["top_logprobs"][:n, :k][own]
        return res

