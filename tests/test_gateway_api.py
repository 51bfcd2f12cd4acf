"""The OpenAI-compatible API against a stand-in node: answers, streaming, parameters sent
to the node, failover, stream errors, bad input, error shapes, metrics and logs."""
from __future__ import annotations

import http.client
import json
import logging
import select
import socket
import threading
import time

import pytest
from werkzeug.test import EnvironBuilder, run_wsgi_app

from app import close_app, create_app, node_client, responses
from engine.protocol import APIError
from tests.test_gateway_support import (METRICS_HEADERS, MODEL_ID, TOKENS, StandInNode, auth, bearer,  # noqa: F401
                                        client, gateway, make_config, node)

FULL_TEXT = "".join(p for _, p in TOKENS)
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def chat_body(**over):
    body = {"model": "zen-small", "messages": [{"role": "user", "content": "Say hello"}]}
    body.update(over)
    return body


def sse_events(text: str) -> list:
    out = []
    for block in text.split("\n\n"):
        block = block.strip()
        if not block:
            continue
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def assert_error(resp, status: int, param=..., code=...):
    assert resp.status_code == status, resp.get_data(as_text=True)
    body = resp.get_json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert "Traceback" not in err["message"]
    if param is not ...:
        assert err["param"] == param, err
    if code is not ...:
        assert err["code"] == code, err
    return err


# -- answers -------------------------------------------------------------------------------------

def test_chat_completion(client, auth, node):
    r = client.post(CHAT, headers=auth, json=chat_body())
    assert r.status_code == 200, r.get_json()
    body = r.get_json()
    assert body["object"] == "chat.completion" and body["model"] == "zen-small"
    assert body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": FULL_TEXT}
    assert choice["finish_reason"] == "stop" and choice["logprobs"] is None
    u = body["usage"]
    assert u["completion_tokens"] == len(TOKENS)
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert r.headers["x-request-id"] and r.headers["x-latency-class"] == "standard"
    assert "x-ratelimit-remaining-tokens" in r.headers


def test_parameters_reach_the_node_as_its_protocol_says(client, gateway, node):
    cfg = gateway[1]
    body = chat_body(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, presence_penalty=0.5,
                     frequency_penalty=-0.5, repetition_penalty=1.1, seed=1234,
                     logit_bias={"50256": -100, "17": 2.5}, stop=["\n\n", "END"], n=2,
                     max_tokens=7, logprobs=True, top_logprobs=3, min_tokens=2, ignore_eos=True,
                     stop_token_ids=[2], user="u-1")
    body["messages"] = [{"role": "developer", "content": "Be brief."},
                        {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                     {"type": "text", "text": "there"}]}]
    r = client.post(CHAT, headers={**bearer(cfg, "acme"), "X-Latency-Class": "realtime",
                                   "X-Request-Id": "my-req-1"}, json=body)
    assert r.status_code == 200, r.get_json()
    sent = node.received[-1]
    assert sent["request_id"] == "acme/my-req-1" and r.headers["x-request-id"] == "my-req-1"
    assert sent["model"] == MODEL_ID and sent["quantization"] == "q4_1"
    assert sent["org"] == "acme" and sent["latency_class"] == "realtime"
    assert sent["messages"] == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Hi\nthere"}]
    assert "prompt" not in sent and "prompt_token_ids" not in sent
    assert sent["stream"] is True   # the node always streams: the gateway collects a JSON answer itself
    assert sent["sampling"] == {
        "max_tokens": 7, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05,
        "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1,
        "logit_bias": {"50256": -100.0, "17": 2.5}, "seed": 1234, "stop": ["\n\n", "END"],
        "stop_token_ids": [2], "min_tokens": 2, "ignore_eos": True, "n": 2, "logprobs": 3}
    out = r.get_json()
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert all(c["finish_reason"] == "length" for c in out["choices"])
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == 7 and content[0]["token"] == "Hello"
    assert content[0]["bytes"] == list(b"Hello") and len(content[0]["top_logprobs"]) == 3


def test_defaults_sent_to_the_node(client, auth, node):
    client.post(CHAT, headers=auth, json=chat_body())
    s = node.received[-1]["sampling"]
    assert s["max_tokens"] == 512 and s["n"] == 1 and s["logprobs"] is None
    assert s["temperature"] == 1.0 and s["top_k"] == -1 and s["seed"] is None
    assert "skip_special_tokens" not in s and "include_stop_str_in_output" not in s


@pytest.mark.parametrize("path, body", [(CHAT, chat_body()), (COMPLETIONS, {"model": "zen-small", "prompt": "x"})])
def test_vllm_text_flags_reach_the_node(client, auth, node, path, body):
    r = client.post(path, headers=auth, json={**body, "skip_special_tokens": False,
                                              "include_stop_str_in_output": True})
    assert r.status_code == 200, r.get_json()
    s = node.received[-1]["sampling"]
    assert s["skip_special_tokens"] is False and s["include_stop_str_in_output"] is True


@pytest.mark.parametrize("field, expected", [
    ({"response_format": {"type": "json_object"}}, {"type": "json", "value": {"type": "object"}}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "integer"}}}},
     {"type": "json", "value": {"type": "integer"}}),
    # strict: objects that do not say otherwise are closed; without it they stay open, as JSON Schema has them
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "strict": True, "schema": {
        "type": "object", "properties": {"a": {"type": "object"}, "b": {"type": "object", "additionalProperties": True}}}}}},
     {"type": "json", "value": {"type": "object", "properties": {
         "a": {"type": "object", "additionalProperties": False}, "b": {"type": "object", "additionalProperties": True}},
         "additionalProperties": False}}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "strict": False, "schema": {
        "type": "object", "properties": {"a": {"type": "object"}}}}}},
     {"type": "json", "value": {"type": "object", "properties": {"a": {"type": "object"}}}}),
    ({"structured_outputs": {"regex": "[0-9]+"}}, {"type": "regex", "value": "[0-9]+"}),
    ({"structured_outputs": {"json": '{"type": "string"}'}}, {"type": "json", "value": {"type": "string"}}),
    ({"guided_choice": ["a", "b"]}, {"type": "choice", "value": ["a", "b"]}),
    ({"guided_grammar": 'start: "x"'}, {"type": "grammar", "value": 'start: "x"'}),
    ({"response_format": {"type": "text"}}, None),
])
def test_structured_output_sent_to_the_node(client, auth, node, field, expected):
    assert client.post(CHAT, headers=auth, json=chat_body(**field)).status_code == 200
    assert node.received[-1]["sampling"].get("structured_output") == expected
    r = client.post(COMPLETIONS, headers=auth, json={"model": "zen-small", "prompt": "x", **field})
    assert r.status_code == 200 and node.received[-1]["sampling"].get("structured_output") == expected


def test_asking_for_text_output_is_no_unsupported_modality(client, auth, node):
    assert client.post(CHAT, headers=auth, json=chat_body(modalities=["text"])).status_code == 200
    assert len(node.received) == 1


def test_max_completion_tokens_wins_and_stop_applies(client, auth, node):
    r = client.post(CHAT, headers=auth, json=chat_body(max_tokens=100, max_completion_tokens=3))
    assert r.get_json()["choices"][0]["message"]["content"] == "Hello, world"
    assert r.get_json()["choices"][0]["finish_reason"] == "length"
    r = client.post(CHAT, headers=auth, json=chat_body(stop="!"))
    choice = r.get_json()["choices"][0]
    assert choice["message"]["content"] == "Hello, world" and choice["finish_reason"] == "stop"


def test_text_completion_with_text_and_token_prompts(client, auth, node):
    r = client.post(COMPLETIONS, headers=auth,
                    json={"model": "zen-small", "prompt": "Once", "max_tokens": 4, "logprobs": 2})
    body = r.get_json()
    assert r.status_code == 200 and body["object"] == "text_completion"
    c = body["choices"][0]
    assert c["text"] == "Hello, world!" and c["finish_reason"] == "length"
    assert c["logprobs"]["tokens"] == ["Hello", ",", " world", "!"]
    assert c["logprobs"]["text_offset"] == [0, 5, 6, 12]
    assert len(c["logprobs"]["top_logprobs"][0]) == 2
    assert node.received[-1]["prompt"] == "Once"
    for prompt in ([1, 2, 3], [[1, 2, 3]]):
        r = client.post(COMPLETIONS, headers=auth, json={"model": "zen-small", "prompt": prompt,
                                                          "max_tokens": 2})
        assert r.status_code == 200
        assert node.received[-1]["prompt_token_ids"] == [1, 2, 3]
        assert r.get_json()["usage"]["prompt_tokens"] == 3


def test_models_endpoints(client, auth):
    data = client.get("/v1/models", headers=auth).get_json()
    assert data["object"] == "list" and data["data"][0]["id"] == "zen-small"
    assert client.get("/v1/models/zen-small-q8", headers=auth).get_json()["quantization"] == "q8_0"
    assert client.get("/v1/models/zen-small", headers=auth).get_json()["chat"] is True
    assert_error(client.get("/v1/models/gpt-4", headers=auth), 404, "model", "model_not_found")


def test_models_lists_what_the_nodes_can_serve(client, auth, node):
    client.post(COMPLETIONS, headers=auth, json={"model": "zen-small", "prompt": "hi"})   # the node is known now
    listed = [m["id"] for m in client.get("/v1/models", headers=auth).get_json()["data"]]
    # the stand-in node serves SmolLM2 only: zen-gemma (in the pro tier's catalog) is not listed
    assert listed == ["zen-small", "zen-small-q8", "zen-small-f16"]
    assert_error(client.get("/v1/models/zen-gemma", headers=auth), 404, "model", "model_not_found")


