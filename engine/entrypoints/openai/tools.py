"""Tools in a chat request: their shapes, and the grammar that makes the model call them.

tool_choice "required" and a named function are enforced by a JSON schema (the engine
compiles it into a grammar); "auto" leaves the output free and a parser finds the calls;
"none" leaves both alone.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import field_validator

from tidegate.engine.entrypoints.openai.request_body import RequestBody
from tidegate.engine.entrypoints.openai.structured_outputs import schema_text
from tidegate.engine.sampling_params import StructuredOutputsParams

ToolChoiceMode = Literal["none", "auto", "required", "named"]
# OpenAI's parameters when a function has none: an object without properties.
DEFAULT_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
_TOOL_CHOICE_SHAPES = (
    '\'none\', \'auto\', \'required\' or {"type": "function", "function": {"name": ...}}'
)


class FunctionDefinition(RequestBody):
    """A function the model may call."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: DEFAULT_PARAMETERS
    strict: bool | None = None  # accepted; "required" and named calls follow the schema anyway

    @field_validator("name")
    @classmethod
    def _named(cls, name: str) -> str:
        if not name:
            raise ValueError("a function's name must not be empty")
        return name

    @field_validator("parameters")
    @classmethod
    def _writable(cls, parameters: dict[str, Any] | None) -> dict[str, Any] | None:
        if parameters is not None:
            schema_text(parameters, "parameters")  # NaN, or nesting too deep
        return parameters

    @property
    def schema(self) -> dict[str, Any]:
        """The parameters' JSON schema."""
        return self.parameters if self.parameters is not None else dict(DEFAULT_PARAMETERS)


class ChatTool(RequestBody):
    """One entry of `tools`."""

    type: Literal["function"] = "function"
    function: FunctionDefinition

    def for_template(self) -> dict[str, Any]:
        """OpenAI's tool dict, as chat templates take it (parameters filled in)."""
        function = self.function
        described = {"name": function.name}
        if function.description is not None:
            described["description"] = function.description
        return {"type": "function", "function": {**described, "parameters": function.schema}}


class NamedFunction(RequestBody):
    name: str


class NamedToolChoice(RequestBody):
    """tool_choice naming the one function the model must call."""

    type: Literal["function"] = "function"
    function: NamedFunction


def check_tool_choice(value: Any) -> Any:
    """The value if it has one of tool_choice's shapes (ValueError saying which if not)."""
    if value is None or value in ("none", "auto", "required"):
        return value
    if isinstance(value, dict) and value.get("type", "function") == "function":
        function = value.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return value
    shown = json.dumps(value)[:100] if not isinstance(value, str) else repr(value[:100])
    raise ValueError(f"tool_choice must be {_TOOL_CHOICE_SHAPES}; got {shown}")


class FunctionCall(RequestBody):
    name: str
    arguments: str | dict[str, Any]  # JSON text, as OpenAI sends it


class MessageToolCall(RequestBody):
    """A call an earlier assistant turn made (`messages[i].tool_calls[j]`)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall

    def for_template(self) -> dict[str, Any]:
        """The call as Hugging Face templates take it: arguments as an object when they are one.

        (Templates write `arguments | tojson`; text that is no JSON object is passed as text.)
        """
        arguments: Any = self.function.arguments
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except (ValueError, RecursionError):
                parsed = None
            if isinstance(parsed, dict):
                arguments = parsed
        call: dict[str, Any] = {
            "type": "function",
            "function": {"name": self.function.name, "arguments": arguments},
        }
        if self.id is not None:
            call = {"id": self.id, **call}
        return call


def required_schema(tools: list[ChatTool], parallel: bool) -> dict[str, Any]:
    """tool_choice "required": a list of calls, each `{"name": <a tool>, "parameters": {...}}`."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "const": tool.function.name},
                "parameters": tool.function.schema,
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    schema["items"] = {"anyOf": calls}
    return schema


def tool_constraint(
    tools: list[ChatTool], mode: ToolChoiceMode, named: str | None, parallel: bool
) -> StructuredOutputsParams | None:
    """The grammar a tool_choice asks for: "required" and named ones have one."""
    if mode == "required":
        schema = schema_text(required_schema(tools, parallel), "tools")
        return StructuredOutputsParams(json=schema)
    if mode == "named":
        index, tool = next((i, t) for i, t in enumerate(tools) if t.function.name == named)
        where = f"tools[{index}].function.parameters"
        return StructuredOutputsParams(json=schema_text(tool.function.schema, where))
    return None
