"""Reading records written by another process, maybe of another version: typed, tolerant of what is new.

A rolling upgrade runs old and new processes side by side, so a record may carry fields this version
does not know: they are ignored, with one warning per record type and field set. A value of a StrEnum
field this version does not know (a newer worker's state) is read as the enum's UNKNOWN member, with
one warning per enum and value, and the rest of the record is kept -- except in a field marked
`REFUSE_UNKNOWN` (what a server is asked to run: a worker cannot run what it does not know). A field
of the wrong type, or a record that is not an object, is a RecordError: the reader decides what to do
(skip the record, keep what it had), and never exits on it.

Records are frozen dataclasses (`batchfleet.records`); a field whose type is itself such a dataclass
(or `X | None`) is decoded the same way. What each record type needs is worked out once: `decode`
runs for every prompt a worker takes.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import types
import typing
from dataclasses import dataclass, fields
from enum import StrEnum
from typing import Any, TypeVar

import orjson

from .errors import RecordError

__all__ = ["REFUSE_UNKNOWN", "decode", "enum_members", "loads"]

log = logging.getLogger("batchfleet.records")

R = TypeVar("R")
REFUSE_UNKNOWN = {"refuse_unknown": True}  # dataclass field metadata: an unknown enum value is a RecordError
_warned: set[tuple[str, frozenset[str]]] = set()
_warned_values: set[tuple[str, str]] = set()
_WARNED_VALUES_MAX = 1000  # a forger writing endless values gets that many warnings, then silence

Check = typing.Callable[[Any], bool]


def _is_record(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def _is_enum(hint: Any) -> bool:
    return isinstance(hint, type) and issubclass(hint, StrEnum)


def _type_ok(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin is not None:
        hint = origin
    if _is_enum(hint):
        return isinstance(value, str) and value in {m.value for m in hint}
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if _is_record(hint):
        return isinstance(value, dict)
    return isinstance(value, hint) if isinstance(hint, type) else True


def _record_type(hint: Any) -> type | None:
    """The record type a field holds (itself or inside `X | None`), for nested decoding."""
    return next((h for h in (hint, *typing.get_args(hint)) if _is_record(h)), None)


def _check_for(hint: Any) -> Check:
    """The type check of one field, as a bare isinstance wherever the hint allows (it runs for every
    field of every prompt a worker takes)."""
    origin = typing.get_origin(hint)
    if _is_enum(hint):  # any string: a value this version does not know is handled by _EnumField
        return lambda v: isinstance(v, str)
    if hint in (str, bool, dict, list):
        return lambda v, t=hint: isinstance(v, t)
    if hint is int:
        return lambda v: isinstance(v, int) and not isinstance(v, bool)
    if origin in (dict, list):  # dict[str, Any], list[str]: the container is checked, not its items
        return lambda v, t=origin: isinstance(v, t)
    return lambda v: _type_ok(v, hint)


@dataclass(frozen=True, slots=True)
class _EnumField:
    enum: type[StrEnum]
    members: dict[str, StrEnum]  # value -> member
    unknown: StrEnum | None  # the enum's UNKNOWN member; None where an unknown value is refused

    @classmethod
    def of(cls, enum: type[StrEnum], *, refuse_unknown: bool) -> _EnumField:
        return cls(enum, {m.value: m for m in enum}, None if refuse_unknown else enum.__members__.get("UNKNOWN"))

    def member(self, record: type, name: str, value: str) -> StrEnum:
        """The member of this value; an unknown one is UNKNOWN (one warning), or a RecordError."""
        member = self.members.get(value)
        if member is not None:
            return member
        if self.unknown is None:
            known = ", ".join(m.value for m in self.enum if m.name != "UNKNOWN")
            raise RecordError(f"{record.__name__}: {name} {value[:60]!r} is not one of {known}")
        key = (self.enum.__name__, value[:200])
        if key not in _warned_values and len(_warned_values) < _WARNED_VALUES_MAX:
            _warned_values.add(key)
            log.warning("%s record has %s %r, which this version does not know: read as %s.UNKNOWN, the rest of the "
                        "record kept (a newer batchfleet wrote it?)", record.__name__, name, value[:60],
                        self.enum.__name__)
        return self.unknown


_Field = tuple[Check, type | None, _EnumField | None]  # its type check, nested record type, StrEnum field
_PLANS: dict[type, tuple[frozenset[str], dict[str, _Field]]] = {}
_ENUM_FIELDS: dict[type, tuple[tuple[str, type[StrEnum]], ...]] = {}


def _plan(cls: type) -> tuple[frozenset[str], dict[str, _Field]]:
    """Per record type, worked out once: the known field names, and each field's checks."""
    plan = _PLANS.get(cls)
    if plan is None:
        hints = typing.get_type_hints(cls)
        per_field = {}
        for f in fields(cls):  # type: ignore[arg-type]
            hint = hints[f.name]
            enum = _EnumField.of(hint, refuse_unknown=bool(f.metadata.get("refuse_unknown"))) \
                if _is_enum(hint) else None
            per_field[f.name] = (_check_for(hint), _record_type(hint), enum)
        plan = _PLANS[cls] = (frozenset(per_field), per_field)
    return plan


def enum_members(record: Any) -> None:
    """In a record's __post_init__: each StrEnum field holds a member, not the string it was given
    (ValueError for a string that is none of them). Decoded records hold members already."""
    cls = type(record)
    enums = _ENUM_FIELDS.get(cls)
    if enums is None:
        enums = _ENUM_FIELDS[cls] = tuple((name, e.enum) for name, (_, _, e) in _plan(cls)[1].items() if e is not None)
    for name, enum in enums:
        value = getattr(record, name)
        if type(value) is not enum:
            object.__setattr__(record, name, enum(value))


def decode(cls: type[R], data: Any) -> R:
    """Build record `cls` from a decoded JSON object: unknown fields ignored (one warning), known
    fields type-checked, nested records decoded the same way. Raises RecordError."""
    if not isinstance(data, dict):
        raise RecordError(f"{cls.__name__}: not a JSON object ({type(data).__name__})")
    known, per_field = _plan(cls)
    if not known.issuperset(data):
        unknown = frozenset(data) - known
        if (cls.__name__, unknown) not in _warned:
            _warned.add((cls.__name__, unknown))
            log.warning("%s record has field(s) this version does not know, ignored: %s (a newer batchfleet "
                        "wrote it?)", cls.__name__, ", ".join(sorted(map(str, unknown)))[:200])
    values: dict[str, Any] = {}
    for name, value in data.items():
        entry = per_field.get(name)
        if entry is None:
            continue
        check, sub, enum = entry
        if not check(value):
            raise RecordError(f"{cls.__name__}.{name}: unexpected value {orjson.dumps(value).decode()[:60]}")
        if sub is not None and isinstance(value, dict):
            value = decode(sub, value)
        elif enum is not None:
            value = enum.member(cls, name, value)
        values[name] = value
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:  # a required field missing, or __post_init__ refused it
        raise RecordError(f"{cls.__name__}: {exc}") from None


def loads(cls: type[R], raw: bytes | str) -> R:
    """`decode` of JSON text; RecordError when it is not JSON."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RecordError(f"{cls.__name__}: not JSON ({exc})") from None
    return decode(cls, data)