def test_a_model_no_live_node_serves_is_not_found_not_unavailable(client, auth, node):
    """The SDK retries a 503: for a model of the catalog that every node, all up, says it cannot serve, the
    answer is a 404 it does not retry."""
    client.post(COMPLETIONS, headers=auth, json={"model": "zen-small", "prompt": "hi"})   # the node is known now
    assert_error(client.post(COMPLETIONS, headers=auth, json={"model": "zen-gemma", "prompt": "hi"}), 404,
                 "model", "model_not_found")
    node.stop()          # down now (a request for zen-small finds it so): it might serve zen-gemma when back
    assert client.post(COMPLETIONS, headers=auth, json={"model": "zen-small", "prompt": "hi"}).status_code == 503
    r = client.post(COMPLETIONS, headers=auth, json={"model": "zen-gemma", "prompt": "hi"})
    assert r.status_code == 503 and r.get_json()["error"]["code"] == "no_node_available"


def test_chat_to_a_model_without_a_template_is_a_400(client, auth, node):
    sent = len(node.received)
    err = assert_error(client.post(CHAT, headers=auth, json=chat_body(model="zen-gemma")), 400, "messages",
                       "chat_not_supported")
    assert "completions" in err["message"]
    assert len(node.received) == sent   # refused at the gateway, never forwarded


@pytest.mark.parametrize("stream", [False, True])
def test_usage_names_the_prompt_tokens_the_prefix_cache_held(client, auth, node, stream):
    node.cached_tokens = 2
    r = client.post(CHAT, headers=auth, json=chat_body(stream=stream, max_tokens=3,
                                                       **({"stream_options": {"include_usage": True}} if stream else {})))
    usage = sse_events(r.get_data(as_text=True))[-2]["usage"] if stream else r.get_json()["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 2} and usage["prompt_tokens"] > 2


def test_a_completion_streams_the_text_offsets_its_whole_answer_has():
    """Tokens whose text the node holds back (a possible stop string) and sends with a later one: each
    offset counts the tokens' own text before it, streamed as in the whole answer."""
    from app.responses import COMPLETIONS, ChunkWriter, text_completion
    released = [("a", "a"), (" S", ""), ("T", ""), ("x", " STx")]    # (token, text the node sends with it)
    entries = [{"token_id": i, "token": t, "bytes": list(t.encode()), "logprob": -1.0, "top": []}
               for i, (t, _) in enumerate(released)]
    writer = ChunkWriter(COMPLETIONS, "r", "m", "m", "q", 1, False, 0)
    streamed = [json.loads(writer.token({"index": 0, "text": text, "logprobs": e})[6:])
                for e, (_, text) in zip(entries, released)]
    offsets = [o for chunk in streamed for o in chunk["choices"][0]["logprobs"]["text_offset"]]
    whole = text_completion("r", "m", "m", "q", {"choices": [{"index": 0, "text": "a STx", "logprobs": entries,
                                                               "finish_reason": "length"}]}, 0)
    assert offsets == whole["choices"][0]["logprobs"]["text_offset"] == [0, 1, 3, 4]



def test_the_tokens_of_one_character_share_its_text_offset():
    """An emoji in byte-piece tokens: each token's text is "\ufffd", the answer's text has the emoji once;
    the offsets index that text, streamed as in the whole answer."""
    from app.responses import COMPLETIONS, ChunkWriter, text_completion
    pieces = [b"A", "😀".encode()[:2], "😀".encode()[2:], b"b"]
    entries = [{"token_id": i, "token": p.decode(errors="replace"), "bytes": list(p), "logprob": -1.0, "top": []}
               for i, p in enumerate(pieces)]
    whole = text_completion("r", "m", "m", "q", {"choices": [{"index": 0, "text": "A😀b", "logprobs": entries,
                                                               "finish_reason": "length"}]}, 0)
    assert whole["choices"][0]["logprobs"]["text_offset"] == [0, 1, 1, 2]
    writer = ChunkWriter(COMPLETIONS, "r", "m", "m", "q", 1, False, 0)
    streamed = [json.loads(writer.token({"index": 0, "text": "", "logprobs": e})[6:]) for e in entries]
    assert [c["choices"][0]["logprobs"]["text_offset"][0] for c in streamed] == [0, 1, 1, 2]


# -- streaming -----------------------------------------------------------------------------------

def test_chat_streaming_with_usage(client, auth, node):
    r = client.post(CHAT, headers=auth, json=chat_body(stream=True, max_tokens=5,
                                                       stream_options={"include_usage": True}))
    assert r.status_code == 200 and r.mimetype == "text/event-stream"
    events = sse_events(r.get_data(as_text=True))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "Hello, world! How"
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and finish[0]["choices"][0]["finish_reason"] == "length"
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 5
    assert all(c["usage"] is None for c in chunks[:-1])
    assert node.received[-1]["stream"] is True


def test_chat_streaming_without_usage_and_with_n(client, auth):
    r = client.post(CHAT, headers=auth, json=chat_body(stream=True, max_tokens=2, n=2))
    chunks = sse_events(r.get_data(as_text=True))[:-1]
    assert all("usage" not in c for c in chunks)
    for i in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert mine[0]["delta"]["role"] == "assistant"
        assert "".join(ch["delta"].get("content", "") for ch in mine) == "Hello,"
        assert mine[-1]["finish_reason"] == "length"


def test_completion_streaming(client, auth):
    r = client.post(COMPLETIONS, headers=auth,
                    json={"model": "zen-small", "prompt": "x", "max_tokens": 3, "stream": True,
                          "logprobs": 1, "stream_options": {"include_usage": True}})
    events = sse_events(r.get_data(as_text=True))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "Hello, world"
    assert chunks[0]["choices"][0]["logprobs"]["tokens"] == ["Hello"]
    assert chunks[1]["choices"][0]["logprobs"]["text_offset"] == [5]
    assert chunks[-1]["usage"]["completion_tokens"] == 3


def test_finished_node_streams_give_their_connection_back(client, auth, node):
    """A stream read to its end leaves its connection to the node open for the next request (streamed
    or JSON): no new TCP connection, and no node-side accept, per request."""
    for i in range(4):
        with client.post(CHAT, headers=auth, json=chat_body(stream=bool(i % 2), max_tokens=3)) as r:
            assert r.status_code == 200
            r.get_data()
    assert len(node.received) == 4
    assert len(node.generate_peers) == 1, node.generate_peers


def test_a_node_stalling_after_done_does_not_hold_the_request(client, auth, node):
    """The read of a finished stream's last bytes is bounded: a node that stalls after its done
    event costs the connection, not the request's time (its usage is settled at once)."""
    node.trailer_delay_s = 3.0
    for stream in (True, False):
        t0 = time.monotonic()
        with client.post(CHAT, headers=auth, json=chat_body(stream=stream, max_tokens=3)) as r:
            assert r.status_code == 200
            r.get_data()
        assert time.monotonic() - t0 < 1.5, f"stream={stream}: {time.monotonic() - t0:.2f} s"


def test_client_disconnect_closes_the_node_stream(client, auth, node):
    node.token_delay_s = 0.05
    r = client.post(CHAT, headers=auth, json=chat_body(stream=True, max_tokens=200,
                                                       extra_ignored_field=1))
    it = r.response
    next(it), next(it)                    # the headers; the role chunk with the first token
    r.close()                             # the client goes away
    deadline = time.monotonic() + 5
    while node.client_disconnects < 1:
        assert time.monotonic() < deadline, "node never saw the disconnect"
        time.sleep(0.02)
    # its bookkeeping ran once (the response's close, not once more by each iterator around it)
    metrics = client.get("/metrics", headers=METRICS_HEADERS).get_data(as_text=True)
    counts = [line.rsplit(" ", 1)[1] for line in metrics.splitlines()
              if line.startswith("zen_gateway_org_requests_total{") and 'status="499"' in line]
    assert counts == ["1.0"]
    assert "zen_gateway_org_errors_total{" not in metrics      # the client left: not an error of ours


def test_a_stream_starts_when_the_node_takes_the_request_not_at_its_first_token(client, auth, node):
    """The headers go out while the node computes its first token; the chat role chunk comes in one
    write with that token (alone, its write and its reader's wake-up would take a core from the node)."""
    node.first_token_delay_s = 1.0
    t0 = time.monotonic()
    r = client.post(CHAT, headers=auth, json=chat_body(stream=True, max_tokens=3), buffered=False)
    assert r.status_code == 200 and r.headers["x-ratelimit-limit-requests"]
    it = iter(r.response)
    assert next(it) == b""                # what a server writes as the headers alone
    assert time.monotonic() - t0 < 0.7, "the response waited for the first token"
    first = sse_events(next(it).decode())
    assert time.monotonic() - t0 >= 1.0
    assert [e["choices"][0]["delta"] for e in first] == [{"role": "assistant", "content": ""},
                                                         {"content": "Hello"}]
    rest = b"".join(it).decode()
    r.close()
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in first + sse_events(rest)[:-1]
                   if e["choices"])
    assert text == "Hello, world"


def test_a_stream_is_set_up_while_the_node_reads_the_request(client, auth, node, monkeypatch):
    """The answer (its response, its rate-limit headers) is built between the request's write to the
    node and the node's answer, not after it: then the node computes the first token."""
    from app import api
    node.response_delay_s = 0.3
    built = []
    real = api._answer_stream
    monkeypatch.setattr(api, "_answer_stream", lambda *a: built.append(time.monotonic()) or real(*a))
    t0 = time.monotonic()
    with client.post(CHAT, headers=auth, json=chat_body(stream=True, max_tokens=3)) as r:
        answered = time.monotonic() - t0
        assert r.headers["x-ratelimit-remaining-requests"]
        assert sse_events(r.get_data(as_text=True))[-1] == "[DONE]"
    assert len(built) == 1 and built[0] - t0 < 0.2 and answered >= 0.3


def test_a_chat_stream_without_tokens_still_opens_with_the_role(client, auth):
    # The stand-in node's first token is "Hello": a stop string that ends the stream before it.
    with client.post(CHAT, headers=auth, json=chat_body(stream=True, max_tokens=3, stop=["Hello"])) as r:
        events = sse_events(r.get_data(as_text=True))
    assert [e["choices"][0]["delta"] for e in events[:2]] == [{"role": "assistant", "content": ""}, {}]
    assert events[1]["choices"][0]["finish_reason"] == "stop" and events[2:] == ["[DONE]"]


