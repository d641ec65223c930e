"""What apps call is declared on `Ledger` itself with a signature and a
docstring each (what help(), documentation generators and type checkers
read): the request flow's and the single steps' methods are the class's
own, by inheritance; the core's and the housekeeping's are declared on the
class and an instance carries each part's own method under the same name,
so a call goes through no layer of the ledger's own."""

from __future__ import annotations

import inspect
import pydoc
from typing import Any

import pytest

from idemctl import Ledger
from idemctl.ledger import CHORE_NAMES, CORE_NAMES
from idemctl.ledger.requests import RequestFlow
from idemctl.ledger.steps import SingleSteps
from idemctl.outcomes import Answer, Outcome, Ticket

# Bound on each instance from the core and the housekeeping.
BOUND = (*CORE_NAMES, *CHORE_NAMES, "heard")
# The class's own, from the request flow and the single steps ...
INHERITED = (
    *("begin_steps", "begin", "finish_steps", "finish", "abandon_steps", "abandon", "handle"),
    *("decide", "refuse", "shape", "claim", "lookup", "takeover", "complete_steps", "complete"),
    *("release_steps", "release"),
)
# ... and the idempotent functions, made on the ledger itself.
OWN = (*INHERITED, "idempotent", "idempotent_call")
FACE = (*BOUND, *OWN)


def part_signature(ledger: Ledger, name: str) -> inspect.Signature:
    """The signature of the part's method an instance carries under `name`,
    with `self`: a synchronous method made by ``decision.blocking`` takes
    what its ``*_steps`` method takes and returns what the steps return."""
    part = type(vars(ledger)[name].__self__)
    method = getattr(part, name)
    steps = getattr(part, f"{name}_steps", None)
    if steps is None:
        return inspect.signature(method)
    made = inspect.signature(steps)
    returned = str(made.return_annotation).removeprefix("decision.Steps[").removesuffix("]")
    return made.replace(return_annotation=returned)


def drifted(cls: type, ledger: Ledger, names: tuple[str, ...]) -> dict[str, tuple[str, str]]:
    """Each name whose method on `cls` does not take what the part's takes."""
    found = {}
    for name in names:
        declared, own = inspect.signature(getattr(cls, name)), part_signature(ledger, name)
        if declared != own:
            found[name] = (str(declared), str(own))
    return found


def test_every_bound_method_is_declared_on_the_class_with_the_parts_signature():
    ledger = Ledger.open(":memory:")
    assert drifted(Ledger, ledger, BOUND) == {}


def test_the_signature_check_finds_a_method_that_drifted():
    # The check above must be able to fail: a face whose init lost `dry_run`.
    class Drifted(Ledger):
        def init(self) -> Any:  # type: ignore[override]
            raise AssertionError("never called")

    ledger = Ledger.open(":memory:")
    assert drifted(Drifted, ledger, ("init", "describe")) == {
        "init": ("(self) -> 'Any'", "(self, *, dry_run: 'bool' = False) -> 'InitResult'")
    }


def test_dir_and_help_of_the_class_list_every_app_facing_method_with_its_example():
    assert [name for name in FACE if name not in dir(Ledger)] == []
    undocumented = [name for name in FACE if ">>> " not in (inspect.getdoc(getattr(Ledger, name)) or "")]
    assert undocumented == []
    shown = pydoc.render_doc(Ledger, renderer=pydoc.plaintext)
    assert [name for name in FACE if f"{name}(self" not in shown] == []
    assert "Run one request under the Idempotency-Key contract" in shown


def test_an_instance_carries_each_parts_own_method_not_the_classs():
    ledger = Ledger.open(":memory:")
    carried = {name: getattr(ledger, name) for name in BOUND}
    assert {name for name, method in carried.items() if getattr(method, "__self__", None) is ledger} == set()
    assert {name for name, method in carried.items() if method.__func__ is getattr(Ledger, name)} == set()


def test_the_request_path_is_the_classs_own_methods_with_nothing_shadowing_them():
    ledger = Ledger.open(":memory:")
    assert [name for name in OWN if name in vars(ledger)] == []
    assert [name for name in OWN if getattr(ledger, name).__func__ is not getattr(Ledger, name)] == []
    assert [name for name in INHERITED if getattr(Ledger, name) is not getattr(RequestFlow, name)] == []
    assert SingleSteps.claim is Ledger.claim


def test_a_blocking_method_shows_the_signature_of_its_steps_returning_what_they_return():
    shown = str(inspect.signature(Ledger.begin))
    assert shown == (
        "(self, principal: 'str | None', key: 'str | None', method: 'str', path_and_query: 'str', "
        "headers: 'HeadersLike | None', body: 'bytes | bytearray | memoryview') -> 'Answer | Ticket'"
    )
    assert str(inspect.signature(Ledger.release)) == "(self, reservation: 'Reservation') -> 'bool'"


def test_a_method_reached_through_the_class_runs_the_parts_own():
    ledger = Ledger.open(":memory:", clock=lambda: 1_000)
    Ledger.init(ledger)
    made = Ledger.handle(ledger, "acct_1", "k1", "POST", "/orders", {}, b"", lambda body: (201, {}, b"made"))
    assert (made.status, made.body, made.outcome) == (201, b"made", Outcome.EXECUTED)
    ticket = Ledger.begin(ledger, "acct_1", "k2", "POST", "/orders", {}, b"")
    assert isinstance(ticket, Ticket)
    answer = Ledger.finish(ledger, ticket, 202, {}, b"later")
    assert isinstance(answer, Answer) and (answer.status, answer.body) == (202, b"later")
    replay = ledger.handle("acct_1", "k2", "POST", "/orders", {}, b"", lambda body: (500, {}, b""))
    assert (replay.status, replay.body, replay.outcome) == (202, b"later", Outcome.REPLAYED)
    assert Ledger.lookup(ledger, "acct_1", "k1").response_body == "made"  # type: ignore[union-attr]
    assert (Ledger.now(ledger), Ledger.describe(ledger), Ledger.schema_version(ledger)) == (1_000, ":memory:", 3)


@pytest.mark.parametrize("name", BOUND)
def test_each_class_method_calls_the_part_it_documents(name: str, monkeypatch: pytest.MonkeyPatch):
    # The body of each declared method hands its arguments on unchanged.
    ledger = Ledger.open(":memory:")
    params = list(inspect.signature(getattr(Ledger, name)).parameters.values())[1:]
    args = [f"arg-{p.name}" for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    kwargs = {p.name: f"kw-{p.name}" for p in params if p.kind is p.KEYWORD_ONLY}
    seen: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def recorded(*a: Any, **kw: Any) -> str:
        seen.append((a, kw))
        return "answered"

    async def recorded_async(*a: Any, **kw: Any) -> str:
        return recorded(*a, **kw)

    is_async = inspect.iscoroutinefunction(getattr(Ledger, name))
    monkeypatch.setitem(vars(ledger), name, recorded_async if is_async else recorded)
    called = getattr(Ledger, name)(ledger, *args, **kwargs)
    if is_async:
        import asyncio

        called = asyncio.run(called)
    assert (called, seen) == ("answered", [(tuple(args), kwargs)])
