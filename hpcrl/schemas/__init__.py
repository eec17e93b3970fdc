"""Declarative argument schemas: one table per trainer, read by the launcher and the trainer.

Stdlib only (plus hpcrl.errors, itself stdlib only), so both sides may import it: the launcher's
adapters (hpcrl/trainers) check a spec's `args:` at render/submit, and a trainer (hpcrl/rl)
checks its trainer.json with the very same table.

    SCHEMA = Schema("smoke", [
        Int("steps", 60, "total steps of the whole run", ge=1),
        Float("step_time_s", 0.5, "seconds one step takes", ge=0),
        Choice("mode", "a", ("a", "b"), "what it does"),
    ], checks=[my_cross_field_check])
    merged = SCHEMA.validate(args)      # defaults merged in, values normalised; raises ArgError

Every error is one line that names the field, the bad value and what is allowed, e.g.

    args.loss_agg: 'bogus' is not allowed (did you mean ...?); use one of a, b, c
    args.mini_batches: 3 does not divide batch_size * group_size = 64; use a divisor such as 1, 2, 4

ArgError is both a SpecError (the CLI prints it as `hpcrl: error: ...`, exit 2) and a ValueError
(what a trainer that knows nothing of hpcrl's errors would catch).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..errors import SpecError, did_you_mean, one_of

__all__ = ["ArgError", "Field", "Schema", "Int", "Float", "Bool", "Str", "StrList", "Map", "Choice", "fail", "show",
           "divisors"]

_FLOAT_TEXT = re.compile(r"^\s*[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?\s*$")


class ArgError(SpecError, ValueError):
    """A bad trainer argument; the one-line message names the field, the value and what is allowed."""


def show(value) -> str:
    """A value as the user wrote it in YAML: strings quoted, None as null, booleans lower-case."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


def fail(where: str, value, problem: str, allowed: str) -> None:
    """Raise the one-line ArgError '<where>: <value> <problem>; <allowed>'."""
    raise ArgError(f"{where}: {show(value)} {problem}; {allowed}")


def divisors(n: int, limit: int = 8) -> str:
    """'1, 2, 4, 8' - the first `limit` divisors of n (with '...' when there are more)."""
    ds = [d for d in range(1, n + 1) if n % d == 0]
    return ", ".join(map(str, ds[:limit])) + (", ..." if len(ds) > limit else "")


KINDS = ("int", "float", "bool", "str", "list", "map", "choice")


def _same(a, b) -> bool:
    # True == 1 in Python; a choice matches only a value of its own type
    return type(a) is type(b) and a == b


@dataclass(frozen=True)
class Field:
    """One argument: name, default, kind and its constraints, and a one-line doc.

    kind: "int" (whole numbers; 2.0 is taken as 2), "float" (any finite number; a numeric string
    such as '1e-6', which YAML 1.1 reads as text, is taken as its number), "bool", "str",
    "list" (a list of strings), "map" (a mapping with string keys, checked further by a schema of its
    own: args.judge), "choice" (one of `choices`, compared with their types).
    ge/gt/le/lt bound numbers; nullable admits None (null); required means None/'' is refused.
    """

    name: str
    kind: str
    default: object
    doc: str = ""
    choices: tuple | None = None
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    nullable: bool = False
    required: bool = False
    nonempty: bool = False  # str: '' is refused

    def __post_init__(self):
        if self.kind not in KINDS or (self.kind == "choice") != (self.choices is not None):
            raise ValueError(f"field {self.name}: kind {self.kind!r} (one of {KINDS}) with choices only for 'choice'")

    def allowed(self) -> str:
        """What this field takes, in words (the tail of every error about it)."""
        null = ", or null" if self.nullable else ""
        if self.kind == "choice":
            return f"use one of {', '.join(show(c) for c in self.choices)}{null}"
        if self.kind in ("int", "float"):
            noun = "a whole number" if self.kind == "int" else "a number"
            lo = ("[", ">=", self.ge) if self.ge is not None else ("(", ">", self.gt) if self.gt is not None else None
            hi = ("]", "<=", self.le) if self.le is not None else (")", "<", self.lt) if self.lt is not None else None
            if lo and hi:
                return f"use {noun} in {lo[0]}{_num(lo[2])}, {_num(hi[2])}{hi[0]}{null}"
            bound = lo or hi
            return f"use {noun}{f' {bound[1]} {_num(bound[2])}' if bound else ''}{null}"
        if self.kind == "bool":
            return f"use true or false{null}"
        if self.kind == "list":
            return "use a list of strings"
        if self.kind == "map":
            return f"use a mapping (key: value){null}"
        return f"use a {'non-empty ' if self.nonempty else ''}string{null}"

    def check(self, value, where: str):
        """The normalised value, or ArgError."""
        if value is None:
            if self.nullable:
                return None
            fail(where, value, "is not allowed", self.allowed())
        if self.kind == "choice":
            if not any(_same(value, c) for c in self.choices):
                fail(where, value, f"is not allowed{did_you_mean(value, self.choices)}", self.allowed())
            return value
        if self.kind == "bool":
            if not isinstance(value, bool):
                fail(where, value, "is not true or false", self.allowed())
            return value
        if self.kind == "str":
            if not isinstance(value, str):
                fail(where, value, "is not a string", self.allowed())
            if self.nonempty and not value.strip():
                fail(where, value, "is empty", self.allowed())
            return value
        if self.kind == "list":
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                fail(where, value, "is not a list of strings", self.allowed())
            return list(value)
        if self.kind == "map":
            if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
                fail(where, value, "is not a mapping", self.allowed())
            return dict(value)
        return self._number(value, where)

    def _number(self, value, where: str):
        integer = self.kind == "int"
        if not integer and isinstance(value, str) and _FLOAT_TEXT.match(value):
            value = float(value)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        ok = ok and math.isfinite(value) and (not integer or float(value).is_integer())
        if not ok:
            # the wording spec.py uses for its own numbers: "expected a whole number, got 'many'"
            raise ArgError(f"{where}: expected {'a whole number' if integer else 'a number'}, got {value!r}; "
                           f"{self.allowed()}")
        if integer:
            value = int(value)
        if ((self.ge is not None and value < self.ge) or (self.gt is not None and value <= self.gt)
                or (self.le is not None and value > self.le) or (self.lt is not None and value >= self.lt)):
            fail(where, value, "is out of range", self.allowed())
        return value


