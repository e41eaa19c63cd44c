"""cli/coercion.py: every option of every command, given values valid and invalid, coerced
as Typer's own (pydantic) coercion does it: the same value of the same type, or the same
error in the same words (issue 30: the command line answers without importing pydantic)."""

import math

import pytest
import typer.main
from typer import _coercion
from typer._click import Context

from tldp_cli.cli import app, coercion

TEXTS = ["1", "-1", "+2", "0", "007", "1.5", ".5", "5.", "1e5", "1E-3", "1e400", "abc", "", "1,5", "0x10",
         "e5", "--1", "1_000", " 1", "inf", "-inf", "nan", "1.0", "true", "laplace", "LAPLACE", "gaussian",
         "discrete-laplace", "exact", "record", "npy", "png", "dask", "float32", "x.npy", "-", "s3://b/k",
         "dct:8", "0:1", "a=0:2", "\x1b[31mred"]
OTHER = [None, 0, 1, 2.5, True, False]


def outcome(runtime, value, param, ctx):
    try:
        got = runtime.coerce(value, param=param, ctx=ctx)
    except Exception as exc:  # noqa: BLE001 (the error itself is what is compared)
        message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        return ("error", type(exc).__name__, message)
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
        assert outcome(quick, value, param, ctx) == outcome(own, value, param, ctx), (param.name, value)


def test_every_parameter_and_help_option_gets_the_quick_coercion():
    root = typer.main.get_command(app)
    coercion.install(root)
    ctx = Context(root, info_name="tldp")
    for command in [root, *root.commands.values()]:
        for param in command.get_params(Context(command, info_name=command.name, parent=ctx)):
            assert type(param._runtime_param).__name__ == "_Quick", (command.name, param.name)
