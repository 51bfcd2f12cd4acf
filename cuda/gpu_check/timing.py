"""The timed half of gpu_check: decode and prefill tokens/s beside the roofline, and per-kernel timings."""
from __future__ import annotations

import dataclasses
import time
import traceback

import numpy as np

from cuda.gpu_check.model_setup import BatchLayout, greedy_sampler, prefilled, upload_step
from cuda.gpu_check.plan import BLOCK_SIZE, FULL, Plan
from cuda.gpu_check.report import Report
from cuda.gpu_check.roofline import decode_roofline, matmul_params


def _time_decode(model, layout: BatchLayout, prompts: np.ndarray, steps: int, warmup: int, sample,
                 fused: bool) -> tuple[float, tuple]:
    """Prefill every sequence (per-op path), then time `steps` decode steps: forward + on-device sampling with
    the ids copied back (per-op), or decode_step (fused). (tokens/s, (launches, uploads, downloads) of a step)."""
    b = model.backend
    kc, vc, tokens = prefilled(model, layout, prompts, sample)
    p = prompts.shape[1]
    if fused:
        step_fn = b.fused_decode(model, kc, vc)
        if step_fn is None:
            raise RuntimeError("the backend has no fused decode step for this model on this GPU")
        greedy = sample.batch(layout.batch)

        def decode(tok, pos):
            return step_fn.run(layout.decode(tok, pos), greedy).token_ids.astype(np.int32)

        def counts():
            c = step_fn.counters
            return c.launches, c.uploads, c.downloads
    else:
        def decode(tok, pos):
            return sample(model.forward(upload_step(b, layout.decode(tok, pos)), kc, vc), layout.batch)

        def counts():
            c = b.counters
            return c.launches, c.uploads, c.downloads
    pos = p
    for _ in range(warmup):
        b.counters.reset()
        tokens = decode(tokens, pos)
        pos += 1
    per_step = counts()
    b.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        tokens = decode(tokens, pos)
        pos += 1
    b.synchronize()
    return layout.batch * steps / (time.perf_counter() - t0), per_step


