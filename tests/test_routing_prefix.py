"""Prefix-aware routing (app/prefix_index.py, the score's prefix term) and the baseline policies
(app/routing_policy.py): block hashes of a prompt's text, the bounded index, the credit weighed against load,
and requests sharing a 400-token prefix through the gateway to three stand-in nodes."""
from __future__ import annotations

import random
import string
import time

import pytest

from app import close_app, create_app
from app.catalog import ResolvedModel
from app.config import ConfigError, RoutingConfig
from app.prefix_index import PrefixIndex, block_hashes, canonical_prompt
from app.router import rank_nodes
from app.routing_policy import RoutingPolicy
from engine.protocol import NodeState
from scripts.stand_in_node import MODEL_ID, StandInNode, bearer, make_config

SMALL = ResolvedModel("zen-small", MODEL_ID, "q4_1", 8192, 512, cold_load_s=2.0)


def words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join("".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 8))) for _ in range(n))


def chat(turns) -> tuple[dict, ...]:
    """Chat messages as the gateway holds them (app/params.py)."""
    return tuple({"role": role, "content": content} for role, content in turns)


def node_state(waiting: int = 0, running: int = 0, resident: bool = True) -> NodeState:
    models = [{"id": MODEL_ID, "quantization": "q4_1", "prefill_tokens_per_s": 1000.0,
               "decode_tokens_per_s": 50.0}] if resident else []
    return NodeState.from_json({"node_id": "n", "healthy": True, "ready": True, "models": models,
                                "utilization": 0.1, "queue": {
                                    "waiting": waiting, "running": running, "max_waiting": 64, "admitted": waiting,
                                    # the waiting requests are standard ones of 500 prompt tokens each
                                    "admitted_by_class": [0, waiting, 0],
                                    "admitted_tokens_by_class": [0, 500 * waiting, 0]}})


# -- hashing and the index ---------------------------------------------------------------------------------

def test_shared_text_prefix_shares_leading_block_hashes():
    system = words(300, 1)
    a = block_hashes(system + " first question", "m", 64)
    b = block_hashes(system + " another question entirely", "m", 64)
    shared = len(system) // 64
    assert a[:shared] == b[:shared] and len(a) >= shared
    assert a[shared + 1:] != b[shared + 1:] or len(a) == shared + 1
    assert block_hashes(system, "other model", 64)[0] != a[0]       # a prefix cache belongs to one model
    assert block_hashes("x" * 63, "m", 64) == []                     # only full blocks count


def test_a_conversation_keeps_its_history_as_prefix():
    history = (("system", words(100, 2)), ("user", "hello"), ("assistant", words(40, 3)))
    shorter = canonical_prompt(messages=chat(history))
    longer = canonical_prompt(messages=chat(history + (("user", "and then?"),)))
    assert longer.startswith(shorter)
    # the role is part of the text: the same content under another role is another prompt
    assert canonical_prompt(messages=chat((("user", "abc"),))) != canonical_prompt(messages=chat((("system", "abc"),)))
    assert canonical_prompt(prompt_token_ids=(1, 23)) == "1,23,"


def test_index_matches_leading_blocks_per_node_and_stays_bounded():
    index = PrefixIndex(block_chars=8, max_blocks=10)
    text = "abcdefgh" * 6                     # six blocks
    hashes = index.hashes(text, "m")
    index.record(hashes[:4], "http://a")
    index.record(hashes[:2], "http://b")
    assert index.matched_blocks(hashes) == {"http://a": 4, "http://b": 2}
    cached = index.expected_cached_tokens(hashes, len(text), prompt_tokens=12)
    assert cached == {"http://a": pytest.approx(8.0), "http://b": pytest.approx(4.0)}
    # a gap ends the match: a node holding only a later block holds no prefix
    index.record(hashes[5:], "http://c")
    assert "http://c" not in index.matched_blocks(hashes)
    for i in range(20):                       # other prompts push the oldest hashes out
        index.record(index.hashes(f"{i:08d}", "m"), "http://d")
    assert len(index) == 10
    assert index.matched_blocks(hashes) == {}
    index.record(hashes, "http://a")
    index.forget("http://a")
    assert index.matched_blocks(hashes) == {} and len(index) <= 10


def test_eviction_keeps_a_prompts_leading_blocks():
    index = PrefixIndex(block_chars=4, max_blocks=3)
    hashes = index.hashes("abcdefghijklmnopqrst", "m")      # five blocks, room for three
    index.record(hashes, "http://a")
    assert index.matched_blocks(hashes) == {"http://a": 3}


def test_config_rejects_an_unknown_policy():
    with pytest.raises(ConfigError, match="routing.policy"):
        make_config(routing={"policy": "random"})
    assert RoutingConfig(policy="least_outstanding").policy == "least_outstanding"


# -- the prefix term in the score --------------------------------------------------------------------------

