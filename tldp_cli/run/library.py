"""The library speaks Python: its entry points raise messages that name their parameters.

Messages have one source, written for the command ("--eps must be a finite number > 0",
"pass --allow-weak-seed"). The library's entry points (perturb_array, perturb, plan, calibrate)
translate the flags in the messages they raise into their parameters' names, through the
table of PerturbOptions' flags (pipeline.OPTION_FLAGS, which a resume record's keys use
too): `--eps 0` reads `eps=0`, `--mechanism privunit` `mechanism='privunit'`,
`--allow-weak-seed` `allow_weak_seed=True`, `--range LO:HI` `value_range=(lo, hi)` and
`--range t2m=...` `ranges['t2m']`. The command calls pipeline.perturb and
mechanisms.calibrate themselves, so its messages keep naming its flags.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Callable, Mapping, TypeVar

from tldp_cli.errors import Interrupted, TldpError
from tldp_cli.privacy import mechanisms, privunit
from tldp_cli.run import pipeline
from tldp_cli.sampling.rng import RNG_KINDS

__all__ = ["calibrate", "perturb", "python_words", "speaks_python"]

F = TypeVar("F", bound=Callable)

# The values a flag takes that a message may spell after it (--noise gaussian): shown as
# Python strings (noise='gaussian'). A value missing here reads as a word after the name.
CHOICES: dict[str, tuple[str, ...]] = {
    "mechanism": mechanisms.MECHANISMS, "noise": mechanisms.NOISES, "budget": mechanisms.BUDGETS,
    "sampler": mechanisms.SAMPLERS, "rng": RNG_KINDS, "dtype": ("float32", "float64"),
    "scheduler": ("threads", "dask"), "reference": privunit.REFERENCE_CHOICES, "store": pipeline.STORE_CHOICES,
}
_FIELDS = {f.name: f for f in dataclasses.fields(pipeline.PerturbOptions)}
# flag -> parameter: the table's exceptions, else the field's name with "_" for "-"
_PARAMETERS = {**{"--" + name.replace("_", "-"): name for name in _FIELDS},
               **{flag: name for name, flag in pipeline.OPTION_FLAGS.items() if name != "ranges"}}
_SWITCHES = {name for name, f in _FIELDS.items() if isinstance(f.default, bool)}  # --overwrite: overwrite=True
_COMMAND_ONLY = {"--json": "PerturbResult.manifest"}  # flags of the command alone: what the library has instead

_NUMBER = r"-?(?:\d+\.?\d*|\.\d+)(?:e[+-]?\d+)?|-?inf|nan"
_FLAG = re.compile(r"(?<![\w-])--(?P<flag>[a-z][a-z0-9-]*)(?: (?P<value>(?!--)[^\s,;()]+))?")
_RANGE = re.compile(rf"(?:(?P<name>[^\s=]+)=)?(?P<lo>{_NUMBER}|LO):(?P<hi>{_NUMBER}|HI)")
_OWN_RANGE = re.compile(r"(?P<name>[^\s=]+)=\.\.\.")
_METAVAR = re.compile(r"[A-Z][A-Z0-9_]*(?:\.[a-z]+)?")


def python_words(text: str, renamed: Mapping[str, str] | None = None) -> str:
    """`text` with each --flag (and the value a message gives it) in the library's words:
    the parameter's name (`renamed`: flag -> name where an entry point names it otherwise,
    calibrate's epsilon), =True for a switch, =VALUE for a number or a placeholder (C,
    PATH), ='VALUE' for a choice or a value the message follows with a colon."""
    renamed = renamed or {}

    def word(match: re.Match) -> str:
        flag, value = "--" + match["flag"], match["value"] or ""
        core = value.rstrip(".:")
        tail = value[len(core):]  # the sentence's punctuation
        if flag == "--range":
            return _range_words(core, tail, value)
        name = (renamed.get(flag) or _PARAMETERS.get(flag) or _COMMAND_ONLY.get(flag)
                or match["flag"].replace("-", "_"))
        if name in _SWITCHES:
            return f"{name}=True" + (f" {value}" if value else "")
        if value and (re.fullmatch(_NUMBER, core) or _METAVAR.fullmatch(core)):
            return f"{name}={core}{tail}"
        if value and (core in CHOICES.get(name, ()) or tail.startswith(":")):  # "--basis dct:1: ..."
            return f"{name}={core!r}{tail}"
        return name + (f" {value}" if value else "")

    return _FLAG.sub(word, text)


def _range_words(core: str, tail: str, value: str) -> str:
    """--range and what follows it: value_range=(lo, hi), ranges={'t': (lo, hi)}, ranges['t']."""
    bounds = _RANGE.fullmatch(core)
    if bounds:
        lo, hi = (bound.lower() if bound in ("LO", "HI") else bound for bound in (bounds["lo"], bounds["hi"]))
        if bounds["name"] is None:
            return f"value_range=({lo}, {hi}){tail}"
        name = "NAME" if bounds["name"] == "NAME" else repr(bounds["name"])
        return f"ranges={{{name}: ({lo}, {hi})}}{tail}"
    own = _OWN_RANGE.fullmatch(value.rstrip(":"))
    if own:
        return f"ranges[{own['name']!r}]{value[len(own[0]):]}"
    return "value_range" + (f" {value}" if value else "")


def speaks_python(renamed: Mapping[str, str] | None = None) -> Callable[[F], F]:
    """Decorator of a library entry point: the TldpError (or Interrupted) it raises keeps its
    type and traceback, its message in python_words."""
    def decorate(function: F) -> F:
        @functools.wraps(function)
        def entry_point(*args, **kwargs):
            try:
                return function(*args, **kwargs)
            except (TldpError, Interrupted) as exc:
                if len(exc.args) == 1 and isinstance(exc.args[0], str):
                    exc.args = (python_words(exc.args[0], renamed),)
                raise
        return entry_point  # type: ignore[return-value]
    return decorate


# The library's perturb and calibrate (tldp_cli.perturb, tldp_cli.calibrate): the command's,
# speaking Python. calibrate's epsilon keeps its name: the accounting's functions all use it.
perturb = speaks_python()(pipeline.perturb)
calibrate = speaks_python({"--eps": "epsilon"})(mechanisms.calibrate)
