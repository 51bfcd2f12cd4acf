"""The allowed-token mask of constrained rows inside the CPU sampler kernel: a masked row never samples a
disallowed token whatever its temperature, top-k, top-p, min-p, bias or penalties; an unmasked row in the
same batch samples exactly what it samples without any mask in the batch."""
from __future__ import annotations

import numpy as np
import pytest

from engine.backends.cpu_sampler import processed_logits, sample
from engine.backends.sampling_batch import RowSpec, SamplingBatch
from engine.sampling import SamplingParams
from tests.test_sampling import random_logits, random_params, rng  # noqa: F401 (rng: fixture)


def pack(allowed: np.ndarray) -> np.ndarray:
    """bool [R, V] -> the packed uint32 mask [R, ceil(V/32)] (bit t % 32 of word t // 32)."""
    R, V = allowed.shape
    W = (V + 31) // 32
    padded = np.zeros((R, W * 32), bool)
    padded[:, :V] = allowed
    return np.packbits(padded.reshape(R, W, 4, 8), axis=-1, bitorder="little").reshape(R, W * 4).view(np.uint32)


def random_allowed(rng, R, V):
    """Masks of every kind: a handful of tokens, about half, all but a few, one token, a block edge."""
    out = np.zeros((R, V), bool)
    for r in range(R):
        kind = r % 5
        if kind == 0:
            out[r, rng.choice(V, 5, replace=False)] = True
        elif kind == 1:
            out[r] = rng.random(V) < 0.5
        elif kind == 2:
            out[r] = True
            out[r, rng.choice(V, 7, replace=False)] = False
        elif kind == 3:
            out[r, rng.integers(0, V)] = True
        else:
            out[r, 31:33] = True
    return out


def test_pack_matches_llguidance_layout():
    allowed = np.zeros((1, 70), bool)
    allowed[0, [0, 31, 32, 69]] = True
    words = pack(allowed)[0]
    assert words.tolist() == [1 | (1 << 31), 1, 1 << 5]


@pytest.mark.parametrize("V", [40, 257, 5000])
def test_a_masked_row_never_samples_a_disallowed_token(rng, V):  # noqa: F811
    S = 40
    logits = random_logits(rng, S, V)
    allowed = random_allowed(rng, S, V)
    # the disallowed tokens are made the most likely ones, and biased up: the mask must still win
    logits[~allowed] += 50.0
    rows = []
    for i in range(S):
        p = random_params(rng, temperature=float(rng.choice([0.0, 0.5, 1.0, 5.0, 100.0])),
                          logit_bias={int(rng.integers(0, V)): 100.0}, presence_penalty=-2.0)
        rows.append(RowSpec(p, seed=int(rng.integers(0, 2**62)), step=int(rng.integers(0, 50)), allowed_row=i,
                            output_token_ids=[int(rng.integers(0, V))]))
    batch = SamplingBatch.build(rows, pack(allowed))
    for step in range(5):
        batch.step[:] += 1
        res = sample(logits, batch)
        assert allowed[np.arange(S), res.token_ids].all(), (rng.seed, step)
    w = processed_logits(logits, batch)
    assert np.isneginf(w[~allowed]).all()


def test_unmasked_rows_are_bit_identical_to_a_batch_without_masks(rng):  # noqa: F811
    S, V = 24, 3000
    logits = random_logits(rng, S, V)
    params = [random_params(rng, logprobs=3) for _ in range(S)]
    seeds = [int(rng.integers(0, 2**62)) for _ in range(S)]
    plain = sample(logits, SamplingBatch.build([RowSpec(p, seed=s, step=4) for p, s in zip(params, seeds)]))
    # every third row constrained (its own mask row), the others untouched
    allowed = random_allowed(rng, S // 3, V)
    rows = [RowSpec(p, seed=s, step=4, allowed_row=i // 3 if i % 3 == 0 else -1)
            for i, (p, s) in enumerate(zip(params, seeds))]
    mixed = sample(logits, SamplingBatch.build(rows, pack(allowed)))
    free = np.arange(S) % 3 != 0
    assert np.array_equal(mixed.token_ids[free], plain.token_ids[free])
    assert np.array_equal(mixed.logprobs[free].view(np.uint32), plain.logprobs[free].view(np.uint32))
    assert np.array_equal(mixed.top_token_ids[free], plain.top_token_ids[free])
    assert np.array_equal(mixed.top_logprobs[free].view(np.uint32), plain.top_logprobs[free].view(np.uint32))
    assert allowed[np.arange(S)[~free] // 3, mixed.token_ids[~free]].all()


def test_a_short_mask_bans_the_tokens_past_it_and_a_bad_row_is_refused():
    V = 100
    logits = np.zeros((1, V), np.float32)
    logits[0, 90] = 10.0
    mask = np.full((1, 2), 0xFFFFFFFF, np.uint32)     # covers 64 tokens of 100
    batch = SamplingBatch.build([RowSpec(SamplingParams(temperature=0), seed=0, step=0, allowed_row=0)], mask)
    with pytest.raises(ValueError, match="mask covers 64 tokens"):
        sample(logits, batch)
    with pytest.raises(ValueError, match="past the mask"):
        SamplingBatch.build([RowSpec(SamplingParams(), seed=0, step=0, allowed_row=1)], mask)
