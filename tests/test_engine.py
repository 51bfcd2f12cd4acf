"""The engine on a tiny random Llama: batching, prefix caching, preemption, priorities, aborts."""
from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig
from engine.engine import Engine, RequestError
from engine.protocol import LatencyClass
from engine.request import EngineRequest
from engine.sampling import SamplingParams
from tests.node_fixtures import wait_for
from engine.scheduler import SchedulerConfig


def make_engine(path, num_blocks=64, block_size=4, max_num_seqs=None, max_batched=64, **kw) -> Engine:
    max_num_seqs = min(16, max_batched) if max_num_seqs is None else max_num_seqs   # a step's budget bounds the batch
    probe = Engine.__new__(Engine)  # bytes per block depend on the model: compute from a real engine
    del probe
    eng = Engine(EngineConfig(model=path, backend="cpu", block_size=block_size, kv_cache_bytes=1 << 20,
                              scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_batched,
                                                        **kw)))
    if num_blocks != eng.pool.num_blocks:
        eng = Engine(EngineConfig(
            model=path, backend="cpu", block_size=block_size,
            kv_cache_bytes=num_blocks * eng.model.kv_bytes_per_block(block_size),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_batched, **kw)))
    assert eng.pool.num_blocks == num_blocks
    return eng


def prompt(seed, n):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 250, n)]


def run(eng: Engine, requests, abort_at=None):
    """Drive the engine to completion; returns {request_id: {index: (token_ids, finish_reason, text)}}."""
    out = {}
    for r in requests:
        eng.add_request(r)
    steps = 0
    while eng.has_unfinished():
        for d in eng.step():
            tok, _, text = out.setdefault(d.request_id, {}).get(d.index, ([], None, ""))
            out[d.request_id][d.index] = (tok + d.token_ids, d.finish_reason, text + d.text)
        steps += 1
        if abort_at and steps in abort_at:
            for rid in abort_at[steps]:
                eng.abort(rid)
        assert steps < 10_000
    eng.pool.check_invariants([])
    assert eng.pool.usage == 0.0
    return out


def req(rid, toks, cls=LatencyClass.STANDARD, **sp):
    sp.setdefault("max_tokens", 8)
    sp.setdefault("temperature", 0.0)
    return EngineRequest(rid, "tiny", toks, SamplingParams(**sp), cls)


@pytest.fixture(scope="module")
def engine(tiny_gguf):
    return make_engine(tiny_gguf)


def test_generates_and_frees_everything(engine):
    out = run(engine, [req("a", prompt(1, 9)), req("b", prompt(2, 30), max_tokens=5)])
    assert len(out["a"][0][0]) == 8 and out["a"][0][1] == "length"
    assert len(out["b"][0][0]) == 5


@pytest.mark.parametrize("sp", [dict(temperature=0.0), dict(temperature=0.9, top_p=0.9, seed=1234)])
def test_tokens_identical_alone_or_in_any_batch(tiny_gguf, sp):
    target = req("t", prompt(7, 13), max_tokens=12, **sp)
    alone = run(make_engine(tiny_gguf), [target])["t"][0][0]
    others = [req(f"o{i}", prompt(100 + i, 3 + 7 * i), max_tokens=4 + i, temperature=1.0) for i in range(6)]
    target2 = req("t", prompt(7, 13), max_tokens=12, **sp)
    in_batch = run(make_engine(tiny_gguf, max_batched=24), others[:3] + [target2] + others[3:])["t"][0][0]
    assert alone == in_batch


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_a_quantized_models_logprobs_are_the_same_alone_or_in_any_batch(tmp_path, fmt):
    """The int8 kernels round each activation row the same way in a step of 13 rows or of 40: a seeded
    request's tokens must not depend on the batch (a row's block sums came out a bit apart past 16 rows)."""
    from tests.tiny_model import make_tiny_tokenizer, make_tiny_weights, write_tiny_gguf
    path = write_tiny_gguf(tmp_path / f"tiny-{fmt}.gguf", make_tiny_weights(seed=1).converted(fmt),
                           make_tiny_tokenizer())

    def target_logprobs(eng: Engine, others: list) -> list:
        for r in others + [req("t", prompt(7, 13), max_tokens=6, temperature=1.0, seed=77, logprobs=3)]:
            eng.add_request(r)
        seen = []
        while eng.has_unfinished():
            seen += [(e.token_id, e.logprob, e.top) for d in eng.step() if d.request_id == "t" for e in d.logprobs]
        return seen
    alone = target_logprobs(make_engine(path), [])
    others = [req(f"o{i}", prompt(100 + i, 9 + 7 * i), max_tokens=4, temperature=1.0) for i in range(4)]
    in_batch = target_logprobs(make_engine(path, max_batched=64), others)
    assert len(alone) == 6 and alone == in_batch


def test_top_p_zero_is_the_greedy_choice(tiny_gguf):
    greedy = run(make_engine(tiny_gguf), [req("g", prompt(7, 13), max_tokens=12, temperature=0.0)])["g"][0][0]
    nucleus = run(make_engine(tiny_gguf), [req("z", prompt(7, 13), max_tokens=12, temperature=1.5, top_p=0,
                                               seed=5)])["z"][0][0]
    assert nucleus == greedy


def test_prefix_cache_hit_gives_the_same_logprobs_as_a_miss(tiny_gguf):
    eng = make_engine(tiny_gguf)
    shared = prompt(3, 21)
    first = run(eng, [req("miss", shared, logprobs=5, max_tokens=6)])
    hits_before = eng.pool.prefix_hit_tokens
    eng2 = make_engine(tiny_gguf)
    cold = run(eng2, [req("cold", shared, logprobs=5, max_tokens=6)])
    second = run(eng, [req("hit", shared, logprobs=5, max_tokens=6)])
    assert eng.pool.prefix_hit_tokens - hits_before == 20  # five full blocks of 4
    assert second["hit"][0][0] == first["miss"][0][0] == cold["cold"][0][0]


def test_prefix_hit_logprobs_equal(tiny_gguf):
    eng = make_engine(tiny_gguf)
    shared = prompt(4, 17)
    lp = []
    for rid in ("x", "y"):
        eng.add_request(req(rid, shared, logprobs=4, max_tokens=3))
        got = []
        while eng.has_unfinished():
            for d in eng.step():
                got += d.logprobs
        lp.append([(e.token_id, e.logprob, e.top) for e in got])
    assert eng.pool.prefix_hit_tokens == 16
    assert lp[0] == lp[1]


