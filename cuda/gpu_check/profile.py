"""Where a decode_step step's time goes: the host's share (packing, upload, launch, download) timed on the host,
the kernel and each of its phases timed on the device with CUDA events.

Device times are taken behind a spin kernel that holds the GPU while the host queues the timed work, so a
host slower to launch than the GPU is to run shows in no device figure. The phases are timed as decode_phase
launches on decode_step's own grid, an event between two: the same device code without the grid barrier.
"""
from __future__ import annotations

import time
import traceback

import numpy as np

from cuda.gpu_check.model_setup import BatchLayout, greedy_sampler, prefilled
from cuda.gpu_check.plan import FULL, Plan
from cuda.gpu_check.report import Report

SPIN_MS = 300  # the GPU held this long while the host queues the timed launches


def _spin_kernel():
    from numba import cuda

    @cuda.jit
    def spin(n):
        for _ in range(n):
            cuda.nanosleep(1000000)
    return spin


class DeviceClock:
    """Events around work queued behind a spin kernel: device milliseconds, and whether the spin outlasted the
    host's queueing (else host launch gaps are in the figures)."""

    def __init__(self):
        from numba import cuda

        from cuda.kernels.common import SIMULATOR

        self.cuda, self.simulator = cuda, SIMULATOR
        self._spin = None if SIMULATOR else _spin_kernel()
        self.covered = True

    def time(self, launches: list) -> list[float]:
        """Run each callable of launches in order; the device milliseconds of each."""
        cuda = self.cuda
        events = [cuda.event() for _ in range(len(launches) + 2)]
        events[0].record()
        if self._spin is not None:
            self._spin[1, 1](SPIN_MS)
        events[1].record()
        t0 = time.perf_counter()
        for i, fn in enumerate(launches):
            fn()
            events[i + 2].record()
        queued_ms = 1e3 * (time.perf_counter() - t0)
        cuda.synchronize()
        if not self.simulator and events[0].elapsed_time(events[1]) < queued_ms:
            self.covered = False
        return [events[i + 1].elapsed_time(events[i + 2]) for i in range(len(launches))]


def _median_us(samples) -> float:
    return 1e3 * float(np.median(samples))


def profile_batch(weights, be, batch: int, plan: Plan, clock: DeviceClock) -> dict:
    """One batch size: host stages (us, medians over plan.profile_steps steps), the kernel's device time and
    each phase kind's device time summed over layers (us)."""
    from cuda.kernels import decode_step as step_k
    from cuda.kernels.decode_phases import PHASE_NAMES
    from models.llama import LlamaModel

    cfg = weights.config
    model = LlamaModel(weights, be)
    sample = greedy_sampler(be)
    rng = np.random.default_rng(17)
    prompts = rng.integers(3, cfg.vocab_size, (batch, plan.prompt_len)).astype(np.int32)
    layout = BatchLayout(batch, plan.prompt_len + 2 * plan.profile_steps + 4)
    kc, vc, tokens = prefilled(model, layout, prompts, sample)
    fd = be.fused_decode(model, kc, vc)
    if fd is None:
        raise RuntimeError("the backend has no fused decode step for this model on this GPU")
    greedy = sample.batch(batch)
    pos = plan.prompt_len
    for _ in range(2):  # compiles and configures decode_step
        tokens = fd.run(layout.decode(tokens, pos), greedy).token_ids.astype(np.int32)
        pos += 1

    host = {k: [] for k in ("pack", "upload", "launch", "wait", "download", "step")}
    kernel = []
    phase_ms = np.zeros(len(PHASE_NAMES))
    for i in range(plan.profile_steps + 1):  # the first compiles decode_phase, untimed
        be.synchronize()
        t0 = time.perf_counter()
        p = fd.prepare(layout.decode(tokens, pos), greedy)
        t1 = time.perf_counter()
        fd.upload(p)
        t2 = time.perf_counter()
        fd.launch(p)
        t3 = time.perf_counter()
        be.synchronize()
        t4 = time.perf_counter()
        tokens = fd.download(p, greedy).token_ids.astype(np.int32)
        t5 = time.perf_counter()
        grid, threads = fd.grid(p.spec), p.spec.threads
        phase_kern = step_k.decode_phase(p.spec)
        if i == 0:
            phase_kern[grid, threads](p.plan, 0, 0, *p.args)  # no phase: compiles decode_phase
            pos += 1
            continue
        for k, a, b in (("pack", t0, t1), ("upload", t1, t2), ("launch", t2, t3), ("wait", t3, t4),
                        ("download", t4, t5), ("step", t0, t5)):
            host[k].append(b - a)
        # the same step again (its KV writes are the same values): the kernel alone, then phase by phase
        kernel.append(clock.time([lambda: fd.launch(p)])[0])
        rows = [lambda s=s: phase_kern[grid, threads](p.plan, s, s + 1, *p.args) for s in range(p.plan.shape[0])]
        for (phase, _), ms in zip(p.plan.copy_to_host(), clock.time(rows)):
            phase_ms[phase] += ms
        pos += 1
    res = {k: 1e6 * float(np.median(v)) for k, v in host.items()}
    res["kernel"] = _median_us(kernel)
    res["phases"] = {PHASE_NAMES[i]: 1e3 * phase_ms[i] / plan.profile_steps for i in range(len(PHASE_NAMES))
                     if phase_ms[i]}
    res["grid"] = (grid, threads)
    return res


