"""`strict` JSON schemas: every object that describes a value of its own and does not say
`additionalProperties` is closed (false), so the output holds only the properties the schema names, as
OpenAI's strict mode guarantees (OpenAI refuses a strict schema with an open object; here it is closed for
the client).

An object that takes its properties from schemas applied beside its own (`allOf`, `if`/`then`/`else`,
`dependentSchemas`, a `$ref` or `anyOf`/`oneOf` next to its own `properties`) stays as given, and so do
those schemas: closing each of them would refuse the properties of the others. Their own property values
are closed as usual.
"""
from __future__ import annotations

from typing import Any

from engine.protocol import bad_value

# schemas applied to the same value as the schema that holds them (a part's properties are the whole's)
_BESIDE = ("allOf", "if", "then", "else", "dependentSchemas")
_UNIONS = ("anyOf", "oneOf")
# schemas of other values: a property's, an item's, a definition's
_VALUE_MAPS = ("properties", "patternProperties")
_DEFINITIONS = ("$defs", "definitions")
_VALUE_SCHEMAS = ("items", "additionalProperties", "contains")
_VALUE_LISTS = ("prefixItems",)
_OWN_PROPERTIES = ("properties", "patternProperties", "required")


def is_strict(value: Any, where: str, param: str) -> bool:
    """A `strict` flag: true, false or absent (null); 400 naming `param` otherwise."""
    if value is not None and not isinstance(value, bool):
        raise bad_value(f"`{where}.strict` must be a boolean", param, "invalid_type")
    return value is True


def closed(schema: Any, param: str) -> Any:
    """The strict form of `schema`; 400 naming `param` for one nested past Python's recursion."""
    try:
        mixins: set[str] = set()
        _find_mixins(schema, mixins)
        return _closed(schema, True, mixins)
    except RecursionError:
        raise bad_value(f"`{param}` is nested too deeply", param) from None


def _find_mixins(schema: Any, out: set[str]) -> None:
    """The `$ref`s whose definitions are applied beside other schemas of the same value."""
    if isinstance(schema, list):
        for item in schema:
            _find_mixins(item, out)
        return
    if not isinstance(schema, dict):
        return
    own = any(k in schema for k in _OWN_PROPERTIES)
    if isinstance(schema.get("$ref"), str) and (own or any(k in schema for k in (*_BESIDE, *_UNIONS))):
        out.add(schema["$ref"])
    for key in ("allOf", *(_UNIONS if own else ())):
        for item in schema.get(key) or ():
            if isinstance(item, dict) and isinstance(item.get("$ref"), str):
                out.add(item["$ref"])
    for value in schema.values():
        _find_mixins(value, out)


def _closed(schema: Any, close: bool, mixins: set[str]) -> Any:
    """`schema` with its value schemas closed, and itself when `close` (it describes a value of its own)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    own = any(k in out for k in _OWN_PROPERTIES)
    for key in _VALUE_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed(sub, True, mixins) for name, sub in out[key].items()}
    for key in _DEFINITIONS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed(sub, f"#/{key}/{name}" not in mixins, mixins) for name, sub in out[key].items()}
    for key in _VALUE_SCHEMAS:
        if key in out:
            out[key] = [_closed(s, True, mixins) for s in out[key]] if isinstance(out[key], list) \
                else _closed(out[key], True, mixins)
    for key in _VALUE_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_closed(s, True, mixins) for s in out[key]]
    for key in _UNIONS:   # a union's branches are each the whole value, unless they add to its own properties
        if isinstance(out.get(key), list):
            out[key] = [_closed(s, not own, mixins) for s in out[key]]
    for key in _BESIDE:
        value = out.get(key)
        if isinstance(value, list):
            out[key] = [_closed(s, False, mixins) for s in value]
        elif isinstance(value, dict):
            out[key] = ({name: _closed(s, False, mixins) for name, s in value.items()} if key == "dependentSchemas"
                        else _closed(value, False, mixins))
    kind = out.get("type")
    is_object = kind == "object" or (isinstance(kind, list) and "object" in kind) or (kind is None and own)
    beside = any(k in out for k in _BESIDE) or (own and (any(k in out for k in _UNIONS) or "$ref" in out))
    if close and is_object and not beside and "additionalProperties" not in out \
            and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out
