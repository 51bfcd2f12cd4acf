"""POST /tokenize and /detokenize on the gateway: authenticated, org-scoped, counted against the org's
requests per minute, forwarded to a node serving the model with the model's concrete id."""
from __future__ import annotations

import pytest

from app import close_app, create_app
from tests.test_gateway_support import MODEL_ID, auth, bearer, client, gateway, make_config, node  # noqa: F401


def test_tokenize_and_detokenize_are_forwarded(client, auth, node):  # noqa: F811
    r = client.post("/tokenize", headers=auth, json={"model": "zen-small", "prompt": "hey"})
    assert r.status_code == 200, r.get_json()
    assert r.get_json() == {"count": 3, "max_model_len": 8192, "tokens": [104, 101, 121], "token_strs": None}
    sent = node.received[-1]
    assert sent["path"] == "/tokenize" and sent["model"] == MODEL_ID and sent["quantization"] == "q4_1"
    assert sent["add_special_tokens"] is True
    r = client.post("/tokenize", headers=auth, json={"model": "zen-small",
                                                     "messages": [{"role": "user", "content": "hi"}]})
    assert r.get_json()["tokens"] == [104, 105] and node.received[-1]["add_special_tokens"] is False
    r = client.post("/detokenize", headers=auth, json={"model": "zen-small", "tokens": [104, 105]})
    assert r.status_code == 200 and r.get_json() == {"prompt": "hi"}
    tool = {"type": "function", "function": {"name": "lookup", "description": "find", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}}}}
    r = client.post("/tokenize", headers=auth, json={"model": "zen-small", "tools": [tool],
                                                     "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and node.received[-1]["tools"] == [tool]   # checked, sent as chat's are
    # the messages as a chat request's are: text parts joined, developer as system
    r = client.post("/tokenize", headers=auth, json={"model": "zen-small", "tools": [tool], "messages": [
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Really."}]},
        {"role": "user", "content": "hi"}]})
    assert r.status_code == 200
    assert node.received[-1]["messages"][0] == {"role": "system", "content": "Be brief.\nReally."}


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"model": "zen-small"}, 400, "prompt"),
    ("/tokenize", {"model": "zen-small", "prompt": 5}, 400, "prompt"),
    ("/detokenize", {"model": "zen-small", "tokens": "abc"}, 400, "tokens"),
    ("/detokenize", {"model": "no-such-model", "tokens": [1]}, 404, "model"),
    ("/tokenize", {"model": "zen-small", "messages": [{"role": "user", "content": "a"}],
                   "tools": [{"type": "function", "function": {"name": "bad name!"}}]}, 400, "tools"),
])
def test_bad_input_is_refused_before_the_node(client, auth, node, path, body, status, param):  # noqa: F811
    r = client.post(path, headers=auth, json=body)
    assert r.status_code == status and r.get_json()["error"]["param"] == param, r.get_json()
    assert node.received == []


def test_authentication_is_required(client, node):  # noqa: F811
    r = client.post("/tokenize", json={"model": "zen-small", "prompt": "a"})
    assert r.status_code == 401 and node.received == []


def test_counted_against_the_orgs_requests_per_minute(node):  # noqa: F811
    cfg = make_config([node.url], tiers={"free": {"requests_per_minute": 2}})
    app = create_app(cfg)
    try:
        c, headers = app.test_client(), bearer(cfg, "globex")
        codes = [c.post("/detokenize", headers=headers, json={"model": "zen-small", "tokens": [97]}).status_code
                 for _ in range(3)]
        assert codes == [200, 200, 429]
    finally:
        close_app(app)