def test_realtime_first_token_before_earlier_batch_requests(tiny_gguf):
    eng = make_engine(tiny_gguf, max_num_seqs=2, max_batched=16)
    reqs = [req(f"b{i}", prompt(10 + i, 12), LatencyClass.BATCH, max_tokens=3) for i in range(6)]
    reqs += [req(f"r{i}", prompt(20 + i, 12), LatencyClass.REALTIME, max_tokens=3) for i in range(2)]
    first = {}
    for r in reqs:
        eng.add_request(r)
    step = 0
    while eng.has_unfinished():
        step += 1
        for d in eng.step():
            if d.token_ids:
                first.setdefault(d.request_id, step)
    assert max(first[f"r{i}"] for i in range(2)) < min(first[f"b{i}"] for i in range(6))


def _with_a_late_request(eng, late, steps_before):
    """Step `steps_before` times, add `late`, run everything: {request_id: (step of its first token, step
    it finished, its tokens)}, steps counted from late's arrival."""
    seen, step = {}, 0
    for _ in range(steps_before):
        for d in eng.step():
            seen.setdefault(d.request_id, [None, None, []])[2].extend(d.token_ids)
    eng.add_request(late)
    while eng.has_unfinished():
        step += 1
        for d in eng.step():
            entry = seen.setdefault(d.request_id, [None, None, []])
            entry[2].extend(d.token_ids)
            if d.token_ids and entry[0] is None:
                entry[0] = step
            if d.finished:
                entry[1] = step
    eng.pool.check_invariants([])
    return seen


@pytest.mark.parametrize("short_of", ["slots", "blocks"])
def test_a_realtime_request_preempts_batch_decodes_in_progress(tiny_gguf, short_of):
    """A realtime request arriving while batch streams decode starts at once: a batch sequence is
    preempted (and recomputed later, its tokens unchanged), though it was already decoding."""
    slots = short_of == "slots"
    def batch():
        return [req(f"b{i}", prompt(40 + i, 8), LatencyClass.BATCH, max_tokens=30 if slots else 24,
                    temperature=1.0, seed=i) for i in range(2)]
    eng = make_engine(tiny_gguf, num_blocks=64 if slots else 20, max_batched=64, max_num_seqs=2 if slots else 16)
    for r in batch():
        eng.add_request(r)
    late = req("rt", prompt(99, 8 if slots else 44), LatencyClass.REALTIME, max_tokens=2, temperature=1.0, seed=5)
    seen = _with_a_late_request(eng, late, steps_before=2 if slots else 10)
    assert seen["rt"][0] == 1 and seen["rt"][1] < min(seen["b0"][1], seen["b1"][1])
    assert eng.num_preemptions >= 1
    alone = run(make_engine(tiny_gguf), batch())
    assert [seen[f"b{i}"][2] for i in range(2)] == [alone[f"b{i}"][0][0] for i in range(2)]


def test_a_request_waiting_for_blocks_is_one_prefix_cache_query(tiny_gguf):
    eng = make_engine(tiny_gguf, num_blocks=20, max_batched=64)
    for i in range(2):
        eng.add_request(req(f"b{i}", prompt(40 + i, 8), max_tokens=24))
    seen = _with_a_late_request(eng, req("late", prompt(99, 44), max_tokens=2), steps_before=10)
    assert seen["late"][0] > 1                        # it waited for blocks, step after step
    assert eng.pool.prefix_query_tokens == 8 + 8 + 44  # each prompt once, as it was admitted


def test_a_short_prompt_starts_before_a_long_prefill_ends(tiny_gguf):
    """Chunked prefill shares the step: a short prompt arriving while a long one is being prefilled
    gets its first token within a step or two, not after the long prompt's whole prefill."""
    eng = make_engine(tiny_gguf, num_blocks=96, max_batched=16)
    eng.add_request(req("long", prompt(70, 120), max_tokens=2))
    eng.add_request(req("long2", prompt(72, 120), max_tokens=2))   # two long prompts share the half
    first_token = {}
    steps = 0
    while eng.has_unfinished():
        if steps == 1:
            eng.add_request(req("short", prompt(71, 4), max_tokens=2))
        steps += 1
        for d in eng.step():
            if d.token_ids:
                first_token.setdefault(d.request_id, steps)
    assert first_token["short"] <= 3, first_token          # ~15 steps of 16 tokens for the long prompts
    assert first_token["short"] < min(first_token["long"], first_token["long2"]), first_token
    eng.pool.check_invariants([])


def _prefill_chunks(requests, steps=4, budget=256, prefix_caching=True):
    """The scheduler alone (no model): the tokens each sequence gets at each step."""
    from engine.kv_cache import BlockPool, KVCacheManager
    from engine.scheduler import Scheduler
    from engine.sequence import Sequence
    kv = KVCacheManager(BlockPool(1000), 16, "m", enable_prefix_caching=prefix_caching)
    sched = Scheduler(SchedulerConfig(max_num_seqs=min(64, budget), max_num_batched_tokens=budget), kv)
    arrivals = {}   # step -> the sequences that arrive then
    for r, start_step in requests:
        leader = None
        for i in range(r.sampling.n):
            seq = Sequence(len(arrivals.get(start_step, [])) + 100 * start_step, r, i, 0)
            seq.prefill_leader = leader
            leader = leader or seq
            arrivals.setdefault(start_step, []).append(seq)
    out = []
    for step in range(steps):
        for seq in arrivals.get(step, []):
            sched.add(seq)
        scheduled = sched.schedule(now=0.0).scheduled
        out.append({seq.request.request_id + f"/{seq.index}": n for seq, n in scheduled})
        for seq, n in scheduled:
            seq.num_computed_tokens += n
            kv.cache_computed_blocks(seq)
            if seq.num_computed_tokens >= seq.num_tokens:
                seq.append_token(5)
    return out


