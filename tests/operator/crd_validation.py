"""What kube-apiserver does with crds/llmdeployment.yaml when a resource is created, for tests.

The steps, in the apiserver's order:

1. decode with strict field validation (kubectl's default): a field the schema does not
   declare fails the request with `unknown field "spec.foo"`, and nothing else is checked
   (numbers arrive as kubectl sends them: a YAML 2.0 as the integer 2);
2. drop `status` (the status subresource is on, so a create cannot set it);
3. drop nulls of non-nullable fields and apply the schema's defaults;
4. validate against the openAPIV3Schema (with `jsonschema`, the OpenAPI v3 subset translated);
5. unless step 4 found a type, required, enum or too-long error, evaluate every
   `x-kubernetes-validations` rule (with cel-python) on each node present in the object.

Messages are kube-apiserver's (1.28 to 1.31), e.g.
`spec.scheduling.maxNumSeqs: Invalid value: 0: spec.scheduling.maxNumSeqs in body should be
greater than or equal to 1`. A rule whose evaluation fails counts as not holding, and
reports its message. Not emulated: formats (`date-time` is not checked), CEL cost limits,
updates (ratcheting, transition rules with `oldSelf`), `messageExpression`, `fieldPath` and
`reason` of rules, and ObjectMeta beyond the name's presence and format.

`structural_problems` checks the rules a CRD's schema must follow to be accepted at all.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import celpy
import jsonschema

from tidegate.operator.manifest import load_yaml

CRD_PATH = Path(__file__).resolve().parents[2] / "crds" / "llmdeployment.yaml"

# CEL rules are skipped when schema validation already found one of these (a required, enum,
# too-long, too-many or type error): the object does not have the shape the rules were
# written for (apiextensions-apiserver's hasBlockingErr).
_BLOCKING = {"required", "enum", "maxLength", "maxItems", "maxProperties", "type"}
_NOT_CHECKED = (
    '<nil>: Invalid value: "null": some validation rules were not checked because the object '
    "was invalid; correct the existing errors to complete validation"
)
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def load_crd(path: Path = CRD_PATH) -> dict[str, Any]:
    """The CustomResourceDefinition in `path`."""
    return load_yaml(path.read_text())


def version_schema(crd: dict[str, Any], version: str = "v1alpha1") -> dict[str, Any]:
    """The openAPIV3Schema of one version of the CRD."""
    for entry in crd["spec"]["versions"]:
        if entry["name"] == version:
            return entry["schema"]["openAPIV3Schema"]
    raise KeyError(f"version {version} is not in the CRD")


class CRDValidator:
    """Creates of one CRD version, checked as kube-apiserver checks them."""

    def __init__(self, crd: dict[str, Any] | None = None, version: str = "v1alpha1") -> None:
        self.crd = crd if crd is not None else load_crd()
        self.schema = version_schema(self.crd, version)
        self._jsonschema = _JsonSchemaValidator(_to_json_schema(self.schema))
        # Compiled now: cel-python raises the recursion limit when it first compiles.
        for rule in _rules(self.schema):
            compile_rule(rule)

    def validate(self, resource: dict[str, Any]) -> list[str]:
        """The apiserver's error messages for creating `resource`; [] means it is accepted."""
        return self._check(resource, keep_status=False)

    def validate_status(self, resource: dict[str, Any]) -> list[str]:
        """The messages for writing `resource` through the status subresource."""
        return self._check(resource, keep_status=True)

    def _check(self, resource: dict[str, Any], keep_status: bool) -> list[str]:
        unknown = list(_unknown_fields(resource, self.schema, ""))
        if unknown:
            return [f'unknown field "{path}"' for path in unknown]
        obj = _as_sent(resource)
        if not keep_status:
            obj.pop("status", None)
        errors = _metadata_errors(obj.get("metadata"))
        blocked = not (obj.get("metadata") or {}).get("name")
        obj = apply_defaults(obj, self.schema)
        found = list(self._jsonschema.iter_errors(obj))
        errors += list(dict.fromkeys(_describe(error) for error in found))
        if blocked or any(error.validator in _BLOCKING for error in found):
            return [*errors, _NOT_CHECKED]
        return errors + _rule_errors(obj, self.schema, "", root=True)

    def validate_spec(self, spec: Any, name: str = "example") -> list[str]:
        """`validate` of a resource named `name` with this spec."""
        return self.validate(resource(spec, name))

    def defaulted(self, resource: dict[str, Any]) -> dict[str, Any]:
        """The resource as the apiserver stores it: nulls dropped, defaults applied."""
        return apply_defaults(resource, self.schema)


