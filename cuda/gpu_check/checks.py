"""The correctness half of gpu_check: every kernel against the numpy reference, the sampler against
the cpu sampler, and the cuda backend against the cpu backend on a whole model."""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from cuda.gpu_check.model_setup import BatchLayout, greedy_sampler, prefilled, upload_step
from cuda.gpu_check.plan import BLOCK_SIZE, CHECK_PROMPT, FULL, Plan
from cuda.gpu_check.report import Report


def _close(name, got, want, tol, report: Report) -> None:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        report.check(name, False, f"shape {got.shape} != {want.shape}")
        return
    scale = max(1.0, float(np.abs(want).max()) if want.size else 1.0)
    err = float(np.abs(got - want).max()) / scale if want.size else 0.0
    report.check(name, bool(np.isfinite(err) and err <= tol), f"max rel. error {err:.2e} (tol {tol:g})")


def kernel_checks(be, report: Report, rng, plan: Plan = FULL) -> None:
    """Each op against numpy on random data, with the GPU's own launch configuration."""
    from cuda.backend import CudaBackend
    from models.quant import QuantTensor
    from tests import reference as R

    c = be.config
    kd, nd = plan.k, plan.n
    x = rng.standard_normal((7, kd)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(kd)).astype(np.float32)
    out = be.zeros((7, kd))
    be.rmsnorm(be.upload(x), be.vector(w), 1e-5, out)
    _close("rmsnorm", be.download(out), R.rmsnorm(x, w, 1e-5), 1e-5, report)
    gu = (3 * rng.standard_normal((9, 2 * kd))).astype(np.float32)
    out = be.zeros((9, kd))
    be.silu_mul(be.upload(gu), out)
    _close("silu_mul", be.download(out), R.silu_mul(gu), 1e-5, report)

    for fmt in plan.formats:
        wt = QuantTensor.from_float(rng.standard_normal((nd, kd)).astype(np.float32), fmt)
        lin = be.linear([wt])
        dense = wt.dequantize().astype(np.float64)
        ids = rng.integers(0, nd, 11).astype(np.int32)
        out = be.zeros((11, kd))
        be.embedding(lin, ids, out)
        _close(f"embedding {fmt}", be.download(out), dense[ids], 1e-6, report)
        for ntok in sorted({1, 5, c.gemv_max_tokens, c.gemv_max_tokens + 1, 2 * c.gemm_tiles[0][0] + 3}):
            xx = rng.standard_normal((ntok, kd)).astype(np.float32)
            base = rng.standard_normal((ntok, nd)).astype(np.float32)
            o = be.upload(base)
            be.matmul(be.upload(xx), lin, o, accumulate=True)
            path = "gemv" if ntok <= c.gemv_max_tokens else "gemm"
            _close(f"matmul {fmt} T={ntok} ({path})", be.download(o), base + xx @ dense.T, 1e-5, report)
    parts = [QuantTensor.from_float(rng.standard_normal((n, 100)).astype(np.float32), f)
             for n, f in ((70, "f32"), (33, "bf16"), (40, "f16"))]
    lin = be.linear(parts)
    dense = np.concatenate([p.dequantize() for p in parts]).astype(np.float64)
    for ntok in (3, c.gemv_max_tokens + 2):
        xx = rng.standard_normal((ntok, 100)).astype(np.float32)
        o = be.zeros((ntok, 143))
        be.matmul(be.upload(xx), lin, o)
        _close(f"matmul fused f32|bf16|f16, K=100, T={ntok}", be.download(o), xx @ dense.T, 1e-5, report)

    for h, hkv, dh in plan.attn_heads:
        for split in (False, True):
            min_split = max(8, max(s + n for s, n in plan.attn_seqs) // 8)
            cfg = dataclasses.replace(c, attn_min_split=min_split, sm_count=256) if split else \
                dataclasses.replace(c, attn_min_split=1 << 20)
            attention_check(CudaBackend(cfg), report, rng, h, hkv, dh, split, plan.attn_seqs)

    sampling_check(be, report, rng, plan.vocab, plan.sample_rows)


def attention_check(be, report, rng, h, hkv, dh, split, seqs) -> None:
    """RoPE + KV write, then one launch over a prefill, a decode far into its context and a prefill chunk in
    the middle of one (seqs: (first position, tokens)), against the float64 reference."""
    from tests import reference as R

    theta = 10000.0
    case = R.paged_kv_case(rng, seqs, h, hkv, dh, bs=16)
    ctx, tables, positions, token_seq = case["ctx"], case["tables"], case["positions"], case["token_seq"]
    qkv, kc, vc, t = case["qkv"], case["kc"], case["vc"], len(case["positions"])
    q, _, kref, vref = R.rope_store_kv(case, theta)
    dq, dk, dv = be.upload(qkv), be.upload(kc), be.upload(vc)
    cos, sin = be.rope_tables(max(ctx) + 1, dh, theta)
    be.rope_store_kv(dq, positions, cos, sin, dk, dv, case["slot"], h, hkv)
    tag = f"H={h} Hkv={hkv} Dh={dh}"
    _close(f"rope_store_kv {tag}", be.download(dk), kref, 1e-5, report)
    out = be.zeros((t, h * dh))
    ntiles = be._tiles(positions, token_seq, be.config.attn_rows // (h // hkv))[2]
    nsplit = be.split_plan(ntiles * hkv, max(ctx))[0]
    be.attention(dq, dk, dv, tables, positions, token_seq, h, hkv, dh ** -0.5, out)
    ref = R.paged_attention(q, kref, vref, tables, ctx, case["qsl"], dh ** -0.5)
    _close(f"paged attention {tag}, {nsplit} split(s){' (forced)' if split else ''}", be.download(out),
           ref.reshape(t, -1), 1e-4, report)
    if split and nsplit < 2:
        report.check(f"paged attention {tag} split-K taken", False, "the forced configuration did not split")


def sampling_check(be, report, rng, vocab: int = 49152, nrows: int = 32) -> None:
    from engine.backends import get_backend
    from engine.backends.contract import RowSpec, SamplingBatch, SamplingParams

    cpu = get_backend("cpu")   # the reference, through the same contract as the backend under test
    p = SamplingParams
    prompt = rng.integers(0, vocab, 40).tolist()
    outs = rng.integers(0, vocab, 12).tolist()
    specs = [p(temperature=0.0, logprobs=5), p(temperature=0.0, logit_bias={123: 100.0}),
             p(temperature=0.8, logprobs=2), p(temperature=1.2, top_k=50), p(temperature=0.7, top_p=0.9),
             p(temperature=1.0, top_k=200, top_p=0.95, min_p=0.02, logprobs=20),
             p(temperature=1.0, repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.3),
             p(temperature=0.0, repetition_penalty=1.5, min_tokens=14, stop_token_ids=[outs[0]])]
    specs += [p(temperature=1.0)] * max(0, nrows - len(specs))
    rows = [RowSpec(params=sp, seed=1000 + i, step=i % 5, prompt_token_ids=prompt, output_token_ids=outs,
                    eos_token_ids=[2]) for i, sp in enumerate(specs)]
    logits = (3.0 * rng.standard_normal((len(rows), vocab))).astype(np.float32)
    batch = SamplingBatch.build(rows)
    want = cpu.sample(cpu.upload(logits), batch)
    got = be.sample(be.upload(logits), batch)
    same = got.token_ids == want.token_ids
    report.check("sample: token ids equal to the cpu sampler", bool(same.all()),
                 f"{int(same.sum())}/{len(rows)} rows equal" + ("" if same.all() else
                                                               f"; differ at rows {np.flatnonzero(~same).tolist()}"))
    _close("sample: chosen-token logprobs", got.logprobs, want.logprobs, 1e-4, report)
    ids_eq = bool(np.array_equal(got.top_token_ids, want.top_token_ids))
    report.check("sample: top logprob ids", ids_eq, "")
    fin = np.isfinite(want.top_logprobs)
    _close("sample: top logprobs", np.where(fin, got.top_logprobs, 0), np.where(fin, want.top_logprobs, 0), 1e-4,
           report)


def model_check(weights, tokenizer, be, report: Report, greedy_tokens: int = 24) -> None:
    """cpu vs cuda backend: logits of a prompt, then greedy decoding, one sequence."""
    from engine.backends.contract import RowSpec, SamplingBatch, SamplingParams
    from engine.backends.cpu import CpuBackend  # the reference in float32: no int8 activations
    from models.llama import LlamaModel

    cfg = weights.config
    if tokenizer is not None:
        try:
            ids = np.asarray(tokenizer.encode(CHECK_PROMPT), np.int32)
        except Exception:
            ids = None
    else:
        ids = None
    if ids is None or len(ids) < 4:
        ids = np.random.default_rng(7).integers(3, cfg.vocab_size, min(24, cfg.max_position // 4)).astype(np.int32)
    n = len(ids)
    layout = BatchLayout(1, n + greedy_tokens + 1)
    models = {"cpu": LlamaModel(weights, CpuBackend(int8_activations=False)), "cuda": LlamaModel(weights, be)}
    greedy = SamplingBatch.build([RowSpec(params=SamplingParams(temperature=0.0), seed=0, step=0)])
    seqs, first_logits = {}, {}
    for name, model in models.items():
        b = model.backend
        kc, vc = model.allocate_kv_cache(layout.num_blocks, BLOCK_SIZE)
        step = layout.prefill(ids[None, :], 0, 1)
        step = dataclasses.replace(step, logits_indices=np.arange(n, dtype=np.int32))
        t0 = time.perf_counter()
        logits = model.forward(step, kc, vc)
        first_logits[name] = b.download(logits)
        out, margins = [], []
        last = first_logits[name][-1:]
        for i in range(greedy_tokens):
            if name == "cuda":
                tok = int(be.sample(logits[n - 1:n] if i == 0 else logits, greedy).token_ids[0])
            else:
                tok = int(np.argmax(last[0]))
                srt = np.sort(last[0])
                margins.append(float(srt[-1] - srt[-2]))
            out.append(tok)
            logits = model.forward(layout.decode(np.array([tok]), n + i), kc, vc)
            last = b.download(logits) if name == "cpu" else None
        seqs[name] = (out, margins)
        print(f"  {name}: prefill + {greedy_tokens} greedy steps in {time.perf_counter() - t0:.1f} s", flush=True)
    ref = first_logits["cpu"]
    _close(f"model logits, {n} prompt positions (cuda vs cpu)", first_logits["cuda"], ref, 1e-3, report)
    report.check("model: argmax of every prompt position equal",
                 bool(np.array_equal(first_logits["cuda"].argmax(-1), ref.argmax(-1))), "")
    a, b_ = seqs["cuda"][0], seqs["cpu"][0]
    same = a == b_
    detail = f"{greedy_tokens} tokens"
    if not same:
        i = next(j for j in range(len(a)) if a[j] != b_[j])
        detail += f"; first difference at token {i} (cuda {a[i]}, cpu {b_[i]}; cpu top-2 margin " \
                  f"{seqs['cpu'][1][i]:.2e})"
    if tokenizer is not None:
        try:
            detail += f"; cuda text: {tokenizer.decode(a)!r}"
        except Exception:
            pass
    report.check("model: greedy ids equal (cuda vs cpu, float32)", same, detail.replace("|", "/"))
    fused = fused_greedy(weights, be, ids, layout, greedy, greedy_tokens)
    if fused is None:
        report.notes.append("decode_step not checked: the backend has no fused decode step for this model/GPU")
    else:
        ids_, launches = fused
        first = next((j for j in range(len(b_)) if ids_[j] != b_[j]), None)
        report.check("model: greedy ids equal (decode_step vs cpu, float32)", first is None,
                     f"{greedy_tokens} tokens, {launches} launch(es) a decode step"
                     + ("" if first is None else f"; first difference at token {first}"))
        tiled_decode_check(weights, be, report, min(4, greedy_tokens))


def tiled_decode_check(weights, be, report: Report, steps: int) -> None:
    """decode_step's tiled variant (a batch past gemv_max_tokens) against the per-op path, both on the GPU:
    greedy ids of every sequence equal for `steps` steps (the per-op path is checked against the cpu above)."""
    from models.llama import LlamaModel

    batch = be.config.gemv_max_tokens + 1
    model = LlamaModel(weights, be)
    sample = greedy_sampler(be)
    prompts = np.random.default_rng(9).integers(3, weights.config.vocab_size, (batch, 8)).astype(np.int32)
    layout = BatchLayout(batch, 8 + steps + 1)
    fused_kv, per_op_kv = prefilled(model, layout, prompts, sample), prefilled(model, layout, prompts, sample)
    fused = be.fused_decode(model, *fused_kv[:2])
    if fused is None or fused.bucket(batch) is None:
        report.notes.append(f"decode_step's tiled variant not checked: no fused step takes a batch of {batch} here")
        return
    tokens, first = fused_kv[2], None
    for s in range(steps):
        a = fused.run(layout.decode(tokens, 8 + s), sample.batch(batch)).token_ids.astype(np.int32)
        b = sample(model.forward(upload_step(be, layout.decode(tokens, 8 + s)), *per_op_kv[:2]), batch)
        if not np.array_equal(a, b):
            first = (s, int(np.sum(a != b)))
            break
        tokens = a
    report.check(f"model: greedy ids equal (tiled decode_step vs per-op, batch {batch})", first is None,
                 f"{steps} steps" + ("" if first is None else f"; step {first[0]}: {first[1]} sequences differ"))


def fused_greedy(weights, be, ids: np.ndarray, layout, greedy, count: int):
    """(greedy ids, launches per step) of one sequence: prefill through the per-op path, then decode_step;
    None when the backend has no fused step for the model."""
    from models.llama import LlamaModel

    model = LlamaModel(weights, be)
    kc, vc = model.allocate_kv_cache(layout.num_blocks, BLOCK_SIZE)
    fused = be.fused_decode(model, kc, vc)
    if fused is None:
        return None
    n = len(ids)
    logits = model.forward(layout.prefill(ids[None, :], 0, 1), kc, vc)
    out = [int(be.sample(logits, greedy).token_ids[0])]
    for i in range(count - 1):
        out.append(int(fused.run(layout.decode(np.array([out[-1]]), n + i), greedy).token_ids[0]))
    return out, fused.counters.launches