def test_prompts_keep_the_whole_budget_when_nothing_else_could_start():
    """The half-budget bound on running prompts applies only while another request could start now:
    not for an n > 1 sibling waiting for its leader's prompt, nor for a lower-priority request."""
    n2 = EngineRequest("n2", "m", list(range(1, 1001)), SamplingParams(n=2), LatencyClass.STANDARD)
    steps = _prefill_chunks([(n2, 0)])
    assert [s.get("n2/0") for s in steps] == [256, 256, 256, 232], steps
    def rt():
        return EngineRequest("rt", "m", list(range(1, 1001)), SamplingParams(), LatencyClass.REALTIME)

    batch = EngineRequest("b", "m", list(range(2001, 2030)), SamplingParams(), LatencyClass.BATCH)
    steps = _prefill_chunks([(rt(), 0), (batch, 1)], steps=2)
    assert steps[1] == {"rt/0": 256}, steps                     # the batch request waits a step
    other = EngineRequest("o", "m", list(range(2001, 2030)), SamplingParams(), LatencyClass.REALTIME)
    steps = _prefill_chunks([(rt(), 0), (other, 1)], steps=2)
    assert steps[1] == {"rt/0": 128, "o/0": 29}, steps          # an equal-priority one starts at once


def test_n_siblings_wait_for_their_leaders_prompt_only_where_a_prefix_cache_would_share_it():
    n2 = EngineRequest("n2", "m", list(range(1, 1001)), SamplingParams(n=2), LatencyClass.STANDARD)
    steps = _prefill_chunks([(n2, 0)], steps=2, prefix_caching=False)
    assert steps[1] == {"n2/0": 128, "n2/1": 128}, steps      # with the cache: n2/0 alone (above)


def test_a_preempted_stream_ages_by_its_time_in_the_queue_not_the_time_it_ran():
    """A batch stream decodes for 20 s, a realtime request preempts it, it comes back after 0.5 s in the
    queue: it is still batch, so the next realtime request preempts it again (counted as queue time, its
    20 s of running would have lifted it to realtime). Its re-admission is no second prefix-cache query."""
    from engine.kv_cache import BlockPool, KVCacheManager
    from engine.scheduler import Scheduler
    from engine.sequence import Sequence
    kv = KVCacheManager(BlockPool(100), 16, "m")
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, starvation_s=5.0), kv)

    def arrive(rid, cls, at):
        seq = Sequence(len(rid) + int(at * 10), EngineRequest(rid, "m", list(range(1, 9)),
                                                              SamplingParams(max_tokens=100), cls, arrival_time=at), 0, 0)
        sched.add(seq)
        return seq

    def step(now):
        out = sched.schedule(now=now)
        for seq, n in out.scheduled:
            seq.num_computed_tokens += n
            if seq.num_computed_tokens >= seq.num_tokens:
                seq.append_token(5)
        return out

    batch = arrive("batch", LatencyClass.BATCH, 0.0)
    for t in range(21):
        step(float(t))
    first = arrive("rt1", LatencyClass.REALTIME, 20.5)
    assert step(20.5).preempted == [batch]
    sched.finish(first, "stop")
    step(21.0)
    assert sched.running == [batch]
    arrive("rt2", LatencyClass.REALTIME, 21.5)
    assert step(21.5).preempted == [batch]
    assert kv.pool.prefix_query_tokens == 3 * 8


def _schedule_arrivals(kv, config: SchedulerConfig, requests: list, arrivals: list):
    """Requests (id, class, prompt tokens) scheduled step by step as they arrive (their ids per step), each
    step's work taken as done; (scheduler, sequences by id, the last step's output)."""
    from engine.scheduler import Scheduler
    from engine.sequence import Sequence
    sched = Scheduler(config, kv)
    seqs = {rid: Sequence(i, EngineRequest(rid, "m", list(range(100 * i, 100 * i + n)), SamplingParams(), cls,
                                           arrival_time=0.0), 0, 0)
            for i, (rid, cls, n) in enumerate(requests)}
    for arriving in arrivals:
        for rid in arriving:
            sched.add(seqs[rid])
        out = sched.schedule(now=0.0)
        for seq, n in out.scheduled:
            seq.num_computed_tokens += n
            if seq.num_computed_tokens >= seq.num_tokens:
                seq.append_token(5)
    return sched, seqs, out


def test_no_stream_is_preempted_for_a_request_that_would_still_not_fit():
    """A realtime prompt needs 11 blocks; 6 are free and the batch stream holds 4 (the realtime one
    holds the rest): preempting the batch stream would not admit it, so the stream keeps running."""
    from engine.kv_cache import BlockPool, KVCacheManager
    from engine.sequence import Sequence
    kv = KVCacheManager(BlockPool(20), 4, "m")
    sched, seqs, out = _schedule_arrivals(kv, SchedulerConfig(), [("rt", LatencyClass.REALTIME, 36),
                                                                  ("batch", LatencyClass.BATCH, 14),
                                                                  ("late", LatencyClass.REALTIME, 44)],
                                          [["rt", "batch"], ["late"]])
    assert out.preempted == [] and sched.running == [seqs["rt"], seqs["batch"]] and sched.waiting == [seqs["late"]]
    assert kv.pool.num_free_blocks == 6 and kv.blocks_freed_by([seqs["batch"]]) == 4
    # a block two sequences share goes back only when both are freed
    a, b = (Sequence(10 + i, EngineRequest(f"s{i}", "m", list(range(8)), SamplingParams()), 0, 0) for i in range(2))
    assert kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    kv.cache_computed_blocks(a)
    cached, _ = kv.find_cached_prefix(b)
    assert len(cached) == 1 and kv.allocate_slots(b, 4, cached)
    assert kv.blocks_freed_by([a]) == 1 and kv.blocks_freed_by([b]) == 1 and kv.blocks_freed_by([a, b]) == 3


def test_no_stream_is_preempted_for_a_batch_slot_when_its_blocks_would_still_not_admit_the_request():
    """Two slots, both running (a realtime prompt of 40 tokens, a batch stream of 4): a realtime request of
    30 tokens needs 8 blocks, more than the batch stream's and the free ones, so it keeps its slot."""
    from engine.kv_cache import BlockPool, KVCacheManager
    kv = KVCacheManager(BlockPool(16), 4, "m", enable_prefix_caching=False)
    sched, seqs, out = _schedule_arrivals(kv, SchedulerConfig(max_num_seqs=2), [("rt", LatencyClass.REALTIME, 40),
                                                                              ("batch", LatencyClass.BATCH, 4),
                                                                              ("late", LatencyClass.REALTIME, 30)],
                                          [["rt", "batch"], [], ["late"]])
    assert out.preempted == [] and sched.running == [seqs["rt"], seqs["batch"]] and sched.waiting == [seqs["late"]]
    assert (seqs["batch"], 1) in out.scheduled
    assert kv.pool.num_free_blocks + kv.blocks_freed_by([seqs["batch"]]) < 8