def test_prefix_credit_wins_on_equal_load_and_loses_to_a_queue():
    weights = RoutingConfig()
    idle = [("http://a", node_state()), ("http://b", node_state())]
    ranked = rank_nodes(idle, SMALL, 500, 16, weights, cached_tokens={"http://b": 400.0})
    assert [s.url for s in ranked] == ["http://b", "http://a"]
    assert ranked[0].prefix_saved_s == pytest.approx(400 / 1000)
    queued = [("http://a", node_state()), ("http://b", node_state(waiting=3, running=1))]
    assert rank_nodes(queued, SMALL, 500, 16, weights, cached_tokens={"http://b": 400.0})[0].url == "http://a"
    # a node without the model resident holds none of its prefix
    cold = [("http://a", node_state()), ("http://b", node_state(resident=False))]
    assert rank_nodes(cold, SMALL, 500, 16, weights, cached_tokens={"http://b": 400.0})[1].prefix_saved_s == 0
    # δ = 0: the prefix is not considered
    off = RoutingConfig(prefix_weight=0.0)
    assert rank_nodes(idle, SMALL, 500, 16, off, cached_tokens={"http://b": 400.0})[0].url == "http://a"


# -- the baselines -----------------------------------------------------------------------------------------

def test_round_robin_takes_the_nodes_in_turn():
    policy = RoutingPolicy(RoutingConfig(policy="round_robin"))
    states = {u: node_state() for u in ("http://a", "http://b", "http://c")}
    ranked = rank_nodes(list(states.items()), SMALL, 10, 10, RoutingConfig())
    firsts = [policy.order(ranked, states, {}, None)[0].url for _ in range(6)]
    assert firsts == ["http://a", "http://b", "http://c"] * 2


def test_least_outstanding_counts_what_it_sent_since_the_last_poll():
    policy = RoutingPolicy(RoutingConfig(policy="least_outstanding"))
    states = {"http://a": node_state(running=2), "http://b": node_state(running=1, waiting=1),
              "http://c": node_state()}
    fetched = {u: 1.0 for u in states}
    ranked = rank_nodes(list(states.items()), SMALL, 10, 10, RoutingConfig())
    firsts = [policy.order(ranked, states, fetched, None)[0].url for _ in range(5)]
    # c (0) gets two before it counts as many as a and b (2 each); then they take turns
    assert firsts[:2] == ["http://c", "http://c"]
    assert sorted(firsts[2:]) == ["http://a", "http://b", "http://c"]
    # a new state of c (polled: 0 sequences) resets what was counted against it
    fetched["http://c"] = 2.0
    assert policy.order(ranked, states, fetched, None)[0].url == "http://c"


# -- through the gateway: a 400-token prefix ---------------------------------------------------------------

@pytest.fixture
def three_nodes():
    nodes = [StandInNode(node_id=f"n{i}").start() for i in range(3)]
    config = make_config([n.url for n in nodes])
    app = create_app(config)
    yield app, config, nodes
    close_app(app)
    for n in nodes:
        n.stop()


def wait_for_state(pool, url: str, ready) -> None:
    """Until the pool's view of the node satisfies `ready` (the stand-in's state is polled every 0.2 s)."""
    deadline = time.monotonic() + 5
    while not ready(next(v.state for v in pool.snapshot() if v.url == url)):
        assert time.monotonic() < deadline, "the node's new state was not polled"
        time.sleep(0.05)


def _chat(client, auth, system: str, question: str):
    r = client.post("/v1/chat/completions", headers=auth, json={
        "model": "zen-small", "max_tokens": 16, "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": question}]})
    assert r.status_code == 200, r.get_json()


def _holder(nodes, before: list[int]) -> list[int]:
    """Indexes of the nodes that received a request since `before` (their received counts)."""
    return [i for i, n in enumerate(nodes) if len(n.received) > before[i]]


def test_a_shared_400_token_prefix_lands_where_it_is_cached_until_that_node_is_overloaded(three_nodes):
    app, config, nodes = three_nodes
    client, auth = app.test_client(), bearer(config)
    system = words(300, 7)[:1600]              # about 400 tokens at 4 characters a token
    _chat(client, auth, system, "What is the first question?")
    holder = next(i for i, n in enumerate(nodes) if n.received)
    # the holder is a little busier than the others: without its cached prefix it would not be chosen
    pool = app.extensions["zen.nodes"].pool
    nodes[holder].state = {"utilization": 0.4}
    wait_for_state(pool, nodes[holder].url, lambda s: s.utilization == 0.4)
    before = [len(n.received) for n in nodes]
    _chat(client, auth, words(300, 8)[:1600], "A question with another prefix?")
    assert holder not in _holder(nodes, before)
    for k in range(6):
        before = [len(n.received) for n in nodes]
        _chat(client, auth, system, f"Question number {k}: {words(5, k)}?")
        assert _holder(nodes, before) == [holder]
    # the holder is overloaded: four waiting behind one running; the next requests spread
    nodes[holder].state = {"utilization": 0.4, "queue": {
        "waiting": 4, "running": 1, "max_waiting": 64, "admitted": 4,
        "admitted_by_class": [0, 4, 0], "admitted_tokens_by_class": [0, 1600, 0]}}
    wait_for_state(pool, nodes[holder].url, lambda s: s.queue.waiting == 4)
    before = [len(n.received) for n in nodes]
    _chat(client, auth, system, "One more question while it is busy?")
    assert _holder(nodes, before) != [holder] and len(_holder(nodes, before)) == 1