def _num(x) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else repr(x)


def Int(name, default, doc="", **kw) -> Field:
    return Field(name, "int", default, doc, **kw)


def Float(name, default, doc="", **kw) -> Field:
    return Field(name, "float", default, doc, **kw)


def Bool(name, default, doc="", **kw) -> Field:
    return Field(name, "bool", default, doc, **kw)


def Str(name, default, doc="", **kw) -> Field:
    return Field(name, "str", default, doc, **kw)


def StrList(name, default, doc="", **kw) -> Field:
    return Field(name, "list", default, doc, **kw)


def Map(name, default, doc="", **kw) -> Field:
    return Field(name, "map", default, doc, **kw)


def Choice(name, default, choices, doc="", **kw) -> Field:
    return Field(name, "choice", default, doc, choices=tuple(choices), **kw)


class Schema:
    """One trainer's arguments: fields (in table order) and whole-schema checks.

    A check is a function (merged args dict, where) that raises through `fail(...)` when a
    combination is wrong (where(key) gives 'args.<key>'); checks run after every field passed.
    """

    def __init__(self, trainer: str, fields, checks=(), prefix: str = "args."):
        self.trainer = trainer
        self.prefix = prefix
        self.checks = tuple(checks)
        self._fields: dict[str, Field] = {}
        for f in fields:
            if f.name in self._fields:
                raise ValueError(f"schema {trainer}: field {f.name} declared twice")
            self._fields[f.name] = f
            if not (f.required and f.default is None):
                f.check(f.default, self.where(f.name))  # a table whose own default is refused is a bug

    def __repr__(self) -> str:
        return f"Schema({self.trainer!r}, {len(self._fields)} fields, {len(self.checks)} checks)"

    @property
    def fields(self) -> dict:
        """name -> Field, in table order."""
        return dict(self._fields)

    @property
    def defaults(self) -> dict:
        """A fresh dict of every key's default (lists and mappings copied)."""
        return {f.name: type(f.default)(f.default) if isinstance(f.default, (list, dict)) else f.default
                for f in self._fields.values()}

    @property
    def required(self) -> tuple:
        return tuple(f.name for f in self._fields.values() if f.required)

    def where(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def validate(self, args) -> dict:
        """args merged over the defaults, each value checked and normalised, then the checks.

        Raises ArgError (a SpecError and a ValueError) with one line naming the field.
        """
        if args is None:
            args = {}
        if not isinstance(args, dict):
            raise ArgError(f"{self.prefix.rstrip('.')}: expected a mapping of {self.trainer} trainer arguments, "
                           f"got {type(args).__name__}")
        for key in args:
            if key not in self._fields:
                raise ArgError(f"{self.where(key)}: unknown argument for trainer '{self.trainer}'"
                               f"{did_you_mean(key, self._fields)}; allowed: {one_of(self._fields)}")
        merged = {**self.defaults, **args}
        for f in self._fields.values():
            if f.required and merged[f.name] in (None, ""):
                raise ArgError(f"{self.where(f.name)}: trainer '{self.trainer}' needs a value; set it in the spec "
                               f"or with --set {self.where(f.name)}=VALUE")
        for f in self._fields.values():
            merged[f.name] = f.check(merged[f.name], self.where(f.name))
        for check in self.checks:
            check(merged, self.where)
        return merged
