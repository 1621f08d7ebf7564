"""JSON schema checks shared by both backends: what a library would silently ignore is refused.

A grammar library that skips a keyword it does not implement lets the model write output that
does not validate. Each backend has a `SchemaPolicy`: the keywords it refuses and the special
cases it gets wrong; `check_schema` walks every subschema and raises GrammarError naming the
keyword and where it is. The lists were found by random-walk generation against `jsonschema`
(tests/engine/structured_output/test_structured_corpus.py keeps them honest).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tidegate.engine.structured_output.backend import GrammarError

# Keywords whose value is a map of subschemas, one subschema, or a list of subschemas.
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_ONE = (
    "additionalProperties",
    "unevaluatedProperties",
    "unevaluatedItems",
    "additionalItems",
    "propertyNames",
    "contains",
    "not",
    "if",
    "then",
    "else",
)
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
# Keywords that never constrain the output.
ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "$comment",
        "deprecated",
        "readOnly",
        "writeOnly",
        "$schema",
        "$id",
        "$anchor",
        "$defs",
        "definitions",
        "discriminator",  # OpenAPI; pydantic writes it beside a oneOf of tagged models
        "contentEncoding",
        "contentMediaType",
    }
)
JSON_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
# Neither library implements these: llguidance refuses them, xgrammar ignores most of them.
REFUSED_BY_BOTH = {
    "not": "",
    "if": "",
    "then": "",
    "else": "",
    "dependentRequired": "",
    "dependentSchemas": "",
    "dependencies": "",
    "contains": "",
    "minContains": "",
    "maxContains": "",
    "uniqueItems": "",
    "propertyNames": "",
    "unevaluatedProperties": "use additionalProperties",
    "unevaluatedItems": "use items",
    "additionalItems": "use prefixItems and items",
    "$dynamicRef": "",
    "$dynamicAnchor": "",
    "$recursiveRef": "",
    "$recursiveAnchor": "",
}


@dataclass(frozen=True)
class SchemaPolicy:
    """What one backend generates beyond the common keywords, and what it does by default."""

    backend: str
    formats: frozenset[str]  # string formats the library generates
    # True when an object without additionalProperties may still get other properties.
    extra_properties_by_default: bool
    # xgrammar ignores: validation keywords beside $ref, enum or const; a second allOf member;
    # minLength/maxLength beside pattern or format (and its oneOf is rewritten as an anyOf).
    single_keyword_nodes: bool = False


def parse_schema(text: str) -> dict[str, Any] | bool:
    """The schema of a json constraint; GrammarError unless it is a JSON object or boolean."""
    try:
        schema = json.loads(text)
    except (json.JSONDecodeError, TypeError) as error:
        raise GrammarError(f"json schema: not valid JSON ({error})") from None
    if not isinstance(schema, dict | bool):
        raise GrammarError(
            f"json schema: must be a JSON object (or true/false), got {type(schema).__name__}"
        )
    return schema


def subschemas(schema: Any, pointer: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every object subschema with its JSON pointer, parents before children."""
    if not isinstance(schema, dict):
        return
    yield pointer or "/", schema
    for key in SCHEMA_MAPS:
        children = schema.get(key)
        if isinstance(children, dict):
            for name, child in children.items():
                yield from subschemas(child, f"{pointer}/{key}/{_escape(name)}")
    for key in SCHEMA_ONE:
        yield from subschemas(schema.get(key), f"{pointer}/{key}")
    items = schema.get("items")
    if isinstance(items, list):
        for i, child in enumerate(items):
            yield from subschemas(child, f"{pointer}/items/{i}")
    else:
        yield from subschemas(items, f"{pointer}/items")
    for key in SCHEMA_LISTS:
        children = schema.get(key)
        if isinstance(children, list):
            for i, child in enumerate(children):
                yield from subschemas(child, f"{pointer}/{key}/{i}")


def check_schema(schema: dict[str, Any] | bool, policy: SchemaPolicy) -> None:
    """Raise GrammarError for the first keyword of schema that policy's backend cannot honour."""
    if isinstance(schema, bool):
        return
    for pointer, node in subschemas(schema):
        _check_node(schema, pointer, node, policy)


def _check_node(root: dict[str, Any], at: str, node: dict[str, Any], policy: SchemaPolicy) -> None:
    def refuse(what: str, hint: str = "") -> GrammarError:
        return GrammarError(
            f"json schema: {what} is not supported by {policy.backend} (at {at})"
            + (f"; {hint}" if hint else "")
        )

    for key in node:
        if key in REFUSED_BY_BOTH:
            raise refuse(repr(key), REFUSED_BY_BOTH[key])
    types = _types(node)
    unknown = [t for t in types if t not in JSON_TYPES]
    if unknown:
        raise GrammarError(
            f"json schema: type {unknown[0]!r} is not a JSON type (at {at}); "
            f"use {', '.join(JSON_TYPES)}"
        )
    if isinstance(node.get("items"), list):
        raise refuse("'items' as a list", "draft 4 tuples are written with prefixItems now")
    for key in ("exclusiveMinimum", "exclusiveMaximum"):
        if isinstance(node.get(key), bool):
            raise refuse(f"{key!r} as a boolean", "draft 6 and later give the bound as a number")
    if "$ref" in node:
        _resolve(root, node["$ref"], at)
    fmt = node.get("format")
    if fmt is not None and fmt not in policy.formats:
        raise refuse(f"format {fmt!r}", f"supported formats: {', '.join(sorted(policy.formats))}")
    _check_properties(at, node, policy, refuse)
    if "oneOf" in node:
        _check_one_of(root, at, node["oneOf"], refuse)
    if policy.single_keyword_nodes:
        _check_single_keywords(at, node, types, refuse)