def test_within_a_class_the_org_with_fewer_sequences_in_service_starts_first():
    """Two batch slots; org a's request of four prompts came first, b's and c's after: the slots go in
    turns (a, b, a, c, a, a), not to all of a's prompts first; a realtime request of a's still goes
    before every standard one."""
    from engine.kv_cache import BlockPool, KVCacheManager
    from engine.scheduler import Scheduler
    from engine.sequence import Sequence
    sched = Scheduler(SchedulerConfig(max_num_seqs=2), KVCacheManager(BlockPool(64), 4, "m"))

    def arrive(i, org, t, cls=LatencyClass.STANDARD):
        seq = Sequence(i, EngineRequest(f"{org}{i}", "m", list(range(10 * i, 10 * i + 4)), SamplingParams(), cls,
                                        org=org, arrival_time=t), 0, 0)
        sched.add(seq)
        return seq

    for i, (org, t) in enumerate([("a", 0.0)] * 4 + [("b", 1.0), ("c", 2.0)]):
        arrive(i, org, t)
    started = []
    for step in range(7):
        if step == 3:
            arrive(9, "a", 3.0, LatencyClass.REALTIME)
        sched.schedule(now=4.0)
        started += [s.request.request_id for s in sched.running if s.request.request_id not in started]
        sched.finish(sched.running[0], "stop")   # one slot frees a step
    assert started == ["a0", "b4", "a1", "c5", "a9", "a2", "a3"]
    # a preempted stream resumes before a newer request of an org with less in service
    from engine.scheduler import SchedulerOutput
    first, second = arrive(10, "a", 5.0), arrive(11, "a", 5.0)
    sched.schedule(now=6.0)
    assert sched.running == [first, second]
    sched._preempt(first, SchedulerOutput(), 6.0)
    late = arrive(12, "b", 7.0)
    sched.schedule(now=8.0)
    assert sched.running == [second, first] and sched.waiting == [late]


def test_batch_work_is_not_starved(tiny_gguf):
    eng = make_engine(tiny_gguf, max_num_seqs=1, max_batched=16, starvation_s=0.05)
    eng.add_request(req("batch", prompt(30, 8), LatencyClass.BATCH, max_tokens=2))
    time.sleep(0.12)   # the batch request ages past two starvation periods: it now ranks as realtime
    for i in range(3):
        eng.add_request(req(f"std{i}", prompt(31 + i, 8), LatencyClass.STANDARD, max_tokens=2))
    order = []
    while eng.has_unfinished():
        for d in eng.step():
            if d.finished:
                order.append(d.request_id)
    assert order[0] == "batch"


def test_a_batch_stream_running_longer_than_the_starvation_period_still_yields_to_realtime(tiny_gguf):
    """Aging lifts a request by its time in the queue: a batch sequence admitted at once and decoding
    for several starvation periods stays batch, so a realtime request preempts it."""
    eng = make_engine(tiny_gguf, max_num_seqs=1, starvation_s=0.05)
    eng.add_request(req("batch", prompt(30, 8), LatencyClass.BATCH, max_tokens=200, ignore_eos=True))
    eng.step()                 # admitted without waiting
    time.sleep(0.15)           # three starvation periods of decoding
    eng.add_request(req("rt", prompt(31, 8), LatencyClass.REALTIME, max_tokens=2))
    order = []
    while eng.has_unfinished():
        order += [d.request_id for d in eng.step() if d.finished]
    assert order == ["rt", "batch"] and eng.num_preemptions >= 1


def test_preempted_sequences_finish_with_the_same_tokens(tiny_gguf):
    reqs = lambda: [req(f"p{i}", prompt(40 + i, 10), max_tokens=20, temperature=0.8, seed=i) for i in range(4)]  # noqa: E731
    roomy = run(make_engine(tiny_gguf, num_blocks=64), reqs())
    eng = make_engine(tiny_gguf, num_blocks=12)   # 4 x (10 + 20) tokens need 32 blocks of 4
    tight = run(eng, reqs())
    assert eng.num_preemptions > 0, "the tight pool should have forced preemptions"
    assert tight == roomy


def test_preemption_happens_under_pressure(tiny_gguf):
    eng = make_engine(tiny_gguf, num_blocks=12)
    seqs = []
    for i in range(4):
        eng.add_request(req(f"q{i}", prompt(50 + i, 10), max_tokens=20))
        seqs += eng._requests[f"q{i}"]
    preempted = 0
    while eng.has_unfinished():
        eng.step()
        preempted = max(preempted, sum(s.num_preemptions for s in seqs))
    assert preempted > 0 and eng.num_preemptions >= preempted
    assert all(s.finish_reason == "length" and s.num_output_tokens == 20 for s in seqs)
    eng.pool.check_invariants([])


def test_abort_in_every_state_frees_blocks_at_once(tiny_gguf):
    eng = make_engine(tiny_gguf, max_num_seqs=1, max_batched=8)
    eng.add_request(req("running", prompt(60, 6), max_tokens=50))
    eng.add_request(req("prefilling", prompt(61, 40), max_tokens=5))
    eng.add_request(req("waiting", prompt(62, 6), max_tokens=5))
    eng.step()
    eng.step()
    states = {rid: eng._requests[rid][0].status.value for rid in ("running", "prefilling", "waiting")}
    assert states["running"] == "running"
    for rid in ("waiting", "running"):
        d = eng.abort(rid)
        assert d and all(x.finish_reason == "abort" for x in d)
    eng.step()   # "prefilling" is admitted now and computes its first chunk
    seq = eng._requests["prefilling"][0]
    assert 0 < seq.num_computed_tokens < seq.num_prompt_tokens
    eng.abort("prefilling")
    eng.pool.check_invariants([])
    assert eng.pool.usage == 0.0 and not eng.has_unfinished()


