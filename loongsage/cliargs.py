"""Command-line flags generated from a pydantic config model, and back: one declaration of each
setting (the model), so a child process started with `flags_of(cfg)` rebuilds exactly `cfg`.

Supported field types: str, int, float, bool (`--x` / `--no-x`), Literal (choices), list[int]
(comma-separated), and optional versions of these. Fields marked `json_schema_extra={"cli": False}`
are left out.
"""
from __future__ import annotations

import argparse
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base(annotation: Any) -> tuple[Any, bool]:
    """(the type without None, whether None is allowed)."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0], True
    return annotation, False


def _fields(model: type[BaseModel]):
    for name, field in model.model_fields.items():
        if (field.json_schema_extra or {}).get("cli", True):
            yield name, field, *_base(field.annotation)


def add_model_args(parser: argparse.ArgumentParser, model: type[BaseModel]) -> None:
    for name, field, typ, _ in _fields(model):
        helptext = (field.description or "") + f" (default: {field.default})"
        origin = typing.get_origin(typ)
        if typ is bool:
            parser.add_argument(_flag(name), action=argparse.BooleanOptionalAction, default=field.default, help=helptext)
        elif origin is Literal:
            parser.add_argument(_flag(name), choices=list(typing.get_args(typ)), default=field.default, help=helptext)
        elif origin is list:
            item = typing.get_args(typ)[0]
            parser.add_argument(_flag(name), type=lambda s, t=item: [t(x) for x in s.split(",") if x],
                                default=field.default, help=helptext + "; comma-separated")
        elif typ in (int, float, str):
            parser.add_argument(_flag(name), type=typ, default=field.default, help=helptext)
        else:
            raise TypeError(f"{model.__name__}.{name}: type {typ} has no command-line form; mark it cli=False")


def model_from_args(ns: argparse.Namespace, model: type[BaseModel]):
    return model.model_validate({name: getattr(ns, name) for name, *_ in _fields(model)})


def flags_of(cfg: BaseModel) -> list[str]:
    """The flags that make `model_from_args` rebuild `cfg` (defaults included: nothing is implicit)."""
    out: list[str] = []
    for name, _, typ, _ in _fields(type(cfg)):
        value = getattr(cfg, name)
        if value is None:
            continue
        if typ is bool:
            out.append(_flag(name) if value else "--no-" + name.replace("_", "-"))
        elif typing.get_origin(typ) is list:
            out += [_flag(name), ",".join(str(v) for v in value)]
        else:
            out += [_flag(name), str(value)]
    return out
