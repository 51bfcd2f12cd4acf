"""A catalog's chat template: checked when the gateway's config loads, sent to the node with the alias's chat
and /tokenize-with-messages requests (and only those), rendered by the node in place of the model's own."""
from __future__ import annotations

import pytest

from app import close_app, create_app
from app.config import DEFAULT_CONFIG_PATH, ConfigError, load_config
from engine.node.generation import prompt_token_ids
from engine.protocol import MAX_CHAT_TEMPLATE_CHARS, APIError, GenerateRequest, TokenizeRequest
from engine.tools import RESPONSE_OPEN
from models.chat_template import cached_chat_template
from tests.test_gateway_api import assert_error, chat_body
from tests.test_gateway_support import bearer, make_config, node  # noqa: F401 (fixtures)
from tests.tiny_model import make_tiny_tokenizer

GEMMA_TEMPLATE = DEFAULT_CONFIG_PATH.parent / "templates" / "gemma.jinja"
PLAIN = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
WITH_TOOLS = "{% for t in tools %}<{{ t['name'] }}>{% endfor %}" + PLAIN
TOOL = {"name": "lookup", "parameters": {"type": "object", "properties": {}}}
HI = [{"role": "user", "content": "hi"}]


def _model_config(**model) -> dict:
    return {"models": {"zen-small": model}}


# -- the configuration ----------------------------------------------------------------------------

def test_a_named_template_is_read_relative_to_the_config_file(tmp_path):
    cfg = load_config(env={}, overrides=_model_config(chat_template="templates/gemma.jinja"))
    assert cfg.models["zen-small"].chat_template_source == GEMMA_TEMPLATE.read_text()
    assert cfg.models["zen-small"].chat and cfg.models["zen-gemma"].chat_template_source is None
    (tmp_path / "mine.jinja").write_text(PLAIN)
    cfg = load_config(env={}, overrides=_model_config(chat_template=str(tmp_path / "mine.jinja")))
    assert cfg.models["zen-small"].chat_template_source == PLAIN


@pytest.mark.parametrize("write, model, words", [
    (None, {"chat_template": "templates/missing.jinja"}, "models.zen-small.chat_template: cannot read"),
    ("{% for m in messages %}{{ m.content ", {}, "models.zen-small.chat_template: .* does not compile"),
    ("", {}, "models.zen-small.chat_template: .* must hold 1 to"),
    ("x" * (MAX_CHAT_TEMPLATE_CHARS + 1), {}, "models.zen-small.chat_template: .* must hold 1 to"),
    (PLAIN, {"chat": False}, "models.zen-small: chat = false and a chat_template contradict"),
    (None, {"chat_template": 3}, "models.zen-small.chat_template must be a string, got an integer"),
    (None, {"chat_template_source": PLAIN}, r"\[models.zen-small\] unknown keys"),
])
def test_a_bad_template_is_a_config_error_naming_the_key(tmp_path, write, model, words):
    if write is not None:
        (tmp_path / "t.jinja").write_text(write)
        model = {"chat_template": str(tmp_path / "t.jinja"), **model}
    with pytest.raises(ConfigError, match=words):
        load_config(env={}, overrides=_model_config(**model))


# -- the node's rendering -------------------------------------------------------------------------

def test_the_node_renders_with_the_template_it_is_sent():
    tok = make_tiny_tokenizer()
    own = prompt_token_ids(tok, None, HI, add_special_tokens=False)
    assert own == tok.encode(tok.apply_chat_template(HI), add_special_tokens=False)
    sent = prompt_token_ids(tok, None, HI, add_special_tokens=False, chat_template=PLAIN)
    assert sent == tok.encode("[user] hi\n", add_special_tokens=False) != own
    before = cached_chat_template.cache_info()
    for _ in range(3):
        prompt_token_ids(tok, None, HI, chat_template=PLAIN)
    after = cached_chat_template.cache_info()
    assert after.hits - before.hits == 3 and after.misses == before.misses   # compiled once, not per request