def decode_step_profile(weights, be, report: Report, deadline: float, plan: Plan = FULL) -> None:
    """The section "decode_step: where a step's time goes" of the report, at plan.profile_batches."""
    clock = DeviceClock()
    results = {}
    for batch in plan.profile_batches:
        if time.time() > deadline:
            report.notes.append(f"decode_step profile at batch {batch} and later skipped: the time budget ran out")
            break
        if batch > max(be.config.decode_buckets):
            report.notes.append(f"decode_step profile at batch {batch} skipped: past the largest bucket")
            continue
        try:
            results[batch] = r = profile_batch(weights, be, batch, plan, clock)
        except Exception:
            report.errors.append(f"decode_step profile, batch {batch}:\n{traceback.format_exc()}")
            continue
        print(f"  profile batch {batch}: step {r['step']:.0f} us, kernel {r['kernel']:.0f} us (device)", flush=True)
    if not results:
        return
    cols = list(results)
    lines = ["## decode_step: where a step's time goes", "",
             f"Microseconds a step: host and kernel rows the medians of {plan.profile_steps} steps, phase rows their "
             "means. Host: wall time of each stage of "
             "`FusedDecode.run`, synchronised after the launch. Device: CUDA events, the work queued behind a "
             f"{SPIN_MS} ms spin kernel; phases as decode_phase launches on decode_step's grid ("
             + ", ".join(f"batch {b}: {r['grid'][0]} blocks of {r['grid'][1]} threads" for b, r in results.items())
             + "), summed over layers; past gemv_max_tokens the matmul phases are tiled (decode_phases.py).",
             "", "| | " + " | ".join(f"batch {b}" for b in cols) + " |", "|---|" + "---:|" * len(cols)]

    def row(label, values):
        lines.append(f"| {label} | " + " | ".join(f"{v:,.0f}" for v in values) + " |")

    for key, label in (("pack", "host: pack the inputs"), ("upload", "host: upload (one copy)"),
                       ("launch", "host: launch decode_step"), ("wait", "host: wait for the kernel"),
                       ("download", "host: download (one copy)"), ("step", "host: the whole step"),
                       ("kernel", "device: decode_step")):
        row(label, [results[b][key] for b in cols])
    from cuda.kernels.decode_phases import PHASE_NAMES

    names = [n for n in PHASE_NAMES if any(n in results[b]["phases"] for b in cols)]
    for n in names:
        row(f"device: phase {n}", [results[b]["phases"].get(n, 0.0) for b in cols])
    row("device: phases, sum", [sum(results[b]["phases"].values()) for b in cols])
    if not clock.covered:
        lines += ["", "The host queued some timed launches after the spin kernel ended: device figures include "
                      "host launch gaps."]
    report.sections.append("\n".join(lines))