def resource(spec: Any, name: str = "example") -> dict[str, Any]:
    """An LLMDeployment named `name` with `spec`."""
    return {
        "apiVersion": "tidegate.dev/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": name, "namespace": "default"},
        "spec": spec,
    }


# -- step 1: unknown fields --------------------------------------------------------------------


def _as_sent(value: Any) -> Any:
    # kubectl turns YAML into JSON through Go's float64: 2.0 arrives as 2, an integer. The
    # apiserver reads a number as an int64 when it is one, else as a float64 (convertNumber
    # in k8s.io/apimachinery/pkg/util/json): 10**30 arrives as 1e+30, a number.
    if isinstance(value, dict):
        return {key: _as_sent(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_as_sent(item) for item in value]
    if isinstance(value, float) and value.is_integer() and -(2**63) <= value < 2**63:
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**63:
        return float(value)
    return value


def _unknown_fields(value: Any, schema: dict[str, Any], path: str) -> Iterator[str]:
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            yield from _unknown_fields(item, schema["items"], f"{path}[{index}]")
    if not isinstance(value, dict):
        return
    properties = schema.get("properties") or {}
    additional = schema.get("additionalProperties")
    for key, item in value.items():
        child = _join(path, key)
        if path == "" and key == "metadata":
            continue  # ObjectMeta: decoded by its Go type, not by this schema
        if key in properties:
            yield from _unknown_fields(item, properties[key], child)
        elif isinstance(additional, dict):
            yield from _unknown_fields(item, additional, child)
        elif not schema.get("x-kubernetes-preserve-unknown-fields"):
            yield child


def _metadata_errors(metadata: Any) -> list[str]:
    name = (metadata or {}).get("name")
    if not name:
        return ["metadata.name: Required value: name or generateName is required"]
    if len(name) > 253 or not _DNS_SUBDOMAIN.match(name):
        return [
            f"metadata.name: Invalid value: {_go(name)}: a lowercase RFC 1123 subdomain must "
            "consist of lower case alphanumeric characters, '-' or '.', and must start and "
            "end with an alphanumeric character"
        ]
    return []


# -- step 3: nulls and defaults ----------------------------------------------------------------


def apply_defaults(value: Any, schema: dict[str, Any]) -> Any:
    """`value` with nulls of non-nullable fields dropped and the schema's defaults applied."""
    value = copy.deepcopy(value)
    _default_in_place(value, schema)
    return value


def _default_in_place(value: Any, schema: dict[str, Any]) -> None:
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            _default_in_place(item, schema["items"])
    if not isinstance(value, dict):
        return
    properties = schema.get("properties") or {}
    for key, child in properties.items():
        if key in value and value[key] is None and not child.get("nullable"):
            del value[key]
        if key not in value and "default" in child:
            value[key] = copy.deepcopy(child["default"])
    additional = schema.get("additionalProperties")
    for key, item in value.items():
        if key in properties:
            _default_in_place(item, properties[key])
        elif isinstance(additional, dict):
            _default_in_place(item, additional)


# -- step 4: the OpenAPI schema ----------------------------------------------------------------


def _to_json_schema(node: Any) -> Any:
    """An OpenAPI v3 (CRD subset) schema as JSON Schema 2020-12."""
    if isinstance(node, list):
        return [_to_json_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in ("properties", "patternProperties"):
            out[key] = {name: _to_json_schema(child) for name, child in value.items()}
        elif key in ("items", "additionalProperties", "not", "anyOf", "allOf", "oneOf"):
            out[key] = _to_json_schema(value)
        elif key in ("exclusiveMinimum", "exclusiveMaximum"):
            continue  # OpenAPI 3.0's booleans: handled with minimum/maximum below
        elif key == "minimum" and node.get("exclusiveMinimum"):
            out["exclusiveMinimum"] = value
        elif key == "maximum" and node.get("exclusiveMaximum"):
            out["exclusiveMaximum"] = value
        elif key in ("default", "description", "example", "format") or key.startswith("x-"):
            continue  # annotations, or checked elsewhere
        else:
            out[key] = value
    if node.get("x-kubernetes-int-or-string"):
        out["type"] = ["integer", "string"]
    if node.get("nullable") and "type" in out:
        out["type"] = [*_as_list(out["type"]), "null"]
    out.pop("nullable", None)
    return out


def _pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Iterator[Any]:
    # Go's RE2 `$` matches only at the end of the text; Python's also before a final "\n".
    if isinstance(instance, str) and not re.search(_go_regex(pattern), instance):
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


@functools.cache
def _go_regex(pattern: str) -> str:
    return re.sub(r"(?<!\\)\$", r"\\Z", pattern)


_JsonSchemaValidator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator, {"pattern": _pattern}
)


def _describe(error: jsonschema.ValidationError) -> str:
    """One jsonschema error as kube-openapi reports it through field.Error."""
    path = _path(error.absolute_path)
    kind, bound, value = error.validator, error.validator_value, error.instance
    said = f"{path} in body"
    if kind == "required":
        missing = re.match(r"^'(.*)' is a required property$", error.message)
        return f"{_join(path, missing.group(1) if missing else '?')}: Required value"
    if kind == "type":
        expected = ",".join(t for t in _as_list(bound) if t != "null")
        actual = _json_type(value)
        return (
            f"{path}: Invalid value: {_go(actual)}: {said} must be of type {expected}: "
            f"{_go(actual)}"
        )
    if kind == "enum":
        allowed = ", ".join(_go(v if isinstance(v, str) else json.dumps(v)) for v in bound)
        return f"{path}: Unsupported value: {_go(value)}: supported values: {allowed}"
    if kind == "maxLength":
        return f"{path}: Too long: may not be longer than {bound}"
    if kind == "maxItems":
        return f"{path}: Too many: {len(value)}: must have at most {bound} items"
    comparisons = {
        "minimum": "greater than or equal to",
        "exclusiveMinimum": "greater than",
        "maximum": "less than or equal to",
        "exclusiveMaximum": "less than",
    }
    if kind in comparisons:
        detail = f"should be {comparisons[kind]} {_go(float(bound))}"
    elif kind == "minLength":
        detail = f"should be at least {bound} chars long"
    elif kind == "pattern":
        detail = f"should match '{bound}'"
    elif kind == "minItems":
        detail = f"should have at least {bound} items"
    else:
        detail = error.message
    return f"{path}: Invalid value: {_go(value)}: {said} {detail}"


# -- step 5: CEL rules -------------------------------------------------------------------------


def _rule_errors(value: Any, schema: dict[str, Any], path: str, root: bool = False) -> list[str]:
    """Each node's rules before its children's, as the apiserver's CEL validator walks."""
    if value is None:
        return []
    errors = []
    rules = schema.get("x-kubernetes-validations") or []
    if rules:
        self = _root_self(value) if root else value
        for rule in rules:
            if not _holds(rule["rule"], self):
                message = rule.get("message") or f"failed rule: {rule['rule']}"
                errors.append(
                    f"{path or '<nil>'}: Invalid value: {_go(_node_type(schema))}: {message}"
                )
    if isinstance(value, dict):
        properties = schema.get("properties") or {}
        additional = schema.get("additionalProperties")
        for key, item in value.items():
            child = properties.get(key, additional if isinstance(additional, dict) else None)
            if child is not None and not (root and key == "metadata"):
                errors += _rule_errors(item, child, _join(path, key))
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            errors += _rule_errors(item, schema["items"], f"{path}[{index}]")
    return errors


def _root_self(obj: dict[str, Any]) -> dict[str, Any]:
    # At the root, rules see only metadata.name and metadata.generateName.
    metadata = obj.get("metadata") or {}
    kept = {key: metadata[key] for key in ("name", "generateName") if key in metadata}
    return {**obj, "metadata": kept}


def _holds(rule: str, self: Any) -> bool:
    program = compile_rule(rule)
    try:
        result = program.evaluate({"self": celpy.json_to_cel(self)})
    except celpy.CELEvalError:
        return False  # the apiserver reports an evaluation error: the rule did not hold
    return isinstance(result, celpy.celtypes.BoolType) and bool(result)


def _rules(schema: dict[str, Any]) -> Iterator[str]:
    for rule in schema.get("x-kubernetes-validations") or []:
        yield rule["rule"]
    for child in (schema.get("properties") or {}).values():
        yield from _rules(child)
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            yield from _rules(schema[key])


@functools.cache
def compile_rule(rule: str) -> Any:
    """A CEL rule as a cel-python program (CELParseError when it does not compile)."""
    environment = celpy.Environment()
    return environment.program(environment.compile(rule))


# -- structural schemas ------------------------------------------------------------------------

_TYPES = {"object", "array", "string", "integer", "number", "boolean"}
_FORBIDDEN = (
    "$ref",
    "$schema",
    "definitions",
    "id",
    "additionalItems",
    "patternProperties",
    "dependencies",
)
# Inside anyOf/allOf/oneOf/not only value validations may appear, no shape.
_NOT_IN_JUNCTORS = ("type", "default", "description", "nullable", "additionalProperties")


def structural_problems(crd: dict[str, Any]) -> list[str]:
    """Why each version's schema is not structural (kube-apiserver would refuse the CRD)."""
    problems = []
    for entry in crd["spec"]["versions"]:
        schema = entry.get("schema", {}).get("openAPIV3Schema")
        if schema is None:
            problems.append(f"{entry['name']}: no openAPIV3Schema")
            continue
        if schema.get("type") != "object":
            problems.append(f"{entry['name']}: the root must be of type object")
        metadata = (schema.get("properties") or {}).get("metadata") or {}
        restricted = set(metadata.get("properties") or {})
        if restricted - {"name", "generateName"}:
            problems.append(f"{entry['name']}: metadata may only restrict name and generateName")
        problems += [f"{entry['name']}: {p}" for p in _node_problems(schema, "openAPIV3Schema")]
    return problems


def _node_problems(node: dict[str, Any], where: str, in_junctor: bool = False) -> list[str]:
    problems = []
    if in_junctor:
        problems += [
            f"{where}: {key} is not allowed in anyOf/allOf/oneOf/not"
            for key in node
            if key in _NOT_IN_JUNCTORS
        ]
    problems += [f"{where}: {key} is not allowed" for key in _FORBIDDEN if key in node]
    if node.get("uniqueItems"):
        problems.append(f"{where}: uniqueItems is not allowed")
    kind = node.get("type")
    int_or_string = node.get("x-kubernetes-int-or-string")
    if not in_junctor:
        if int_or_string and kind is not None:
            problems.append(f"{where}: x-kubernetes-int-or-string must not have a type")
        elif (
            kind is None
            and not int_or_string
            and not node.get("x-kubernetes-preserve-unknown-fields")
        ):
            problems.append(f"{where}: type is required")
        elif kind is not None and kind not in _TYPES:
            problems.append(f"{where}: type {kind!r} is not one of {sorted(_TYPES)}")
    if "properties" in node and "additionalProperties" in node:
        problems.append(f"{where}: properties and additionalProperties are mutually exclusive")
    if ("properties" in node or "additionalProperties" in node) and kind not in (None, "object"):
        problems.append(f"{where}: properties need type object")
    if "additionalProperties" in node and not isinstance(node["additionalProperties"], dict):
        problems.append(f"{where}: additionalProperties must be a schema")
    if kind == "array" and not isinstance(node.get("items"), dict):
        problems.append(f"{where}: an array needs items (one schema)")
    if "items" in node and kind != "array" and not in_junctor:
        problems.append(f"{where}: items need type array")
    problems += _list_map_problems(node, where)
    problems += _rule_problems(node, where)
    if "default" in node:
        problems += _default_problems(node, where)
    for name, child in (node.get("properties") or {}).items():
        problems += _node_problems(child, f"{where}.properties.{name}", in_junctor)
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            problems += _node_problems(node[key], f"{where}.{key}", in_junctor)
    for key in ("anyOf", "allOf", "oneOf"):
        for index, child in enumerate(node.get(key) or []):
            problems += _node_problems(child, f"{where}.{key}[{index}]", in_junctor=True)
    if isinstance(node.get("not"), dict):
        problems += _node_problems(node["not"], f"{where}.not", in_junctor=True)
    return problems


def _list_map_problems(node: dict[str, Any], where: str) -> list[str]:
    list_type = node.get("x-kubernetes-list-type")
    if list_type is None:
        return []
    if list_type not in ("atomic", "set", "map"):
        return [f"{where}: x-kubernetes-list-type {list_type!r} is not atomic, set or map"]
    keys = node.get("x-kubernetes-list-map-keys") or []
    if list_type != "map":
        return [f"{where}: list-map-keys need list-type map"] if keys else []
    items = node.get("items") or {}
    if not keys or items.get("type") != "object":
        return [f"{where}: a map list needs list-map-keys and object items"]
    problems = []
    for key in keys:
        prop = (items.get("properties") or {}).get(key)
        if prop is None or prop.get("type") not in ("string", "integer", "number", "boolean"):
            problems.append(f"{where}: list-map-key {key} must be a scalar property of the items")
        elif key not in (items.get("required") or []) and "default" not in prop:
            problems.append(f"{where}: list-map-key {key} must be required or have a default")
    return problems


def _rule_problems(node: dict[str, Any], where: str) -> list[str]:
    problems = []
    for index, rule in enumerate(node.get("x-kubernetes-validations") or []):
        if not isinstance(rule.get("rule"), str) or not rule["rule"].strip():
            problems.append(f"{where}.x-kubernetes-validations[{index}]: rule is required")
            continue
        try:
            compile_rule(rule["rule"])
        except celpy.CELParseError as error:
            problems.append(f"{where}.x-kubernetes-validations[{index}]: {error}")
        message = rule.get("message", "")
        if message != message.strip() or "\n" in message:
            problems.append(f"{where}.x-kubernetes-validations[{index}]: message must be one line")
    return problems


def _default_problems(node: dict[str, Any], where: str) -> list[str]:
    # A default must be valid, and already pruned: no field the schema does not declare.
    default = node["default"]
    unknown = list(_unknown_fields(default, node, "default"))
    if unknown:
        return [f"{where}: default has unknown fields {unknown}"]
    defaulted = apply_defaults(default, node)
    errors = [
        _describe(e) for e in _JsonSchemaValidator(_to_json_schema(node)).iter_errors(defaulted)
    ]
    return [f"{where}: default is invalid: {error}" for error in errors]


# -- formatting --------------------------------------------------------------------------------


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _path(parts: Any) -> str:
    path = ""
    for part in parts:
        path = f"{path}[{part}]" if isinstance(part, int) else _join(path, str(part))
    return path


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _node_type(schema: dict[str, Any]) -> str:
    # What the apiserver prints as a CEL error's value: the node's type ("" for int-or-string).
    return schema.get("type", "")


def _go(value: Any) -> str:
    """`value` as Go's field.Error prints it: strings quoted, numbers with %v."""
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return _go_float(value)
    if value is None:
        return '"null"'
    return str(value) if isinstance(value, int) else repr(value)


def _go_float(value: float) -> str:
    # %v of a float64 is %g with the shortest digits: exponent form below 1e-4 and from 1e6 on.
    if value == 0:
        return "0"
    sign, digits, exponent = Decimal(repr(value)).normalize().as_tuple()
    lead = len(digits) - 1 + exponent  # the power of ten of the first digit
    if -4 <= lead < 6:
        return format(Decimal(repr(value)).normalize(), "f")
    mantissa = str(digits[0]) + ("." + "".join(map(str, digits[1:])) if len(digits) > 1 else "")
    return f"{'-' if sign else ''}{mantissa}e{lead:+03d}"
