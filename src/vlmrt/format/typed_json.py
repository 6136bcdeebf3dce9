"""Dataclasses built from parsed JSON with every field checked against its type hint, so that a malformed file
is reported by the field that is wrong, in words: `kv lacks the field 'layers'`, `kv.layers must be an integer,
not "two"`, `decoder has an unknown field 'flash'` (stdlib only)."""

from __future__ import annotations

import dataclasses
import functools
import json
import types
import typing
from typing import Any


class Malformed(Exception):
    """The message names the field (`kv.layers must be an integer, not "two"`)."""


def _kind(tp) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_kind(a) for a in typing.get_args(tp))
    tp = origin or tp
    return {int: "an integer", float: "a number", str: "a string", bool: "true/false", list: "a list", dict: "an object",
            type(None): "null"}.get(tp, getattr(tp, "__name__", str(tp)))


def _check(value, tp, where: str):
    """value as type tp (dataclasses built from their dict), or Malformed naming `where`."""
    if tp is Any:
        return value
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        for a in args:
            try:
                return _check(value, a, where)
            except Malformed:
                pass
        raise Malformed(f"{where} must be {_kind(tp)}, not {json.dumps(value)[:40]}")
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where)
    base = origin or tp
    ok = {int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          type(None): lambda v: v is None}.get(base, lambda v: isinstance(v, base))
    if not ok(value):
        raise Malformed(f"{where} must be {_kind(tp)}, not {json.dumps(value)[:40]}")
    if base is list and args:
        return [_check(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if base is dict and args:
        return {_check(k, args[0], f"{where} key"): _check(v, args[1], f"{where}.{k}") for k, v in value.items()}
    if base is float:
        try:
            return float(value)
        except OverflowError:
            raise Malformed(f"{where} is out of range") from None
    return value


@functools.cache
def _shape(cls) -> tuple[dict, dict, list]:
    """(type hints, fields, required field names) of a dataclass, worked out once per class: get_type_hints evaluates
    the string annotations (compile + eval), which a manifest with many graphs would otherwise repeat per entry."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    required = [n for n, f in fields.items() if (f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
                or n in getattr(cls, "_required", ())]
    return hints, fields, required


class _Bad(Exception):
    """A value the fast path (_fast) does not take: the slow path says which field and why."""


def _leaf(base):
    if base is int:
        return lambda v: v if isinstance(v, int) and not isinstance(v, bool) else _bad()
    if base is float:
        def number(v):
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                try:
                    return float(v)
                except OverflowError:
                    pass
            return _bad()
        return number
    if base is type(None):
        return lambda v: v if v is None else _bad()
    return lambda v: v if isinstance(v, base) else _bad()


def _bad():
    raise _Bad


@functools.cache
def _fast(tp):
    """A function value -> the value as _check returns it, or _Bad, made once per type hint: _check's answer without
    its per-value type introspection and field paths (a manifest's ~400 weight entries took ~55 ms through _check)."""
    if tp is Any:
        return lambda v: v
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        options = [_fast(a) for a in args]

        def union(v):
            for f in options:
                try:
                    return f(v)
                except _Bad:
                    pass
            return _bad()
        return union
    if dataclasses.is_dataclass(tp):
        return lambda v: _fast_build(tp, v)
    base = origin or tp
    ok = _leaf(base)
    if base is list and args:
        item = _fast(args[0])
        return lambda v: [item(x) for x in ok(v)]
    if base is dict and args:
        key, val = _fast(args[0]), _fast(args[1])
        return lambda v: {key(k): val(x) for k, x in ok(v).items()}
    return ok


def _fast_build(cls, d):
    if not isinstance(d, dict):
        _bad()
    hints, fields, required = _shape(cls)
    if any(n not in d for n in required) or any(k not in fields for k in d):
        _bad()
    return cls(**{k: _fast(hints[k])(v) for k, v in d.items()})


def build(cls, d, where: str):
    """cls from the parsed JSON object d, every field checked; Malformed names the first wrong field under where."""
    try:
        return _fast_build(cls, d)
    except _Bad:
        return _build(cls, d, where)  # the slow path raises Malformed with the field's path and what is wrong


def _build(cls, d, where: str):
    if not isinstance(d, dict):
        raise Malformed(f"{where} must be an object, not {json.dumps(d)[:40]}")
    hints, fields, required = _shape(cls)
    missing = [n for n in required if n not in d]
    if missing:
        raise Malformed(f"{where} lacks the field {missing[0]!r}" if where else f"the field {missing[0]!r} is missing")
    unknown = sorted(set(d) - set(fields))
    if unknown:
        raise Malformed(f"{where or 'the manifest'} has an unknown field {unknown[0]!r}")
    return cls(**{k: _check(v, hints[k], f"{where}.{k}" if where else k) for k, v in d.items()})
