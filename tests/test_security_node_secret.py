"""Engine nodes refuse every request without the internal secret (X-Node-Secret), except GET /health
and GET /metrics; a wrong secret, one of another length, one in another header or in the body, and
an empty one are all refused the same way, and the refusal reveals nothing of the node's state."""
from __future__ import annotations

import json

import pytest
import requests

from tests.node_fixtures import SECRET_HEADER, launch_node, tiny_models  # noqa: F401 (tiny_models: fixture)

pytestmark = pytest.mark.slow
SECRET = "node-secret-for-security-tests-7f3a"

# (method, path, JSON body) of every endpoint that needs the secret.
PROTECTED = [
    ("POST", "/v1/generate", {"model": "tiny-a", "prompt": "hello", "sampling": {"max_tokens": 2}}),
    ("POST", "/v1/generate", {"model": "tiny-a", "prompt": "hello", "stream": True,
                              "sampling": {"max_tokens": 2}}),
    ("GET", "/state", None),
    ("GET", "/v1/models", None),
    ("POST", "/v1/models/load", {"model": "tiny-a"}),
    ("POST", "/v1/models/unload", {"model": "tiny-a"}),
]
BAD_SECRETS = [
    None,                                  # no header
    "",                                    # empty
    "wrong",                               # shorter
    SECRET[:-1],                           # a prefix
    SECRET + "x",                          # longer, with the secret as prefix
    SECRET.upper(),                        # case
    SECRET[:10] + "X" + SECRET[11:],       # same length, one character changed
]


@pytest.fixture(scope="module")
def node(tiny_models, tmp_path_factory):  # noqa: F811
    n = launch_node([tiny_models["a"] + "=tiny-a"], SECRET, log_dir=str(tmp_path_factory.mktemp("node-sec")))
    yield n
    n.stop()


def call(url: str, method: str, path: str, body, headers: dict) -> requests.Response:
    return requests.request(method, url + path, data=None if body is None else json.dumps(body),
                            headers={"Content-Type": "application/json", **headers}, timeout=30)


@pytest.mark.parametrize("method,path,body", PROTECTED, ids=[f"{m} {p}" for m, p, _ in PROTECTED])
@pytest.mark.parametrize("secret", BAD_SECRETS, ids=lambda s: "missing" if s is None else repr(s)[:12])
def test_protected_endpoints_refuse_without_the_secret(node, method, path, body, secret):
    headers = {} if secret is None else {SECRET_HEADER: secret}
    r = call(node.url, method, path, body, headers)
    assert r.status_code == 401, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    text = r.text
    # Nothing of the node leaks through a refusal: no model, no state, not the secret.
    assert SECRET not in text and "tiny-a" not in text and "kv_cache" not in text


def test_secret_elsewhere_is_not_accepted(node):
    """The secret counts only in its header: not as a bearer token, a query parameter or in the body."""
    body = {"model": "tiny-a", "prompt": "hi", "sampling": {"max_tokens": 2}, "secret": SECRET,
            "X-Node-Secret": SECRET}
    for headers, path in [({"Authorization": f"Bearer {SECRET}"}, "/v1/generate"),
                          ({}, f"/v1/generate?secret={SECRET}&X-Node-Secret={SECRET}"),
                          ({"X-Node-Secret-": SECRET}, "/v1/generate"),
                          ({}, "/v1/generate")]:
        r = call(node.url, "POST", path, body, headers)
        assert r.status_code == 401, (headers, path, r.status_code, r.text[:200])


def test_unknown_paths_and_methods_do_not_answer_without_the_secret(node):
    for method, path in [("GET", "/v1/generate"), ("DELETE", "/state"), ("GET", "/admin"),
                         ("GET", "/v1/models/tiny-a"), ("POST", "/state"), ("PUT", "/v1/models/load")]:
        r = requests.request(method, node.url + path, timeout=30)
        assert r.status_code in (401, 404, 405), (method, path, r.status_code)
        assert r.status_code != 200 and "tiny-a" not in r.text


def test_health_and_metrics_are_open(node):
    assert requests.get(node.url + "/health", timeout=30).status_code == 200
    m = requests.get(node.url + "/metrics", timeout=30)
    assert m.status_code == 200 and "zen_node_" in m.text


def test_the_right_secret_is_accepted(node):
    """The control: with the secret, the same requests are served."""
    h = {SECRET_HEADER: SECRET}
    assert call(node.url, "GET", "/state", None, h).status_code == 200
    assert call(node.url, "GET", "/v1/models", None, h).status_code == 200
    r = call(node.url, "POST", "/v1/generate", PROTECTED[0][2], h)
    assert r.status_code == 200, r.text[:300]
    assert r.json()["usage"]["completion_tokens"] >= 1


def test_refused_generate_does_not_reach_the_engine(node):
    """A refused /v1/generate never runs: the node's prompt-token counter does not move."""
    h = {SECRET_HEADER: SECRET}

    def prompt_tokens() -> float:
        text = requests.get(node.url + "/metrics", timeout=30).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("zen_node_prompt_tokens_total"))

    call(node.url, "POST", "/v1/generate", PROTECTED[0][2], h)      # the model is loaded and counted
    before = prompt_tokens()
    for _ in range(5):
        assert call(node.url, "POST", "/v1/generate", PROTECTED[0][2], {SECRET_HEADER: "nope"}).status_code == 401
    assert prompt_tokens() == before
