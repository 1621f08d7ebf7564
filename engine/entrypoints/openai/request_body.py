"""The base of every request body: unknown fields ignored, text that is not Unicode refused."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

_SURROGATE = re.compile(r"[\ud800-\udfff]")


class FieldError(ValueError):
    """A request error found across fields, where pydantic cannot tell which one it is about.

    errors.py reports `param` as the error's field.
    """

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _lone_surrogate(value: Any) -> tuple[str, str] | None:
    """Where (as `[0].content`) and which lone surrogate a JSON value holds, if any.

    JSON can escape one (`"\\ud800"`) though it is no character: neither the tokenizer nor
    UTF-8 can take it. Walked without recursion, as the nesting is the client's to choose.
    """
    pending: list[tuple[str, Any]] = [("", value)]
    while pending:
        where, item = pending.pop()
        if isinstance(item, str) and (match := _SURROGATE.search(item)):
            return where, match.group()
        if isinstance(item, dict):
            pending.extend((where, key) for key in item)
            pending.extend((f"{where}.{key}", child) for key, child in item.items())
        elif isinstance(item, list):
            pending.extend((f"{where}[{i}]", child) for i, child in enumerate(item))
    return None


def null_is_default(*fields: str) -> Any:
    """A validator that reads null in `fields` as each one's default.

    OpenAI's API reference marks these fields nullable, and clients send null for "not set".
    Their annotations include None, so that the OpenAPI document allows null, but a validated
    body holds the default instead.
    """

    def default(cls: type[BaseModel], value: Any, info: ValidationInfo) -> Any:
        if value is None and info.field_name is not None:
            return cls.model_fields[info.field_name].default
        return value

    return field_validator(*fields, mode="before")(classmethod(default))


class RequestBody(BaseModel):
    """A request body or a part of one."""

    model_config = ConfigDict(extra="ignore")

    @field_validator("*", mode="before")
    @classmethod
    def _valid_unicode(cls, value: Any, info: ValidationInfo) -> Any:
        found = _lone_surrogate(value)
        if found is not None:
            where, char = found
            raise ValueError(
                f"{info.field_name}{where} is not valid Unicode: it holds the lone surrogate "
                f"{char!r}; a \\uD800-\\uDFFF escape must be one half of a surrogate pair"
            )
        return value