def benchmarks(weights, be, report: Report, deadline: float, bandwidth, peak, torch_model, plan: Plan = FULL) -> None:
    from models.llama import LlamaModel

    cfg = weights.config
    model = LlamaModel(weights, be)
    wbytes = model.nbytes
    rng = np.random.default_rng(11)
    sample = greedy_sampler(be)

    for batch in plan.batches:
        if time.time() > deadline:
            report.notes.append(f"decode at batch {batch} and later skipped: the time budget ran out")
            break
        prompts = rng.integers(3, cfg.vocab_size, (batch, plan.prompt_len)).astype(np.int32)
        layout = BatchLayout(batch, plan.prompt_len + plan.warmup_steps + plan.decode_steps + 1)
        row = {"name": f"decode, batch {batch} (context {plan.prompt_len}-{plan.prompt_len + plan.warmup_steps + plan.decode_steps})",
               "roofline": decode_roofline(batch, wbytes, bandwidth, peak, matmul_params(cfg))}
        for key, fused in (("fused", True), ("ours", False)):
            try:
                row[key], row[key + "_counts"] = _time_decode(model, layout, prompts, plan.decode_steps,
                                                              plan.warmup_steps, sample, fused)
                print(f"  decode batch {batch} ({'decode_step' if fused else 'per-op'}): {row[key]:,.0f} tok/s, "
                      f"launches/uploads/downloads a step {row[key + '_counts']}", flush=True)
            except Exception:
                report.errors.append(f"decode batch {batch} ({key}):\n{traceback.format_exc()}")
        if torch_model is not None and time.time() < deadline:
            try:
                row["torch"] = torch_model.decode(prompts, plan.decode_steps, plan.warmup_steps)
                print(f"  transformers decode batch {batch}: {row['torch']:,.0f} tok/s", flush=True)
            except Exception:
                report.errors.append(f"transformers decode batch {batch}:\n{traceback.format_exc()}")
        report.bench.append(row)

    if time.time() < deadline:
        prompts = rng.integers(3, cfg.vocab_size, (plan.prefill_seqs, plan.prompt_len)).astype(np.int32)
        layout = BatchLayout(plan.prefill_seqs, plan.prompt_len)
        ntok = plan.prefill_seqs * plan.prompt_len
        row = {"name": f"prefill, {plan.prefill_seqs} x {plan.prompt_len} tokens in one step",
               "roofline": None if peak is None else peak / (2 * matmul_params(cfg))}
        try:
            kc, vc = model.allocate_kv_cache(layout.num_blocks, layout.block_size)
            step = upload_step(be, layout.prefill(prompts, 0, plan.prefill_seqs))
            model.forward(step, kc, vc)
            be.synchronize()
            reps = plan.prefill_reps
            t0 = time.perf_counter()
            for _ in range(reps):
                be.download(model.forward(step, kc, vc))
            row["ours"] = reps * ntok / (time.perf_counter() - t0)
            print(f"  prefill: {row['ours']:,.0f} tok/s", flush=True)
        except Exception:
            report.errors.append(f"prefill:\n{traceback.format_exc()}")
        if torch_model is not None and time.time() < deadline:
            try:
                row["torch"] = torch_model.prefill(prompts, plan.prefill_reps)
            except Exception:
                report.errors.append(f"transformers prefill:\n{traceback.format_exc()}")
        report.bench.append(row)
        report.notes.append("Decode roofline: the lower of batch x memory bandwidth / weight bytes (one read of the "
                            f"weights per step, {wbytes / 1e6:.1f} MB; KV cache reads left out) and the FP32 SIMT "
                            "peak / (2 x multiply-adds per token). Prefill roofline: the compute bound alone - "
                            "these kernels use no tensor cores.")
        report.notes.append(f"Decode: {plan.prompt_len}-token prompts prefilled, {plan.warmup_steps} warm-up steps, then "
                            f"{plan.decode_steps} timed steps; each step is the forward plus greedy sampling on the "
                            "device with the token ids copied back (as the engine runs it), timed from the host: "
                            "decode_step = the whole step in one cooperative launch (cuda/fused_decode.py), per-op "
                            "= one launch per op (the path prefill steps take).")


def _per_call_us(fn, sync, min_reps: int = 5, max_reps: int = 200, target_s: float = 0.15) -> float:
    """Wall time of one call (microseconds), synchronised, after a warm-up call (which compiles)."""
    fn()
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    once = time.perf_counter() - t0
    if max_reps <= 1:
        return once * 1e6
    reps = int(min(max_reps, max(min_reps, target_s / max(once, 1e-6))))
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t0) / reps * 1e6


