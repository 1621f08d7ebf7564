"""Constraints on a completion's shape as requests state them, and as the engine takes them.

OpenAI's `response_format`, vLLM's `structured_outputs` and its older `guided_*` fields all
become one `StructuredOutputsParams`. Only the structure is checked here (a schema is an object
or a boolean, JSON text parses, a regex is a non-empty string); the engine compiles the grammar
and refuses, as a 400, one it cannot build.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import Field, StrictBool, ValidationInfo, field_validator, model_validator

from tidegate.engine.entrypoints.openai.request_body import FieldError, RequestBody
from tidegate.engine.sampling_params import StructuredOutputsParams

SCHEMA_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
# What a schema may be sent as: a JSON object or boolean, or (vLLM's fields) either as text.
Schema = dict[str, Any] | StrictBool
SchemaOrText = dict[str, Any] | StrictBool | str
# The request's fields that constrain the output, in the order their conflicts are named.
CONSTRAINT_FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    return names.get(type(value), "a number")


def check_schema(value: Any, where: str, text_allowed: bool = True) -> Any:
    """A schema as sent, if it is one (ValueError naming `where` if not)."""
    allowed = "an object or a boolean" + (", or either as JSON text" if text_allowed else "")
    if isinstance(value, str) and text_allowed:
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where} is not valid JSON: {error}") from None
        except RecursionError:
            raise ValueError(f"{where} is nested too deeply") from None
        if not isinstance(parsed, dict | bool):
            raise ValueError(f"{where} must be a JSON schema, {allowed}; got {_json_type(parsed)}")
        schema_text(parsed, where)
        return value
    if not isinstance(value, dict | bool):
        raise ValueError(f"{where} must be a JSON schema, {allowed}; got {_json_type(value)}")
    schema_text(value, where)  # NaN, or nesting too deep to write back
    return value


def schema_text(value: Any, where: str) -> str:
    """A checked schema as the engine takes it: compact JSON, its properties in their order.

    The order is kept because it is the order in which the model writes the keys.
    """
    if isinstance(value, str):
        value = json.loads(value)
    try:
        return json.dumps(value, separators=(",", ":"), sort_keys=False, allow_nan=False)
    except ValueError:
        raise ValueError(f"{where} holds NaN or Infinity, which JSON does not allow") from None
    except RecursionError:
        raise ValueError(f"{where} is nested too deeply") from None


def _non_empty(value: Any, where: str) -> Any:
    if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(f"{where} must be a non-empty string; got {_json_type(value)}")
    return value


def _choices(value: Any, where: str) -> Any:
    if value is None:
        return value
    if (
        not isinstance(value, list)
        or not value
        or any(not isinstance(choice, str) or not choice for choice in value)
    ):
        raise ValueError(f"{where} must be a non-empty list of non-empty strings")
    return value


class JSONSchemaFormat(RequestBody):
    """`response_format.json_schema`: OpenAI's named schema."""

    name: str = Field(json_schema_extra={"pattern": "^" + SCHEMA_NAME.pattern + "$"})
    description: str | None = None
    schema_: Schema = Field(alias="schema")
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _check_name(cls, name: str) -> str:
        if not SCHEMA_NAME.fullmatch(name):
            raise ValueError(
                "response_format.json_schema.name must be 1 to 64 letters, digits, underscores "
                f"or dashes; got {name!r}"
            )
        return name

    @field_validator("schema_", mode="before")
    @classmethod
    def _check_schema(cls, value: Any) -> Any:
        return check_schema(value, "response_format.json_schema.schema", text_allowed=False)


