"""cli/coercion.py: every option of every command, given values valid and invalid, coerced
as Typer's own (pydantic) coercion does it: the same value of the same type, or a refusal of
the same values (issue 30: the command line answers without importing pydantic), in the
CLI's words where Typer's are pydantic's, in the option's own where its parser refuses."""

import enum
import math
import typing

import pytest
import typer.main
from typer import _coercion
from typer._click import Context

from tests.builders import one_line_error
from tldp_cli.cli import app, coercion

TEXTS = ["1", "-1", "+2", "0", "007", "1.5", ".5", "5.", "1e5", "1E-3", "1e400", "abc", "", "1,5", "0x10",
         "e5", "--1", "1_000", " 1", "inf", "-inf", "nan", "1.0", "true", "laplace", "LAPLACE", "gaussian",
         "discrete-laplace", "exact", "record", "npy", "png", "dask", "float32", "x.npy", "-", "s3://b/k",
         "dct:8", "0:1", "a=0:2", "\x1b[31mred"]
OTHER = [None, 0, 1, 2.5, True, False]


PYDANTIC_WORDS = ("Input should", "Value error", "valid integer", "valid number", "Invalid value")


def outcome(runtime, value, param, ctx):
    try:
        got = runtime.coerce(value, param=param, ctx=ctx)
    except Exception as exc:  # noqa: BLE001 (the error itself is what is compared)
        kind = "BadParameter" if isinstance(exc, typer.BadParameter) else type(exc).__name__
        message = exc.message if kind == "BadParameter" else str(exc)  # a BadParameter's without "Invalid value for"
        if hasattr(exc.__cause__, "errors"):  # pydantic's ValidationError: its words, not the CLI's
            return ("error", kind, "pydantic")
        return ("error", kind, message)
    if isinstance(got, float) and math.isnan(got):
        return ("value", "float", "nan")
    if isinstance(got, (list, tuple)):
        return ("value", type(got).__name__, [(type(v).__name__, v) for v in got])
    return ("value", type(got).__name__, got)


def parameters():
    root = typer.main.get_command(app)
    coercion.install(root)
    found = [(root, p) for p in root.params]
    for command in root.commands.values():
        found += [(command, p) for p in command.params]
    return found


@pytest.mark.parametrize("command, param", parameters(), ids=lambda v: getattr(v, "name", str(v)))
def test_quick_coercion_agrees_with_typers_own(command, param):
    ctx = Context(command, info_name=command.name)
    quick = param._runtime_param
    assert isinstance(quick, _coercion.RuntimeParam) and not isinstance(quick, _coercion.AdapterRuntimeParam)
    own = _coercion.build_runtime_param(param.type_descriptor)
    values = list(TEXTS) + OTHER + [param.default]
    if param.multiple or param.nargs == -1:
        values = [None] + [[text] for text in TEXTS] + [["x.npy", text] for text in TEXTS] + [()]
    for value in values:
        if param.type_descriptor.annotation is bool and isinstance(value, bool):
            continue  # Typer does not coerce a flag's bool
        got, typers = outcome(quick, value, param, ctx), outcome(own, value, param, ctx)
        name = param.opts[0] if param.param_type_name == "option" else param.metavar.removesuffix("...")
        if typers[2] == "pydantic":  # refused by pydantic: refused here too, in plain words
            assert got[:2] == typers[:2] and got[2].startswith(f"{name} must be "), (param.name, value, got)
            assert ", not " in got[2] and not any(words in got[2] for words in PYDANTIC_WORDS), got
        elif typers[:2] == ("error", "BadParameter"):  # the parser's own words, after the option's name
            assert got == (*typers[:2], f"{name}: {typers[2]}"), (param.name, value, got)
        else:
            assert got == typers, (param.name, value)


def test_every_parameter_and_help_option_gets_the_quick_coercion():
    root = typer.main.get_command(app)
    coercion.install(root)
    ctx = Context(root, info_name="tldp")
    for command in [root, *root.commands.values()]:
        for param in command.get_params(Context(command, info_name=command.name, parent=ctx)):
            assert type(param._runtime_param).__name__ == "_Quick", (command.name, param.name)


def refused_options():
    """(command, option, annotation) of every option whose values Typer's pydantic refuses:
    enums and numbers, alone or as lists."""
    root = typer.main.get_command(app)
    found = []
    for name, command in root.commands.items():
        for param in command.params:
            annotation = param.type_descriptor.annotation
            leaf = typing.get_args(annotation)[0] if typing.get_origin(annotation) is list else annotation
            if param.param_type_name == "option" and (leaf in (int, float) or isinstance(leaf, type)
                                                       and issubclass(leaf, enum.Enum)):
                found.append((name, param.opts[0], leaf))
    return found


@pytest.mark.parametrize("command, option, leaf", refused_options(), ids=lambda v: getattr(v, "__name__", str(v)))
def test_a_refused_value_is_one_plain_line_exit_2(cli, command, option, leaf):
    """`--noise bogus` said "Invalid value for '--noise': Value error, 'bogus' is not one of
    ...", `--eps x` "Input should be a valid number, unable to parse string as a number":
    pydantic's words. Each is one line naming the option, what it takes and the value."""
    bad = ["bogus"] + (["1.5"] if leaf is int else [])
    for value in bad:
        line = one_line_error(cli(command, option, value), 2)
        assert line.startswith(f"tldp: error: {option} must be "), line
        assert line.endswith(f", not '{value}' (see 'tldp {command} --help')"), line
        assert not any(words in line for words in PYDANTIC_WORDS), line
        if leaf in (int, float):
            assert ("a whole number" if leaf is int else "a number") in line, line
        else:
            assert "one of " + ", ".join(member.value for member in leaf) in line, line


def test_an_option_from_the_environment_is_named_with_its_variable(cli, monkeypatch):
    monkeypatch.setenv("TLDP_WORKERS", "many")
    line = one_line_error(cli("perturb", "x.npy", "--eps", "1"), 2)
    assert line == ("tldp: error: --workers (from $TLDP_WORKERS) must be a whole number >= 1, not 'many' "
                    "(see 'tldp perturb --help')"), line


@pytest.mark.parametrize("args, line", [
    (["perturb", "-", "--eps", "1"], "INPUT: reading from stdin is not supported"),
    (["perturb", "x.npy", "--eps", "1", "--ledger", "s3://b/k"], "--ledger: s3://b/k: remote paths are not supported"),
    (["evaluate", "x.npy", "y.npy", "--manifest", ""], "--manifest: the path is empty"),
])
def test_a_path_option_s_refusal_names_the_option_without_click_s_preamble(cli, args, line):
    """"Invalid value for '--ledger' (env var: 'TLDP_LEDGER'): s3://b/k: ...": Click's words
    before the parser's; now the option, then the parser's words."""
    got = one_line_error(cli(*args), 2)
    assert got.startswith(f"tldp: error: {line}") and "Invalid value" not in got, got