def kernel_timings(weights, be, report: Report, deadline: float, plan: Plan = FULL) -> None:
    """Per-op timings at the model's shapes, for tuning cuda/launch.py: the host cost of a launch, each matmul
    on the GEMV and on the GEMM path, decode attention (with its split-K choice) and the sampler."""
    from cuda.backend import CudaBackend, split_plan
    from engine.backends.contract import RowSpec, SamplingBatch, SamplingParams

    c = be.config
    cfg = weights.config
    rng = np.random.default_rng(3)

    def per_call_us(fn):
        return _per_call_us(fn, be.synchronize, max_reps=plan.timing_max_reps)

    lines = ["## Kernel timings (for tuning cuda/launch.py)", "",
             "Wall time per call, synchronised, averaged over repetitions after a warm-up call.", ""]

    one = be.zeros((1, 1))
    gu = be.zeros((1, 2))
    n = 100 if plan.timing_max_reps > 1 else 1
    launch_us = per_call_us(lambda: [be.silu_mul(gu, one) for _ in range(n)]) / n
    lines += [f"- host cost of one kernel launch (silu_mul on one element, {n} in a row): {launch_us:.1f} us", ""]
    print(f"  launch: {launch_us:.1f} us", flush=True)

    gemv_only = CudaBackend(dataclasses.replace(c, gemv_max_tokens=1 << 30))
    gemm_only = CudaBackend(dataclasses.replace(c, gemv_max_tokens=0))
    lw = weights.layers[0]
    mats = [("qkv", [lw.q, lw.k, lw.v]), ("gate_up", [lw.gate, lw.up]), ("down", [lw.down]),
            ("lm_head", [weights.lm_head or weights.embed])]
    lines += ["| matmul | N x K (format) | T | GEMV us | GEMM us (tile) | GEMV GB/s | in use |",
              "|---|---|---:|---:|---:|---:|---|"]
    for name, tensors in mats:
        lin = be.linear(tensors)
        for t in plan.timing_tokens:
            if time.time() > deadline:
                break
            x = be.upload(rng.standard_normal((t, lin.in_features)).astype(np.float32))
            out = be.zeros((t, lin.out_features))
            gv = per_call_us(lambda: gemv_only.matmul(x, lin, out))
            gm = per_call_us(lambda: gemm_only.matmul(x, lin, out))
            tile = "x".join(map(str, c.gemm_tile(t, lin.out_features)[:2]))
            used = "gemv" if t <= c.gemv_max_tokens else "gemm"
            lines.append(f"| {name} | {lin.out_features} x {lin.in_features} ({'/'.join(sorted(set(lin.formats)))}) "
                         f"| {t} | {gv:.1f} | {gm:.1f} ({tile}) | {lin.nbytes / gv / 1e3:.0f} | {used} |")
        print(f"  matmul {name} done", flush=True)

    h, hkv, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    lines += ["", "| attention (decode) | batch | context | splits | us |", "|---|---:|---:|---:|---:|"]
    for batch in plan.timing_batches:
        for ctx in plan.timing_contexts:
            if time.time() > deadline:
                break
            layout = BatchLayout(batch, ctx)
            kc = be.upload(rng.standard_normal((layout.num_blocks, BLOCK_SIZE, hkv, dh)).astype(np.float32))
            vc = be.upload(rng.standard_normal((layout.num_blocks, BLOCK_SIZE, hkv, dh)).astype(np.float32))
            step = upload_step(be, layout.decode(np.zeros(batch, np.int32), ctx - 1))
            qkv = be.upload(rng.standard_normal((batch, (h + 2 * hkv) * dh)).astype(np.float32))
            out = be.zeros((batch, h * dh))
            us = per_call_us(lambda: be.attention(qkv, kc, vc, step.block_tables, step.positions, step.token_seq,
                                                  h, hkv, dh ** -0.5, out))
            nsplit = split_plan(c, batch * hkv, ctx)[0]
            lines.append(f"| H={h} Hkv={hkv} Dh={dh} | {batch} | {ctx} | {nsplit} | {us:.1f} |")
    print("  attention done", flush=True)

    lines += ["", "| sampler | rows | vocab | us (ids copied back) |", "|---|---:|---:|---:|"]
    for label, params in (("greedy", SamplingParams(temperature=0.0)),
                          ("top_p 0.9, top_k 50, T 0.8", SamplingParams(temperature=0.8, top_p=0.9, top_k=50))):
        for batch in plan.timing_batches:
            if time.time() > deadline:
                break
            logits = be.upload((3 * rng.standard_normal((batch, cfg.vocab_size))).astype(np.float32))
            sb = SamplingBatch.build([RowSpec(params=params, seed=i, step=0) for i in range(batch)])
            us = per_call_us(lambda: be.sample(logits, sb))
            lines.append(f"| {label} | {batch} | {cfg.vocab_size} | {us:.1f} |")
    report.sections.append("\n".join(lines))