def _check_properties(at: str, node: dict[str, Any], policy: SchemaPolicy, refuse) -> None:
    """Required names that cannot appear, and minProperties that duplicate keys could defeat."""
    properties = node.get("properties") or {}
    required = node.get("required") or []
    extra = node.get("additionalProperties", policy.extra_properties_by_default)
    extra_allowed = extra is not False or bool(node.get("patternProperties"))
    for name in required:
        if name not in properties and not extra_allowed:
            raise GrammarError(
                f"json schema: required property {name!r} is not in 'properties' and no other "
                f"property is allowed (at {at})"
            )
    # Generated keys beyond 'properties' may repeat ({"a": 1, "a": 2}), and a repeated key
    # counts once when parsed: only the required properties are sure to count.
    min_properties = node.get("minProperties", 0)
    if min_properties > len(set(required)) and extra_allowed:
        raise refuse(
            f"'minProperties' above the number of required properties ({len(set(required))})",
            "a repeated extra key would count once; require properties or set "
            "additionalProperties to false",
        )


def _check_one_of(root: dict[str, Any], at: str, branches: Any, refuse) -> None:
    """oneOf is generated as anyOf: refused unless no value can match two branches."""
    if not isinstance(branches, list):
        return
    resolved = [_follow(root, branch, at) for branch in branches]
    for i, first in enumerate(resolved):
        for second in resolved[i + 1 :]:
            if not _disjoint(first, second):
                raise refuse("'oneOf' whose branches may overlap", "use anyOf")


def _check_single_keywords(at: str, node: dict[str, Any], types: list[str], refuse) -> None:
    """Keyword combinations of which xgrammar honours only one."""
    validation = [k for k in node if k not in ANNOTATIONS]
    if "$ref" in node and len(validation) > 1:
        other = next(k for k in validation if k != "$ref")
        raise refuse(f"{other!r} beside '$ref'", "move it into the referenced schema")
    for key in ("enum", "const"):
        if key not in node:
            continue
        other = [k for k in validation if k not in (key, "type")]
        if other:
            raise refuse(f"{other[0]!r} beside {key!r}")
        values = node["enum"] if key == "enum" else [node["const"]]
        for value in values if isinstance(values, list) else []:
            if (
                types
                and _json_type(value) not in types
                and not (_json_type(value) == "integer" and "number" in types)
            ):
                raise GrammarError(
                    f"json schema: {key} value {value!r} is not of type {' or '.join(types)} "
                    f"(at {at})"
                )
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        raise refuse("'allOf' with more than one schema")
    if "oneOf" in node and "anyOf" in node:
        raise refuse("'oneOf' beside 'anyOf'", "nest one of them in the other's branches")
    if ("minLength" in node or "maxLength" in node) and ("pattern" in node or "format" in node):
        raise refuse("'minLength'/'maxLength' beside 'pattern' or 'format'")


def _disjoint(first: Any, second: Any) -> bool:
    """True when no JSON value can validate against both schemas (a conservative test)."""
    if not isinstance(first, dict) or not isinstance(second, dict):
        return False
    a, b = _value_types(first), _value_types(second)
    if a is not None and b is not None and not _types_overlap(a, b):
        return True
    # Tagged objects: a property both require, with constants that differ.
    props_a, props_b = first.get("properties") or {}, second.get("properties") or {}
    for name in set(first.get("required") or []) & set(second.get("required") or []):
        values_a = _constants(props_a.get(name))
        values_b = _constants(props_b.get(name))
        if values_a is not None and values_b is not None and not values_a & values_b:
            return True
    return False


def _value_types(node: dict[str, Any]) -> set[str] | None:
    """The JSON types a schema's values may have; None when it does not say."""
    if "const" in node:
        return {_json_type(node["const"])}
    if isinstance(node.get("enum"), list):
        return {_json_type(value) for value in node["enum"]}
    types = _types(node)
    return set(types) if types else None


def _types_overlap(a: set[str], b: set[str]) -> bool:
    widen = {"integer": {"integer", "number"}, "number": {"integer", "number"}}
    return any(widen.get(t, {t}) & b for t in a)


def _constants(node: Any) -> set[str] | None:
    """The values a schema allows, as JSON texts, when it is a const or an enum."""
    if not isinstance(node, dict):
        return None
    if "const" in node:
        return {json.dumps(node["const"], sort_keys=True)}
    if isinstance(node.get("enum"), list):
        return {json.dumps(value, sort_keys=True) for value in node["enum"]}
    return None


def _types(node: dict[str, Any]) -> list[str]:
    value = node.get("type")
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "integer" if value.is_integer() else "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _follow(root: dict[str, Any], node: Any, at: str) -> Any:
    """A schema with its $ref chain followed (a bare $ref only, as pydantic writes them)."""
    seen = set()
    while isinstance(node, dict) and "$ref" in node and node["$ref"] not in seen:
        seen.add(node["$ref"])
        node = _resolve(root, node["$ref"], at)
    return node


def _resolve(root: dict[str, Any], ref: Any, at: str) -> Any:
    """The subschema a local $ref ("#" or "#/json/pointer") names; GrammarError otherwise."""
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        raise GrammarError(
            f"json schema: $ref {ref!r} is not supported (at {at}); only local references "
            "such as '#/$defs/Name' are"
        )
    node: Any = root
    for part in ref[2:].split("/") if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise GrammarError(f"json schema: $ref {ref!r} names nothing in the schema (at {at})")
    return node


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")
