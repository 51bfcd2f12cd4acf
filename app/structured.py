"""The constraint of a structured-output request, from whichever field the client used.

OpenAI's `response_format` (text, json_object, json_schema), vLLM's `structured_outputs` object
(json, regex, choice, grammar, json_object) and its older `guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar` fields all become one engine constraint
(`SamplingParams.structured_output`: {"type", "value"}), checked here — shape and compilation —
so a bad schema is a 400 naming the field before anything is reserved or queued.
"""
from __future__ import annotations

from typing import Any, Mapping

from app.strict_schema import closed, is_strict
from engine.grammar import check_constraint
from engine.protocol import bad_value, json_value
from engine.sampling import SamplingParamError, check_structured_output

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}
STRUCTURED_OUTPUTS_KEYS = ("json", "regex", "choice", "grammar", "json_object")
ANY_JSON_OBJECT = {"type": "object"}


def _schema(value: Any, param: str) -> dict:
    """A JSON schema given as an object or as its JSON text."""
    if isinstance(value, str):
        try:
            value = json_value(value)
        except ValueError as e:
            raise bad_value(f"`{param}` is not valid JSON: {e}", param) from None
    if not isinstance(value, dict):
        raise bad_value(f"`{param}` must be a JSON schema object", param, "invalid_type")
    return value


def _from_response_format(fmt: Any) -> dict | None:
    param = "response_format"
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise bad_value("`response_format` must be an object with a `type`", param, "invalid_type")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json", "value": ANY_JSON_OBJECT}
    if kind != "json_schema":
        raise bad_value(f"`response_format.type` must be text, json_object or json_schema, got {kind!r}", param)
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_value("`response_format.json_schema` must be an object {name, schema, strict}", param,
                        "invalid_type")
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise bad_value("`response_format.json_schema.name` is required", param, "missing_required_parameter")
    strict = is_strict(spec.get("strict"), "response_format.json_schema", param)
    if spec.get("schema") is None:
        return {"type": "json", "value": ANY_JSON_OBJECT}
    schema = _schema(spec["schema"], "response_format")
    return {"type": "json", "value": closed(schema, param) if strict else schema}


def _from_structured_outputs(value: Any) -> dict:
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise bad_value("`structured_outputs` must be an object", param, "invalid_type")
    given = [k for k in STRUCTURED_OUTPUTS_KEYS if value.get(k) not in (None, False)]
    if len(given) != 1:
        raise bad_value(f"`structured_outputs` must set exactly one of {', '.join(STRUCTURED_OUTPUTS_KEYS)}",
                        param)
    kind = given[0]
    if kind == "json_object":
        return {"type": "json", "value": ANY_JSON_OBJECT}
    if kind == "json":
        return {"type": "json", "value": _schema(value["json"], param)}
    return {"type": kind, "value": value[kind]}


def structured_output(body: Mapping[str, Any]) -> tuple[dict | None, str | None]:
    """(the constraint or None, the field it came from); 400 naming that field when it is invalid."""
    sources = [k for k in ("response_format", "structured_outputs", *GUIDED) if body.get(k) is not None]
    if len(sources) > 1:
        raise bad_value(f"give at most one of response_format, structured_outputs, guided_*; got "
                        f"{', '.join(sources)}", sources[1])
    if not sources:
        return None, None
    param = sources[0]
    if param == "response_format":
        spec = _from_response_format(body[param])
    elif param == "structured_outputs":
        spec = _from_structured_outputs(body[param])
    elif param == "guided_json":
        spec = {"type": "json", "value": _schema(body[param], param)}
    else:
        spec = {"type": GUIDED[param], "value": body[param]}
    return check(spec, param), param


def check(spec: dict | None, param: str) -> dict | None:
    """The constraint's shape and grammar checked (no tokenizer needed): 400 naming `param`."""
    if spec is None:
        return None
    try:
        spec = check_structured_output(spec)
        check_constraint(spec)
    except SamplingParamError as e:
        raise bad_value(str(e).replace("structured_output", f"`{param}`"), param) from None
    return spec