def test_an_abort_finishes_only_the_sequences_still_running(tiny_gguf):
    eng = make_engine(tiny_gguf)
    eng.add_request(req("n", prompt(63, 6), n=2, temperature=1.0, seed=4, max_tokens=20))
    while not all(s.num_output_tokens for s in eng._requests["n"]):
        eng.step()
    first, second = eng._requests["n"]
    eng.scheduler.finish(first, "stop")   # as a stop string would: its finished delta went out then
    assert [(d.index, d.finish_reason) for d in eng.abort("n")] == [(second.index, "abort")]
    eng.pool.check_invariants([])


def test_the_offline_api_drops_a_batch_whose_prompt_cannot_be_read(tiny_gguf):
    from engine.llm import LLM
    llm = LLM(model=tiny_gguf, kv_cache_bytes=1 << 20, block_size=4)
    p = SamplingParams(max_tokens=3, temperature=0.0)
    with pytest.raises(TypeError):
        llm.generate(["Hello", None], p)
    assert not llm.engine.has_unfinished()   # "Hello", queued before it, went too
    (out,) = llm.generate("Hi", p)
    assert len(out.outputs[0].token_ids) == 3


def test_queue_deadline_finishes_with_timeout(tiny_gguf):
    eng = make_engine(tiny_gguf, max_num_seqs=1, max_batched=8)
    eng.add_request(req("busy", prompt(70, 6), max_tokens=30))
    r = req("late", prompt(71, 6), max_tokens=3)
    r.queue_timeout_s = 0.01
    eng.add_request(r)
    eng.step()
    time.sleep(0.02)
    out = run(eng, [])
    assert eng._requests == {}
    late = [d for d in out.get("late", {}).values()]
    assert late and late[0][1] == "timeout"


def test_n_sequences_share_the_prompt_blocks(tiny_gguf):
    eng = make_engine(tiny_gguf)
    out = run(eng, [req("n", prompt(80, 17), n=3, temperature=1.0, seed=5, max_tokens=6)])
    assert sorted(out["n"]) == [0, 1, 2]
    assert eng.pool.prefix_hit_tokens == 2 * 16      # children reuse the leader's 4 full blocks
    assert len({tuple(v[0]) for v in out["n"].values()}) > 1


def test_stop_strings_min_tokens_and_ignore_eos(tiny_gguf):
    eng = make_engine(tiny_gguf)
    base = run(eng, [req("base", prompt(90, 8), max_tokens=30, ignore_eos=True)])["base"][0]
    text = base[2]
    assert len(base[0]) == 30 and base[1] == "length"
    stop = text[5:8]
    assert stop
    cut = run(eng, [req("cut", prompt(90, 8), max_tokens=30, ignore_eos=True, stop=[stop])])["cut"][0]
    assert cut[1] == "stop" and cut[2] == text[:text.index(stop)]
    # the first token that did not occur before position 2: masking it there changes nothing greedy picks
    at = next(i for i in range(2, 30) if base[0][i] not in base[0][:i])
    stop_id = base[0][at]
    by_id = run(eng, [req("id", prompt(90, 8), max_tokens=30, ignore_eos=True, stop_token_ids=[stop_id],
                          min_tokens=2)])["id"][0]
    assert by_id[1] == "stop" and by_id[0] == base[0][:at + 1]
    # the stop token's own text is not in the output, as a stop string's is not
    before = run(eng, [req("before", prompt(90, 8), max_tokens=at, ignore_eos=True)])["before"][0]
    assert by_id[2] == before[2] and before[0] == base[0][:at]
    # under min_tokens a stop string does not stop the sequence either
    late = run(eng, [req("late", prompt(90, 8), max_tokens=30, ignore_eos=True, stop=[stop],
                         min_tokens=len(cut[0]) + 1)])["late"][0]
    assert len(late[0]) > len(cut[0]) and late[2].startswith(text[:text.index(stop) + len(stop)])


def test_include_stop_str_in_output_keeps_the_stop_string_and_nothing_after_it(tiny_gguf):
    eng = make_engine(tiny_gguf)
    base = run(eng, [req("base", prompt(90, 8), max_tokens=30, ignore_eos=True)])["base"][0]
    text = base[2]
    stop = text[5:8]
    kept = run(eng, [req("kept", prompt(90, 8), max_tokens=30, ignore_eos=True, stop=[stop],
                         include_stop_str_in_output=True)])["kept"][0]
    end = text.index(stop) + len(stop)
    assert kept[1] == "stop" and kept[2] == text[:end]
    # generation ends at the same token as without the option: the one whose text completed the stop string
    cut = run(eng, [req("cut", prompt(90, 8), max_tokens=30, ignore_eos=True, stop=[stop])])["cut"][0]
    assert kept[0] == cut[0] == base[0][:len(kept[0])] and kept[2] == cut[2] + stop


def test_a_stop_string_begun_under_min_tokens_stops_once_it_ends_after_them(tiny_gguf):
    eng = make_engine(tiny_gguf)
    c = 3 + ord("c")   # the tiny tokenizer's byte token for "c": greedy emits it every step with this bias
    for min_tokens in (0, 2, 3, 4, 6):
        tokens, finish, text = run(eng, [req("m", prompt(3, 6), max_tokens=10, logit_bias={c: 100.0},
                                             stop=["ccc"], min_tokens=min_tokens)])["m"][0]
        # the first "ccc" that ends once min_tokens are out stops it; the text before it is kept
        assert (finish, len(tokens), text) == ("stop", max(3, min_tokens), "c" * max(0, min_tokens - 3))


def test_a_request_whose_first_sequence_started_does_not_time_out_in_the_queue(tiny_gguf):
    eng = make_engine(tiny_gguf, max_batched=8)
    r = req("n", prompt(72, 40), n=2, temperature=1.0, seed=3, max_tokens=4)
    r.queue_timeout_s = 0.05
    eng.add_request(r)
    eng.step()   # the first sequence starts its prompt; the second waits for it (5 chunks of 8)
    time.sleep(0.1)
    out = run(eng, [])
    assert sorted(out["n"]) == [0, 1] and [out["n"][i][1] for i in (0, 1)] == ["length", "length"]