def test_a_client_that_leaves_before_the_first_token_closes_the_node_stream(client, auth, node):
    """While the node computes, its heartbeats are the gateway's moments to look at its client."""
    node.first_token_delay_s = 3.0
    ours, theirs = socket.socketpair()   # the gateway's end of a client connection, and the client's
    try:
        r = client.post(CHAT, headers=auth, json=chat_body(stream=True, max_tokens=3), buffered=False,
                        environ_overrides={"gunicorn.socket": ours})
        it = iter(r.response)
        assert next(it) == b""            # the headers: the stream has started
        theirs.close()                    # the client goes away
        t0 = time.monotonic()
        assert b"".join(it) == b""        # the stream ends at the next heartbeat, with no tokens
        assert time.monotonic() - t0 < 1.0
        r.close()
        deadline = time.monotonic() + 5
        while node.client_disconnects < 1:
            assert time.monotonic() < deadline, "the node never saw the disconnect"
            time.sleep(0.02)
    finally:
        ours.close()


# -- failover and stream errors ------------------------------------------------------------------

@pytest.fixture
def two_nodes():
    a, b = StandInNode(node_id="a").start(), StandInNode(node_id="b").start()
    cfg = make_config([a.url, b.url])
    app = create_app(cfg)
    yield app, cfg, a, b
    close_app(app)
    a.stop()
    b.stop()


def _first_choice(app, cfg):
    """Which node the router prefers now (both idle: ties break by URL)."""
    return app.extensions["zen.nodes"].pool


def test_failover_on_503_and_on_a_dead_node(two_nodes):
    app, cfg, a, b = two_nodes
    c, h = app.test_client(), bearer(cfg)
    first, second = sorted([a, b], key=lambda n: n.url)
    first.busy = True
    r = c.post(CHAT, headers=h, json=chat_body(max_tokens=2))
    assert r.status_code == 200
    assert len(first.received) == 1 and len(second.received) == 1
    first.busy = False
    first.stop()                                   # killed: connection refused from now on
    r = c.post(CHAT, headers=h, json=chat_body(max_tokens=2, stream=True))
    assert r.status_code == 200 and sse_events(r.get_data(as_text=True))[-1] == "[DONE]"
    assert len(second.received) == 2
    metrics = c.get("/metrics", headers=METRICS_HEADERS).get_data(as_text=True)
    assert "zen_gateway_node_failovers_total" in metrics and 'reason="busy"' in metrics


@pytest.mark.parametrize("stream", [True, False])
def test_a_connection_the_node_closes_as_it_is_reused_is_retried_on_the_same_node(client, auth, node,
                                                                                 stream):
    """Not a failover: the node is up, and a single closed connection must not mark it down."""
    assert client.post(CHAT, headers=auth, json=chat_body(max_tokens=1)).status_code == 200
    node.drop_requests = 1            # the next request comes on the kept-alive connection: dropped
    r = client.post(CHAT, headers=auth, json=chat_body(stream=stream, max_tokens=3))
    assert r.status_code == 200
    text = (r.get_json()["choices"][0]["message"]["content"] if not stream else
            "".join(e["choices"][0]["delta"].get("content", "")
                    for e in sse_events(r.get_data(as_text=True))[:-1] if e["choices"]))
    assert text == "Hello, world" and len(node.received) == 3
    assert len(node.generate_peers) == 2          # the retry came on a new connection
    pool = client.application.extensions["zen.nodes"].pool
    assert not any(view.down for view in pool.snapshot())
    metrics = client.get("/metrics", headers=METRICS_HEADERS).get_data(as_text=True)
    assert "zen_gateway_node_failovers_total{" not in metrics


def test_a_kept_alive_connection_the_node_closed_while_idle_is_not_used_again(client, auth, node,
                                                                              monkeypatch):
    """A connection the node closed after its last request (its keep-alive timeout) is seen to be
    closed before the next request would be written to it: one send, on a new connection."""
    sends, checks = [], []
    real_send, real_still_open = node_client.NodeClient.send_request, node_client._still_open

    def send_request(self, *args, **kwargs):
        conn, kept_alive = real_send(self, *args, **kwargs)
        sends.append(conn)
        return conn, kept_alive
    monkeypatch.setattr(node_client.NodeClient, "send_request", send_request)
    monkeypatch.setattr(node_client, "_still_open",
                        lambda sock: checks.append(real_still_open(sock)) or checks[-1])
    node.close_after_stream = True
    with client.post(CHAT, headers=auth, json=chat_body(stream=True, max_tokens=3)) as r:
        assert r.status_code == 200 and sse_events(r.get_data(as_text=True))[-1] == "[DONE]"
    (kept,) = client.application.extensions["zen.nodes"]._connections[node.url]._idle
    poller = select.poll()
    poller.register(kept.sock, select.POLLIN)
    assert poller.poll(5000), "the node did not close the connection"
    with client.post(CHAT, headers=auth, json=chat_body(stream=True, max_tokens=3)) as r:
        assert r.status_code == 200 and sse_events(r.get_data(as_text=True))[-1] == "[DONE]"
    assert checks == [False]
    assert len(sends) == 2 and sends[0] is kept and sends[1] is not kept
    assert len(node.received) == 2 and len(node.generate_peers) == 2
    assert not any(view.down for view in client.application.extensions["zen.nodes"].pool.snapshot())


def test_a_node_answer_that_is_not_http_closes_its_connection(client, auth, monkeypatch):
    """Whatever breaks the first send (here a status line that is not HTTP) closes the connection it
    used; only a kept-alive connection found closed is retried."""
    listener = socket.create_server(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"

    def answer_garbage():
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"garbage\r\n\r\n")
            conn.recv(1)          # until the gateway closes its end

    threading.Thread(target=answer_garbage, daemon=True).start()
    connections = node_client.NodeConnections(url, 4, 2.0, 5.0)
    opened = []
    real_connect = connections.connect
    monkeypatch.setattr(connections, "connect", lambda: opened.append(real_connect()) or opened[-1])
    nodes = client.application.extensions["zen.nodes"]
    monkeypatch.setitem(nodes._connections, url, connections)
    with listener, pytest.raises(http.client.BadStatusLine):
        nodes.post_generate(url, b"{}", {"Content-Type": "application/json"})
    assert len(opened) == 1 and opened[0].sock is None and connections._idle == []


def test_a_connection_given_back_after_the_pool_closed_is_closed():
    connections = node_client.NodeConnections("http://127.0.0.1:1", 4, 1.0, 1.0)
    a, b = socket.socketpair()
    with b:
        conn = http.client.HTTPConnection("127.0.0.1", 1)
        conn.sock = a
        connections.close()
        connections.give_back(conn)
        assert connections._idle == [] and conn.sock is None and a.fileno() == -1


def test_an_idle_connection_is_open_until_the_peer_closes_it_or_sends_out_of_turn():
    for peer_does in ("nothing", "close", "send"):
        a, b = socket.socketpair()
        with a, b:
            if peer_does == "close":
                b.close()
            elif peer_does == "send":
                b.sendall(b"HTTP/1.1 408 Request Timeout\r\n\r\n")
            assert node_client._still_open(a) == (peer_does == "nothing"), peer_does
    assert not node_client._still_open(None)


def test_all_nodes_busy_is_a_503_with_retry_after(two_nodes):
    app, cfg, a, b = two_nodes
    a.busy = b.busy = True
    r = app.test_client().post(CHAT, headers=bearer(cfg), json=chat_body())
    err = assert_error(r, 503, None, "no_node_available")
    assert "busy" in err["message"] and r.headers["Retry-After"] == "2"
    assert a.url not in err["message"] and b.url not in err["message"]   # the nodes' addresses are the operator's


def test_a_node_full_for_the_org_hands_the_request_on_and_all_of_them_is_a_429(two_nodes):
    """A node whose queue holds its share of the org's requests (429 org_queue_full) is no fault: the
    request goes to the next node; when every node says so, the client gets a 429 with Retry-After."""
    app, cfg, a, b = two_nodes
    c, h = app.test_client(), bearer(cfg)
    first, second = sorted([a, b], key=lambda n: n.url)
    first.org_queue_full = True
    r = c.post(CHAT, headers=h, json=chat_body(max_tokens=2))
    assert r.status_code == 200 and len(first.received) == 1 and len(second.received) == 1
    second.org_queue_full = True
    for stream in (False, True):
        r = c.post(CHAT, headers=h, json=chat_body(max_tokens=2, stream=stream))
        err = assert_error(r, 429, None, "org_queue_full")
        assert err["type"] == "rate_limit_exceeded" and r.headers["Retry-After"] == "3"
    first.busy = True   # one node busy, the other full for the org: the service's 503
    assert_error(c.post(CHAT, headers=h, json=chat_body(max_tokens=2)), 503, None, "no_node_available")
    metrics = c.get("/metrics", headers=METRICS_HEADERS).get_data(as_text=True)
    assert 'reason="org_queue_full"' in metrics
    # both 429s (JSON and stream) under their own limit, not the requests per minute
    assert 'zen_gateway_org_rate_limited_total{limit="node_queue",org="acme"} 2.0' in metrics
    assert 'limit="requests"' not in metrics
    first.busy = first.org_queue_full = second.org_queue_full = False
    before = len(first.received)
    assert c.post(CHAT, headers=h, json=chat_body(max_tokens=2)).status_code == 200
    assert len(first.received) == before + 1   # still the first choice: its refusals were no fault


