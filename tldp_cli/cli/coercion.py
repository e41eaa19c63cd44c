"""Typer's coercion of option values without pydantic, where the value is plainly valid.

Typer (0.29) coerces every option a command is given, and each default, through a
pydantic TypeAdapter built for it; importing pydantic and building the adapters costs
more than importing NumPy. Completion, a usage error and a missing input paid it before
doing anything (issue 30). `install` gives each parameter a coercion that returns what
the adapter returns for the values it can judge without pydantic (an enum member, a
float or int written plainly, a string, a path through the option's parser) and hands
anything else to Typer's own coercion: a value this module does not know (a bool written
as text, a number written with an underscore) gets Typer's reading. A value refused, here
or by Typer's pydantic, is one plain line in the words of the CLI's other usage errors
("--noise must be one of laplace, gaussian, ..., not 'bogus'"), never pydantic's ("Value
error, ...", "Input should be a valid number, ..."); a path option's own refusal (a URL,
`-`) keeps its words. tests/cli/test_coercion.py checks the two agree on every value and
refuse the same ones; tests/cli/test_startup.py that pydantic is not imported.
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
    """The value is refused (pydantic refuses it too: tests/cli/test_coercion.py)."""


class _PlainBadParameter(BadParameter):
    """A refused value in the CLI's words: the message is the whole line (no "Invalid value
    for '--x':" before it)."""

    def format_message(self) -> str:
        return self.message


def _not_a_number(value: str) -> None:
    """Refuses text that is no number even to Python (pydantic refuses it too), else _Unknown."""
    try:
        float(value)
    except ValueError:
        raise _Refused from None
    raise _Unknown


def expected(annotation: Any, info: Any) -> str | None:
    """What an option of this type takes, as its refusal says it; None for a type whose
    values cannot be refused but by its parser (a path, a string)."""
    if get_origin(annotation) is list:
        (annotation,) = get_args(annotation)
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        return "one of " + ", ".join(str(member.value) for member in annotation)
    if annotation is bool:
        return "true or false"
    if annotation not in (int, float) or info.parser is not None:
        return None
    bounds = [f"{sign} {bound}" for sign, bound in ((">=", info.min), ("<=", info.max))
              if bound is not None and not info.clamp]
    return ("a whole number" if annotation is int else "a number") + (" " + " and ".join(bounds) if bounds else "")


def option_name(param: Any, ctx: Any) -> str:
    """The option as a refusal names it: its flag (an argument's metavar), and the variable
    where the value came from the environment ("--workers (from $TLDP_WORKERS)")."""
    name = param.opts[0] if getattr(param, "param_type_name", "") == "option" and param.opts else (
        (getattr(param, "metavar", None) or str(param.name).upper()).removesuffix("..."))
    source = ctx.get_parameter_source(param.name) if ctx is not None and param.name else None
    if source is not None and source.name == "ENVIRONMENT" and param.envvar:
        variable = param.envvar if isinstance(param.envvar, str) else param.envvar[0]
        name = f"{name} (from ${variable})"
    return name


def refusal(param: Any, ctx: Any, value: Any, takes: str) -> BadParameter:
    """"--workers must be a whole number >= 1, not 'x'": the option, what it takes and the
    value refused, as the CLI's other usage errors say it."""
    shown = repr(value) if isinstance(value, str) else str(value)
    return _PlainBadParameter(_escape_control_characters(f"{option_name(param, ctx)} must be {takes}, not {shown}"),
                              ctx=ctx, param=param)


def _plainly(exc: BadParameter, param: Any, ctx: Any) -> BadParameter:
    """A parser's refusal after the option's name ("--ledger: s3://b/k: remote paths are not
    supported; ..."), not after Click's "Invalid value for '--ledger' (env var: ...):"."""
    if isinstance(exc, _PlainBadParameter):
        return exc
    return _PlainBadParameter(f"{option_name(param, ctx)}: {exc.message}", ctx=ctx, param=param)


def _number(value: Any, annotation: type, info: Any) -> Any:
    if annotation is float:
        if type(value) is float:
            number = value
        elif type(value) is int:
            number = float(value)
        elif isinstance(value, str) and _FLOAT.fullmatch(value):
            number = float(value)
        elif isinstance(value, str):
            _not_a_number(value)
        else:
            raise _Unknown
    elif type(value) is int:
        number = value
    elif isinstance(value, str) and _INT.fullmatch(value):
        number = int(value)
    elif isinstance(value, str):
        _not_a_number(value)
    else:
        raise _Unknown
    if info.clamp:
        raise _Unknown  # Typer's clamping
    if (info.min is not None and number < info.min) or (info.max is not None and number > info.max):
        raise _Refused
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
        except ValueError:
            raise _Refused from None
    if annotation in (float, int):
        return _number(value, annotation, info)
    if annotation is str and isinstance(value, str):
        return value
    raise _Unknown


class _Quick(_RuntimeParam or object):  # type: ignore[misc]
    """A parameter's coercion: the plain cases here, the rest by Typer's (built when needed)."""

    def _coerce_value(self, value: Any, param: Any, ctx: Any) -> Any:
        takes = expected(self.annotation, self.parameter_info)
        refused = value
        try:
            if get_origin(self.annotation) is list:
                if not isinstance(value, (list, tuple)):
                    raise _Unknown
                (item,) = get_args(self.annotation)
                coerced = []
                for refused in value:
                    coerced.append(_leaf(refused, item, self.parameter_info, ctx))
                return coerced
            return _leaf(value, self.annotation, self.parameter_info, ctx)
        except BadParameter as exc:  # a parser's own refusal (a URL as a path): its words, after the option's
            raise _plainly(exc, param, ctx) from None
        except _Refused:  # where Typer raises pydantic's ValidationError (AdapterRuntimeParam)
            assert takes is not None  # only enums and numbers are refused here
            raise refusal(param, ctx, refused, takes) from None
        except _Unknown:
            pass
        typer_own = _coercion.build_runtime_param(param.type_descriptor)
        try:
            return typer_own._coerce_value(value, param=param, ctx=ctx)
        except BadParameter as exc:
            errors_of = getattr(exc.__cause__, "errors", None)  # pydantic's ValidationError.errors
            errors = errors_of() if callable(errors_of) else []
            if not errors:
                raise _plainly(exc, param, ctx) from None  # a parser's own refusal, as above
            first = errors[0]
            if takes is None:  # a parser's ValueError, which pydantic words "Value error, ..."
                reason = str((first.get("ctx") or {}).get("error") or first["msg"])
                raise _PlainBadParameter(_escape_control_characters(f"{option_name(param, ctx)}: {reason}"),
                                         ctx=ctx, param=param) from None
            raise refusal(param, ctx, first.get("input", value), takes) from None


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