def test_a_padded_model_never_samples_past_its_tokenizer(tmp_path):
    from tests.tiny_model import TINY_VOCAB, make_tiny_tokenizer, make_tiny_weights, write_tiny_safetensors
    path = write_tiny_safetensors(tmp_path / "padded", make_tiny_weights(seed=2, vocab=TINY_VOCAB + 16),
                                  make_tiny_tokenizer())
    eng = make_engine(path)
    assert eng.model_config.vocab_size == TINY_VOCAB + 16 and eng.num_text_tokens == TINY_VOCAB
    padding = TINY_VOCAB + 3
    out = run(eng, [req("biased", prompt(5, 6), max_tokens=6, ignore_eos=True, logit_bias={padding: 100.0},
                        temperature=1.0, seed=1, logprobs=3)])
    tokens, reason, _ = out["biased"][0]
    assert reason == "length" and len(tokens) == 6 and max(tokens) < TINY_VOCAB
    with pytest.raises(RequestError) as e:   # a prompt id the tokenizer does not have
        eng.add_request(req("pad-prompt", [5, padding, 7]))
    assert e.value.param == "prompt"


def test_a_default_max_tokens_is_cut_to_what_the_prompt_leaves(engine):
    toks = prompt(81, 10)
    r = req("default", toks, max_tokens=10_000, max_tokens_default=True)
    engine.add_request(r)
    room = min(engine.max_model_len, engine.max_seq_tokens) - len(toks)
    assert r.sampling.max_tokens == room
    engine.abort("default")
    with pytest.raises(RequestError) as e:   # the client's own max_tokens is refused, not cut
        engine.add_request(req("own", toks, max_tokens=room + 1))
    assert e.value.param == "max_tokens"


@pytest.mark.parametrize("bad, param", [
    (dict(toks=[]), "prompt"),
    (dict(toks=[10] * 600), "prompt"),
    (dict(max_tokens=10_000), "max_tokens"),
    (dict(toks=[10**7]), "prompt"),
    (dict(toks=[10] * 10, max_tokens=300), "max_tokens"),   # fits the context (512), not the pool (256)
    (dict(toks=[10] * 10, max_tokens=None, min_tokens=300), "min_tokens"),   # nor can min_tokens
])
def test_bad_requests_fail_at_add_request(engine, bad, param):
    toks = bad.pop("toks", [5, 6, 7])
    with pytest.raises(RequestError) as e:
        engine.add_request(req("bad", toks, **bad))
    assert e.value.param == param
    assert not engine.has_unfinished() and "bad" not in engine._requests


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 3), st.booleans(),
                          st.integers(0, 8)), min_size=1, max_size=8))
def test_no_block_leaks_or_double_frees(tiny_gguf_engine_small, spec):
    eng = tiny_gguf_engine_small
    live = {}
    abort_at = {}
    for i, (plen, max_tokens, cls, abort, when) in enumerate(spec):
        rid = f"h{i}"
        eng.add_request(req(rid, prompt(i, plen), LatencyClass(cls % 3), max_tokens=max_tokens,
                            temperature=1.0, seed=i, n=1 + (plen % 2)))
        live[rid] = True
        if abort:
            abort_at.setdefault(when, []).append(rid)
    step = 0
    while eng.has_unfinished():
        for rid in abort_at.get(step, []):
            eng.abort(rid)
        eng.step()
        tables = [s.block_table for s in eng.scheduler.running + eng.scheduler.waiting]
        eng.pool.check_invariants(tables)
        step += 1
        assert step < 2000
    eng.pool.check_invariants([])
    assert eng.pool.usage == 0.0


@pytest.fixture(scope="module")
def tiny_gguf_engine_small(tiny_gguf):
    return make_engine(tiny_gguf, num_blocks=14, max_num_seqs=4, max_batched=16)


def test_a_sequence_without_max_tokens_ends_when_the_pool_is_full(tiny_gguf):
    eng = make_engine(tiny_gguf, num_blocks=12)   # 48 tokens; the model's context is 512
    out = run(eng, [req("long", prompt(95, 10), max_tokens=None, ignore_eos=True)])
    assert out["long"][0][1] == "length" and len(out["long"][0][0]) == 48 - 10



class _GilHoldingEngine:
    """Just enough of an Engine for EngineLoop: each step gives one token to request "r", and every
    step after the first holds the GIL for a while, as the CPU kernels do."""

    model_id = "stand-in"
    first_step_gate = None   # an Event the first step waits for (a test's reader gets ready first)

    def __init__(self):
        self.steps = 0
        self.step_started: list[float] = []
        self.step_ended: list[float] = []
        self.last_step_tokens = self.last_batch_size = 1
        self.pending = 0

    def validate(self, request):
        pass

    def add_request(self, request):
        self.pending = 3

    def has_request(self, request_id):
        return False

    def has_unfinished(self):
        return self.pending > 0

    def step(self):
        from engine.engine import SequenceDelta
        if not self.steps and self.first_step_gate is not None:
            self.first_step_gate.wait(10)
        self.step_started.append(time.monotonic())
        if self.steps:
            sum(range(3_000_000))          # C code that never lets the GIL go: a kernel's step
        self.steps += 1
        self.pending -= 1
        self.step_ended.append(time.monotonic())
        return [SequenceDelta("r", 0, [self.steps], str(self.steps),
                              finish_reason=None if self.pending else "length")]


class _CountingEngine:
    """Just enough of an Engine for EngineLoop: a request gets its max_tokens tokens, one per step, and
    the thread of every step is noted. With fail_at, that step raises as a kernel bug would."""

    def __init__(self, model_id: str, fail_at: int | None = None):
        self.model_id = model_id
        self.fail_at = fail_at
        self.steps = 0
        self.step_threads: set[int] = set()
        self.last_step_tokens = self.last_batch_size = 1
        self.pending: dict[str, int] = {}

    def validate(self, request):
        pass

    def add_request(self, request):
        self.pending[request.request_id] = request.sampling.max_tokens

    def has_request(self, request_id):
        return request_id in self.pending

    def has_unfinished(self):
        return bool(self.pending)

    def step(self):
        import threading

        from engine.engine import SequenceDelta
        self.steps += 1
        self.step_threads.add(threading.get_ident())
        if self.steps == self.fail_at:
            raise ValueError("a kernel bug")
        out = []
        for rid in list(self.pending):
            self.pending[rid] -= 1
            done = self.pending[rid] == 0
            if done:
                del self.pending[rid]
            out.append(SequenceDelta(rid, 0, [self.steps], "x", finish_reason="length" if done else None))
        return out