def test_a_stream_no_node_accepts_is_an_http_503_with_its_headers(two_nodes):
    """When no node accepts a stream, the client gets the HTTP error (not a 200 stream), with the limit
    headers, and the org is charged nothing."""
    _, _, a, b = two_nodes
    # a bucket that refills too slowly to hide a reservation that was not given back
    cfg = make_config([a.url, b.url], tiers={"pro": {"tokens_per_second": 0.001, "burst_tokens": 10000}})
    app = create_app(cfg)
    try:
        a.busy = b.busy = True
        c = app.test_client()
        r = c.post(CHAT, headers=bearer(cfg), json=chat_body(stream=True, max_tokens=3))
        err = assert_error(r, 503, None, "no_node_available")
        r.close()
        assert "busy" in err["message"] and r.headers["Retry-After"] == "2"
        assert r.headers["Content-Type"] == "application/json"
        assert int(r.headers["x-ratelimit-remaining-requests"]) >= 0
        assert r.headers["x-ratelimit-remaining-tokens"] == "10000"   # its reservation given back
        assert len(a.received) == 1 and len(b.received) == 1
        metrics = c.get("/metrics", headers=METRICS_HEADERS).get_data(as_text=True)
        assert 'zen_gateway_org_errors_total{org="acme",status="503"} 1.0' in metrics
        a.busy = b.busy = False
        r = c.post(CHAT, headers=bearer(cfg), json=chat_body(stream=True, max_tokens=3))
        assert r.status_code == 200 and sse_events(r.get_data(as_text=True))[-1] == "[DONE]"
        r.close()
        assert 10000 - 100 < int(r.headers["x-ratelimit-remaining-tokens"]) < 10000   # this one's reservation only
    finally:
        close_app(app)


def test_a_stream_the_node_finds_too_long_is_an_http_400_naming_the_parameter(client, auth, node):
    r = client.post(CHAT, headers=auth, json=chat_body(stream=True, messages=[{"role": "user",
                                                                              "content": "x" * 40000}]))
    assert_error(r, 400, "messages", "context_length_exceeded")
    r = client.post(COMPLETIONS, headers=auth, json={"model": "zen-small", "prompt": "x" * 40000,
                                                     "stream": True})
    assert_error(r, 400, "prompt", "context_length_exceeded")
    assert len(node.received) == 2


def test_stream_that_breaks_before_the_first_token_fails_over(two_nodes):
    app, cfg, a, b = two_nodes
    first, second = sorted([a, b], key=lambda n: n.url)
    first.fail_after_tokens = 0
    r = app.test_client().post(CHAT, headers=bearer(cfg), json=chat_body(stream=True, max_tokens=3))
    events = sse_events(r.get_data(as_text=True))
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"])
    assert text == "Hello, world" and len(second.received) == 1


def test_an_abandoned_stream_that_breaks_before_its_first_token_fails_over_no_more(two_nodes):
    """A closed PromptBatch's streams are abandoned: no reader wants a node's answer any more."""
    from flask import request
    from app import api
    from app.node_client import NodeStreamError
    app, cfg, a, b = two_nodes
    first, second = sorted([a, b], key=lambda n: n.url)
    first.fail_after_tokens = 0
    with app.test_request_context(COMPLETIONS, method="POST", headers=bearer(cfg),
                                  json={"model": "zen-small", "prompt": "hi", "max_tokens": 2, "stream": True}):
        app.preprocess_request()
        req, _, _ = api.build_request(request.get_json(), responses.COMPLETIONS)
        stream = app.extensions["zen.nodes"].send(req)
        stream.accept()
        stream.abandoned = True
        with pytest.raises(NodeStreamError):
            list(stream.events())
        stream.close()
    assert len(first.received) == 1 and second.received == []


def test_a_node_that_fails_what_another_serves_is_passed_over_for_a_while(two_nodes, monkeypatch):
    """Node a (idle, so ranked first) breaks every stream before its first token, and b serves it: after
    three such failures a is passed over; once the pause is over it is tried again."""
    import app.node_faults as faults
    now = [1000.0]
    monkeypatch.setattr(faults, "monotonic", lambda: now[0])
    app, cfg, a, b = two_nodes
    a.state, b.state = {"utilization": 0.0}, {"utilization": 0.9}
    a.fail_after_tokens = 0
    client = app.test_client()
    for _ in range(5):
        assert client.post(COMPLETIONS, headers=bearer(cfg), json={"model": "zen-small", "prompt": "hi",
                                                                   "max_tokens": 2}).status_code == 200
    assert len(a.received) == 3 and len(b.received) == 5
    now[0] += faults.BASE_S + 1
    client.post(COMPLETIONS, headers=bearer(cfg), json={"model": "zen-small", "prompt": "hi", "max_tokens": 2})
    assert len(a.received) == 4


def test_requests_that_fail_on_every_node_pass_no_node_over(two_nodes):
    app, cfg, a, b = two_nodes
    a.state, b.state = {"utilization": 0.0}, {"utilization": 0.9}
    a.fail_after_tokens = b.fail_after_tokens = 0
    client = app.test_client()
    for _ in range(5):
        assert client.post(COMPLETIONS, headers=bearer(cfg), json={"model": "zen-small", "prompt": "hi",
                                                                   "max_tokens": 2}).status_code == 503
    assert len(a.received) == len(b.received) == 5


@pytest.mark.parametrize("knob", ["fail_after_tokens", "error_after_tokens"])
def test_a_stream_every_node_fails_before_its_first_token_ends_with_an_error_event(two_nodes, knob):
    """The headers went out when the first node took the request, so when no node is left the
    stream carries the 503's error, and [DONE]."""
    app, cfg, a, b = two_nodes
    setattr(a, knob, 0)
    setattr(b, knob, 0)
    r = app.test_client().post(CHAT, headers=bearer(cfg), json=chat_body(stream=True, max_tokens=3))
    assert r.status_code == 200
    events = sse_events(r.get_data(as_text=True))
    r.close()                                      # the request's bookkeeping runs at its close
    assert events[-1] == "[DONE]"
    err = events[-2]["error"]
    assert err["code"] == "no_node_available" and err["type"] == "server_error"
    assert "127.0.0.1" not in err["message"]
    assert not any(e["choices"][0]["delta"].get("content") for e in events[:-2] if e.get("choices"))
    assert len(a.received) == 1 and len(b.received) == 1
    metrics = app.test_client().get("/metrics", headers=METRICS_HEADERS).get_data(as_text=True)
    assert 'reason="broken_before_first_token"' in metrics
    assert 'zen_gateway_org_errors_total{org="acme",status="503"} 1.0' in metrics


@pytest.mark.parametrize("stream, after_tokens", [(False, 0), (True, 0), (True, 2)])
def test_a_node_that_refuses_the_request_itself_is_not_failed_over(two_nodes, stream, after_tokens):
    """An error event of the request's own (invalid_request_error: a constraint that broke down, a request
    id in use) reaches the client as a 400 or 409 (in the stream once it has begun); no other node is tried
    and the node counts no fault."""
    app, cfg, a, b = two_nodes
    a.state, b.state = {"utilization": 0.0}, {"utilization": 0.9}
    for stand_in in (a, b):
        stand_in.error_after_tokens, stand_in.error_type = after_tokens, "invalid_request_error"
    client = app.test_client()
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    for code, status, param in (("structured_output_failed", 400, "structured_output"),
                                ("duplicate_request_id", 409, "request_id")):
        a.error_code, a.error_param = code, param
        r = client.post(CHAT, headers=bearer(cfg), json=chat_body(stream=stream, max_tokens=5,
                                                                  response_format=schema))
        named = "response_format" if param == "structured_output" else param   # the client's own field
        if stream:
            assert r.status_code == 200
            events = sse_events(r.get_data(as_text=True))
            r.close()
            assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "invalid_request_error"
            assert events[-2]["error"]["code"] == code and events[-2]["error"]["param"] == named
        else:
            assert_error(r, status, param=named, code=code)
    assert len(a.received) == 2 and b.received == []
    metrics = client.get("/metrics", headers=METRICS_HEADERS).get_data(as_text=True)
    assert "broken_before_first_token" not in metrics
    # counted as the client's errors, streamed or not: no stream failure of the service's
    assert 'zen_gateway_org_errors_total{org="acme",status="400"} 1.0' in metrics
    assert 'zen_gateway_org_errors_total{org="acme",status="409"} 1.0' in metrics and 'status="stream"' not in metrics


@pytest.mark.parametrize("knob", ["fail_after_tokens", "error_after_tokens"])
def test_failure_after_the_first_token_is_an_error_event(client, auth, node, knob):
    setattr(node, knob, 3)
    r = client.post(CHAT, headers=auth, json=chat_body(stream=True, max_tokens=10))
    assert r.status_code == 200
    events = sse_events(r.get_data(as_text=True))
    assert events[-1] == "[DONE]"
    err = events[-2]["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "engine_error"
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-2])
    assert text == "Hello, world"                  # the 3 tokens before the failure
    assert len(node.received) == 1                 # no failover after the first token


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_cut_short_counts_the_tokens_the_org_is_charged(client, auth, node, stream):
    """The node fails after 3 tokens: the org's bucket is charged the prompt as the node counted it (the
    stand-in: 200 for 800 characters, where the gateway's estimate is 267) and those 3, and its token
    counters say as much, for a JSON answer (a 502) as for a stream."""
    node.fail_after_tokens = 3
    r = client.post(COMPLETIONS, headers=auth, json={"model": "zen-small", "prompt": "a" * 800, "max_tokens": 10,
                                                      "stream": stream})
    r.get_data()
    r.close()
    assert r.status_code == (200 if stream else 502)
    metrics = client.get("/metrics", headers=METRICS_HEADERS).get_data(as_text=True)
    def counter(name):
        return [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                if line.startswith(f"zen_gateway_org_{name}_total{{") and 'org="acme"' in line]
    assert counter("completion_tokens") == [3.0]
    assert counter("prompt_tokens") == [200.0]


