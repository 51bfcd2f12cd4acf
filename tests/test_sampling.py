"""The sampler against a plain numpy reference; parameters' validation; the batch's packing.

Random inputs are fresh each run; every assertion message carries the seed that reproduces it.
"""
from __future__ import annotations

import functools
import math
import secrets
from collections import Counter

import numpy as np
import pytest

from engine.backends import cpu_sampler as sm
from engine.backends.cpu_sampler import BLOCK, processed_logits, sample
from engine.backends.sampling_batch import RowSpec, SamplingBatch
from engine.sampling import MAX_LOGPROBS, SamplingParamError, SamplingParams

MASK64 = (1 << 64) - 1


class SeededRng(np.random.Generator):
    """A Generator that remembers its seed, for assertion messages."""

    def __init__(self, seed: int):
        super().__init__(np.random.PCG64(seed))
        self.seed = seed


@pytest.fixture
def rng():
    return SeededRng(secrets.randbits(32))


# --------------------------------------------------------------------------- reference

def splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def uniform(seed: int, step: int) -> float:
    """The draw's uniform: a pure function of (seed, step)."""
    return (splitmix64((splitmix64(seed & MASK64) + step) & MASK64) >> 11) * 2.0 ** -53


@functools.lru_cache(maxsize=8)
def draw_order(V: int) -> np.ndarray:
    """Token ids in the order the inverse CDF walks them: (t mod nb, t div nb), nb = ceil(V / BLOCK)."""
    nb = -(-V // BLOCK)
    t = np.arange(V)
    return np.lexsort((t // nb, t % nb))


def processed_reference(row: np.ndarray, spec: RowSpec) -> np.ndarray:
    """Bias, min_tokens mask, repetition / frequency / presence penalties, in float32, from the formulas."""
    p = spec.params
    w = np.array(row, np.float32)
    for t, b in (p.logit_bias or {}).items():
        w[t] = w[t] + np.float32(b)
    if len(spec.output_token_ids) < p.min_tokens:
        for t in list(p.stop_token_ids) + ([] if p.ignore_eos else list(spec.eos_token_ids)):
            w[t] = -np.inf
    r = np.float32(p.repetition_penalty)
    if r != 1:
        for t in set(spec.prompt_token_ids) | set(spec.output_token_ids):
            w[t] = w[t] / r if w[t] > 0 else w[t] * r
    for t, c in Counter(spec.output_token_ids).items():
        w[t] = w[t] - np.float32(p.frequency_penalty) * np.float32(c)
        w[t] = w[t] - np.float32(p.presence_penalty)
    return w


def kept_weights(w, temperature, top_k, top_p, min_p, order=None):
    """Unnormalized probabilities after temperature, top-k, top-p (on the top-k set), min-p; 0 = removed."""
    V = w.size
    e = np.exp((w.astype(np.float64) - w.max()) / temperature)
    if order is None:
        order = np.lexsort((np.arange(V), -w))        # value desc, id asc
    n = top_k if 0 < top_k < V else V
    prefix = order[:n]
    if top_p < 1:
        cum = np.cumsum(e[prefix])
        prefix = prefix[:np.searchsorted(cum, top_p * cum[-1], side="left") + 1]
    keep = np.zeros(V, bool)
    keep[prefix] = True
    keep &= e >= min_p
    return np.where(keep, e, 0.0)


def draw(weights, u):
    order = draw_order(weights.size)
    cum = np.cumsum(weights[order])
    return int(order[min(np.searchsorted(cum, u * cum[-1], side="right"), weights.size - 1)])


def _csr_row(indptr, values, i):
    return values[indptr[i]:indptr[i + 1]]


NO_NUDGE = ((0.0, 0.0, 0.0),)


def sample_reference(logits: np.ndarray, batch: SamplingBatch, nudges=NO_NUDGE):
    """The sampler in plain numpy, from the batch's packed arrays: (tokens, logprobs, top ids, top logprobs).
    With several nudges (du, dp, dmin) of u, top_p and min_p, tokens is [len(nudges), S]: draws that sit on
    a boundary, where float rounding may legitimately decide, show up as disagreeing nudges."""
    S, V = logits.shape
    toks = np.zeros((len(nudges), S), np.int64)
    for i in range(S):
        w = np.array(logits[i], np.float32)
        for t, b in zip(_csr_row(batch.bias_indptr, batch.bias_token_ids, i),
                        _csr_row(batch.bias_indptr, batch.bias_values, i)):
            w[t] = w[t] + b
        w[_csr_row(batch.mask_indptr, batch.mask_token_ids, i)] = -np.inf
        hist = _csr_row(batch.hist_indptr, batch.hist_token_ids, i)
        if hist.size:
            out = hist[batch.hist_num_prompt[i]:]
            r = batch.repetition_penalty[i]
            if r != 1:
                for t in set(hist.tolist()):
                    w[t] = w[t] / r if w[t] > 0 else w[t] * r
            for t, c in Counter(out.tolist()).items():
                w[t] = w[t] - batch.frequency_penalty[i] * np.float32(c)
                w[t] = w[t] - batch.presence_penalty[i]
        if batch.temperature[i] == 0:
            toks[:, i] = int(np.argmax(w))
            continue
        order = np.lexsort((np.arange(V), -w))
        for n, (du, dp, dmin) in enumerate(nudges):
            u = min(max(uniform(int(batch.seed[i]), int(batch.step[i])) + du, 0.0), 1 - 1e-12)
            top_p = float(batch.top_p[i])
            top_p = min(top_p + dp, 1.0) if top_p < 1 else 1.0
            kw = kept_weights(w, float(batch.temperature[i]), int(batch.top_k[i]), top_p,
                              float(batch.min_p[i]) * (1 + dmin), order)
            toks[n, i] = draw(kw, u)
    x = logits.astype(np.float64)
    lse = np.log(np.exp(x - x.max(1, keepdims=True)).sum(1)) + x.max(1)
    K = batch.max_num_logprobs
    top_ids = np.full((S, K), -1, np.int64)
    top_lp = np.full((S, K), -np.inf)
    for i in range(S):
        k = batch.num_logprobs[i]
        if k:
            top_ids[i, :k] = np.lexsort((np.arange(V), -logits[i]))[:k]
            top_lp[i, :k] = x[i, top_ids[i, :k]] - lse[i]
    chosen = toks[0] if len(nudges) == 1 else toks
    return chosen, x[np.arange(S), toks[0]] - lse, top_ids, top_lp


def robust_reference(logits, batch):
    """Reference tokens, and which rows are clear of boundaries (there the sampler must agree exactly)."""
    d = 1e-5
    nudges = ((0, 0, 0), (d, 0, 0), (-d, 0, 0), (0, d, 0), (0, -d, 0), (0, 0, d), (0, 0, -d))
    toks = sample_reference(logits, batch, nudges)[0]
    return toks[0], (toks == toks[0]).all(axis=0)


# --------------------------------------------------------------------------- helpers

def rows_for(params, n=1, seed=0, step=0, **kw):
    return [RowSpec(params, seed=seed + i, step=step, **kw) for i in range(n)]


def random_logits(rng, S, V, kind="mixed"):
    kinds = ["flat", "peaked", "ties", "wide"] if kind == "mixed" else [kind]
    out = np.empty((S, V), np.float32)
    for i in range(S):
        k = kinds[i % len(kinds)]
        if k == "flat":
            out[i] = rng.standard_normal(V) * 3
        elif k == "peaked":
            out[i] = rng.standard_normal(V) * 2
            out[i, rng.integers(0, V, 5)] += rng.uniform(4, 12, 5)
        elif k == "ties":
            out[i] = np.round(rng.standard_normal(V) * 4) / 2   # many equal values
        else:
            out[i] = rng.uniform(-30, 10, V)
    return out


def random_params(rng, **fixed):
    kw = dict(temperature=float(rng.choice([0.3, 0.7, 1.0, 1.6])),
              top_k=int(rng.choice([0, 0, 1, 7, 50, 2000])),
              top_p=float(rng.choice([1.0, 1.0, 0.5, 0.9, 0.99])),
              min_p=float(rng.choice([0.0, 0.0, 0.05, 0.3])))
    kw.update(fixed)
    return SamplingParams(**kw)


# --------------------------------------------------------------------------- the draw

def test_uniform_is_splitmix64_of_seed_and_step(rng):
    for _ in range(50):
        seed, step = int(rng.integers(0, 2**63)) * 2 + 1, int(rng.integers(0, 10**6))
        assert sm.uniform01(np.uint64(seed), step) == uniform(seed, step), rng.seed
    us = np.array([uniform(7, s) for s in range(4000)])
    assert abs(us.mean() - 0.5) < 0.03 and us.min() >= 0 and us.max() < 1


def test_greedy_is_argmax(rng):
    for V in (3, 1000, 49152):
        S = 9
        lg = random_logits(rng, S, V)
        lg[0, :] = 1.0                        # all equal: first index
        lg[1, 5 % V] = np.inf if V > 5 else lg[1, 0]
        params = [random_params(rng, temperature=0.0) for _ in range(S)]
        params[2] = SamplingParams(temperature=1e-7)   # below the greedy epsilon
        res = sample(lg, SamplingBatch.build([RowSpec(p, seed=i, step=0) for i, p in enumerate(params)]))
        assert (res.token_ids == np.argmax(lg, axis=1)).all(), (rng.seed, V)
        assert res.token_ids.dtype == np.int64 and res.logprobs.dtype == np.float32


@pytest.mark.parametrize("V", [50, 49152])
def test_sampler_matches_numpy_reference(rng, V):
    S = 48
    lg = random_logits(rng, S, V)
    specs = []
    for i in range(S):
        extra = {}
        if i % 5 == 0:
            extra = dict(repetition_penalty=float(rng.uniform(0.5, 2)), presence_penalty=float(rng.uniform(-2, 2)),
                         frequency_penalty=float(rng.uniform(-2, 2)))
        if i % 7 == 0:
            extra["logit_bias"] = {int(t): float(rng.uniform(-100, 100)) for t in rng.integers(0, V, 4)}
        if i % 6 == 0:
            extra.update(min_tokens=3, stop_token_ids=[int(rng.integers(0, V))])
        specs.append(RowSpec(random_params(rng, **extra), seed=int(rng.integers(0, 2**64, dtype=np.uint64)),
                             step=int(rng.integers(0, 1000)),
                             prompt_token_ids=rng.integers(0, V, 30).tolist(),
                             output_token_ids=rng.integers(0, V, int(rng.integers(0, 6))).tolist(),
                             eos_token_ids=[int(np.argmax(lg[i]))]))
    batch = SamplingBatch.build(specs)
    res = sample(lg, batch)
    ref, clear = robust_reference(lg, batch)
    assert clear.mean() >= 0.5, rng.seed                      # the comparison is not vacuous
    bad = np.nonzero(clear & (res.token_ids != ref))[0]
    assert bad.size == 0, (rng.seed, [(int(i), specs[i].params, int(res.token_ids[i]), int(ref[i])) for i in bad])


def test_large_vocab_paths_match_reference(rng):
    """V = 49152 through every cut path: candidates gathered by block maxima, widened top-p, the
    whole-row bisection, large top-k, ties."""
    V = 49152
    cases = [dict(temperature=0.7, top_p=0.9), dict(temperature=1.0, top_p=0.95), dict(temperature=1.5, top_p=0.99),
             dict(temperature=0.8, top_k=40), dict(temperature=1.0, top_k=3000), dict(temperature=1.0, top_k=3000,
                                                                                        top_p=0.8),
             dict(temperature=1.0, top_k=20, top_p=0.6, min_p=0.1), dict(temperature=0.9, min_p=0.02),
             dict(temperature=1.2, top_p=0.3), dict(temperature=2.0, top_k=5000, top_p=0.97)]
    specs, rows = [], []
    for j, kind in enumerate(["flat", "peaked", "ties", "wide"]):
        for c in cases:
            specs.append(RowSpec(SamplingParams(**c), seed=int(rng.integers(0, 2**62)), step=j))
        rows.append(random_logits(rng, len(cases), V, kind))
    lg = np.concatenate(rows)
    batch = SamplingBatch.build(specs)
    res = sample(lg, batch)
    ref, clear = robust_reference(lg, batch)
    assert clear.mean() >= 0.5, rng.seed   # most rows are far from a tie: enough of them are compared
    bad = np.nonzero(clear & (res.token_ids != ref))[0]
    assert bad.size == 0, (rng.seed, [(int(i), specs[i].params, int(res.token_ids[i]), int(ref[i])) for i in bad])


def test_seeded_draw_independent_of_batch_and_position(rng):
    V = 2000
    target = random_logits(rng, 1, V, "flat")[0]
    params = [SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0.8, top_p=0.9, seed=2),
              SamplingParams(temperature=1.3, top_k=30, min_p=0.01, seed=3, repetition_penalty=1.3,
                             frequency_penalty=0.4)]
    for p in params:
        spec = RowSpec(p, seed=p.seed, step=11, prompt_token_ids=[1, 2, 3], output_token_ids=[4, 4])
        alone = sample(target[None], SamplingBatch.build([spec])).token_ids[0]
        again = sample(target[None], SamplingBatch.build([spec])).token_ids[0]
        assert alone == again, rng.seed
        for _ in range(3):
            S = int(rng.integers(2, 40))
            pos = int(rng.integers(0, S))
            others = [RowSpec(random_params(rng, presence_penalty=0.5), seed=int(rng.integers(0, 2**32)),
                              step=int(rng.integers(0, 50)), output_token_ids=[1]) for _ in range(S - 1)]
            lg = random_logits(rng, S, V)
            lg[pos] = target
            specs = others[:pos] + [spec] + others[pos:]
            assert sample(lg, SamplingBatch.build(specs)).token_ids[pos] == alone, (rng.seed, p, S, pos)
    # the step moves the draw: 40 steps over a nearly uniform distribution give many tokens
    flat = (rng.standard_normal(V) * 0.1).astype(np.float32)
    steps = [RowSpec(params[0], seed=5, step=s) for s in range(40)]
    toks = sample(np.repeat(flat[None], 40, 0), SamplingBatch.build(steps)).token_ids
    assert len(set(toks.tolist())) > 30, rng.seed


def _chi_square_ok(counts, probs, n):
    """Pearson's test on cells of expected count >= 5 (small cells merged); threshold at p ~ 1e-6."""
    order = np.argsort(probs)
    cells_obs, cells_exp, o, e = [], [], 0.0, 0.0
    for t in order:
        o, e = o + counts[t], e + probs[t] * n
        if e >= 5:
            cells_obs.append(o)
            cells_exp.append(e)
            o = e = 0.0
    if e > 0 and cells_exp:
        cells_obs[-1] += o
        cells_exp[-1] += e
    obs, exp = np.array(cells_obs), np.array(cells_exp)
    df = len(obs) - 1
    if df < 1:
        return True, 0.0, 0.0
    stat = float(((obs - exp) ** 2 / exp).sum())
    z = 4.75  # one-sided normal quantile of 1e-6; Wilson-Hilferty for the chi-square quantile
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat < crit, stat, crit


@pytest.mark.parametrize("cfg", [
    dict(temperature=1.0), dict(temperature=0.5), dict(temperature=1.0, top_k=5), dict(temperature=0.8, top_p=0.7),
    dict(temperature=1.0, min_p=0.1), dict(temperature=1.5, top_k=12, top_p=0.8, min_p=0.02),
])
def test_empirical_distribution_matches_filtered_softmax(rng, cfg):
    V, N = 40, 20000
    row = (rng.standard_normal(V) * 1.5).astype(np.float32)
    p = SamplingParams(**cfg)
    kw = kept_weights(row, p.temperature, p.top_k, p.top_p, p.min_p)
    probs = kw / kw.sum()
    seed = int(rng.integers(0, 2**63))
    toks = sample(np.repeat(row[None], N, 0), SamplingBatch.build(
        [RowSpec(p, seed=seed, step=s) for s in range(N)])).token_ids
    counts = np.bincount(toks, minlength=V)
    assert counts[probs == 0].sum() == 0, (rng.seed, cfg, np.nonzero(counts * (probs == 0)))
    ok, stat, crit = _chi_square_ok(counts, probs, N)
    assert ok, (rng.seed, cfg, stat, crit)
    assert 0.5 * np.abs(counts / N - probs).sum() < 0.05, (rng.seed, cfg)


def test_empirical_distribution_with_bisected_top_p(rng):
    """A flat row of 3000 tokens with top_p 0.9: the cut is found by bisection over the whole row."""
    V, N = 3000, 1500
    row = (rng.standard_normal(V) * 0.7).astype(np.float32)
    p = SamplingParams(temperature=1.0, top_p=0.9)
    kw = kept_weights(row, 1.0, 0, 0.9, 0.0)
    probs = kw / kw.sum()
    toks = sample(np.repeat(row[None], N, 0), SamplingBatch.build(
        [RowSpec(p, seed=3, step=s) for s in range(N)])).token_ids
    assert (probs[toks] > 0).all(), rng.seed
    # coarse cells: tokens grouped by probability into 15 cells of equal mass
    order = np.argsort(probs)
    cell = np.zeros(V, int)
    cell[order] = np.minimum((np.cumsum(probs[order]) * 15).astype(int), 14)
    cell_p = np.bincount(cell, weights=probs, minlength=15)
    ok, stat, crit = _chi_square_ok(np.bincount(cell[toks], minlength=15), cell_p, N)
    assert ok, (rng.seed, stat, crit)


# --------------------------------------------------------------------------- processing

def test_penalties_and_bias_change_logits_exactly(rng):
    for V in (30, 5000):
        specs = []
        for i in range(24):
            p = SamplingParams(
                repetition_penalty=float(rng.choice([1.0, rng.uniform(0.3, 3.0)])),
                presence_penalty=float(rng.choice([0.0, rng.uniform(-2, 2)])),
                frequency_penalty=float(rng.choice([0.0, rng.uniform(-2, 2)])),
                logit_bias={int(t): float(rng.uniform(-100, 100)) for t in rng.integers(0, V, int(rng.integers(0, 5)))}
                or None,
                min_tokens=int(rng.integers(0, 4)), stop_token_ids=rng.integers(0, V, 2).tolist(),
                ignore_eos=bool(rng.integers(0, 2)), max_tokens=100)
            out = rng.integers(0, min(V, 12), int(rng.integers(0, 20))).tolist()
            specs.append(RowSpec(p, seed=i, step=len(out), prompt_token_ids=rng.integers(0, V, int(rng.integers(0, 40))),
                                 output_token_ids=out, eos_token_ids=[int(rng.integers(0, V))]))
        lg = random_logits(rng, len(specs), V)
        batch = SamplingBatch.build(specs)
        got = processed_logits(lg, batch)
        want = np.stack([processed_reference(lg[i], s) for i, s in enumerate(specs)])
        assert np.array_equal(got, want), (rng.seed, V, np.argwhere(got != want)[:5])
        # the sampler draws from those logits: greedy picks their argmax
        for s in specs:
            s.params.temperature = 0.0
        assert (sample(lg, SamplingBatch.build(specs)).token_ids == np.argmax(want, axis=1)).all(), rng.seed


def test_repetition_penalty_counts_each_token_once(rng):
    V = 10
    lg = np.array([[2.0, -2.0, 1.0, 0.5, 0, 0, 0, 0, 0, 0]], np.float32)
    spec = RowSpec(SamplingParams(repetition_penalty=2.0, frequency_penalty=0.25, presence_penalty=0.5),
                   seed=0, step=0, prompt_token_ids=[0, 0, 1, 3], output_token_ids=[0, 1, 1, 2])
    got = processed_logits(lg, SamplingBatch.build([spec]))[0]
    assert got[0] == np.float32(2.0 / 2 - 0.25 * 1 - 0.5)
    assert got[1] == np.float32(-2.0 * 2 - 0.25 * 2 - 0.5)
    assert got[2] == np.float32(1.0 / 2 - 0.25 - 0.5)
    assert got[3] == np.float32(0.5 / 2)                # prompt only: no presence/frequency
    assert (got[4:] == 0).all()


def test_min_tokens_masks_eos_and_stop_ids(rng):
    V, eos, stop_id = 100, 7, 9
    lg = (rng.standard_normal((1, V))).astype(np.float32)
    lg[0, eos], lg[0, stop_id] = 30.0, 29.0
    p = SamplingParams(min_tokens=4, stop_token_ids=[stop_id], temperature=1.0)
    for n_out in range(4):
        specs = [RowSpec(p, seed=s, step=n_out, output_token_ids=[1] * n_out, eos_token_ids=[eos]) for s in range(200)]
        toks = sample(np.repeat(lg, 200, 0), SamplingBatch.build(specs)).token_ids
        assert not np.isin(toks, [eos, stop_id]).any(), (rng.seed, n_out)
    greedy = SamplingParams(min_tokens=4, stop_token_ids=[stop_id], temperature=0)
    assert sample(lg, SamplingBatch.build([RowSpec(greedy, 0, 3, output_token_ids=[1] * 3,
                                                   eos_token_ids=[eos])])).token_ids[0] not in (eos, stop_id)
    assert sample(lg, SamplingBatch.build([RowSpec(greedy, 0, 4, output_token_ids=[1] * 4,
                                                   eos_token_ids=[eos])])).token_ids[0] == eos
    # ignore_eos: EOS is no stop token, so min_tokens leaves it alone (as vLLM)
    ig = SamplingParams(min_tokens=4, temperature=0, ignore_eos=True)
    assert sample(lg, SamplingBatch.build([RowSpec(ig, 0, 0, eos_token_ids=[eos])])).token_ids[0] == eos


# --------------------------------------------------------------------------- logprobs

def test_logprobs_are_raw_log_softmax_and_top_k_largest(rng):
    for V in (25, 49152):
        S = 12
        lg = random_logits(rng, S, V)
        params = [SamplingParams(logprobs=[None, 0, 1, 5, MAX_LOGPROBS][i % 5], temperature=[0, 0.7, 1.4][i % 3],
                                 top_p=0.9, repetition_penalty=1.5, presence_penalty=1.0,
                                 logit_bias={3: 50.0}) for i in range(S)]
        specs = [RowSpec(p, seed=i, step=0, prompt_token_ids=[3, 4], output_token_ids=[5])
                 for i, p in enumerate(params)]
        res = sample(lg, SamplingBatch.build(specs))
        K = MAX_LOGPROBS
        assert res.top_token_ids.shape == (S, K) and res.top_logprobs.shape == (S, K)
        assert res.top_token_ids.dtype == np.int64 and res.top_logprobs.dtype == np.float32
        x = lg.astype(np.float64)
        logsm = x - (np.log(np.exp(x - x.max(1, keepdims=True)).sum(1, keepdims=True)) + x.max(1, keepdims=True))
        chosen = logsm[np.arange(S), res.token_ids]
        assert np.allclose(res.logprobs, chosen, atol=2e-5, rtol=1e-5), rng.seed
        for i, p in enumerate(params):
            k = p.logprobs or 0
            want = np.lexsort((np.arange(V), -lg[i]))[:k]
            assert (res.top_token_ids[i, :k] == want).all(), (rng.seed, V, i)
            assert np.allclose(res.top_logprobs[i, :k], logsm[i, want], atol=2e-5, rtol=1e-5), rng.seed
            assert (np.diff(res.top_logprobs[i, :k]) <= 0).all()
            assert (res.top_token_ids[i, k:] == -1).all() and np.isneginf(res.top_logprobs[i, k:]).all()
    # K is the largest request in the batch; 0 when nobody asked
    lg = random_logits(rng, 2, 30)
    none = sample(lg, SamplingBatch.build(rows_for(SamplingParams(), 2)))
    assert none.top_token_ids.shape == (2, 0) and none.top_logprobs.shape == (2, 0)
    three = sample(lg, SamplingBatch.build(rows_for(SamplingParams(logprobs=3), 1) +
                                           rows_for(SamplingParams(logprobs=1), 1)))
    assert three.top_token_ids.shape == (2, 3) and three.top_token_ids[1, 1] == -1


# --------------------------------------------------------------------------- batch and entry points

def test_batch_packs_only_rows_that_need_it():
    plain = SamplingParams()
    pen = SamplingParams(repetition_penalty=1.2)
    pres = SamplingParams(presence_penalty=0.5)
    bias = SamplingParams(logit_bias={"4": 1.5, 2: -3})
    mt = SamplingParams(min_tokens=2, stop_token_ids=[8])
    specs = [RowSpec(plain, 1, 0, [1, 2], [3]), RowSpec(pen, 2, 0, [1, 2], [3]), RowSpec(pres, 3, 0, [1, 2], [3, 3]),
             RowSpec(bias, 4, 0, [1], []), RowSpec(mt, 5, 1, [1], [6], eos_token_ids=[0]),
             RowSpec(mt, 6, 2, [1], [6, 6], eos_token_ids=[0]), RowSpec(SamplingParams(top_k=-1), -1, 0)]
    b = SamplingBatch.build(specs)
    assert b.num_rows == 7 and b.hist_indptr.tolist() == [0, 0, 3, 5, 5, 5, 5, 5]
    assert b.hist_token_ids.tolist() == [1, 2, 3, 3, 3] and b.hist_num_prompt.tolist() == [0, 2, 0, 0, 0, 0, 0]
    assert b.bias_indptr.tolist() == [0, 0, 0, 0, 2, 2, 2, 2]
    assert dict(zip(b.bias_token_ids.tolist(), b.bias_values.tolist())) == {4: 1.5, 2: -3.0}
    assert b.mask_indptr.tolist() == [0, 0, 0, 0, 0, 2, 2, 2] and sorted(b.mask_token_ids.tolist()) == [0, 8]
    assert b.top_k[-1] == 0 and b.seed[-1] == np.uint64(MASK64) and b.max_token_id == 8
    for a, dt in ((b.temperature, np.float32), (b.top_k, np.int32), (b.seed, np.uint64), (b.step, np.int64),
                  (b.hist_indptr, np.int64), (b.hist_token_ids, np.int32), (b.bias_values, np.float32)):
        assert a.dtype == dt


def test_sample_checks_shapes_and_token_ids():
    b = SamplingBatch.build(rows_for(SamplingParams(logit_bias={60: 1.0}), 2))
    with pytest.raises(ValueError, match="logits"):
        sample(np.zeros((3, 100), np.float32), b)
    with pytest.raises(ValueError, match="out of range"):
        sample(np.zeros((2, 50), np.float32), b)
    empty = sample(np.zeros((0, 10), np.float32), SamplingBatch.build([]))
    assert empty.token_ids.shape == (0,)


def test_degenerate_rows_still_give_a_valid_token():
    lg = np.full((4, 70), -np.inf, np.float32)
    lg[1, :] = np.nan
    lg[2, 40] = 0.0
    lg[3, :] = 0.0
    lg[3, [20, 30]] = np.inf
    for p in (SamplingParams(top_p=0.5), SamplingParams(), SamplingParams(top_k=3, min_p=0.2)):
        res = sample(lg, SamplingBatch.build(rows_for(p, 4)))
        assert ((res.token_ids >= 0) & (res.token_ids < 70)).all()
        assert res.token_ids[2] == 40 and res.token_ids[3] == 20


# --------------------------------------------------------------------------- parameters

@pytest.mark.parametrize("kwargs, param", [
    (dict(n=0), "n"), (dict(n=1000), "n"), (dict(n=True), "n"), (dict(n=2.0), "n"),
    (dict(temperature=-1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"), (dict(temperature="1"), "temperature"),
    (dict(top_p=1.5), "top_p"), (dict(top_p=-0.1), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(top_k=3.0), "top_k"), (dict(top_k=True), "top_k"),
    (dict(min_p=1.1), "min_p"), (dict(min_p=-0.1), "min_p"),
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(presence_penalty=float("-inf")), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(repetition_penalty=-1), "repetition_penalty"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty"),
    (dict(repetition_penalty=1e-9), "repetition_penalty"),
    (dict(repetition_penalty=1e9), "repetition_penalty"), (dict(temperature=1e6), "temperature"),
    (dict(logit_bias={1: 101}), "logit_bias"), (dict(logit_bias={1: float("nan")}), "logit_bias"),
    (dict(logit_bias={-1: 1}), "logit_bias"), (dict(logit_bias={"x": 1}), "logit_bias"),
    (dict(logit_bias=[1, 2]), "logit_bias"), (dict(logit_bias={True: 1}), "logit_bias"),
    (dict(seed=1.5), "seed"), (dict(seed=True), "seed"), (dict(seed=1 << 70), "seed"),
    (dict(stop=[1, 2]), "stop"), (dict(stop=5), "stop"), (dict(stop=[""]), "stop"), (dict(stop=["a", None]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(stop_token_ids=["a"]), "stop_token_ids"),
    (dict(stop_token_ids=3), "stop_token_ids"), (dict(stop_token_ids=[False]), "stop_token_ids"),
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=-5), "max_tokens"), (dict(max_tokens=1.5), "max_tokens"),
    (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=20, max_tokens=10), "min_tokens"),
    (dict(ignore_eos=1), "ignore_eos"), (dict(skip_special_tokens="yes"), "skip_special_tokens"),
    (dict(include_stop_str_in_output=1), "include_stop_str_in_output"),
    (dict(logprobs=21), "logprobs"), (dict(logprobs=-1), "logprobs"), (dict(logprobs=True), "logprobs"),
    (dict(best_of=0), "best_of"),
])
def test_bad_parameters_name_the_parameter(kwargs, param):
    with pytest.raises(ValueError, match=param) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param
    assert isinstance(e.value, SamplingParamError)


def test_parameters_normalize():
    p = SamplingParams(stop="###", logit_bias={"12": 5, 3: -1.5}, top_k=-1, temperature=0, seed=-3,
                       stop_token_ids=(4, np.int64(5)), max_tokens=None, logprobs=0)
    assert p.stop == ["###"] and p.logit_bias == {12: 5.0, 3: -1.5} and p.stop_token_ids == [4, 5]
    assert p.greedy and type(p.temperature) is float and p.max_tokens is None and p.logprobs == 0
    q = SamplingParams()
    assert q.stop == [] and q.stop_token_ids == [] and q.max_tokens == 16 and q.logit_bias is None
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    z = SamplingParams(top_p=0, temperature=1.0)
    assert (z.top_p, z.top_k) == (1.0, 1) and SamplingParams(**{**z.__dict__}).top_k == 1


@pytest.mark.parametrize("kwargs, lens, param", [
    (dict(logit_bias={1000: 1.0}), (1000, 100, 10), "logit_bias"),
    (dict(stop_token_ids=[5, 1000]), (1000, 100, 10), "stop_token_ids"),
    (dict(max_tokens=91), (1000, 100, 10), "max_tokens"),
    (dict(max_tokens=None, min_tokens=95), (1000, 100, 10), "min_tokens"),
    (dict(), (1000, 100, 0), "prompt"),
    (dict(max_tokens=None), (1000, 100, 100), "prompt"),
])
def test_validate_for_the_model(kwargs, lens, param):
    with pytest.raises(ValueError, match=param) as e:
        SamplingParams(**kwargs).validate_for(*lens)
    assert e.value.param == param


def test_validate_for_accepts_what_fits():
    SamplingParams(max_tokens=90, logit_bias={999: 1}, stop_token_ids=[999]).validate_for(1000, 100, 10)
    SamplingParams(max_tokens=None).validate_for(1000, 100, 99)
    with pytest.raises(ValueError, match=r"max_tokens \(91\).*context length of 100.*max_tokens <= 90"):
        SamplingParams(max_tokens=91).validate_for(1000, 100, 10)