def test_a_refused_duplicate_cancels_nothing_of_the_request_that_holds_its_id(tiny_gguf):
    from engine.node.loop import EngineLoop, RequestStream
    loop = EngineLoop(make_engine(tiny_gguf))
    try:
        first = loop.submit(req("same", prompt(64, 6), max_tokens=20, ignore_eos=True))
        assert first.next_delta(timeout=30).token_ids
        # a second request with the id, refused as a duplicate: its reader leaves and cancels
        RequestStream(loop, req("same", prompt(65, 6))).cancel()
        rest = list(first)
        assert rest[-1].finish_reason == "length" and 1 + sum(len(d.token_ids) for d in rest) == 20
    finally:
        loop.stop(5)


def test_loops_on_one_step_thread_take_turns_and_fail_alone(monkeypatch):
    """Loops sharing a StepThread are all stepped, on that one thread; a loop whose step raises fails
    its own streams and leaves the thread to the others; the thread ends with its last loop and a new
    one starts for the next."""
    import threading

    from engine.node.loop import EngineLoop, StepThread

    monkeypatch.setattr(EngineLoop, "stream_yield_s", 0.0)
    steps = StepThread("engine-test-shared")
    a, b, bad = _CountingEngine("a"), _CountingEngine("b"), _CountingEngine("bad", fail_at=2)
    loops = [EngineLoop(e, thread=steps) for e in (a, b, bad)]
    try:
        streams = [loop.submit(EngineRequest(f"r-{e.model_id}", e.model_id, [1], SamplingParams(max_tokens=5)))
                   for loop, e in zip(loops, (a, b, bad))]
        assert len(list(streams[0])) == 5 and len(list(streams[1])) == 5
        with pytest.raises(RuntimeError, match="a kernel bug"):
            list(streams[2])
        assert loops[2].failed is not None and loops[0].failed is None
        assert len(a.step_threads | b.step_threads | bad.step_threads) == 1
        assert a.step_threads.isdisjoint({threading.get_ident()})
        # the failed loop is off the thread; the others still serve
        again = loops[1].submit(EngineRequest("r-b2", "b", [1], SamplingParams(max_tokens=2)))
        assert len(list(again)) == 2
        assert all(loop.stop(5) for loop in loops)
        assert not steps.alive
        late = loops[0].submit(EngineRequest("r-late", "a", [1], SamplingParams(max_tokens=2)))
        with pytest.raises(RuntimeError, match="stopped"):   # answered, never left waiting
            late.next_delta(timeout=5)
        deadline = time.monotonic() + 5   # the thread object lingers a moment after its last line
        while [t for t in threading.enumerate() if t.name == "engine-test-shared"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not [t for t in threading.enumerate() if t.name == "engine-test-shared"]
        c = _CountingEngine("c")
        loops.append(EngineLoop(c, thread=steps))
        assert steps.alive
        assert len(list(loops[-1].submit(EngineRequest("r-c", "c", [1], SamplingParams(max_tokens=3))))) == 3
    finally:
        for loop in loops:
            loop.stop(5)
    assert not steps.alive


def test_loop_counts_the_sequences_waiting_to_run():
    """num_waiting (the node's queue.waiting, which the gateway's router reads beside running) counts a
    request submitted during a step by its n, and what the engine's scheduler holds back; never a
    sequence that runs."""
    import threading

    from engine.node.loop import EngineLoop

    gate = threading.Event()

    class _BlockedEngine(_CountingEngine):
        num_waiting = 0   # the scheduler's waiting queue (new or preempted sequences)

        def step(self):
            gate.wait(10)
            return super().step()

    engine = _BlockedEngine("blocked")
    loop = EngineLoop(engine)
    try:
        first = loop.submit(EngineRequest("r1", "blocked", [1], SamplingParams(max_tokens=1)))
        deadline = time.monotonic() + 5
        while "r1" not in engine.pending:          # taken in: the step thread is now inside its step
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert loop.num_waiting == 0
        loop.submit(EngineRequest("r2", "blocked", [1], SamplingParams(max_tokens=1, n=2)))
        assert loop.num_waiting == 2
        engine.num_waiting = 3
        assert loop.num_waiting == 5
        engine.num_waiting = 0
        gate.set()
        assert len(list(first)) == 1
        while loop.num_waiting:
            assert time.monotonic() < deadline
            time.sleep(0.005)
    finally:
        gate.set()
        loop.stop(5)


def _read_on_a_thread(loop, engine: "_GilHoldingEngine", read):
    """Submit a 3-token request and run read(stream) on a thread; the first step runs once the reader
    waits for its first delta (else it might not be waiting yet when that delta comes)."""
    import threading
    engine.first_step_gate = threading.Event()
    stream = loop.submit(EngineRequest("r", "stand-in", [1], SamplingParams(max_tokens=3)))
    reader = threading.Thread(target=read, args=(stream,))
    reader.start()
    wait_for(lambda: stream.reader_waiting, what="the reader to wait")
    engine.first_step_gate.set()
    return reader


def test_the_loop_waits_for_the_reader_of_a_first_token_only(monkeypatch):
    """A request's first token: the next step waits until its reader comes back for more, even a reader
    slower than the pause between steps (it sleeps here, as a reader does that waits for a core). A later
    token: the next step does not wait for its reader."""
    from engine.node.loop import EngineLoop

    monkeypatch.setattr(EngineLoop, "stream_handoff_s", 5.0)   # ample here; a bound, never reached
    engine = _GilHoldingEngine()
    loop = EngineLoop(engine)
    written = []

    def read(stream):
        for d in stream:
            if d.token_ids[0] < 3:
                time.sleep(0.2)                # GIL released: with only the pause, step 2 would start now
            written.append(time.monotonic())   # the token is out

    try:
        _read_on_a_thread(loop, engine, read).join(10)
        assert len(written) == 3
        assert engine.step_started[1] >= written[0], "step 2 began before the first token was written"
        assert engine.step_started[2] < written[1], "step 3 waited for the reader of a later token"
    finally:
        loop.stop()


def test_a_reader_that_does_not_come_back_holds_the_loop_only_so_long(monkeypatch):
    """The wait for a first token's reader is bounded: a reader stuck after its first token (a client
    that stopped reading) costs the other streams one stream_handoff_s, and the loop goes on."""
    import threading
    from engine.node.loop import EngineLoop

    monkeypatch.setattr(EngineLoop, "stream_handoff_s", 0.1)
    engine = _GilHoldingEngine()
    loop = EngineLoop(engine)
    release = threading.Event()
    got_first = threading.Event()

    def read(stream):
        stream.next_delta(timeout=10)
        got_first.set()
        release.wait(10)                       # stuck: never asks for the next delta meanwhile

    try:
        _read_on_a_thread(loop, engine, read)
        wait_for(lambda: len(engine.step_ended) == 3, what="three steps")   # the reader still stuck
        assert got_first.is_set() and not release.is_set()
        waited = engine.step_started[1] - engine.step_ended[0]
        assert 0.1 <= waited < 2.0
    finally:
        release.set()
        loop.stop()


def test_a_stream_gets_its_token_before_the_next_step_holds_the_gil(monkeypatch):
    """The loop lets the stream thread take the GIL between steps; else the token of step 1 would
    reach its reader only once step 2's kernels had let go of it."""
    import threading
    from engine.node.loop import EngineLoop

    monkeypatch.setattr(EngineLoop, "stream_yield_s", 0.2)    # ample here; the shipped values are tuned
    monkeypatch.setattr(EngineLoop, "stream_handoff_s", 5.0)  # (token 1 goes by the hand-off if its reader waits)
    engine = _GilHoldingEngine()
    loop = EngineLoop(engine)
    try:
        stream = loop.submit(EngineRequest("r", "stand-in", [1], SamplingParams(max_tokens=3)))
        received = []
        reader = threading.Thread(target=lambda: received.extend(
            (d.token_ids[0], time.monotonic()) for d in stream))
        reader.start()
        reader.join(10)
        assert [t for t, _ in received] == [1, 2, 3]
        middle_of_step_2 = (engine.step_started[1] + engine.step_ended[1]) / 2
        assert received[0][1] < middle_of_step_2, "token 1 waited for step 2's kernels"
    finally:
        loop.stop()


def test_a_step_budget_smaller_than_the_batch_is_refused():
    """Decodes come first in a step: with fewer tokens a step than sequences in the batch, a full batch's
    decodes would take every step and no waiting request, a realtime one included, could start."""
    with pytest.raises(ValueError, match="must be at least max_num_seqs"):
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4)
    assert SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8).max_num_batched_tokens == 8