def test_a_node_shutdown_after_the_first_token_keeps_its_code(client, auth, node):
    # A draining node ended the stream: the client learns it may retry, not that the engine failed.
    node.error_after_tokens, node.error_code = 2, "node_shutdown"
    r = client.post(CHAT, headers=auth, json=chat_body(stream=True, max_tokens=10))
    err = sse_events(r.get_data(as_text=True))[-2]["error"]
    assert err["code"] == "node_shutdown" and err["type"] == "server_error"
    r = client.post(CHAT, headers=auth, json=chat_body(max_tokens=10))
    assert r.status_code == 503 and r.headers["Retry-After"] == "1"
    assert r.get_json()["error"]["code"] == "node_shutdown"


def test_no_node_configured_is_a_503(auth):
    cfg = make_config([])
    app = create_app(cfg)
    try:
        assert_error(app.test_client().post(CHAT, headers=auth, json=chat_body()), 503,
                     code="no_node_available")
    finally:
        close_app(app)


# -- priority ------------------------------------------------------------------------------------

def test_latency_class_header_is_capped_by_the_sla(client, gateway, node):
    cfg = gateway[1]
    r = client.post(CHAT, headers={**bearer(cfg, "globex"), "X-Latency-Class": "realtime"},
                    json=chat_body())
    assert r.status_code == 200 and node.received[-1]["latency_class"] == "standard"
    assert r.headers["x-latency-class"] == "standard"
    client.post(CHAT, headers=bearer(cfg, "globex"), json=chat_body())
    assert node.received[-1]["latency_class"] == "batch"            # globex's default
    assert_error(client.post(CHAT, headers={**bearer(cfg, "acme"), "X-Latency-Class": "asap"},
                             json=chat_body()), 400, "X-Latency-Class")


def test_service_tier_names_the_latency_class_and_the_answer_names_the_one_served(client, gateway, node):
    cfg = gateway[1]
    acme, globex = bearer(cfg, "acme"), bearer(cfg, "globex")
    for headers, tier, sent, answered in [(acme, "flex", "batch", "flex"), (acme, "priority", "realtime", "priority"),
                                          (acme, None, "standard", "default"), (acme, "auto", "standard", "default"),
                                          (globex, "priority", "standard", "default"),   # capped by globex's SLA
                                          (globex, "auto", "batch", "flex")]:           # globex's default
        body = chat_body() if tier is None else chat_body(service_tier=tier)
        r = client.post(CHAT, headers=headers, json=body)
        assert r.status_code == 200 and node.received[-1]["latency_class"] == sent, tier
        assert r.get_json()["service_tier"] == answered and r.headers["x-latency-class"] == sent
    # a stream's chunks name it too, on both endpoints
    r = client.post(CHAT, headers=acme, json=chat_body(service_tier="flex", stream=True))
    chunks = [json.loads(line[6:]) for line in r.get_data(as_text=True).splitlines()
              if line.startswith("data: {")]
    assert chunks and {c["service_tier"] for c in chunks} == {"flex"}
    r = client.post(COMPLETIONS, headers=acme, json={"model": "zen-small", "prompt": "x", "service_tier": "priority"})
    assert r.get_json()["service_tier"] == "priority" and node.received[-1]["latency_class"] == "realtime"
    # the header and the tier may agree; disagreeing, or a tier of no class, is the client's error
    r = client.post(CHAT, headers={**acme, "X-Latency-Class": "batch"}, json=chat_body(service_tier="flex"))
    assert r.status_code == 200 and node.received[-1]["latency_class"] == "batch"
    assert_error(client.post(CHAT, headers={**acme, "X-Latency-Class": "realtime"}, json=chat_body(service_tier="flex")),
                 400, "service_tier")
    assert_error(client.post(CHAT, headers=acme, json=chat_body(service_tier="scale")), 400, "service_tier")


# -- bad input -----------------------------------------------------------------------------------

