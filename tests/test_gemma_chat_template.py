"""Chat with Gemma 3 270M (its file has no chat template) through the gateway and a real node, rendered with
the catalog's config/templates/gemma.jinja: the prompt the node runs is that template's text, encoded by the
model's own tokenizer with exactly one BOS; the alias without the template still refuses chat."""
from __future__ import annotations

import pytest
import requests

from app import close_app, create_app
from app.config import DEFAULT_CONFIG_PATH
from engine.protocol import SECRET_HEADER
from models.loader import load_tokenizer
from tests.node_fixtures import start_node  # noqa: F401 (a fixture)
from tests.test_gateway_api import assert_error
from tests.test_gateway_support import NODE_SECRET, bearer, make_config
from tests.test_gemma3_real import gemma_path  # noqa: F401 (a fixture)

pytestmark = pytest.mark.slow

ALIAS = "zen-gemma-chat"
MESSAGES = [{"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "Paris"},
            {"role": "user", "content": "And of Italy?"}]
# Gemma's turn format, written out by hand: the system message folded into the first user turn
EXPECTED = ("<bos><start_of_turn>user\nAnswer in one word.\n\nWhat is the capital of France?<end_of_turn>\n"
            "<start_of_turn>model\nParis<end_of_turn>\n<start_of_turn>user\nAnd of Italy?<end_of_turn>\n"
            "<start_of_turn>model\n")


@pytest.fixture
def gateway(start_node, gemma_path):  # noqa: F811
    url = start_node([f"{gemma_path}=gemma-3-270m"], NODE_SECRET, kv_cache_bytes="64MiB", load_wait=600)
    # loaded before the gateway asks (a load on this shared machine takes longer than the ready wait)
    r = requests.post(url + "/tokenize", json={"model": "gemma-3-270m", "prompt": "x"},
                      headers={SECRET_HEADER: NODE_SECRET}, timeout=600)
    assert r.status_code == 200, r.text
    template = str(DEFAULT_CONFIG_PATH.parent / "templates" / "gemma.jinja")
    config = make_config([url], models={ALIAS: {"model": "gemma-3-270m", "quantization": "q4_k",
                                                "max_context": 8192, "default_max_tokens": 8,
                                                "chat_template": template}},
                         tiers={"pro": {"models": ["zen-small", "zen-gemma", ALIAS]}},
                         nodes={"read_timeout_s": 120.0})
    app = create_app(config)
    yield app.test_client(), bearer(config)
    close_app(app)


def test_chat_is_rendered_with_the_catalogs_template(gateway, gemma_path):  # noqa: F811
    client, auth = gateway
    tok = load_tokenizer(gemma_path)
    expected = tok.encode(EXPECTED, add_special_tokens=False)
    assert expected[:2] == [tok.bos_token_id, tok.encode("<start_of_turn>", add_special_tokens=False)[0]]
    assert expected.count(tok.bos_token_id) == 1

    r = client.post("/tokenize", headers=auth, json={"model": ALIAS, "messages": MESSAGES})
    assert r.status_code == 200, r.get_json()
    assert r.get_json()["tokens"] == expected

    r = client.post("/v1/chat/completions", headers=auth,
                    json={"model": ALIAS, "messages": MESSAGES, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.get_json()
    body = r.get_json()
    assert body["usage"]["prompt_tokens"] == len(expected)
    assert body["choices"][0]["message"]["role"] == "assistant"

    # the same model under the shipped alias, which names no template: still completions only
    assert_error(client.post("/v1/chat/completions", headers=auth, json={"model": "zen-gemma", "messages": MESSAGES}),
                 400, "messages", "chat_not_supported")
    r = client.post("/v1/completions", headers=auth, json={"model": "zen-gemma", "prompt": "The", "max_tokens": 2})
    assert r.status_code == 200, r.get_json()
