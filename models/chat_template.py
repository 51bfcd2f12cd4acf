"""Chat templates as transformers renders them: a sandboxed Jinja2 environment, and the messages checked
and flattened to the strings templates expect."""
from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.sandbox


class TemplateError(ValueError):
    """The chat template refused the messages (raise_exception) or failed to render."""


class TemplateCompileError(ValueError):
    """The chat template's source is not a valid Jinja2 template."""


def compile_chat_template(source: str) -> jinja2.Template:
    """A sandboxed Jinja2 environment configured like transformers' apply_chat_template."""

    def raise_exception(message):
        raise TemplateError(str(message))

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise TemplateCompileError(f"the chat template does not compile: {e}") from None


@functools.lru_cache(maxsize=64)
def cached_chat_template(source: str) -> jinja2.Template:
    """compile_chat_template, once per distinct source: the models' own templates and those sent with each
    request (a catalog's) are compiled on their first use only."""
    return compile_chat_template(source)


@functools.lru_cache(maxsize=64)
def renders_tools(source: str | None) -> bool:
    """Whether a template reads a `tools` variable itself (else callers describe tools in messages); not
    the word in its text, which a template may have in a comment or a string."""
    if not source:
        return False
    try:
        return "tools" in jinja2.meta.find_undeclared_variables(
            jinja2.Environment(extensions=[jinja2.ext.loopcontrols]).parse(source))
    except jinja2.TemplateError:   # rendering it reports why
        return False


def normalize_messages(messages) -> list[dict]:
    """Validate chat messages; content may be a string, None, or a list of OpenAI text parts."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError("messages must be a list of {'role': ..., 'content': ...} objects")
    if not messages:
        raise ValueError("messages must not be empty")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content', got {type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}].role must be a non-empty string")
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                    raise ValueError(f"messages[{i}].content[{j}]: unsupported content part {kind!r} (only text)")
                texts.append(part["text"])
            content = "\n".join(texts)
        elif not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts")
        msg = dict(m)
        msg["content"] = content
        out.append(msg)
    return out
