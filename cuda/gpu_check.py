"""`make gpu-check`: the cuda backend on a real GPU, checked and measured in a few minutes.

1. every kernel against numpy on random data, with this GPU's launch configuration (each weight format on
   the GEMV and GEMM paths, RoPE + paged attention with and without split-K, head dims 64 and 128, the
   sampler against engine.sampling on a full vocabulary);
2. the cuda backend against the cpu backend on the default model: logits of a prompt close, greedy ids equal
   (both compute in float32);
3. decode tokens/s at batch 1, 16, 64, 256 and prefill tokens/s, beside the roofline (weight bytes / memory
   bandwidth) and beside transformers on PyTorch on the same GPU and weights when torch is importable.
Writes cuda/RESULTS.md (date, GPU, configuration, every number) and exits 1 on any mismatch or error,
after running whatever else it can. When the model file is missing (the default one is 98 MB), a model of
the same shapes and formats with random weights stands in, and the report says so.

    python -m cuda.gpu_check [--model PATH] [--budget 480] [--no-torch] [--out cuda/RESULTS.md]
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import faulthandler
import os
import platform
import sys
import time
import traceback

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO, "cuda", "RESULTS.md")
BLOCK_SIZE = 16
CHECK_PROMPT = "Explain in two sentences why the sky is blue."


@dataclasses.dataclass(frozen=True)
class Plan:
    """Sizes of every check and benchmark. FULL runs on the GPU; TINY runs the same code in the CUDA simulator
    (tests/test_cuda_kernels.py) so the script is exercised without a GPU."""
    batches: tuple = (1, 16, 64, 256)   # decode batch sizes
    prompt_len: int = 128               # context of every sequence before the timed decode steps
    decode_steps: int = 32              # timed decode steps per batch size (after plan.warmup_steps)
    prefill_seqs: int = 16              # prefill benchmark: this many prompts of prompt_len in one step
    greedy_tokens: int = 24             # cpu/cuda greedy comparison
    k: int = 576                        # kernel checks: input features
    n: int = 300                        # kernel checks: output features
    vocab: int = 49152                  # sampler check: vocabulary
    sample_rows: int = 32               # sampler check: rows (the first 8 exercise every parameter)
    attn_seqs: tuple = ((0, 100), (700, 1), (300, 37))     # (first position, tokens) of each sequence
    attn_heads: tuple = ((9, 3, 64), (8, 2, 128))          # (H, Hkv, Dh)
    formats: tuple = ("q4_1", "q4_0", "q8_0", "f16", "bf16", "f32")  # weight formats of the matmul checks
    warmup_steps: int = 3               # decode steps before the timed ones
    prefill_reps: int = 5               # timed repetitions of the prefill step
    timing_tokens: tuple = (1, 16, 64, 256)   # kernel timings: input rows of the matmuls
    timing_batches: tuple = (1, 64, 256)      # kernel timings: decode batches of attention and sampling
    timing_contexts: tuple = (160, 2048)      # kernel timings: attention context lengths
    timing_max_reps: int = 200                # kernel timings: most timed repetitions of one call
    tiny_model: bool = False            # a tiny synthetic model instead of the default one


FULL = Plan()
TINY = Plan(batches=(2,), prompt_len=5, decode_steps=1, prefill_seqs=1, greedy_tokens=2, k=64, n=20, vocab=300,
            sample_rows=9, attn_seqs=((0, 9), (40, 1), (20, 5)), attn_heads=((2, 1, 72),), formats=("q4_1",),
            warmup_steps=1, prefill_reps=1, timing_tokens=(3,), timing_batches=(2,), timing_contexts=(12,),
            timing_max_reps=1, tiny_model=True)


def _tiny_config():
    from cuda import launch

    return dataclasses.replace(launch.TABLE["fallback"], arch="simulator", sm_count=1, threads=32, gemv_threads=64,
                               gemv_tokens=2, gemv_max_tokens=4, gemm_tiles=((16, 16, 2, 2),),
                               attn_rows=8, attn_chunk=8, attn_threads=32, attn_min_split=8, sample_threads=32)


# Memory bandwidth from the vendors' datasheets (bytes/s), matched on the device name; else from the clocks.
BANDWIDTH = [
    ("H200", 4.8e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12), ("GH200", 4.0e12),
    ("A100-SXM4-80GB", 2.039e12), ("A100 80GB PCIe", 1.935e12), ("A100", 1.555e12), ("L40S", 0.864e12),
    ("L40", 0.864e12), ("L4", 0.3e12), ("A10", 0.6e12), ("RTX 4090", 1.008e12), ("RTX 3090", 0.936e12),
    ("T4", 0.32e12),
]
FP32_LANES = {(7, 0): 64, (7, 5): 64, (8, 0): 64}  # FP32 lanes per SM; 128 otherwise (sm_86+, sm_90)


class CheckFailed(AssertionError):
    pass


# --------------------------------------------------------------------------- GPU-free helpers (tested on CI)

def bandwidth_for(name: str, mem_clock_khz: int = 0, bus_width_bits: int = 0) -> tuple[float | None, str]:
    """(bytes/s, where the number comes from) for a GPU."""
    for key, bw in BANDWIDTH:
        if key.lower() in name.lower():
            return bw, f"datasheet ({key})"
    if mem_clock_khz and bus_width_bits:
        return mem_clock_khz * 1e3 * 2 * bus_width_bits / 8, "memory clock x bus width"
    return None, "unknown"


def fp32_peak(cc, sm_count: int, clock_khz: int) -> float | None:
    """FP32 FMA throughput (FLOP/s) of the SIMT cores."""
    if not sm_count or not clock_khz:
        return None
    return sm_count * FP32_LANES.get(tuple(cc), 128) * 2 * clock_khz * 1e3


def matmul_params(cfg) -> int:
    """Multiply-adds per token of every weight matrix of one forward (the LM head included)."""
    per_layer = cfg.hidden_size * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * cfg.hidden_size \
        + 3 * cfg.hidden_size * cfg.intermediate_size
    return cfg.num_layers * per_layer + cfg.vocab_size * cfg.hidden_size


def decode_roofline(batch: int, weight_bytes: int, bandwidth: float | None) -> float | None:
    """Tokens/s if a decode step cost one read of the weights (the KV cache and activations left out)."""
    return None if not bandwidth else batch * bandwidth / weight_bytes


class BatchLayout:
    """StepInputs for `batch` sequences, each owning a fixed run of KV blocks (sequence s: blocks s*n..)."""

    def __init__(self, batch: int, max_len: int, block_size: int = BLOCK_SIZE):
        self.batch, self.block_size = batch, block_size
        self.blocks_per_seq = -(-max_len // block_size)
        self.num_blocks = batch * self.blocks_per_seq
        self.tables = np.arange(self.num_blocks, dtype=np.int32).reshape(batch, self.blocks_per_seq)

    def _slots(self, seqs: np.ndarray, pos: np.ndarray) -> np.ndarray:
        bs = self.block_size
        return self.tables[seqs, pos // bs].astype(np.int64) * bs + pos % bs

    def prefill(self, prompts: np.ndarray, first: int, count: int):
        """One step prefilling sequences first..first+count-1 with their whole prompts ([batch, P] ids)."""
        from models.llama import StepInput

        p = prompts.shape[1]
        seqs = np.repeat(np.arange(first, first + count), p)
        pos = np.tile(np.arange(p, dtype=np.int32), count)
        return StepInput(tokens=np.ascontiguousarray(prompts[first:first + count].reshape(-1), np.int32),
                         positions=pos, token_seq=(seqs - first).astype(np.int32),
                         slot_mapping=self._slots(seqs, pos), block_tables=self.tables[first:first + count],
                         logits_indices=(np.arange(1, count + 1) * p - 1).astype(np.int32))

    def decode(self, tokens: np.ndarray, position: int):
        """One decode step: token b of every sequence b at `position`."""
        from models.llama import StepInput

        seqs = np.arange(self.batch)
        pos = np.full(self.batch, position, np.int32)
        return StepInput(tokens=np.ascontiguousarray(tokens, np.int32), positions=pos,
                         token_seq=seqs.astype(np.int32), slot_mapping=self._slots(seqs, pos),
                         block_tables=self.tables, logits_indices=seqs.astype(np.int32))


def prefill_groups(batch: int, prompt_len: int, max_tokens: int) -> list[tuple[int, int]]:
    """(first, count) of the prefill steps that bring `batch` prompts in, at most max_tokens a step."""
    per = max(1, max_tokens // prompt_len)
    return [(s, min(per, batch - s)) for s in range(0, batch, per)]


def synthetic_weights(cfg, layer_fmt: str = "q4_1", embed_fmt: str = "q8_0", seed: int = 0):
    """Random weights of the given shape in the default model's formats (the stand-in when the file is missing)."""
    from models.quant import QuantTensor
    from models.weights import LayerWeights, ModelWeights

    rng = np.random.default_rng(seed)

    def mat(rows, cols, fmt, scale=None):
        w = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(scale or cols ** -0.5)
        return QuantTensor.from_float(w, fmt)

    def norm():
        return (1.0 + 0.1 * rng.standard_normal(cfg.hidden_size)).astype(np.float32)

    d, f = cfg.hidden_size, cfg.intermediate_size
    layers = [LayerWeights(attn_norm=norm(), q=mat(cfg.q_size, d, layer_fmt), k=mat(cfg.kv_size, d, layer_fmt),
                           v=mat(cfg.kv_size, d, layer_fmt), o=mat(d, cfg.q_size, layer_fmt), ffn_norm=norm(),
                           gate=mat(f, d, layer_fmt), up=mat(f, d, layer_fmt), down=mat(d, f, layer_fmt))
              for _ in range(cfg.num_layers)]
    return ModelWeights(config=cfg, embed=mat(cfg.vocab_size, d, embed_fmt, 0.5), layers=layers,
                        final_norm=norm(), metadata={"name": "synthetic"})


