"""The static device state of the fused decode step: packed per-step buffers laid out once, reused every step.

A `PackedBuffer` is one region of pinned host memory and one of device memory with the same layout: named
arrays at fixed, 8-byte aligned offsets. The host fills its numpy views in place; one copy moves the whole
region (the step's upload, or the results' download); kernels take the device views. Layouts grow (are laid
out again, larger) only when a step needs more room than any step before.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import cuda

from cuda.kernels.common import SIMULATOR

ALIGN = 8


@dataclass
class StepCounters:
    """Device work counted since the last reset: kernel launches, host-to-device and device-to-host copies
    (the fused step resets them every step; the backend's per-op counters run until reset())."""
    launches: int = 0
    uploads: int = 0
    downloads: int = 0

    def reset(self) -> None:
        self.launches = self.uploads = self.downloads = 0


class PackedBuffer:
    """Named arrays [(name, dtype, shape)] packed into one pinned host buffer and one device buffer."""

    def __init__(self, fields: list[tuple[str, object, tuple]]):
        offsets, pos = [], 0
        for _, dtype, shape in fields:
            offsets.append(pos)
            nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            pos += -(-max(nbytes, 1) // ALIGN) * ALIGN
        self.nbytes = pos
        self.host_bytes = cuda.pinned_array(pos, np.uint8)
        self.host_bytes[:] = 0
        self.device_bytes = cuda.to_device(self.host_bytes)
        self.host: dict[str, np.ndarray] = {}
        self.device: dict[str, object] = {}
        for (name, dtype, shape), off in zip(fields, offsets):
            n = int(np.prod(shape, dtype=np.int64))
            nbytes = n * np.dtype(dtype).itemsize
            self.host[name] = self.host_bytes[off:off + nbytes].view(dtype).reshape(shape)
            self.device[name] = _device_view(self.device_bytes, off, nbytes, dtype, shape)

    def upload(self) -> None:
        """The host region to the device: one copy."""
        self.device_bytes.copy_to_device(self.host_bytes)

    def download(self) -> None:
        """The device region to the host: one copy."""
        self.device_bytes.copy_to_host(self.host_bytes)


def _device_view(buf, off: int, nbytes: int, dtype, shape):
    """The device array of `dtype` and `shape` at byte `off` of the uint8 device buffer `buf`."""
    part = buf[off:off + max(nbytes, np.dtype(dtype).itemsize)]
    if SIMULATOR:  # the simulator's arrays wrap numpy arrays: view those
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        a = part._ary.view(dtype)[:int(np.prod(shape, dtype=np.int64))].reshape(shape)
        return FakeCUDAArray(a)
    return part.view(dtype)[:max(int(np.prod(shape, dtype=np.int64)), 1)].reshape(*shape) if nbytes else \
        part.view(dtype)


def input_fields(batch: int, table_width: int, csr: int, mask_shape: tuple = (1, 1)) -> list[tuple[str, object, tuple]]:
    """The step's upload for up to `batch` sequences, block tables `table_width` wide, `csr` entries in each
    of the sampler's per-token lists (logit bias, banned tokens, penalty history) and room for mask_shape
    (rows, words) of the grammar's packed allowed-token masks; the order of the decode step's `inputs` tuple
    (cuda/kernels/decode_phases.py) and of sampling.sample_row."""
    b, c = batch, max(csr, 1)
    return [
        ("tokens", np.int32, (b,)), ("positions", np.int32, (b,)), ("slots", np.int64, (b,)),
        ("block_tables", np.int32, (b, table_width)),
        ("temperature", np.float32, (b,)), ("top_p", np.float32, (b,)), ("top_k", np.int32, (b,)),
        ("min_p", np.float32, (b,)), ("repetition_penalty", np.float32, (b,)),
        ("presence_penalty", np.float32, (b,)), ("frequency_penalty", np.float32, (b,)),
        ("seed", np.uint64, (b,)), ("step", np.int64, (b,)), ("num_logprobs", np.int32, (b,)),
        ("bias_indptr", np.int64, (b + 1,)), ("bias_token_ids", np.int32, (c,)), ("bias_values", np.float32, (c,)),
        ("mask_indptr", np.int64, (b + 1,)), ("mask_token_ids", np.int32, (c,)),
        ("hist_indptr", np.int64, (b + 1,)), ("hist_token_ids", np.int32, (c,)),
        ("hist_num_prompt", np.int32, (b,)),
        ("allowed_row", np.int32, (b,)), ("allowed_mask", np.uint32, (max(mask_shape[0], 1), max(mask_shape[1], 1))),
    ]


SAMPLER_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty", "seed", "step", "num_logprobs", "bias_indptr", "bias_token_ids",
                  "bias_values", "mask_indptr", "mask_token_ids", "hist_indptr", "hist_token_ids", "hist_num_prompt", "allowed_row")


def output_fields(batch: int, k: int) -> list[tuple[str, object, tuple]]:
    """The step's results: the order of the decode step's `outputs` tuple."""
    return [("token_ids", np.int64, (batch,)), ("logprobs", np.float32, (batch,)),
            ("top_token_ids", np.int64, (batch, max(k, 1))), ("top_logprobs", np.float32, (batch, max(k, 1)))]


def fill_inputs(buf: PackedBuffer, step, batch) -> None:
    """Write a decode step (StepInput, one token per sequence) and its SamplingBatch into buf's host views."""
    h = buf.host
    n = len(step.tokens)
    h["tokens"][:n] = step.tokens
    h["positions"][:n] = step.positions
    h["slots"][:n] = step.slot_mapping
    width = step.block_tables.shape[1]
    h["block_tables"][:n, :width] = step.block_tables
    for name in SAMPLER_FIELDS:
        src = np.asarray(getattr(batch, name))
        if name.endswith("indptr"):
            h[name][:n + 1] = src
        else:
            h[name][:len(src)] = src
    if batch.constrained:  # the constrained rows' masks ride in the same upload
        rows, words = batch.allowed_mask.shape
        h["allowed_mask"][:rows, :words] = batch.allowed_mask