def test_a_request_id_is_refused_while_a_request_with_it_waits_to_be_added(tiny_gguf):
    """Two requests with one id before the step thread has added the first: the second is refused at
    submit (a duplicate_request_id error to its client), not failed later on a stream already answered."""
    import threading
    from engine.node.loop import EngineLoop

    loop = EngineLoop(make_engine(tiny_gguf))
    held, release = threading.Event(), threading.Event()

    def hold(engine, seconds, deltas):
        held.set()
        release.wait(10)

    loop.step_listeners.append(hold)
    try:
        loop.submit(req("blocker", prompt(90, 4), max_tokens=3))
        assert held.wait(10)                       # the step thread is held: nothing more is added
        first = loop.submit(req("dup", prompt(91, 4), max_tokens=2))
        with pytest.raises(RequestError) as err:
            loop.submit(req("dup", prompt(92, 4), max_tokens=2))
        assert err.value.code == "duplicate_request_id" and err.value.param == "request_id"
        loop.step_listeners.remove(hold)
        release.set()
        assert [d.finish_reason for d in first][-1] == "length"
        dup_again = loop.submit(req("dup", prompt(92, 4), max_tokens=2))   # free again once it ended
        assert [d.finish_reason for d in dup_again][-1] == "length"
    finally:
        release.set()
        loop.stop()


def test_a_special_token_the_text_skips_is_marked_skipped(tiny_gguf):
    """skip_special_tokens leaves a special token out of the text: its logprob entry says so (no room in the
    text for it); kept in the text, it is not marked."""
    eng = make_engine(tiny_gguf)
    special = min(eng.tokenizer.special_token_ids - set(eng.eos_token_ids))
    for skip in (True, False):
        eng.add_request(req(f"s{skip}", prompt(71, 4), max_tokens=2, logit_bias={special: 100.0}, logprobs=0,
                            skip_special_tokens=skip))
        texts, entries = [], []
        while eng.has_unfinished():
            for d in eng.step():
                texts.append(d.text)
                entries += d.logprobs
        assert [e.token_id for e in entries] == [special, special]
        assert [e.skipped for e in entries] == [skip, skip]
        assert ("".join(texts) == "") == skip


def test_the_token_completing_a_stop_string_with_none_of_its_own_text_output_ends_the_text(tiny_gguf):
    """Stop "lo!": "Hel" holds back its "l" (it may begin the stop string); "lo!" then stops, and the held
    "l" goes out, none of "lo!"'s own text: that token ends the text (its logprob entry is marked skipped)."""
    eng = make_engine(tiny_gguf)
    eng.add_request(req("held", prompt(70, 4), max_tokens=8, stop=["lo!"], logprobs=0, ignore_eos=True))
    pieces = iter(["Hel", "lo!"])
    for seq in eng._requests["held"]:
        eng._outputs[seq.seq_id].detok.push = lambda token: next(pieces)
    texts, entries = [], []
    while eng.has_unfinished():
        for d in eng.step():
            texts.append(d.text)
            entries += d.logprobs
    assert "".join(texts) == "Hel" and [e.skipped for e in entries] == [False, True]


def test_with_the_stop_string_kept_the_token_completing_it_is_not_skipped(tiny_gguf):
    eng = make_engine(tiny_gguf)
    eng.add_request(req("kept", prompt(70, 4), max_tokens=8, stop=["lo!"], logprobs=0, ignore_eos=True,
                        include_stop_str_in_output=True))
    pieces = iter(["Hel", "lo!"])
    for seq in eng._requests["kept"]:
        eng._outputs[seq.seq_id].detok.push = lambda token: next(pieces)
    texts, entries, finish = [], [], None
    while eng.has_unfinished():
        for d in eng.step():
            texts.append(d.text)
            entries += d.logprobs
            finish = d.finish_reason or finish
    assert ("".join(texts), finish) == ("Hello!", "stop") and [e.skipped for e in entries] == [False, False]
