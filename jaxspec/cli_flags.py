"""The flag dataclasses of jaxspec/args.py as argparse options, and back.

`add_arguments(parser, cls)` adds one `--field-name` option per field of a flag dataclass (its
help, default, choices and aliases from the field's metadata); `from_namespace(cls, ns)` builds the
dataclass from the parsed options; `to_argv(obj)` gives the command line that parses back to obj.
`jaxspec generate`'s sampling options are SamplingParams' fields (`add_sampling_arguments`).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, TypeVar

from jaxspec.args import GROUPS
from jaxspec.sampling import SamplingParams

T = TypeVar("T")


def option(name: str) -> str:
    return "--" + name.replace("_", "-")


def _scalar_type(tp: Any) -> type:
    """int for `int | None`, `tuple[int, ...]`, etc."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        tp = args[0]
    if typing.get_origin(tp) is tuple:
        tp = typing.get_args(tp)[0]
    return tp


def _is_many(tp: Any) -> bool:
    """Whether a field's type is `tuple[X, ...]` (or that | None): a flag taking one or more values."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return any(_is_many(a) for a in typing.get_args(tp))
    return typing.get_origin(tp) is tuple


def add_arguments(
    parser: argparse.ArgumentParser, cls: type, title: str | None = None, only: tuple[str, ...] | None = None
) -> None:
    """One argparse group with a `--field-name` option per field of cls (`only`: a subset)."""
    group = parser.add_argument_group(title or GROUPS.get(cls, cls.__name__))
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if only is not None and f.name not in only:
            continue
        tp = _scalar_type(hints[f.name])
        help_ = f.metadata["help"]
        names = (option(f.name), *f.metadata.get("aliases", ()))
        if tp is bool:  # unset (None) by default: --x / --no-x; else a switch
            action = argparse.BooleanOptionalAction if f.default is None else "store_true"
            group.add_argument(*names, action=action, default=f.default, help=help_)
            continue
        shown = "" if f.default is None or f.metadata.get("required") else f" (default: {f.default})"
        kw: dict[str, Any] = dict(
            type=tp,
            default=f.default,
            choices=f.metadata["choices"],
            metavar=f.metadata["metavar"],
            help=help_ + ("" if "default" in help_ else shown),
        )
        if _is_many(hints[f.name]):
            kw["nargs"] = "+"
        if f.metadata.get("positional"):
            group.add_argument(f.name, **kw)
            continue
        if f.metadata.get("required"):
            kw["required"] = True
        group.add_argument(*names, dest=f.name, **kw)


def to_argv(obj: Any) -> list[str]:
    """The command-line flags that give the flag dataclass `obj` its values (those at their default
    are left out): `from_namespace(type(obj), parser.parse_args(to_argv(obj)))` == obj."""
    hints = typing.get_type_hints(type(obj))
    out: list[str] = []
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if v == f.default:
            continue
        name = option(f.name)
        if _scalar_type(hints[f.name]) is bool:  # a switch, or --x / --no-x when unset by default
            out.append(name if v else "--no-" + name[2:])
        elif f.metadata.get("positional"):
            out.append(str(v))
        elif isinstance(v, tuple):
            out += [name, *map(str, v)]
        else:
            out += [name, str(v)]
    return out


def from_namespace(cls: type[T], ns: argparse.Namespace) -> T:
    """cls built from the parsed options that belong to it (lists of values as tuples)."""

    def get(name: str) -> Any:
        v = getattr(ns, name)
        return tuple(v) if isinstance(v, list) else v

    return cls(**{f.name: get(f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)})  # type: ignore[arg-type]


# `jaxspec generate`'s sampling flags are SamplingParams' fields; only the default temperature differs
# (greedy on the command line, 1.0 in the API, as in SGLang)
SAMPLING_CLI_DEFAULTS = {"temperature": 0.0}
SAMPLING_NOT_FLAGS = ("skip_special_tokens",)


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling (SGLang's sampling_params)")
    for f in dataclasses.fields(SamplingParams):
        if f.name in SAMPLING_NOT_FLAGS:
            continue
        default, help_ = SAMPLING_CLI_DEFAULTS.get(f.name, f.default), f.metadata["help"]
        if f.name == "stop":
            group.add_argument(option(f.name), action="append", default=None, help=help_)
        elif f.name == "stop_token_ids":
            group.add_argument(option(f.name), type=int, nargs="*", default=None, help=help_)
        elif isinstance(default, bool):
            group.add_argument(option(f.name), action="store_true", default=default, help=help_)
        else:
            tp = int if f.name == "seed" else type(default)
            shown = "" if default is None else f" (default: {default})"
            group.add_argument(option(f.name), type=tp, default=default, help=help_ + shown)


def sampling_from_namespace(ns: argparse.Namespace) -> dict[str, Any]:
    return {f.name: getattr(ns, f.name) for f in dataclasses.fields(SamplingParams) if f.name not in SAMPLING_NOT_FLAGS}