class ResponseFormat(RequestBody):
    """OpenAI's `response_format`: text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError(
                "response_format.json_schema is required when type is 'json_schema': "
                '{"name": ..., "schema": {...}}'
            )
        return self

    def constraint(self) -> StructuredOutputsParams | None:
        """None for text."""
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.json_schema is not None and self.type == "json_schema":
            where = "response_format.json_schema.schema"
            return StructuredOutputsParams(json=schema_text(self.json_schema.schema_, where))
        return None


class StructuredOutputsRequest(RequestBody):
    """vLLM's `structured_outputs`: exactly one of json, json_object, regex, choice, grammar."""

    json_: SchemaOrText | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: Any = None  # vLLM's; not supported

    @field_validator("json_", mode="before")
    @classmethod
    def _check_json(cls, value: Any) -> Any:
        return None if value is None else check_schema(value, "structured_outputs.json")

    @field_validator("regex", "grammar", mode="before")
    @classmethod
    def _check_text(cls, value: Any, info: ValidationInfo) -> Any:
        return _non_empty(value, f"structured_outputs.{info.field_name}")

    @field_validator("choice", mode="before")
    @classmethod
    def _check_choice(cls, value: Any) -> Any:
        return _choices(value, "structured_outputs.choice")

    @field_validator("structural_tag")
    @classmethod
    def _no_structural_tag(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("structured_outputs.structural_tag is not supported by this server")
        return value

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputsRequest:
        given = self._kinds()
        if len(given) != 1:
            raise ValueError(
                "structured_outputs takes exactly one of json, json_object, regex, choice and "
                f"grammar; got {', '.join(given) or 'none'}"
            )
        return self

    def _kinds(self) -> list[str]:
        kinds = [k for k in ("regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_ is not None:
            kinds.insert(0, "json")
        if self.json_object:
            kinds.insert(0, "json_object")
        return kinds

    def constraint(self) -> StructuredOutputsParams:
        """The engine's form of it."""
        if self.json_ is not None:
            return StructuredOutputsParams(json=schema_text(self.json_, "structured_outputs.json"))
        if self.json_object:
            return StructuredOutputsParams(json_object=True)
        return StructuredOutputsParams(regex=self.regex, choice=self.choice, grammar=self.grammar)


class ConstrainedRequest(RequestBody):
    """The fields of completions and chat that constrain the output; at most one is given."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    # vLLM's older names for structured_outputs' kinds.
    guided_json: SchemaOrText | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("guided_json", mode="before")
    @classmethod
    def _check_guided_json(cls, value: Any) -> Any:
        return None if value is None else check_schema(value, "guided_json")

    @field_validator("guided_regex", "guided_grammar", mode="before")
    @classmethod
    def _check_guided_text(cls, value: Any, info: ValidationInfo) -> Any:
        return _non_empty(value, str(info.field_name))

    @field_validator("guided_choice", mode="before")
    @classmethod
    def _check_guided_choice(cls, value: Any) -> Any:
        return _choices(value, "guided_choice")

    def constraint_fields(self) -> list[str]:
        """The fields given that constrain the output (response_format text does not)."""
        given = []
        for name in CONSTRAINT_FIELDS:
            value = getattr(self, name)
            if value is not None and not (name == "response_format" and value.type == "text"):
                given.append(name)
        return given

    @model_validator(mode="after")
    def _one_constraint(self) -> ConstrainedRequest:
        given = self.constraint_fields()
        if len(given) > 1:
            raise FieldError(
                f"{given[1]} and {given[0]} both constrain the output; send only one of "
                f"{', '.join(CONSTRAINT_FIELDS)}",
                param=given[1],
            )
        return self

    def output_constraint(self) -> StructuredOutputsParams | None:
        """The constraint the request asks for, if any."""
        if self.response_format is not None and self.response_format.type != "text":
            return self.response_format.constraint()
        if self.structured_outputs is not None:
            return self.structured_outputs.constraint()
        if self.guided_json is not None:
            return StructuredOutputsParams(json=schema_text(self.guided_json, "guided_json"))
        if self.guided_regex is not None or self.guided_grammar is not None:
            return StructuredOutputsParams(regex=self.guided_regex, grammar=self.guided_grammar)
        if self.guided_choice is not None:
            return StructuredOutputsParams(choice=self.guided_choice)
        return None