def test_tools_go_to_a_template_that_renders_them_and_into_the_messages_otherwise():
    tok = make_tiny_tokenizer()
    assert prompt_token_ids(tok, None, HI, add_special_tokens=False, tools=[TOOL], chat_template=WITH_TOOLS) == \
        tok.encode("<lookup>[user] hi\n", add_special_tokens=False)
    history = HI + [{"role": "tool", "content": "42"}]
    text = tok.decode(prompt_token_ids(tok, None, history, add_special_tokens=False, tools=[TOOL],
                                       chat_template=PLAIN))
    assert text.startswith("[system] # Tools") and '"name": "lookup"' in text
    assert f"[user] {RESPONSE_OPEN}\n42" in text


def test_a_template_that_does_not_compile_or_refuses_is_a_400():
    tok = make_tiny_tokenizer()
    with pytest.raises(APIError) as err:
        prompt_token_ids(tok, None, HI, chat_template="{% if %}")
    assert (err.value.status, err.value.param) == (400, "chat_template")
    with pytest.raises(APIError) as err:
        prompt_token_ids(tok, None, [{"role": "assistant", "content": "x"}],
                         chat_template=GEMMA_TEMPLATE.read_text())
    assert (err.value.status, err.value.param) == (400, "messages") and "alternate" in err.value.message


@pytest.mark.parametrize("value", [3, "", "x" * (MAX_CHAT_TEMPLATE_CHARS + 1), ["t"]])
def test_the_wire_field_is_checked(value):
    for parse in (lambda b: GenerateRequest.from_json(b, lambda q: q), TokenizeRequest.from_json):
        with pytest.raises(APIError) as err:
            parse({"model": "m", "messages": HI, "chat_template": value})
        assert (err.value.status, err.value.param, err.value.code) == (400, "chat_template", "invalid_type")
    with pytest.raises(APIError) as err:   # a prompt has no template to render
        GenerateRequest.from_json({"model": "m", "prompt": "x", "chat_template": PLAIN}, lambda q: q)
    assert err.value.param == "chat_template"
    call = GenerateRequest.from_json({"model": "m", "messages": HI, "chat_template": PLAIN}, lambda q: q)
    assert call.chat_template == PLAIN and call.to_json()["chat_template"] == PLAIN


# -- through the gateway (a stand-in node records what it is sent) ---------------------------------

@pytest.fixture
def templated(node):  # noqa: F811
    """(client, auth) of a gateway whose zen-small names Gemma's template; zen-gemma names none."""
    config = make_config([node.url], models={"zen-small": {"chat_template": "templates/gemma.jinja"}})
    app = create_app(config)
    yield app.test_client(), bearer(config)
    close_app(app)


def test_the_template_goes_with_chat_and_tokenize_of_messages_only(templated, node):  # noqa: F811
    client, auth = templated
    source = GEMMA_TEMPLATE.read_text()
    assert client.get("/v1/models/zen-small", headers=auth).get_json()["chat"] is True
    assert client.post("/v1/chat/completions", headers=auth, json=chat_body()).status_code == 200
    assert node.received[-1]["chat_template"] == source
    assert client.post("/v1/completions", headers=auth, json={"model": "zen-small", "prompt": "hi"}).status_code == 200
    assert "chat_template" not in node.received[-1]
    r = client.post("/tokenize", headers=auth, json={"model": "zen-small", "messages": HI, "chat_template": PLAIN})
    assert r.status_code == 200 and node.received[-1]["chat_template"] == source   # the catalog's, not the client's
    assert client.post("/tokenize", headers=auth, json={"model": "zen-small", "prompt": "hi"}).status_code == 200
    assert "chat_template" not in node.received[-1]


def test_an_alias_without_a_template_or_chat_is_refused_before_the_node(templated, node):  # noqa: F811
    client, auth = templated
    sent = len(node.received)
    assert client.get("/v1/models/zen-gemma", headers=auth).get_json()["chat"] is False
    assert_error(client.post("/v1/chat/completions", headers=auth, json=chat_body(model="zen-gemma")), 400,
                 "messages", "chat_not_supported")
    assert_error(client.post("/tokenize", headers=auth, json={"model": "zen-gemma", "messages": HI}), 400,
                 "messages", "chat_not_supported")
    assert len(node.received) == sent
    assert client.post("/v1/chat/completions", headers=auth, json=chat_body()).status_code == 200
    assert "chat_template" in node.received[-1]
