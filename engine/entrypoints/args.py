"""Command-line flags from the pydantic config models: one --flag per field, one source of truth.

Every subcommand that takes engine, server or router flags builds them here, and `--config`
files are read against the same models.
"""

from __future__ import annotations

import argparse
import json
import types
import typing
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

from tidegate.engine.config import EngineArgs

M = typing.TypeVar("M", bound=BaseModel)


def add_engine_args(
    parser: argparse.ArgumentParser,
    model: type[BaseModel] = EngineArgs,
    defaults: dict[str, Any] | None = None,
) -> None:
    """Add one --flag per field of a config model, named and documented from the model itself.

    `defaults` (field name -> value, e.g. from --config) replace the model's defaults, so that
    a flag on the command line still wins over the file.
    """
    defaults = defaults or {}
    for name, field in model.model_fields.items():
        flag = "--" + name.replace("_", "-")
        annotation = field.annotation
        default = defaults.get(name, field.default)
        # argparse formats help with %: a literal one ("90% of") must be doubled.
        help_text = (field.description or "").replace("%", "%%")
        kwargs: dict[str, Any] = {"help": help_text, "dest": name}
        if annotation is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
            kwargs["default"] = default
        elif typing.get_origin(_strip_none(annotation)) is list:
            kwargs["nargs"] = "+"
            if field.is_required() and name not in defaults:
                kwargs["required"] = True
            else:
                kwargs["default"] = default
        else:
            choices, cast = _argparse_type(annotation)
            kwargs.update(type=cast, choices=choices)
            if field.is_required() and name not in defaults:
                kwargs["required"] = True
            else:
                kwargs["default"] = default
        parser.add_argument(flag, **kwargs)


def flag_name(field_name: str) -> str:
    """The command-line spelling of a config field: max_num_seqs -> max-num-seqs."""
    return field_name.replace("_", "-")


def load_config_file(path: str, models: Sequence[type[BaseModel]]) -> dict[str, Any]:
    """Flag values from a YAML (or JSON) mapping whose keys are flag names, as vLLM's --config."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except OSError as error:
        raise SystemExit(f"tidegate: cannot read --config {path}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise SystemExit(f"tidegate: --config {path} is not valid YAML: {error}") from None
    if not isinstance(data, dict):
        raise SystemExit(f"tidegate: --config {path} must hold a mapping of flag: value")
    known = {name for model in models for name in model.model_fields}
    values = {str(key).replace("-", "_"): value for key, value in data.items()}
    unknown = sorted(flag_name(key) for key in values if key not in known)
    if unknown:
        raise SystemExit(f"tidegate: --config {path} names unknown flags: {', '.join(unknown)}")
    return values


def _strip_none(annotation: Any) -> Any:
    """The X of `X | None`."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        return inner[0]
    return annotation


def _argparse_type(annotation: Any) -> tuple[list[Any] | None, Any]:
    """(choices, converter) for a field annotation such as int | None or Literal[...]."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        words = [a for a in inner if typing.get_origin(a) is typing.Literal]
        if words and len(inner) == 2:  # e.g. int | Literal["auto"]: a number or the word
            keywords = set(typing.get_args(words[0]))
            other = next(a for a in inner if a is not words[0])
            return None, lambda text: text if text in keywords else other(text)
    annotation = _strip_none(annotation)
    if typing.get_origin(annotation) is typing.Literal:
        choices = list(typing.get_args(annotation))
        return choices, type(choices[0])
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return None, _json_object  # the model validates the mapping (e.g. speculative_config)
    return None, annotation


def _json_object(text: str) -> dict[str, Any]:
    """A flag whose value is a JSON object, such as --speculative-config '{"method": ...}'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not valid JSON ({error}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def engine_args_from(namespace: argparse.Namespace, model: type[M] = EngineArgs) -> M:  # type: ignore[assignment]
    """A config model from parsed flags; a bad combination exits with the validator's message."""
    values = {name: getattr(namespace, name) for name in model.model_fields}
    try:
        return model(**values)
    except ValidationError as error:
        raise SystemExit(f"tidegate: invalid arguments:\n{error}") from None
