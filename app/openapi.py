"""GET /openapi.json: the gateway's API described in OpenAPI 3.0.

The parameter ranges come from the same table the validator uses (app/params.py), so the
description and the checks cannot drift apart. Schemathesis (issue 7) fuzzes against it.
"""
from __future__ import annotations

from typing import Any

from flask import Blueprint, current_app, jsonify

from app import params
from app.priority import AUTO_TIER, LATENCY_CLASS_HEADER, SERVICE_TIERS
from engine.protocol import LatencyClass

bp = Blueprint("openapi", __name__)

_NULLABLE_STRING = {"type": "string", "nullable": True}
_PROBE = {"type": "object", "required": ["status"],
          "properties": {"status": {"type": "string"}, "reason": {"type": "string"},
                         "nodes_up": {"type": "integer"}, "nodes": {"type": "integer"}}}


def _number_schema(f: params.NumberField, max_n: int) -> dict:
    schema: dict[str, Any] = {"type": "integer" if f.integer else "number", "nullable": True,
                              "description": f.description}
    if f.minimum is not None:
        schema["minimum"] = f.minimum
        if f.exclusive_minimum:
            schema["exclusiveMinimum"] = True
    maximum = max_n if f.name == "n" else f.maximum
    if maximum is not None:
        schema["maximum"] = maximum
    return schema


def _error(description: str) -> dict:
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}


_TOOL = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"type": "string", "enum": ["function"]},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}, "description": {"type": "string"},
        "parameters": {"type": "object"}}}}}


def _tokenizer_path(summary: str, request: dict, answer: dict) -> dict:
    return {"post": {
        "summary": summary, "security": [{"bearerAuth": []}],
        "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
        "responses": {
            "200": {"description": "vLLM's answer", "content": {"application/json": {"schema": answer}}},
            "400": _error("Invalid request; `param` names the parameter."),
            "401": _error("Missing or invalid bearer token."),
            "404": _error("Unknown model, or one the caller's tier may not use."),
            "413": _error("Request body too large."),
            "429": _error("Rate limit reached."),
            "503": _error("No engine node available, or rate-limit storage down (fail-closed)."),
        }}}


_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 2 ** 31 - 1}}
TOKENIZE = _tokenizer_path(
    "Token ids of a prompt or of chat messages (vLLM's /tokenize)",
    {"type": "object", "required": ["model", "prompt"], "properties": {
        "model": {"type": "string", "minLength": 1}, "prompt": {"type": "string"},
        "add_special_tokens": {"type": "boolean"}, "return_token_strs": {"type": "boolean"}}},
    {"type": "object", "required": ["count", "max_model_len", "tokens"], "properties": {
        "count": {"type": "integer"}, "max_model_len": {"type": "integer"}, "tokens": _TOKEN_IDS,
        "token_strs": {"type": "array", "nullable": True, "items": {"type": "string"}}}})
