"""Typer's coercion of option values without pydantic, where the value is plainly valid.

Typer (0.29) coerces every option a command is given, and each default, through a
pydantic TypeAdapter built for it; importing pydantic and building the adapters costs
more than importing NumPy. Completion, a usage error and a missing input paid it before
doing anything (issue 30). `install` gives each parameter a coercion that returns what
the adapter returns for the values it can judge without pydantic (an enum member, a
float or int written plainly, a string, a path through the option's parser) and hands
anything else to Typer's own coercion: an invalid value gets Typer's message, word for
word, and a value this module does not know (a bool written as text, a number written
with an underscore) gets Typer's reading. tests/cli/test_coercion.py checks the two
agree; tests/cli/test_startup.py that pydantic is not imported.
"""

from __future__ import annotations

import re
from enum import Enum
from types import SimpleNamespace
from typing import Any, get_args, get_origin

from typer import BadParameter

try:  # Typer's internals as of 0.29; another Typer keeps its own coercion throughout (install)
    from typer import _coercion, _param_types
    from typer._click.utils import _escape_control_characters
    _RuntimeParam: Any = _coercion.RuntimeParam
except (ImportError, AttributeError):
    _RuntimeParam = None

# Numbers as people write them on a command line; anything else (inf, 1_000, " 1") goes to Typer.
_FLOAT = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d{1,3})?")
_INT = re.compile(r"[+-]?\d{1,18}")


class _Unknown(Exception):
    """The value is not one this module judges: Typer's own coercion decides."""


class _Refused(Exception):
    """The value is refused, with the words pydantic's validation gives Typer (checked against
    it: tests/cli/test_coercion.py)."""


def _not_a_number(value: str, annotation: type) -> None:
    """Refuses text that is no number even to Python (pydantic refuses it too), else _Unknown."""
    try:
        float(value)
    except ValueError:
        if annotation is float:
            raise _Refused("Input should be a valid number, unable to parse string as a number") from None
        raise _Refused("Input should be a valid integer, unable to parse string as an integer") from None
    raise _Unknown


def _number(value: Any, annotation: type, info: Any) -> Any:
    if annotation is float:
        if type(value) is float:
            number = value
        elif type(value) is int:
            number = float(value)
        elif isinstance(value, str) and _FLOAT.fullmatch(value):
            number = float(value)
        elif isinstance(value, str):
            _not_a_number(value, float)
        else:
            raise _Unknown
    elif type(value) is int:
        number = value
    elif isinstance(value, str) and _INT.fullmatch(value):
        number = int(value)
    elif isinstance(value, str):
        _not_a_number(value, int)
    else:
        raise _Unknown
    if annotation is int and type(info.min) is int and info.max is None and not info.clamp and number < info.min:
        raise _Refused(f"Input should be greater than or equal to {info.min}")
    if info.clamp or (info.min is not None and number < info.min) or (info.max is not None and number > info.max):
        raise _Unknown  # out of bounds: Typer's message, or its clamping
    return number


def _leaf(value: Any, annotation: Any, info: Any, ctx: Any) -> Any:
    """What Typer's adapter returns for `value`, or _Unknown."""
    if info.parser is not None:
        if not isinstance(value, str):
            raise _Unknown
        try:
            return info.parser(value)  # its BadParameter goes through pydantic unchanged: here too
        except (ValueError, AssertionError):  # what pydantic rewords: Typer calls it again
            raise _Unknown from None
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        try:
            return _param_types.coerce_cli_choice(value, choices=list(annotation),
                                                  case_sensitive=info.case_sensitive, ctx=ctx)
        except ValueError as exc:  # pydantic's words for a validator's ValueError
            raise _Refused(f"Value error, {exc}") from None
    if annotation in (float, int):
        return _number(value, annotation, info)
    if annotation is str and isinstance(value, str):
        return value
    raise _Unknown


class _Quick(_RuntimeParam or object):  # type: ignore[misc]
    """A parameter's coercion: the plain cases here, the rest by Typer's (built when needed)."""

    def _coerce_value(self, value: Any, param: Any, ctx: Any) -> Any:
        try:
            if get_origin(self.annotation) is list:
                if not isinstance(value, (list, tuple)):
                    raise _Unknown
                (item,) = get_args(self.annotation)
                return [_leaf(v, item, self.parameter_info, ctx) for v in value]
            return _leaf(value, self.annotation, self.parameter_info, ctx)
        except _Refused as exc:  # as Typer raises pydantic's ValidationError (AdapterRuntimeParam)
            raise BadParameter(_escape_control_characters(str(exc)), ctx=ctx, param=param) from None
        except _Unknown:
            typer_own = _coercion.build_runtime_param(param.type_descriptor)
            return typer_own._coerce_value(value, param=param, ctx=ctx)


def _quick(param: Any) -> None:
    descriptor = getattr(param, "type_descriptor", None)
    if descriptor is None or descriptor.file_annotation is not None or getattr(param, "_runtime_param", 1) is not None:
        return  # not a Typer parameter, a file, or this Typer keeps its coercion elsewhere
    param._runtime_param = _Quick(parameter_info=descriptor.parameter_info, annotation=descriptor.annotation)


def install(command: Any, help_names: list[str] | None = None) -> None:
    """Give every parameter of `command` and of its subcommands the quick coercion, their
    --help too (Click makes it when the command is parsed: made here, with the names the
    context would give it)."""
    if _RuntimeParam is None:
        return
    settings = getattr(command, "context_settings", None) or {}
    help_names = settings.get("help_option_names", help_names) or ["--help"]
    for param in getattr(command, "params", ()):
        _quick(param)
    if getattr(command, "_help_option", 1) is None:
        help_option = command.get_help_option(SimpleNamespace(help_option_names=help_names))
        if help_option is not None:
            _quick(help_option)
    for sub in (getattr(command, "commands", None) or {}).values():
        install(sub, help_names)
