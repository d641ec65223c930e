"""The values built on every request keep the dataclass contract after
`quick_init` gives them a one-step __init__: the same signature and
defaults, frozen, equal and hashable by value, copied by
`dataclasses.replace` and pickle."""

from __future__ import annotations

import dataclasses
import inspect
import pickle

import pytest

from idemctl.outcomes import Answer, Completion, Event, Outcome, Reservation, Status, StoredRow, Ticket, quick_init
from idemctl.responses import ToStore

VALUES = [
    Answer(201, (("content-type", "application/json"),), b"{}", Outcome.EXECUTED, 1, 1000),
    Reservation("acct_1", "k1", 2, "fp", token=7),
    Ticket(None, Outcome.PASSTHROUGH, b"", None),
    Event(Outcome.REPLAYED, "acct_1", "k1", 1, "POST", "/orders", 201, 0.5, None, 1000),
    StoredRow("acct_1", "k1", "fp", Status.COMPLETED, 1, 201, "{}", "{}", 1000, 1001),
    Completion(True, 201, (), b"", event=None),
    ToStore(201, "{}", "{}", False),
]


@pytest.mark.parametrize("value", VALUES, ids=lambda v: type(v).__name__)
def test_a_request_value_is_still_a_frozen_dataclass_equal_by_value(value):
    cls = type(value)
    names = [f.name for f in dataclasses.fields(cls)]
    assert list(inspect.signature(cls).parameters) == names
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(value, names[0], None)
    same = cls(**{n: getattr(value, n) for n in names})
    assert same == value and hash(same) == hash(value) and repr(same) == repr(value)
    assert pickle.loads(pickle.dumps(value)) == value
    assert dataclasses.replace(value) == value


def test_defaults_are_the_declared_ones():
    assert Answer(200, (), b"", Outcome.EXECUTED).generation is None
    assert Reservation("acct_1", "k1", 1, "fp").token is None
    assert Ticket(None, Outcome.PASSTHROUGH, b"", None).ledger_ms == 0.0
    assert ToStore(500, None, "{}", True).wire_headers == ()


def test_quick_init_refuses_a_dataclass_it_cannot_build_faithfully():
    @dataclasses.dataclass(frozen=True)
    class WithFactory:
        items: list[int] = dataclasses.field(default_factory=list)

    with pytest.raises(TypeError, match="only plain fields"):
        quick_init(WithFactory)