DETOKENIZE = _tokenizer_path(
    "The text of token ids (vLLM's /detokenize)",
    {"type": "object", "required": ["model", "tokens"], "properties": {
        "model": {"type": "string", "minLength": 1}, "tokens": _TOKEN_IDS}},
    {"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}})


def _request_schema(kind: str, max_n: int, max_prompts: int = 1) -> dict:
    props: dict[str, Any] = {"model": {"type": "string", "minLength": 1,
                                       "description": "A model alias from GET /v1/models."}}
    for f in params.SAMPLING_FIELDS:
        props[f.name] = _number_schema(f, max_n)
    props.update({
        "stream": {"type": "boolean", "nullable": True},
        "stream_options": {"type": "object", "nullable": True,
                           "properties": {"include_usage": {"type": "boolean"}},
                           "description": "Only with stream: true."},
        "stop": {"nullable": True, "oneOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "maxItems": params.MAX_STOP,
             "items": {"type": "string", "minLength": 1}}]},
        "stop_token_ids": {"type": "array", "nullable": True, "maxItems": params.MAX_STOP_TOKEN_IDS,
                           "items": {"type": "integer", "minimum": 0, "maximum": 2 ** 31 - 1}},
        "logit_bias": {"type": "object", "nullable": True,
                       "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
                       "description": "Token id (as a string of digits) → bias."},
        "ignore_eos": {"type": "boolean", "nullable": True},
        "skip_special_tokens": {"type": "boolean", "nullable": True,
                                "description": "Leave special tokens out of the text (default true; vLLM extension)."},
        "include_stop_str_in_output": {"type": "boolean", "nullable": True,
                                       "description": "Keep the stop string that ended the text in it (vLLM extension)."},
        "user": {"type": "string", "nullable": True},
        "service_tier": {"type": "string", "nullable": True, "enum": [AUTO_TIER, *SERVICE_TIERS],
                         "description": "The latency class: priority (realtime), default (standard), flex (batch) "
                                        "or auto (the org's default); capped by the org's SLA, as "
                                        f"{LATENCY_CLASS_HEADER}."},
        "response_format": {"type": "object", "nullable": True, "required": ["type"], "properties": {
            "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
            "json_schema": {"type": "object", "required": ["name"], "properties": {
                "name": {"type": "string", "minLength": 1}, "schema": {"type": "object"},
                "strict": {"type": "boolean", "nullable": True}}}},
            "description": "Structured output: any JSON object, or JSON matching a schema (docs/structured-outputs.md)."},
        "structured_outputs": {"type": "object", "nullable": True, "description": (
            "vLLM's structured outputs: exactly one of json (a schema), regex, choice (strings), grammar "
            "(Lark or GBNF), json_object.")},
        "guided_json": {"nullable": True, "oneOf": [{"type": "object"}, {"type": "string"}],
                        "description": "vLLM's older name of structured_outputs.json."},
        "guided_regex": {"type": "string", "nullable": True, "minLength": 1},
        "guided_choice": {"type": "array", "nullable": True, "minItems": 1, "items": {"type": "string", "minLength": 1}},
        "guided_grammar": {"type": "string", "nullable": True, "minLength": 1},
    })
    if kind == params.CHAT:
        props["messages"] = {"type": "array", "minItems": 1, "maxItems": params.MAX_MESSAGES,
                             "items": {"$ref": "#/components/schemas/Message"}}
        props["logprobs"] = {"type": "boolean", "nullable": True}
        props["tools"] = {"type": "array", "nullable": True, "maxItems": 128, "items": _TOOL}
        props["tool_choice"] = {"nullable": True, "oneOf": [
            {"type": "string", "enum": ["none", "auto", "required"]},
            {"type": "object", "required": ["type", "function"], "properties": {
                "type": {"type": "string", "enum": ["function"]},
                "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}}]}
        props["parallel_tool_calls"] = {"type": "boolean", "nullable": True}
        props["top_logprobs"] = {"type": "integer", "nullable": True, "minimum": 0,
                                 "maximum": params.MAX_CHAT_TOP_LOGPROBS,
                                 "description": "Requires logprobs: true."}
        required = ["model", "messages"]
    else:
        props["prompt"] = {"oneOf": [
            {"type": "string"},
            {"type": "array", "minItems": 1, "maxItems": max_prompts, "items": {"type": "string"}},
            {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0,
                                                       "maximum": 2 ** 31 - 1}},
            {"type": "array", "minItems": 1, "maxItems": max_prompts,
             "items": {"type": "array", "minItems": 1,
                       "items": {"type": "integer", "minimum": 0, "maximum": 2 ** 31 - 1}}}]}
        props["logprobs"] = {"type": "integer", "nullable": True, "minimum": 0,
                             "maximum": params.MAX_COMPLETION_LOGPROBS}
        props["echo"] = {"type": "boolean", "nullable": True, "description": "Only false."}
        props["best_of"] = {"type": "integer", "nullable": True, "description": "Only equal to n."}
        required = ["model", "prompt"]
    return {"type": "object", "required": required, "properties": props,
            "additionalProperties": True}


# A text/event-stream body described one event at a time (how OpenAPI tools read SSE): each `data`
# holds a JSON chunk, or "[DONE]" last.
_SSE_EVENT = {"type": "object", "required": ["data"],
              "properties": {"data": {"type": "string"}, "event": {"type": "string"},
                             "id": {"type": "string"}, "retry": {"type": "integer"}}}


def build_openapi(max_n: int, max_prompts: int = 1) -> dict:
    latency_header = {
        "name": LATENCY_CLASS_HEADER, "in": "header", "required": False,
        "description": "Requested latency class; capped by the org's SLA.",
        "schema": {"type": "string", "enum": [c.label for c in LatencyClass]},
    }
    generation_responses = {
        "200": {"description": "The completion (JSON), or with stream: true server-sent events "
                               "ending with `data: [DONE]`.",
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Completion"}},
                            "text/event-stream": {"schema": _SSE_EVENT}}},
        "400": _error("Invalid request; `param` names the parameter."),
        "401": _error("Missing or invalid bearer token."),
        "404": _error("Unknown model, or one the caller's tier may not use."),
        "413": _error("Request body too large."),
        "429": _error("Rate limit (requests, tokens or concurrent generations) reached, or the org's share of "
                      "the nodes' queues is full (org_queue_full); see retry-after."),
        "503": _error("No engine node available, or rate-limit storage down (fail-closed)."),
    }

    def generation(kind: str, summary: str) -> dict:
        schema = "ChatCompletionRequest" if kind == params.CHAT else "CompletionRequest"
        return {"post": {
            "summary": summary, "security": [{"bearerAuth": []}],
            "parameters": [latency_header],
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{schema}"}}}},
            "responses": generation_responses,
        }}

    return {
        "openapi": "3.0.3",
        "info": {"title": "zen inference gateway", "version": "0.1.0",
                 "description": "OpenAI-compatible API in front of engine nodes."},
        "paths": {
            "/v1/chat/completions": generation(params.CHAT, "Create a chat completion"),
            "/v1/completions": generation(params.COMPLETIONS, "Create a text completion"),
            "/v1/models": {"get": {
                "summary": "Models the caller's org may use", "security": [{"bearerAuth": []}],
                "responses": {
                    "200": {"description": "Model list", "content": {"application/json": {
                        "schema": {"$ref": "#/components/schemas/ModelList"}}}},
                    "401": _error("Missing or invalid bearer token."),
                    "429": _error("Rate limit reached."),
                    "503": _error("Rate-limit storage down (fail-closed)."),
                }}},
            "/v1/models/{model}": {"get": {
                "summary": "One model", "security": [{"bearerAuth": []}],
                "parameters": [{"name": "model", "in": "path", "required": True,
                                "schema": {"type": "string"}}],
                "responses": {
                    "200": {"description": "Model", "content": {"application/json": {
                        "schema": {"$ref": "#/components/schemas/Model"}}}},
                    "401": _error("Missing or invalid bearer token."),
                    "404": _error("Unknown model."),
                    "429": _error("Rate limit reached."),
                    "503": _error("Rate-limit storage down (fail-closed)."),
                }}},
            "/tokenize": TOKENIZE,
            "/detokenize": DETOKENIZE,
            "/health": {"get": {"summary": "Gateway liveness", "responses": {
                "200": {"description": "Alive", "content": {"application/json": {"schema": _PROBE}}}}}},
            "/ready": {"get": {"summary": "Gateway readiness: an engine node is ready and the gateway is not "
                                          "draining", "responses": {
                "200": {"description": "Ready", "content": {"application/json": {"schema": _PROBE}}},
                "503": {"description": "Not ready (no ready node, or draining); Retry-After says when to ask "
                                       "again", "content": {"application/json": {"schema": _PROBE}}}}}},
        },
        "components": {
            "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer",
                                               "bearerFormat": "JWT"}},
            "schemas": {
                "Error": {"type": "object", "required": ["error"], "properties": {"error": {
                    "type": "object", "required": ["message", "type", "param", "code"],
                    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                                   "param": _NULLABLE_STRING, "code": _NULLABLE_STRING}}}},
                "Message": {"type": "object", "required": ["role", "content"], "properties": {
                    "role": {"type": "string", "enum": list(params.CHAT_ROLES)},
                    "content": {"oneOf": [
                        {"type": "string"},
                        {"type": "array", "items": {
                            "type": "object", "required": ["type", "text"],
                            "properties": {"type": {"type": "string", "enum": ["text"]},
                                           "text": {"type": "string"}}}}]},
                    "name": {"type": "string"}}},
                "ChatCompletionRequest": _request_schema(params.CHAT, max_n),
                "CompletionRequest": _request_schema(params.COMPLETIONS, max_n, max_prompts),
                "Usage": {"type": "object",
                          "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
                          "properties": {**{k: {"type": "integer"} for k in
                                            ("prompt_tokens", "completion_tokens", "total_tokens")},
                                         "prompt_tokens_details": {
                                             "type": "object",
                                             "properties": {"cached_tokens": {"type": "integer"}}}}},
                "Completion": {"type": "object", "required": ["id", "object", "created", "model",
                                                              "choices", "usage"],
                               "properties": {
                                   "id": {"type": "string"},
                                   "object": {"type": "string",
                                              "enum": ["chat.completion", "text_completion"]},
                                   "created": {"type": "integer"},
                                   "model": {"type": "string"},
                                   "service_tier": {"type": "string", "enum": list(SERVICE_TIERS)},
                                   "system_fingerprint": {"type": "string"},
                                   "choices": {"type": "array", "items": {"type": "object"}},
                                   "usage": {"$ref": "#/components/schemas/Usage"}}},
                "Model": {"type": "object", "required": ["id", "object", "created", "owned_by"],
                          "properties": {"id": {"type": "string"}, "object": {"type": "string"},
                                         "created": {"type": "integer"},
                                         "owned_by": {"type": "string"},
                                         "root": {"type": "string"},
                                         "quantization": {"type": "string"},
                                         "max_model_len": {"type": "integer"}}},
                "ModelList": {"type": "object", "required": ["object", "data"], "properties": {
                    "object": {"type": "string"},
                    "data": {"type": "array", "items": {"$ref": "#/components/schemas/Model"}}}},
            },
        },
    }


@bp.get("/openapi.json")
def openapi_json():
    server = current_app.extensions["zen.config"].server
    return jsonify(build_openapi(server.max_n, server.max_prompts))