BAD_CHAT = [
    ({"messages": [{"role": "user", "content": "x"}]}, "model"),
    (chat_body(model=5), "model"),
    (chat_body(model=""), "model"),
    ({"model": "zen-small"}, "messages"),
    (chat_body(messages=[]), "messages"),
    (chat_body(messages="hi"), "messages"),
    (chat_body(messages=[{"role": "wizard", "content": "x"}]), "messages"),
    (chat_body(messages=[{"role": "user"}]), "messages"),
    (chat_body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]), "messages"),
    (chat_body(messages=["hi"]), "messages"),
    (chat_body(temperature="hot"), "temperature"),
    (chat_body(temperature=2.5), "temperature"),
    (chat_body(temperature=True), "temperature"),
    (chat_body(top_p=-0.1), "top_p"),
    (chat_body(top_k=-5), "top_k"),
    (chat_body(top_k=1.5), "top_k"),
    (chat_body(min_p=2), "min_p"),
    (chat_body(presence_penalty=3), "presence_penalty"),
    (chat_body(frequency_penalty=-3), "frequency_penalty"),
    (chat_body(repetition_penalty=0), "repetition_penalty"),
    (chat_body(n=0), "n"),
    (chat_body(n=1000), "n"),
    (chat_body(max_tokens=10 ** 9), "max_tokens"),
    (chat_body(max_tokens=0), "max_tokens"),
    (chat_body(max_tokens="5"), "max_tokens"),
    (chat_body(max_completion_tokens=10 ** 12), "max_completion_tokens"),
    (chat_body(min_tokens=-1), "min_tokens"),
    (chat_body(min_tokens=600), "min_tokens"),
    (chat_body(stop=["a", "b", "c", "d", "e"]), "stop"),
    (chat_body(stop=[""]), "stop"),
    (chat_body(stop=5), "stop"),
    (chat_body(stop_token_ids=[-1]), "stop_token_ids"),
    (chat_body(logit_bias={"abc": 1}), "logit_bias"),
    (chat_body(logit_bias={"5": 500}), "logit_bias"),
    (chat_body(logit_bias=[1]), "logit_bias"),
    (chat_body(seed="x"), "seed"),
    (chat_body(seed=2 ** 70), "seed"),
    (chat_body(top_logprobs=2), "top_logprobs"),
    (chat_body(logprobs=True, top_logprobs=50), "top_logprobs"),
    (chat_body(logprobs=3), "logprobs"),
    (chat_body(stream="yes"), "stream"),
    (chat_body(stream_options={"include_usage": True}), "stream_options"),
    (chat_body(stream=True, stream_options=[1]), "stream_options"),
    (chat_body(ignore_eos="no"), "ignore_eos"),
    (chat_body(skip_special_tokens=0), "skip_special_tokens"),
    (chat_body(include_stop_str_in_output="yes"), "include_stop_str_in_output"),
    (chat_body(user=7), "user"),
    (chat_body(tools=[{"type": "function", "function": {"name": "no spaces"}}]), "tools"),
    (chat_body(tools=[{"type": "function", "function": {"name": "trailing_newline\n"}}]), "tools"),
    (chat_body(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "bad"}}}]), "tools"),
    (chat_body(tools=[{"type": "function", "function": {"name": "f"}}] * 2), "tools"),
    (chat_body(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="sometimes"), "tool_choice"),
    (chat_body(tools=[{"type": "function", "function": {"name": "f"}}],
               tool_choice={"type": "function", "function": {"name": "g"}}), "tool_choice"),
    (chat_body(tool_choice="required"), "tool_choice"),
    (chat_body(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="required",
               response_format={"type": "json_object"}), "tool_choice"),
    (chat_body(tools=[{"type": "function", "function": {"name": "f"}}], parallel_tool_calls="yes"),
     "parallel_tool_calls"),
    (chat_body(messages=[{"role": "tool", "content": "1"}]), "messages"),
    (chat_body(messages=[{"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}]), "messages"),
    (chat_body(response_format={"type": "xml"}), "response_format"),
    (chat_body(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}),
     "response_format"),
    (chat_body(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}),
     "response_format"),
    (chat_body(response_format={"type": "json_schema", "json_schema": {"name": "x", "strict": "yes",
                                                                       "schema": {"type": "object"}}}),
     "response_format"),
    (chat_body(structured_outputs={"regex": "[a-"}), "structured_outputs"),
    (chat_body(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs"),
    (chat_body(structured_outputs={"grammar": "root ::= ("}), "structured_outputs"),
    (chat_body(guided_choice=[]), "guided_choice"),
    (chat_body(guided_json="{not json"), "guided_json"),
    (chat_body(modalities=["text", "audio"]), "modalities"),
    (chat_body(audio={"voice": "alloy", "format": "wav"}), "audio"),
    (chat_body(functions=[{"name": "f"}]), "functions"),
    (chat_body(guided_json="[" * 1500 + "]" * 1500), "guided_json"),    # past the JSON parser's depth
    (chat_body(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": "[" * 1500 + "]" * 1500}}),
     "response_format"),
    (chat_body(guided_regex="a", response_format={"type": "json_object"}), "guided_regex"),
]


@pytest.mark.parametrize("body, param", BAD_CHAT)
def test_bad_chat_input_names_the_parameter(client, auth, node, body, param):
    assert_error(client.post(CHAT, headers=auth, json=body), 400, param)
    assert node.received == []                     # nothing reached the node


BAD_COMPLETIONS = [
    ({"model": "zen-small"}, "prompt"),
    ({"model": "zen-small", "prompt": 5}, "prompt"),
    ({"model": "zen-small", "prompt": [1, "a"]}, "prompt"),
    ({"model": "zen-small", "prompt": ["a"] * 33}, "prompt"),          # more than server.max_prompts
    ({"model": "zen-small", "prompt": [[1, 2], "b"]}, "prompt"),
    ({"model": "zen-small", "prompt": [-1]}, "prompt"),
    ({"model": "zen-small", "prompt": []}, "prompt"),
    ({"model": "zen-small", "prompt": "x", "logprobs": 50}, "logprobs"),
    ({"model": "zen-small", "prompt": "x", "logprobs": True}, "logprobs"),
    ({"model": "zen-small", "prompt": "x", "echo": True}, "echo"),
    ({"model": "zen-small", "prompt": "x", "best_of": 3}, "best_of"),
    ({"model": "zen-small", "prompt": "x", "best_of": True}, "best_of"),
    ({"model": "zen-small", "prompt": "x", "suffix": "y"}, "suffix"),
]


@pytest.mark.parametrize("stream", [False, True])
def test_a_list_of_prompts_is_answered_n_choices_a_prompt(client, auth, node, stream):
    """Each prompt goes to the node as a request of its own (its id ending in / and its place); the answer
    numbers the choices prompt by prompt (prompt i's j-th is i × n + j) and sums the usage."""
    body = {"model": "zen-small", "prompt": ["Once upon", "a time", "there was"], "n": 2, "max_tokens": 3,
            "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
    r = client.post(COMPLETIONS, headers={**auth, "X-Request-Id": "batch-1"}, json=body)
    assert r.status_code == 200
    sent = sorted(node.received[-3:], key=lambda x: x["request_id"])   # sent in order, received in any
    assert [x["prompt"] for x in sent] == body["prompt"] and all(x["sampling"]["n"] == 2 for x in sent)
    assert [x["request_id"] for x in sent] == [f"acme/batch-1/{i}" for i in range(3)]
    if stream:
        events = sse_events(r.get_data(as_text=True))[:-1]
        text: dict[int, str] = {}
        finish: dict[int, str] = {}
        for e in events:
            for c in e["choices"]:
                text[c["index"]] = text.get(c["index"], "") + c["text"]
                if c["finish_reason"]:
                    finish[c["index"]] = c["finish_reason"]
        usage = events[-1]["usage"]
    else:
        answer = r.get_json()
        text = {c["index"]: c["text"] for c in answer["choices"]}
        finish = {c["index"]: c["finish_reason"] for c in answer["choices"]}
        usage = answer["usage"]
    assert sorted(text) == sorted(finish) == list(range(6)) and all(text.values())
    assert usage["completion_tokens"] == 6 * 3 and usage["prompt_tokens"] == sum(
        node.prompt_tokens(x) for x in sent)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


class _FakeStream:
    """A node stream's events: `tokens` token events and a done event, or an APIError from the start
    (no node took it over). With `after`, it starts once that gate is set (or after 5 s)."""

    def __init__(self, tokens: int, fails: bool = False, after: threading.Event | None = None,
                 close_fails: bool = False) -> None:
        self.tokens, self.fails, self.after, self.close_fails, self.tokens_read = tokens, fails, after, close_fails, 0
        self.closed = self.abandoned = False

    def events(self):
        if self.after is not None:
            self.after.wait(5)
        if self.fails:
            raise APIError(503, "No engine node could serve this request", code="no_node_available")
        for i in range(self.tokens):
            self.tokens_read += 1
            yield {"type": "token", "index": 0, "text": f"t{i}"}
        yield {"type": "done", "choices": [{"index": 0, "finish_reason": "length"}],
               "usage": {"prompt_tokens": 2, "completion_tokens": self.tokens, "total_tokens": 2 + self.tokens}}

    def close(self) -> None:
        self.closed = True
        if self.close_fails:
            raise OSError("the socket's close failed")

    def abandon(self) -> None:
        self.abandoned = True


def test_a_prompt_no_node_serves_after_another_prompts_tokens_fails_the_answer_as_a_broken_stream():
    """A retryable 503 says nothing happened; once a prompt's tokens came (and are charged), a later prompt
    with no node left ends the answer as a stream broken after its first token (a 502, engine_error)."""
    from app.node_client import NodeStreamError
    from app.prompt_batch import PromptBatch
    tokens_came = threading.Event()
    batch = PromptBatch([_FakeStream(3), _FakeStream(0, fails=True, after=tokens_came)], 1)
    seen = []
    with pytest.raises(NodeStreamError):
        for event in batch.events():
            seen.append(event)
            if event["type"] == "finish":
                tokens_came.set()
    assert [e["type"] for e in seen] == ["token"] * 3 + ["finish"] and batch.tokens_read == 3
    with pytest.raises(APIError):                       # nothing came yet: the refusal as it is
        list(PromptBatch([_FakeStream(0, fails=True), _FakeStream(3, after=threading.Event())], 1).events())
    done = list(PromptBatch([_FakeStream(2), _FakeStream(1)], 1).events())[-1]
    assert [c["index"] for c in done["choices"]] == [0, 1] and done["usage"]["completion_tokens"] == 3


def test_a_prompt_batch_relays_each_prompt_as_it_comes_and_ends_each_when_it_ends():
    """A later prompt's tokens are not held back until the earlier prompts end, and each prompt's finish
    comes when it ends; every reader closes its stream."""
    from app.prompt_batch import PromptBatch
    first_ended = threading.Event()
    streams = [_FakeStream(3, after=first_ended), _FakeStream(1)]
    kinds = []
    for event in PromptBatch(streams, 2).events():
        kinds.append((event["type"], [c["index"] for c in event["choices"]] if "choices" in event else event["index"]))
        if event["type"] == "finish":
            first_ended.set()
    assert kinds == [("token", 2), ("finish", [2]), ("token", 0), ("token", 0), ("token", 0), ("finish", [0]),
                     ("done", [0, 2])]
    assert all(s.closed for s in streams)
    ended = []                                          # a close that fails still ends its reader's part
    reading = threading.Thread(target=lambda: ended.extend(PromptBatch([_FakeStream(1, close_fails=True)], 1).events()),
                               daemon=True)
    reading.start()
    reading.join(5)
    assert [e["type"] for e in ended] == ["token", "finish", "done"]


def test_a_closed_prompt_batch_stops_its_readers_and_fails_over_no_more():
    from app.prompt_batch import PromptBatch
    gate = threading.Event()
    streams = [_FakeStream(1), _FakeStream(50, after=gate)]
    batch = PromptBatch(streams, 1)
    events = batch.events()
    next(events)
    batch.close()
    gate.set()
    deadline = time.monotonic() + 5
    while not all(s.closed for s in streams):
        assert time.monotonic() < deadline, "a reader kept its stream"
        time.sleep(0.01)
    assert all(s.abandoned for s in streams) and streams[1].tokens_read <= 2
    unread = [_FakeStream(1), _FakeStream(1)]
    PromptBatch(unread, 1).close()                      # never read: closed at once
    assert all(s.closed for s in unread)


def test_a_client_leaving_a_prompt_batch_ends_every_prompt_at_once(client, auth, node):
    """Its readers wait on the node for the next token: the batch's close wakes them at once (their
    sockets shut down: the node aborts each prompt), not when that token comes."""
    node.token_delay_s = 3.0
    before = set(threading.enumerate())
    r = client.post(COMPLETIONS, headers=auth, json={"model": "zen-small", "prompt": ["a", "b"], "max_tokens": 4,
                                                      "stream": True})
    it = r.response
    next(it), next(it)                                  # the headers, and a first token
    readers = [t for t in threading.enumerate() if t.name.startswith("prompt-") and t not in before]
    assert len(readers) == 2
    left = time.monotonic()
    r.close()
    while any(t.is_alive() for t in readers):
        assert time.monotonic() - left < 2.0, "a prompt's reader went on until its next token"
        time.sleep(0.02)


def test_a_streamed_prompt_batch_interleaves_its_prompts(client, auth, node):
    node.token_delay_s = 0.05
    body = {"model": "zen-small", "prompt": ["Once upon", "a time"], "max_tokens": 4, "stream": True}
    r = client.post(COMPLETIONS, headers=auth, json=body)
    order = [(c["index"], c["finish_reason"] or "") for e in sse_events(r.get_data(as_text=True))[:-1]
             for c in e["choices"]]
    assert sorted(order) == [(0, "")] * 4 + [(0, "length")] + [(1, "")] * 4 + [(1, "length")]
    assert order.index((1, "")) < len(order) - 1 - order[::-1].index((0, ""))    # before prompt 0's last token


def test_token_id_prompts_go_each_as_a_request_of_its_own(client, auth, node):
    r = client.post(COMPLETIONS, headers=auth, json={"model": "zen-small", "prompt": [[1, 2, 3], [4, 5]],
                                                     "max_tokens": 2})
    assert r.status_code == 200 and [c["index"] for c in r.get_json()["choices"]] == [0, 1]
    sent = sorted(node.received[-2:], key=lambda x: x["request_id"])
    assert [x["prompt_token_ids"] for x in sent] == [[1, 2, 3], [4, 5]]
    # one client request to the node's org share: each part names it as its group, an id of the gateway's
    # own (a client reusing its X-Request-Id would join another request's group, and escape the share)
    assert sent[0]["group"] == sent[1]["group"] and sent[0]["group"].startswith(sent[0]["org"] + "/")
    again = {**auth, "X-Request-Id": "same-id"}
    for _ in range(2):
        client.post(COMPLETIONS, headers=again, json={"model": "zen-small", "prompt": [[1], [2]], "max_tokens": 2})
    groups = [x["group"] for x in node.received[-4:]]
    assert groups[0] == groups[1] != groups[2] == groups[3] and not any("same-id" in g for g in groups)
    client.post(COMPLETIONS, headers=auth, json={"model": "zen-small", "prompt": [1, 2], "max_tokens": 2})
    assert "group" not in node.received[-1]


@pytest.mark.parametrize("body, param", BAD_COMPLETIONS)
def test_bad_completion_input_names_the_parameter(client, auth, body, param):
    assert_error(client.post(COMPLETIONS, headers=auth, json=body), 400, param)


@pytest.mark.parametrize("raw", [b"{", b"not json", b"", b"\xff\xfe", b"[1, 2]", b"null", b'"x"',
                                 b"[" * 100_000 + b"]" * 100_000])
def test_malformed_bodies_are_400(client, auth, raw):
    r = client.post(CHAT, headers={**auth, "Content-Type": "application/json"}, data=raw)
    assert_error(r, 400, None)


def test_nan_and_infinity_are_refused(client, auth):
    raw = b'{"model": "zen-small", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}'
    assert_error(client.post(CHAT, headers=auth, data=raw, content_type="application/json"),
                 400, "temperature")


@pytest.mark.parametrize("param", ["temperature", "top_p", "seed", "n", "max_tokens", "logit_bias"])
def test_an_integer_past_floats_range_is_a_400_naming_it(client, auth, param):
    value = {"5": 10 ** 400} if param == "logit_bias" else 10 ** 400
    assert_error(client.post(CHAT, headers=auth, json=chat_body(**{param: value})), 400, param)


@pytest.mark.parametrize("path", [CHAT, "/tokenize"])
def test_a_lone_surrogate_is_a_400_and_reaches_no_node(client, auth, node, path):
    lone = json.dumps(chat_body(messages=[{"role": "user", "content": "a\ud800"}]))
    for raw in (lone.encode(), lone.encode("utf-16"), lone.encode("utf-32-le")):   # json reads all three
        assert_error(client.post(path, headers=auth, data=raw, content_type="application/json"),
                     400, None, "invalid_json")
    assert node.received == []
    ok = chat_body(messages=[{"role": "user", "content": "\ud83c\udf89"}], max_tokens=2)   # a pair: one character
    assert client.post(path, headers=auth, json=ok).status_code == 200


def test_unknown_and_forbidden_models_are_404(client, gateway):
    cfg = gateway[1]
    assert_error(client.post(CHAT, headers=bearer(cfg, "acme"), json=chat_body(model="gpt-4")),
                 404, "model", "model_not_found")
    assert_error(client.post(CHAT, headers=bearer(cfg, "globex"),
                             json=chat_body(model="zen-small-f16")), 404, "model", "model_not_found")


def test_the_default_max_tokens_fits_what_the_prompt_leaves(client, auth, node):
    # no max_tokens: the model's default (512), shortened to the room left by 8000 prompt tokens of 8192
    r = client.post(COMPLETIONS, headers=auth, json={"model": "zen-small", "prompt": list(range(8000))})
    assert r.status_code == 200, r.text
    sent = node.received[-1]["sampling"]
    assert sent["max_tokens"] == 192 and sent["max_tokens_default"] is True
    # a text prompt's length is known at the node: the default goes with its flag, the client's without
    client.post(CHAT, headers=auth, json=chat_body())
    assert node.received[-1]["sampling"]["max_tokens_default"] is True
    client.post(CHAT, headers=auth, json=chat_body(max_completion_tokens=7))
    assert node.received[-1]["sampling"]["max_tokens"] == 7
    assert "max_tokens_default" not in node.received[-1]["sampling"]


def test_logprobs_bytes_are_the_tokens_own():
    # "🎉" over two tokens: each shows as U+FFFD on its own; its bytes still join into the character
    entries = [{"token": "\ufffd", "bytes": [240, 159], "logprob": -0.1,
                "top": [{"token": "\ufffd", "bytes": [240, 159], "logprob": -0.1}]},
               {"token": "\ufffd", "bytes": [142, 137], "logprob": -0.2, "top": []}]
    content = responses.chat_logprob_content(entries, 1)
    assert bytes(content[0]["bytes"] + content[1]["bytes"]).decode() == "🎉"
    assert content[0]["top_logprobs"][0]["bytes"] == [240, 159]


def test_chat_logprobs_leave_out_the_special_tokens_the_content_leaves_out():
    """An end-of-turn token (marked skipped by the node) is not one of the content's tokens, whole or
    streamed; the completions' logprobs keep it (OpenAI's legacy endpoint lists <|endoftext|> too)."""
    entries = [{"token": "No", "bytes": [78, 111], "logprob": -0.1, "top": []},
               {"token": "<|im_end|>", "bytes": list(b"<|im_end|>"), "logprob": -0.2, "top": [], "skipped": True}]
    assert [c["token"] for c in responses.chat_logprob_content(entries, 0)] == ["No"]
    writer = responses.ChunkWriter(responses.CHAT, "1", "zen-small", "m", "q4_1", 1, False, 0)
    chunk = json.loads(writer.token({"index": 0, "text": "", "logprobs": entries[1]})[6:])
    assert chunk["choices"][0]["logprobs"] is None
    assert responses.completion_logprobs(entries, 0)["tokens"] == ["No", "<|im_end|>"]


def test_prompt_over_the_context(client, auth, node):
    err = assert_error(client.post(COMPLETIONS, headers=auth, json={
        "model": "zen-small", "prompt": list(range(8000)), "max_tokens": 500}),
        400, "prompt", "context_length_exceeded")
    assert "8192" in err["message"]
    assert node.received == []
    # text the node finds too long: its 400 comes back, naming the chat parameter
    r = client.post(CHAT, headers=auth, json=chat_body(messages=[{"role": "user", "content": "x" * 40000}]))
    assert_error(r, 400, "messages", "context_length_exceeded")


def test_a_nodes_max_tokens_error_names_the_parameter_the_client_sent(client, auth, node):
    long = [{"role": "user", "content": "x" * 20000}]   # 5002 tokens at the stand-in's count
    for name in ("max_tokens", "max_completion_tokens"):
        for stream in (False, True):
            err = assert_error(client.post(CHAT, headers=auth, json=chat_body(
                messages=long, stream=stream, **{name: 4000})), 400, name, "context_length_exceeded")
            assert f"{name} (4000)" in err["message"] and "use " + name in err["message"]


def test_oversized_body_is_413():
    cfg = make_config([], server={"max_body_bytes": 2048})
    app = create_app(cfg)
    try:
        r = app.test_client().post(CHAT, headers=bearer(cfg), json=chat_body(
            messages=[{"role": "user", "content": "x" * 5000}]))
        assert_error(r, 413, None, "request_too_large")
    finally:
        close_app(app)


def test_an_oversized_chunked_body_is_413_not_cut_short(node):
    cfg = make_config([node.url], server={"max_body_bytes": 2048})
    app = create_app(cfg)
    try:
        exact = 2048 - len(json.dumps({"model": "zen-small", "prompt": "", "max_tokens": 2}))
        for size, status in ((5000, "413"), (1000, "200"), (exact, "200")):     # exact: 2048 bytes in all
            body = json.dumps({"model": "zen-small", "prompt": "a" * size, "max_tokens": 2}).encode()
            env = EnvironBuilder(COMPLETIONS, method="POST", data=body, headers={
                **bearer(cfg), "Content-Type": "application/json"}).get_environ()
            del env["CONTENT_LENGTH"]             # as a server passes a chunked body on
            env["wsgi.input_terminated"] = True
            answer, got, _ = run_wsgi_app(app, env)
            data = b"".join(answer)
            answer.close()
            assert got.startswith(status), (got, data)
            if status == "413":
                assert json.loads(data)["error"]["code"] == "request_too_large"
    finally:
        close_app(app)


def test_unknown_route_and_method_in_openai_shape(client, auth):
    assert_error(client.post("/v1/nope", headers=auth), 404, None, "not_found")
    r = client.get(CHAT, headers=auth)
    assert_error(r, 405, None, "method_not_allowed")
    assert "POST" in r.headers["Allow"]


def test_unexpected_errors_are_a_500_without_a_trace(client, auth, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("secret internals")
    monkeypatch.setattr("app.api.build_request", boom)
    r = client.post(CHAT, headers=auth, json=chat_body())
    err = assert_error(r, 500, None, "internal_error")
    assert "secret internals" not in r.get_data(as_text=True)
    assert r.headers["x-request-id"] in err["message"]


def test_an_unexpected_error_reading_the_node_s_answer_to_a_stream_is_a_500(client, auth, node, monkeypatch):
    """The stream's answer is returned before the node's answer is read; an exception there still
    reaches the client as the 500 the error handler would give, and the server goes on."""
    def boom(self):
        raise RuntimeError("secret internals")
    monkeypatch.setattr(node_client.NodeStream, "_accept", boom)
    r = client.post(CHAT, headers=auth, json=chat_body(stream=True))
    err = assert_error(r, 500, None, "internal_error")
    assert "secret internals" not in r.get_data(as_text=True)
    assert r.headers["x-request-id"] in err["message"] and "x-ratelimit-limit-tokens" in r.headers
    monkeypatch.undo()
    r = client.post(CHAT, headers=auth, json=chat_body(stream=True))
    assert r.status_code == 200 and sse_events(r.get_data(as_text=True))[-1] == "[DONE]"


# -- openapi, metrics, logs ----------------------------------------------------------------------

def test_openapi_description(client):
    doc = client.get("/openapi.json").get_json()
    assert doc["openapi"].startswith("3.0")
    assert set(doc["paths"]) >= {"/v1/chat/completions", "/v1/completions", "/v1/models",
                                 "/v1/models/{model}", "/health"}
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert chat["required"] == ["model", "messages"]
    assert chat["properties"]["temperature"]["maximum"] == 2.0
    assert chat["properties"]["n"]["maximum"] == 8
    assert "429" in doc["paths"]["/v1/chat/completions"]["post"]["responses"]


def test_metrics_per_org_and_latency(client, gateway, node):
    cfg = gateway[1]
    client.post(CHAT, headers=bearer(cfg, "acme"), json=chat_body(max_tokens=4))
    with client.post(CHAT, headers=bearer(cfg, "acme"), json=chat_body(max_tokens=4, stream=True)) as r:
        r.get_data()   # a stream's usage is counted when the server closes the response, as WSGI servers do
    client.post(CHAT, headers=bearer(cfg, "unlisted-org"), json=chat_body(max_tokens=2))
    client.post(CHAT, json=chat_body())
    text = client.get("/metrics", headers=METRICS_HEADERS).get_data(as_text=True)
    assert 'zen_gateway_org_requests_total{endpoint="api.chat_completions",org="acme",status="200"} 2.0' in text
    assert 'zen_gateway_org_completion_tokens_total{model="zen-small",org="acme"} 8.0' in text
    assert 'zen_gateway_org_completion_tokens_total{model="zen-small",org="other"} 2.0' in text
    assert 'unlisted-org' not in text                          # bounded label values
    assert 'zen_gateway_org_errors_total{org="anonymous",status="401"} 1.0' in text
    assert 'zen_gateway_time_to_first_token_seconds_count{latency_class="standard",model="zen-small"} 3.0' in text
    # the stream's three gaps between four tokens: the JSON answers' tokens came at once
    assert 'zen_gateway_inter_token_latency_seconds_count{latency_class="standard",model="zen-small"} 3.0' in text
    assert 'zen_gateway_e2e_request_latency_seconds_bucket{latency_class="standard",le="480.0",model="zen-small"} 3.0' in text
    assert "zen_gateway_flask_http_request_total" in text
    # a method a client invents is a 405 labelled OTHER: a series per invented method was a series per request
    for method in ("XQZJWKA", "BREW"):
        assert_error(client.open("/v1/models", method=method, headers=bearer(cfg)), 405)
    text = client.get("/metrics", headers=METRICS_HEADERS).get_data(as_text=True)
    assert 'method="OTHER"' in text and "XQZJWKA" not in text and "BREW" not in text


def test_failovers_are_labelled_with_the_dns_name_their_pod_was_found_under(monkeypatch):
    """With discovery (the k8s config), a failover names the dns+ entry its pod was found under (pod
    addresses change with every rollout: a series per pod would grow without end); a URL discovery does
    not know is "other"."""
    def pods(host, port, type=0):
        return [(socket.AF_INET, type, 6, "", (f"10.0.0.{i}", port)) for i in (5, 6)]
    monkeypatch.setattr(socket, "getaddrinfo", pods)
    app = create_app(make_config(["dns+http://zen-node.zen.svc.cluster.local:8001"]))
    try:
        client = app.extensions["zen.nodes"]
        assert client.pool.discovery.urls() == ["http://10.0.0.5:8001", "http://10.0.0.6:8001"]
        client.on_failover("http://10.0.0.5:8001", "busy")
        client.on_failover("http://10.9.9.9:8001", "busy")
        client.on_failover("http://10.0.0.6:8001", "busy")
        entry = "dns+http://zen-node.zen.svc.cluster.local:8001"
        text = app.test_client().get("/metrics", headers=METRICS_HEADERS).get_data(as_text=True)
        assert f'zen_gateway_node_failovers_total{{node="{entry}",reason="busy"}} 2.0' in text
        assert 'zen_gateway_node_failovers_total{node="other",reason="busy"} 1.0' in text
        assert "10.0.0." not in text
    finally:
        close_app(app)


def test_logs_are_json_with_request_id_and_org(node):
    cfg = make_config([node.url], server={"log_level": "INFO"})
    app = create_app(cfg)
    lines = []

    class Capture(logging.Handler):
        def emit(self, record):
            lines.append(self.format(record))

    logger = logging.getLogger("zen.gateway")
    handler = Capture()
    handler.setFormatter(logger.handlers[0].formatter)
    logger.addHandler(handler)
    try:
        c, h = app.test_client(), bearer(cfg, "acme")
        c.post(CHAT, headers={**h, "X-Request-Id": "trace-42"}, json=chat_body(max_tokens=2))
        with c.post(CHAT, headers={**h, "X-Request-Id": "trace-43"},
                    json=chat_body(max_tokens=2, stream=True)) as r:
            r.get_data()   # the stream's log line is written when the response is closed
    finally:
        logger.removeHandler(handler)
        close_app(app)
    records = [json.loads(line) for line in lines]
    done = {r["request_id"]: r for r in records if r.get("event") == "request"}
    for rid in ("trace-42", "trace-43"):
        assert done[rid]["org"] == "acme" and done[rid]["status"] == 200
        assert done[rid]["model"] == "zen-small" and done[rid]["node"] == node.url
        assert done[rid]["path"] == CHAT and done[rid]["duration_ms"] > 0
    assert done["trace-43"]["completion_tokens"] == 2 and done["trace-43"]["stream"] is True


@pytest.mark.parametrize("include_usage", [True, False])
@pytest.mark.parametrize("kind", [responses.CHAT, responses.COMPLETIONS])
def test_a_token_chunk_is_its_full_serialisation(kind, include_usage):
    """The token chunk is built from a per-choice template around its text: byte for byte what
    serialising the whole chunk gives, for every choice, for text JSON must escape, and for a model
    name that holds the template's own marker."""
    marker = "\x00text\x00"
    for alias in ("zen-small", marker, '"' + marker):
        writer = responses.ChunkWriter(kind, "req_1", alias, MODEL_ID, "q4_1", 2, include_usage, None,
                                       service_tier="flex")
        for index, text in [(0, "Hé \"quoted\"\n\\ \u2028 😀"), (1, marker), (0, ""), (1, "</s>")]:
            choice = ({"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
                      if kind == responses.CHAT else
                      {"index": index, "text": text, "logprobs": None, "finish_reason": None})
            chunk = {"id": writer.id, "object": writer.object, "created": writer.created, "model": alias,
                     "service_tier": "flex", "system_fingerprint": writer.fingerprint, "choices": [choice]}
            if include_usage:
                chunk["usage"] = None
            assert writer.token({"index": index, "text": text}) == responses.sse(chunk)


def test_completion_top_logprobs_keep_the_likeliest_of_one_text_and_the_sampled_token():
    entries = [{"token": "T", "logprob": -7.6, "top": [{"token": "D", "logprob": -0.4}, {"token": "E", "logprob": -1.0}]},
               {"token": "\ufffd", "logprob": -3.0, "top": [{"token": "\ufffd", "logprob": -1.0},
                                                            {"token": "\ufffd", "logprob": -2.0}]}]
    top = responses.completion_logprobs(entries, top_n=2)["top_logprobs"]
    assert top[0] == {"D": -0.4, "E": -1.0, "T": -7.6}     # OpenAI: up to logprobs + 1, the sampled one always
    assert top[1] == {"\ufffd": -1.0}                       # two byte tokens print alike: the likelier one's


def test_a_prompt_of_digits_is_estimated_a_token_a_digit():
    """SmolLM2's and Gemma's tokenizers split every digit: three bytes a token reserved a third of them."""
    from app.inference import PromptInput
    assert PromptInput(prompt="3141592653" * 30).estimated_tokens == 300
    assert PromptInput(prompt="Say hi").estimated_tokens == 2


def test_a_json_answers_time_to_first_token_is_the_gateways_as_a_streams(client, auth, node):
    """Both from the request's arrival at the gateway to its first token there: the node's own figure
    leaves out routing, a failover or a wait for a load."""
    node.first_token_delay_s = 0.3
    for stream in (False, True):
        r = client.post(CHAT, headers=auth, json=chat_body(stream=stream, max_tokens=2))
        r.get_data()
        r.close()
    text = client.get("/metrics", headers=METRICS_HEADERS).get_data(as_text=True)
    sums = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("zen_gateway_time_to_first_token_seconds_sum{")]
    counts = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("zen_gateway_time_to_first_token_seconds_count{")]
    assert counts == [2.0] and sums[0] >= 0.6


def test_an_answer_that_does_not_stream_has_a_bound_on_its_logprob_entries(client, auth, node):
    """Built whole in the gateway's memory (~0.7 KB an entry): past the bound, a 400 that says to stream."""
    body = chat_body(max_tokens=4000, n=8, logprobs=True, top_logprobs=20)   # 8 x 4000 x 21 entries
    err = assert_error(client.post(CHAT, headers=auth, json=body), 400, param="top_logprobs")
    assert "stream it" in err["message"] and node.received == []
    r = client.post(CHAT, headers=auth, json={**body, "max_tokens": 4, "stream": False})
    assert r.status_code == 200                                              # 8 x 4 x 21: within it
    r = client.post(COMPLETIONS, headers=auth, json={"model": "zen-small", "prompt": "x", "max_tokens": 8000,
                                                     "n": 8, "logprobs": 5})
    assert_error(r, 400, param="logprobs")
    r = client.post(CHAT, headers=auth, json={**body, "stream": True})          # streamed: relayed as it comes
    assert r.status_code == 200
    r.close()


def test_one_org_holds_at_most_its_share_of_a_workers_threads():
    """org_thread_share 0.5 of 4 threads: two of an org's generations at once; its third is a 429 while
    another org's is served, and it is taken again once one of the two has ended."""
    from app.org_share import OrgThreadShare
    node = StandInNode().start()
    node.token_delay_s = 0.05
    cfg = make_config([node.url], server={"threads": 4, "org_thread_share": 0.5})
    app = create_app(cfg)
    try:
        assert app.extensions["zen.org_share"].most == 2
        c = app.test_client()
        held = [c.post(CHAT, headers=bearer(cfg), json=chat_body(stream=True, max_tokens=40)) for _ in range(2)]
        assert [r.status_code for r in held] == [200, 200]
        third = c.post(CHAT, headers=bearer(cfg), json=chat_body(max_tokens=2))
        err = assert_error(third, 429, code="concurrency_limit_exceeded")
        assert err["type"] == "requests" and third.headers["retry-after"] == "1"
        assert c.post(CHAT, headers=bearer(cfg, "globex"), json=chat_body(max_tokens=2)).status_code == 200
        metrics = c.get("/metrics", headers=METRICS_HEADERS).get_data(as_text=True)
        assert 'zen_gateway_org_rate_limited_total{limit="concurrency",org="acme"} 1.0' in metrics
        held[0].close()                                  # its stream ended: its thread is free
        assert c.post(CHAT, headers=bearer(cfg), json=chat_body(max_tokens=2)).status_code == 200
        held[1].close()
    finally:
        close_app(app)
        node.stop()
    share = OrgThreadShare(cfg.server)
    release = share.acquire("a")
    release()
    release()                                            # once only
    assert share.held("a") == 0
