"""POST /tokenize and POST /detokenize: vLLM's tokenizer endpoints, forwarded to a node serving the model.

Authenticated, org-scoped (the model resolves through the caller's tier) and counted against the org's
requests per minute like the generation API; they use no LLM tokens.
"""
from __future__ import annotations

from dataclasses import replace

from flask import Blueprint, current_app, g, jsonify

from app import params
from app.api import read_json_body
from app.auth import login_required
from app.node_client import call_node
from app.tool_params import tool_plan
from engine.protocol import DetokenizeRequest, TokenizeRequest

bp = Blueprint("tokenizer", __name__)


def _forward(path: str, call):
    """Resolve the caller's model alias, send `call` to a node, and answer with the node's body."""
    model = current_app.extensions["zen.catalog"].resolve(call.model, g.caller.tier)
    call = replace(call, model=model.model, quantization=model.quantization)
    if isinstance(call, TokenizeRequest) and call.messages is not None:   # as a chat request to the alias is
        model.check_chat()
        call = replace(call, chat_template=model.chat_template)
    g.log_fields.update(model=model.alias)
    answer = call_node(current_app.extensions["zen.nodes"], model, path, call.to_json(),
                       f"{g.caller.org}/{g.request_id}")
    return jsonify(answer)


@bp.post("/tokenize")
@login_required
def tokenize():
    body = dict(read_json_body())
    body.pop("quantization", None)   # the catalog decides it
    body.pop("chat_template", None)   # and the chat template
    if body.get("messages") is not None:   # as a chat request's: text parts joined, developer as system
        body["messages"] = list(params.messages(body))
    if body.get("tools") not in (None, []):   # checked and rendered as a chat request's tools are
        body["tools"] = list(tool_plan({"tools": body["tools"]}, False).tools)
    return _forward("/tokenize", TokenizeRequest.from_json(body))


@bp.post("/detokenize")
@login_required
def detokenize():
    body = dict(read_json_body())
    body.pop("quantization", None)
    return _forward("/detokenize", DetokenizeRequest.from_json(body))