def smollm2_135m_config():
    from models.config import ModelConfig

    return ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                       num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5, max_position=8192,
                       tie_embeddings=True, bos_token_id=1, eos_token_id=2)


def _fmt_rate(x) -> str:
    if x is None:
        return "—"
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


class Report:
    """What the run found, rendered as cuda/RESULTS.md."""

    def __init__(self):
        self.header: list[tuple[str, str]] = []
        self.checks: list[tuple[str, bool, str]] = []
        self.bench: list[dict] = []
        self.notes: list[str] = []
        self.errors: list[str] = []
        self.sections: list[str] = []  # further markdown (kernel timings)

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        self.checks.append((name, bool(ok), detail))
        print(f"  {'ok  ' if ok else 'FAIL'} {name}  {detail}", flush=True)

    @property
    def failed(self) -> bool:
        return bool(self.errors) or any(not ok for _, ok, _ in self.checks)

    def markdown(self) -> str:
        out = ["# cuda backend on a GPU (`make gpu-check`)", ""]
        out += [f"- {k}: {v}" for k, v in self.header]
        out += ["", f"**Result: {'FAILED' if self.failed else 'passed'}**", "", "## Correctness", "",
                "| check | result | detail |", "|---|---|---|"]
        out += [f"| {n} | {'ok' if ok else '**FAIL**'} | {d} |" for n, ok, d in self.checks]
        if self.bench:
            out += ["", "## Throughput", "",
                    "| workload | cuda backend (tok/s) | roofline (tok/s) | % of roofline | transformers (tok/s) "
                    "| cuda / transformers |", "|---|---:|---:|---:|---:|---:|"]
            for b in self.bench:
                ours, roof, torch_ = b.get("ours"), b.get("roofline"), b.get("torch")
                pct = f"{100 * ours / roof:.1f}%" if ours and roof else "—"
                ratio = f"{ours / torch_:.2f}x" if ours and torch_ else "—"
                out.append(f"| {b['name']} | {_fmt_rate(ours)} | {_fmt_rate(roof)} | {pct} | {_fmt_rate(torch_)} "
                           f"| {ratio} |")
        out += [x for sec in self.sections for x in ("", sec.rstrip())]
        if self.notes:
            out += ["", "## Notes", ""] + [f"- {n}" for n in self.notes]
        if self.errors:
            out += ["", "## Errors", ""] + [f"```\n{e.rstrip()}\n```" for e in self.errors]
        return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- on the GPU

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

    bs, theta = 16, 10000.0
    ctx = [s + n for s, n in seqs]
    nblk = sum(-(-c // bs) for c in ctx) + 5
    perm = rng.permutation(nblk).astype(np.int32)
    tables = np.zeros((3, -(-max(ctx) // bs)), np.int32)
    used = 0
    for i, cl in enumerate(ctx):
        n = -(-cl // bs)
        tables[i, :n] = perm[used:used + n]
        used += n
    kc = rng.standard_normal((nblk, bs, hkv, dh)).astype(np.float32)
    vc = rng.standard_normal((nblk, bs, hkv, dh)).astype(np.float32)
    positions = np.concatenate([np.arange(s, s + n) for s, n in seqs]).astype(np.int32)
    token_seq = np.concatenate([[i] * n for i, (_, n) in enumerate(seqs)]).astype(np.int32)
    slot = tables[token_seq, positions // bs].astype(np.int64) * bs + positions % bs
    t = len(positions)
    qkv = rng.standard_normal((t, (h + 2 * hkv) * dh)).astype(np.float32)
    q = R.rope(qkv[:, :h * dh].reshape(t, h, dh), positions, theta)
    k = R.rope(qkv[:, h * dh:(h + hkv) * dh].reshape(t, hkv, dh), positions, theta)
    kref, vref = kc.astype(np.float64), vc.astype(np.float64)
    kref.reshape(-1, hkv, dh)[slot] = k
    vref.reshape(-1, hkv, dh)[slot] = qkv[:, (h + hkv) * dh:].reshape(t, hkv, dh)
    dq, dk, dv = be.upload(qkv), be.upload(kc), be.upload(vc)
    cos, sin = be.rope_tables(max(ctx) + 1, dh, theta)
    be.rope_store_kv(dq, positions, cos, sin, dk, dv, slot, h, hkv)
    tag = f"H={h} Hkv={hkv} Dh={dh}"
    _close(f"rope_store_kv {tag}", be.download(dk), kref, 1e-5, report)
    out = be.zeros((t, h * dh))
    ntiles = be._tiles(positions, token_seq, be.config.attn_rows // (h // hkv))[2]
    nsplit = be._splits(ntiles * hkv, max(ctx))[0]
    be.attention(dq, dk, dv, tables, positions, token_seq, h, hkv, dh ** -0.5, out)
    qsl = np.concatenate([[0], np.cumsum([n for _, n in seqs])])
    ref = R.paged_attention(q, kref, vref, tables, np.array(ctx), qsl, dh ** -0.5)
    _close(f"paged attention {tag}, {nsplit} split(s){' (forced)' if split else ''}", be.download(out),
           ref.reshape(t, -1), 1e-4, report)
    if split and nsplit < 2:
        report.check(f"paged attention {tag} split-K taken", False, "the forced configuration did not split")


def sampling_check(be, report, rng, vocab: int = 49152, nrows: int = 32) -> None:
    from engine.backends.contract import RowSpec, SamplingBatch, SamplingParams
    from engine.backends.cpu_sampler import sample as cpu_sample

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
    want = cpu_sample(logits, batch)
    got = be.sample(be.upload(logits), batch)
    same = got.token_ids == want.token_ids
    report.check("sample: token ids equal to engine.sampling", bool(same.all()),
                 f"{int(same.sum())}/{len(rows)} rows equal" + ("" if same.all() else
                                                               f"; differ at rows {np.flatnonzero(~same).tolist()}"))
    _close("sample: chosen-token logprobs", got.logprobs, want.logprobs, 1e-4, report)
    ids_eq = bool(np.array_equal(got.top_token_ids, want.top_token_ids))
    report.check("sample: top logprob ids", ids_eq, "")
    fin = np.isfinite(want.top_logprobs)
    _close("sample: top logprobs", np.where(fin, got.top_logprobs, 0), np.where(fin, want.top_logprobs, 0), 1e-4,
           report)


def load_weights(path: str | None, report: Report, plan: Plan = FULL):
    from models.loader import default_model_path, load_model

    if plan.tiny_model:
        from models.config import ModelConfig

        cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                          num_kv_heads=1, head_dim=16, max_position=64)
        report.header.append(("model", "tiny synthetic (simulator run)"))
        return synthetic_weights(cfg), None, False
    path = path or default_model_path()
    if os.path.exists(path):
        weights, tok = load_model(path)
        report.header.append(("model", f"{os.path.basename(path)} ({', '.join(sorted(weights.formats()))})"))
        return weights, tok, True
    report.header.append(("model", "synthetic: SmolLM2-135M shapes, random weights, q4_1 layers + q8_0 embeddings"))
    report.notes.append(f"{path} was not on this machine (the default model is 98 MB, more than travels to the "
                        "GPU machine): a model of the same shapes and formats with random weights stood in. "
                        "Throughput is that of the default model; the cpu/cuda comparison is on random weights.")
    return synthetic_weights(smollm2_135m_config()), None, False


def model_check(weights, tokenizer, be, report: Report, greedy_tokens: int = 24) -> None:
    """cpu vs cuda backend: logits of a prompt, then greedy decoding, one sequence."""
    from engine.backends.cpu import CpuBackend
    from engine.backends.contract import RowSpec, SamplingBatch, SamplingParams
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
    models = {"cpu": LlamaModel(weights, CpuBackend()), "cuda": LlamaModel(weights, be)}
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


def _logits_of(weights, be, ids: np.ndarray) -> np.ndarray:
    """Logits [T, V] of one sequence through the cuda backend."""
    from models.llama import LlamaModel

    model = LlamaModel(weights, be)
    layout = BatchLayout(1, len(ids))
    kc, vc = model.allocate_kv_cache(layout.num_blocks, layout.block_size)
    step = dataclasses.replace(layout.prefill(ids[None, :], 0, 1), logits_indices=np.arange(len(ids), dtype=np.int32))
    return be.download(model.forward(step, kc, vc))


def _time_decode(model, layout: BatchLayout, prompts: np.ndarray, steps: int, warmup: int, sample) -> float:
    """Prefill every sequence, then time `steps` decode steps (forward + on-device sampling); tokens/s."""
    b = model.backend
    kc, vc = model.allocate_kv_cache(layout.num_blocks, layout.block_size)
    p = prompts.shape[1]
    tokens = np.zeros(layout.batch, np.int32)
    for first, count in prefill_groups(layout.batch, p, 2048):
        logits = model.forward(_upload(b, layout.prefill(prompts, first, count)), kc, vc)
        tokens[first:first + count] = sample(logits, count)
    pos = p
    for _ in range(warmup):
        tokens = sample(model.forward(_upload(b, layout.decode(tokens, pos)), kc, vc), layout.batch)
        pos += 1
    b.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        tokens = sample(model.forward(_upload(b, layout.decode(tokens, pos)), kc, vc), layout.batch)
        pos += 1
    b.synchronize()
    return layout.batch * steps / (time.perf_counter() - t0)


def _upload(b, step):
    from models.llama import StepInput

    return StepInput(*(b.upload(a) for a in (step.tokens, step.positions, step.token_seq, step.slot_mapping,
                                             step.block_tables, step.logits_indices)))


def benchmarks(weights, be, report: Report, deadline: float, bandwidth, peak, torch_model, plan: Plan = FULL) -> None:
    from engine.backends.contract import RowSpec, SamplingBatch, SamplingParams
    from models.llama import LlamaModel

    cfg = weights.config
    model = LlamaModel(weights, be)
    wbytes = model.nbytes
    rng = np.random.default_rng(11)
    greedy = {}

    def sample(logits, rows):
        if rows not in greedy:
            greedy[rows] = SamplingBatch.build([RowSpec(params=SamplingParams(temperature=0.0), seed=0, step=0)]
                                               * rows)
        return be.sample(logits, greedy[rows]).token_ids.astype(np.int32)

    for batch in plan.batches:
        if time.time() > deadline:
            report.notes.append(f"decode at batch {batch} and later skipped: the time budget ran out")
            break
        prompts = rng.integers(3, cfg.vocab_size, (batch, plan.prompt_len)).astype(np.int32)
        layout = BatchLayout(batch, plan.prompt_len + plan.warmup_steps + plan.decode_steps + 1)
        row = {"name": f"decode, batch {batch} (context {plan.prompt_len}-{plan.prompt_len + plan.warmup_steps + plan.decode_steps})",
               "roofline": decode_roofline(batch, wbytes, bandwidth)}
        try:
            row["ours"] = _time_decode(model, layout, prompts, plan.decode_steps, plan.warmup_steps, sample)
            print(f"  decode batch {batch}: {row['ours']:,.0f} tok/s", flush=True)
        except Exception:
            report.errors.append(f"decode batch {batch}:\n{traceback.format_exc()}")
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
            step = _upload(be, layout.prefill(prompts, 0, plan.prefill_seqs))
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
        report.notes.append("Decode roofline: batch x memory bandwidth / weight bytes (one read of the weights "
                            f"per step, {wbytes / 1e6:.1f} MB; KV cache reads left out). Prefill roofline: the "
                            "FP32 SIMT peak / (2 x multiply-adds per token) - these kernels use no tensor cores.")
        report.notes.append(f"Decode: {plan.prompt_len}-token prompts prefilled, {plan.warmup_steps} warm-up steps, then "
                            f"{plan.decode_steps} timed steps; each step is the forward plus greedy sampling on the "
                            "device with the token ids copied back (as the engine runs it), timed from the host.")


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
            step = _upload(be, layout.decode(np.zeros(batch, np.int32), ctx - 1))
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


class TorchModel:
    """transformers' LlamaForCausalLM on the same weights (dequantized), bf16, eager decode loop."""

    def __init__(self, weights):
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        self.torch = torch
        cfg = weights.config
        hf = cfg.to_hf()
        hf.pop("architectures", None)
        hf.pop("model_type", None)
        config = LlamaConfig(**hf)
        rope = getattr(config, "rope_parameters", None)  # transformers 5 keeps rope_theta in here
        if isinstance(rope, dict):
            rope["rope_theta"] = cfg.rope_theta
        else:
            config.rope_theta = cfg.rope_theta
        with torch.device("cuda"):
            model = LlamaForCausalLM(config).to(torch.bfloat16)
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a, np.float32)).to("cuda", torch.bfloat16)  # noqa
        sd = {"model.embed_tokens.weight": t(weights.embed.dequantize()), "model.norm.weight": t(weights.final_norm)}
        for i, lw in enumerate(weights.layers):
            p = f"model.layers.{i}."
            sd[p + "input_layernorm.weight"] = t(lw.attn_norm)
            sd[p + "post_attention_layernorm.weight"] = t(lw.ffn_norm)
            for ours, theirs in (("q", "self_attn.q_proj"), ("k", "self_attn.k_proj"), ("v", "self_attn.v_proj"),
                                 ("o", "self_attn.o_proj"), ("gate", "mlp.gate_proj"), ("up", "mlp.up_proj"),
                                 ("down", "mlp.down_proj")):
                sd[p + theirs + ".weight"] = t(getattr(lw, ours).dequantize())
        sd["lm_head.weight"] = t((weights.lm_head or weights.embed).dequantize())
        missing, unexpected = model.load_state_dict(sd, strict=False)
        if [m for m in missing if "rotary" not in m] or unexpected:
            raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
        self.model = model.eval()
        self.version = __import__("transformers").__version__ + " / torch " + torch.__version__

    def decode(self, prompts: np.ndarray, steps: int, warmup: int) -> float:
        torch = self.torch
        with torch.inference_mode():
            ids = torch.from_numpy(prompts.astype(np.int64)).cuda()
            out = self.model(input_ids=ids, use_cache=True)
            past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            for _ in range(warmup):
                out = self.model(input_ids=nxt, past_key_values=past, use_cache=True)
                past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            nxt.cpu()
            t0 = time.perf_counter()
            for _ in range(steps):
                out = self.model(input_ids=nxt, past_key_values=past, use_cache=True)
                past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                nxt.cpu()  # the token ids come back to the host every step, as in a server
            return prompts.shape[0] * steps / (time.perf_counter() - t0)

    def logits(self, ids: np.ndarray) -> np.ndarray:
        """Logits [T, V] (float32) of one sequence."""
        torch = self.torch
        with torch.inference_mode():
            x = torch.from_numpy(ids.astype(np.int64)[None, :]).cuda()
            return self.model(input_ids=x).logits[0].float().cpu().numpy()

    def prefill(self, prompts: np.ndarray, reps: int) -> float:
        torch = self.torch
        with torch.inference_mode():
            ids = torch.from_numpy(prompts.astype(np.int64)).cuda()
            self.model(input_ids=ids).logits[:, -1].argmax(-1).cpu()
            kw = {"logits_to_keep": 1}
            try:
                self.model(input_ids=ids, **kw).logits[:, -1].argmax(-1).cpu()
            except TypeError:  # transformers before 4.45
                kw = {}
            t0 = time.perf_counter()
            for _ in range(reps):
                self.model(input_ids=ids, **kw).logits[:, -1].argmax(-1).cpu()
            return reps * prompts.size / (time.perf_counter() - t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF file or HF directory (default: the default model)")
    ap.add_argument("--out", default=DEFAULT_OUT, help="where to write the report (default cuda/RESULTS.md)")
    ap.add_argument("--budget", type=float, default=480.0, help="seconds before the remaining benchmarks are "
                                                                 "skipped (a hang is dumped and killed at +90 s)")
    ap.add_argument("--no-torch", action="store_true", help="skip the transformers comparison")
    ap.add_argument("--skip-bench", action="store_true", help="correctness only")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes and a small launch configuration: the whole "
                                                         "script in the CUDA simulator (NUMBA_ENABLE_CUDASIM=1)")
    args = ap.parse_args(argv)
    plan = TINY if args.tiny else FULL
    start = time.time()
    deadline = start + args.budget
    faulthandler.dump_traceback_later(args.budget + 90, exit=True)

    from numba import cuda

    if not cuda.is_available():
        print("gpu-check: no CUDA GPU is available here (numba.cuda.is_available() is False); nothing to check.",
              file=sys.stderr)
        return 2

    from cuda.backend import CudaBackend

    report = Report()
    dev = cuda.get_current_device()
    name = getattr(dev, "name", "CUDA simulator")
    name = name.decode() if isinstance(name, bytes) else str(name)

    def attr(a: str) -> int:
        try:
            return int(getattr(dev, a) or 0)
        except Exception:  # an attribute this driver does not have
            return 0

    sms = attr("MULTIPROCESSOR_COUNT")
    bandwidth, bw_src = bandwidth_for(name, attr("MEMORY_CLOCK_RATE"), attr("GLOBAL_MEMORY_BUS_WIDTH"))
    peak = fp32_peak(dev.compute_capability, sms, attr("CLOCK_RATE"))
    be = CudaBackend(_tiny_config() if args.tiny else None)
    c = be.config
    import numba

    try:
        from importlib.metadata import version
        ncv = version("numba-cuda")
    except Exception:
        ncv = "?"
    report.header += [
        ("date", datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")),
        ("GPU", f"{name}, compute capability {dev.compute_capability[0]}.{dev.compute_capability[1]}, {sms} SMs"),
        ("memory bandwidth", f"{bandwidth / 1e12:.2f} TB/s ({bw_src})" if bandwidth else "unknown"),
        ("FP32 peak", f"{peak / 1e12:.1f} TFLOP/s (SMs x lanes x 2 x {attr('CLOCK_RATE') / 1e3:.0f} MHz)"
         if peak else "unknown"),
        ("launch configuration", f"{c.arch}: " + ", ".join(f"{f.name}={getattr(c, f.name)}"
                                                           for f in dataclasses.fields(c) if f.name != "arch")),
        ("software", f"Python {platform.python_version()}, numba {numba.__version__}, numba-cuda "
                     f"{ncv}, numpy {np.__version__}"),
    ]
    print("\n".join(f"{k}: {v}" for k, v in report.header), flush=True)

    status = 0
    try:
        print(f"\n[1/4] kernels against numpy ({time.time() - start:.0f} s)", flush=True)
        try:
            kernel_checks(be, report, np.random.default_rng(int(time.time())), plan)
        except Exception:
            report.errors.append(f"kernel checks:\n{traceback.format_exc()}")
            print(report.errors[-1], flush=True)

        print(f"\n[2/4] cuda backend against cpu backend ({time.time() - start:.0f} s)", flush=True)
        weights = None
        try:
            weights, tokenizer, _ = load_weights(args.model, report, plan)
            print(f"  {report.header[-1][1]}", flush=True)
            model_check(weights, tokenizer, be, report, plan.greedy_tokens)
        except Exception:
            report.errors.append(f"model check:\n{traceback.format_exc()}")
            print(report.errors[-1], flush=True)

        if not args.skip_bench and weights is not None:
            print(f"\n[3/4] throughput ({time.time() - start:.0f} s)", flush=True)
            torch_model = None
            if args.no_torch:
                report.notes.append("transformers column skipped (--no-torch)")
            else:
                try:
                    torch_model = TorchModel(weights)
                    report.header.append(("transformers", torch_model.version + ", bf16 weights, eager"))
                    ids = np.random.default_rng(5).integers(3, weights.config.vocab_size, 32).astype(np.int32)
                    hf = torch_model.logits(ids)
                    ours = _logits_of(weights, be, ids)
                    agree = float(np.mean(hf.argmax(-1) == ours.argmax(-1)))
                    corr = float(np.corrcoef(hf.ravel(), ours.ravel())[0, 1])
                    report.notes.append(f"transformers baseline is the same model: on 32 random tokens its bf16 "
                                        f"logits correlate {corr:.4f} with ours (float32), argmax agrees at "
                                        f"{100 * agree:.0f}% of positions")
                except ImportError as e:
                    report.notes.append(f"transformers column empty: {e} (torch/transformers not importable here)")
                except Exception:
                    report.errors.append(f"transformers model:\n{traceback.format_exc()}")
            try:
                benchmarks(weights, be, report, deadline, bandwidth, peak, torch_model, plan)
            except Exception:
                report.errors.append(f"benchmarks:\n{traceback.format_exc()}")
            print(f"\n[4/4] kernel timings ({time.time() - start:.0f} s)", flush=True)
            if time.time() < deadline:
                try:
                    kernel_timings(weights, be, report, deadline, plan)
                except Exception:
                    report.errors.append(f"kernel timings:\n{traceback.format_exc()}")
            else:
                report.notes.append("kernel timings skipped: the time budget ran out")
    finally:
        report.header.append(("wall time", f"{time.time() - start:.0f} s"))
        with open(args.out, "w") as f:
            f.write(report.markdown())
        print(f"\nwrote {args.out}", flush=True)
        faulthandler.cancel_dump_traceback_later()
    if report.failed:
        print("gpu-check FAILED:", flush=True)
        for n, ok, d in report.checks:
            if not ok:
                print(f"  {n}: {d}", flush=True)
        for e in report.errors:
            print(e, flush=True)
        status = 1
    else:
        print("gpu-check passed", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
