"""What a call's arguments and value become: the canonical JSON of the
arguments that identify a call, its fingerprint (the sha256 of that JSON
and the call's name), and the serializer of its return value.

>>> call_fingerprint({"amount": 500}, name="charge") == call_fingerprint({"amount": 500}, name="charge")
True
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from typing import Any, Protocol

from .errors import UnserializableArgumentsError


class Serializer(Protocol):
    """How return values are stored: `dumps(value) -> bytes`, `loads(bytes) -> value`."""

    def dumps(self, value: Any) -> bytes: ...

    def loads(self, data: bytes) -> Any: ...


class JsonSerializer:
    """The default serializer: compact UTF-8 JSON, readable in `idemctl inspect`.

    >>> JSON.dumps({"id": 7, "note": "thé"})
    b'{"id":7,"note":"th\\xc3\\xa9"}'
    >>> JSON.loads(b'[1,2]')
    [1, 2]
    """

    def dumps(self, value: Any) -> bytes:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")

    def loads(self, data: bytes) -> Any:
        return json.loads(data.decode("utf-8"))


JSON = JsonSerializer()


class JsonVia:
    """A value stored as JSON through a user's own pair of functions:
    `dump(value)` turns it into what JSON holds (a dict, a list, a str, a
    number...), `load(that)` turns it back. The pair a dataclass, a
    pydantic model or a `Decimal` already has, as the to_dict/from_dict of
    AWS Lambda Powertools' output serializers (whose serializer objects are
    taken as they are). The stored JSON stays readable in `idemctl inspect`.

    >>> from decimal import Decimal
    >>> money = JsonVia(str, Decimal)
    >>> money.dumps(Decimal("12.50")), money.loads(b'"12.50"')
    (b'"12.50"', Decimal('12.50'))
    """

    def __init__(self, dump: Callable[[Any], Any], load: Callable[[Any], Any]) -> None:
        self.dump = dump
        self.load = load

    def dumps(self, value: Any) -> bytes:
        return JSON.dumps(self.dump(value))

    def loads(self, data: bytes) -> Any:
        return self.load(JSON.loads(data))


# What `serializer=` takes: an object with dumps/loads (bytes), a (dump, load)
# pair of JSON-value functions, or an object with to_dict/from_dict.
# (Typed loosely: a Powertools serializer matches no protocol of ours.)
SerializerLike = Serializer | tuple[Callable[[Any], Any], Callable[[Any], Any]] | object


def as_serializer(given: object) -> Serializer:
    """The serializer a `serializer=` option names: JSON for None; an object
    with ``dumps(value) -> bytes`` and ``loads(bytes) -> value`` as it is; a
    ``(dump, load)`` pair of callables, or an object with ``to_dict`` and
    ``from_dict`` (a Powertools output serializer), as :class:`JsonVia`.
    TypeError for anything else, before any call is made.

    >>> from dataclasses import asdict, dataclass
    >>> @dataclass
    ... class Receipt:
    ...     charged: int
    >>> as_serializer((asdict, lambda d: Receipt(**d))).loads(b'{"charged":500}')
    Receipt(charged=500)
    >>> as_serializer(str)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    TypeError: serializer must be a (dump, load) pair, ...; got a type
    """
    if given is None:
        return JSON
    if isinstance(given, tuple):
        if len(given) == 2 and callable(given[0]) and callable(given[1]):
            return JsonVia(given[0], given[1])
    elif all(callable(getattr(given, m, None)) for m in ("dumps", "loads")):
        return given  # type: ignore[return-value]  # it has both methods
    elif all(callable(getattr(given, m, None)) for m in ("to_dict", "from_dict")):
        return JsonVia(given.to_dict, given.from_dict)  # type: ignore[attr-defined]  # checked just above
    raise TypeError(
        "serializer must be a (dump, load) pair, an object with dumps/loads of bytes, "
        f"or one with to_dict/from_dict; got a {type(given).__name__}"
    )


def canonical_json(value: object, *, what: str = "args") -> bytes:
    """The one byte string a JSON value has: sorted keys, no whitespace,
    non-ASCII as UTF-8, floats as Python's shortest round-trip form (the
    same on every Python 3 since 3.1). Anything JSON cannot carry exactly
    raises UnserializableArgumentsError naming where it is; `what` names the
    value in that message.

    >>> canonical_json({"b": [1, 2.5, None], "a": "é"})
    b'{"a":"\\xc3\\xa9","b":[1,2.5,null]}'
    >>> canonical_json({"when": float("nan")})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    idemctl.errors.UnserializableArgumentsError: cannot fingerprint the call: args['when'] is nan, not JSON; ...
    """
    _check_json(value, what, set())
    try:
        text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except ValueError as exc:  # an int beyond Python's int-to-str digit limit
        raise UnserializableArgumentsError(what, f"not writable as JSON ({exc})") from None
    return text.encode("utf-8")


def _check_json(value: object, path: str, open_containers: set[int]) -> None:
    """Refuse what json.dumps would write lossily or not at all: non-str keys
    ({1: x} would collide with {"1": x}), NaN and infinities, lone
    surrogates, cycles, and every type that is not JSON."""
    if value is None or isinstance(value, (bool, int)):
        return
    if isinstance(value, str):
        _check_text(value, path)
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise UnserializableArgumentsError(path, repr(value))
        return
    if not isinstance(value, (list, tuple, dict)):
        raise UnserializableArgumentsError(path, f"a {type(value).__qualname__}")
    if id(value) in open_containers:
        raise UnserializableArgumentsError(path, "a container that holds itself")
    open_containers.add(id(value))
    if isinstance(value, dict):
        for name, item in value.items():
            if not isinstance(name, str):
                raise UnserializableArgumentsError(path, f"a dict with the {type(name).__qualname__} key {name!r}")
            _check_text(name, path)
            _check_json(item, f"{path}[{name!r}]", open_containers)
    else:
        for index, item in enumerate(value):
            _check_json(item, f"{path}[{index}]", open_containers)
    open_containers.discard(id(value))


def _check_text(text: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise UnserializableArgumentsError(path, "a str holding a lone surrogate") from None


def call_fingerprint(args: object, *, name: str | None = None) -> str:
    """The fingerprint of a call: sha256 (hex) of the canonical JSON of
    ``{"args": args, "function": name}``. The same arguments give the same
    fingerprint in every process and on every Python version, whatever the
    order their dicts were built in.

    >>> call_fingerprint({"amount": 500, "currency": "EUR"}, name="charge")
    '6dd2bf33cc6445a039c8a61d943e034895fd289c3565338984cc01f3a0b81569'
    >>> call_fingerprint({"currency": "EUR", "amount": 500}, name="charge")
    '6dd2bf33cc6445a039c8a61d943e034895fd289c3565338984cc01f3a0b81569'
    """
    # The canonical form of {"args": ..., "function": ...}: its keys are already in order.
    document = b'{"args":' + canonical_json(args) + b',"function":' + canonical_json(name, what="name") + b"}"
    return hashlib.sha256(document).hexdigest()
