"""`Ledger.copy_to` between engines: every row, token and fenced-out event
arrives exactly; replays on the destination answer as the source did; a
second run writes nothing; newer and conflicting destination rows are kept;
a dry run writes nothing; an owner that began before the move is fenced on
the destination exactly as on the source.

Each test runs for every (source, destination) pair in COPY_PAIRS: adding an
engine is one more pair there and its entry in TARGETS."""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from pathlib import Path

import pytest
from typer.testing import CliRunner

from idemctl import Ledger, Outcome, Policy, fingerprint
from idemctl.cli import app
from idemctl.errors import ReadOnlyDatabaseError, SchemaMissingError
from idemctl.operations.copying import CopyProgress, KeptReason
from idemctl.storage.rows import LedgerRow
from tests.helpers import FakeClock, RecipeWriter, clean_env, mysql_test_database, postgres_test_schema

COPY_PAIRS = [
    ("sqlite", "postgres"),
    ("postgres", "sqlite"),
    ("sqlite", "sqlite"),
    ("sqlite", "mysql"),
    ("mysql", "sqlite"),
    ("mysql", "postgres"),
    # Read through PgBouncer's session pooling (read-only), written through its transaction pooling.
    pytest.param(("pgbouncer-session", "pgbouncer-transaction"), marks=pytest.mark.slow),
    # Both ways between Redis (the suite's own servers) and the SQL engines.
    pytest.param(("sqlite", "redis"), marks=pytest.mark.slow),
    pytest.param(("redis", "postgres"), marks=pytest.mark.slow),
]

Target = Callable[[str, pytest.FixtureRequest, Path, pytest.MonkeyPatch], AbstractContextManager[str]]


def _sqlite(
    name: str, request: pytest.FixtureRequest, tmp_path: Path, mp: pytest.MonkeyPatch
) -> AbstractContextManager[str]:
    return nullcontext(str(tmp_path / f"{name}.db"))


def _postgres(
    name: str, request: pytest.FixtureRequest, tmp_path: Path, mp: pytest.MonkeyPatch
) -> AbstractContextManager[str]:
    return contextmanager(postgres_test_schema)(request.getfixturevalue("postgres_server"), mp)


def _mysql(
    name: str, request: pytest.FixtureRequest, tmp_path: Path, mp: pytest.MonkeyPatch
) -> AbstractContextManager[str]:
    return contextmanager(mysql_test_database)(request.getfixturevalue("mysql_server"), mp)


def _pgbouncer(mode: str) -> Target:
    def target(
        name: str, request: pytest.FixtureRequest, tmp_path: Path, mp: pytest.MonkeyPatch
    ) -> AbstractContextManager[str]:
        via = request.getfixturevalue("pgbouncers")(mode).url()
        return contextmanager(postgres_test_schema)(request.getfixturevalue("postgres_server"), mp, via=via)

    return target


def _redis(fixture: str) -> Target:
    def target(
        name: str, request: pytest.FixtureRequest, tmp_path: Path, mp: pytest.MonkeyPatch
    ) -> AbstractContextManager[str]:
        servers = request.getfixturevalue(fixture)
        servers.flush()
        return nullcontext(f"{servers.url}?prefix={name}")

    return target


# A fresh, empty ledger's location on each engine.
TARGETS: dict[str, Target] = {
    "sqlite": _sqlite,
    "postgres": _postgres,
    "mysql": _mysql,
    "pgbouncer-session": _pgbouncer("session"),
    "pgbouncer-transaction": _pgbouncer("transaction"),
    "redis": _redis("redis_standalone"),
    "redis-cluster": _redis("redis_cluster"),
}
SERVERS = ("postgresql://", "mysql://", "mariadb://", "redis://")

POLICY = Policy(pending_ttl_ms=30_000, retention_ms=86_400_000)
BODY = b'{"sku":"x"}'


@pytest.fixture(params=COPY_PAIRS, ids=lambda pair: f"{pair[0]}-to-{pair[1]}")
def targets(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[str, str]]:
    source_engine, destination_engine = request.param
    with ExitStack() as stack:
        source = stack.enter_context(TARGETS[source_engine]("source", request, tmp_path, monkeypatch))
        destination = stack.enter_context(TARGETS[destination_engine]("destination", request, tmp_path, monkeypatch))
        yield source, destination


class Move:
    """The two ledgers of a move: `source` (written by the test as an app
    would), `reader` (the same ledger opened read-only: what copies read),
    and `destination`, all on one clock."""

    def __init__(self, source: str, destination: str, clock: FakeClock) -> None:
        self.clock = clock
        self.source_target = source
        self.source = Ledger.open(source, policy=POLICY, clock=clock)
        self.source.init()
        self.destination = Ledger.open(destination, policy=POLICY, clock=clock)
        self.destination.init()
        self.reader = Ledger.open(source, policy=POLICY, clock=clock, readonly=True)

    def copy(self, **kw: object):  # type: ignore[no-untyped-def]
        return self.reader.operator.copy_to(self.destination, **kw)  # type: ignore[arg-type]

    def close(self) -> None:
        for ledger in (self.reader, self.source, self.destination):
            ledger.close()


def sql_source_only(targets: tuple[str, str]) -> None:
    if targets[0].startswith("redis"):
        pytest.skip("rows the recipe's Worker wrote (its SQL): a Redis ledger has no such writer")


@pytest.fixture
def move(targets: tuple[str, str], clock: FakeClock) -> Iterator[Move]:
    m = Move(*targets, clock)
    yield m
    m.close()


def rows(ledger: Ledger) -> list[LedgerRow]:
    # Every row, page by page (three app threads write tens of thousands on a fast engine).
    found: list[LedgerRow] = []
    while page := ledger.store.copy_page(found[-1].where if found else None, 10_000):
        found += page
    return found


def events(ledger: Ledger) -> list[tuple[object, ...]]:
    return sorted(
        (e.principal, e.key, e.superseded_generation, e.current_generation, e.computed_status, e.fenced_at)
        for e in ledger.operator.fenced()
    )


def order(ledger: Ledger, key: str, status: int = 201, body: bytes = b'{"id":1}', principal: str = "acct_A"):  # type: ignore[no-untyped-def]
    headers = {"content-type": "application/json", "location": f"/orders/{key}"}
    return ledger.handle(principal, key, "POST", "/orders", {}, BODY, lambda b: (status, headers, body))


def a_live_ledger(m: Move) -> None:
    """Completed rows (text, binary and empty bodies), a fresh pending row,
    a stale one, a row taken over, and the fenced-out event of its late owner."""
    order(m.source, "text", body='{"name":"Zoë"}'.encode())
    order(m.source, "binary", body=b"\xff\x00\x80raw")
    order(m.source, "empty", status=204, body=b"")
    order(m.source, "other-principal", principal="acct_B")
    m.source.claim("acct_A", "stale", "fp-stale")
    late = m.source.claim("acct_A", "taken", "fp-taken")
    assert late is not None
    m.clock.advance(POLICY.pending_ttl_ms + 1)
    winner = m.source.takeover("acct_A", "taken", "fp-taken")
    assert winner is not None and winner.generation == 2
    m.source.complete(winner, 201, {}, b"winner")
    assert not m.source.complete(late, 201, {}, b"loser").stored
    m.source.claim("acct_A", "fresh", "fp-fresh")


def test_a_copy_carries_every_row_token_timestamp_and_fenced_event_exactly(move: Move) -> None:
    a_live_ledger(move)
    result = move.copy()
    assert (result.rows_read, result.inserted, result.updated, result.unchanged) == (7, 7, 0, 0)
    assert (result.kept, result.conflicts) == ((), ())
    assert (result.fenced_read, result.fenced_copied, result.fenced_unchanged) == (1, 1, 0)
    assert sorted(rows(move.destination)) == sorted(rows(move.source))
    assert {r.status for r in rows(move.destination)} == {"pending", "completed"}
    assert all(r.token is not None for r in rows(move.destination))
    assert events(move.destination) == events(move.source) == [("acct_A", "taken", 1, 2, 201, move.clock.now)]


def test_replays_on_the_destination_return_the_same_bytes_and_headers_as_on_the_source(move: Move) -> None:
    a_live_ledger(move)
    move.copy()
    for principal, key in [
        ("acct_A", "text"),
        ("acct_A", "binary"),
        ("acct_A", "empty"),
        ("acct_B", "other-principal"),
    ]:
        before = order(move.source, key, principal=principal, status=500, body=b"ran again")
        after = order(move.destination, key, principal=principal, status=500, body=b"ran again")
        assert before.outcome is after.outcome is Outcome.REPLAYED
        assert after.wire == before.wire
    assert order(move.destination, "binary", status=500).body == b"\xff\x00\x80raw"
    # A pending key is still in progress on the destination, not run again.
    assert (
        move.destination.handle("acct_A", "fresh", "POST", "/orders", {}, b"", lambda b: (500, {}, b"")).status == 409
    )


def test_running_the_copy_again_writes_nothing_and_then_only_what_changed(move: Move) -> None:
    a_live_ledger(move)
    move.copy()
    again = move.copy()
    assert (again.rows_read, again.inserted, again.updated, again.unchanged) == (7, 0, 0, 7)
    assert (again.fenced_copied, again.fenced_unchanged, again.kept, again.conflicts) == (0, 1, (), ())
    move.clock.advance(1000)
    order(move.source, "new-after-first-copy")
    changed = move.copy()
    assert (changed.rows_read, changed.inserted, changed.updated, changed.unchanged) == (8, 1, 0, 7)
    assert sorted(rows(move.destination)) == sorted(rows(move.source))


def test_a_row_completed_on_the_source_after_the_first_copy_is_updated_by_the_second(move: Move) -> None:
    reservation = move.source.claim("acct_A", "k1", "fp")
    assert reservation is not None
    move.copy()
    move.clock.advance(500)
    assert move.source.complete(reservation, 201, {"location": "/orders/1"}, b"done").stored
    second = move.copy()
    assert (second.inserted, second.updated, second.unchanged) == (0, 1, 0)
    (row,) = rows(move.destination)
    assert (row.status, row.response_body, row.updated_at) == ("completed", b"done", move.clock.now)


def test_a_row_taken_over_in_the_destination_is_kept_and_the_summary_says_why(move: Move) -> None:
    move.source.claim("acct_A", "k1", "fp")
    move.copy()
    move.clock.advance(POLICY.pending_ttl_ms + 1)
    newer = move.destination.takeover("acct_A", "k1", "fp")
    assert newer is not None and newer.generation == 2
    move.destination.complete(newer, 201, {}, b"from the destination")
    kept_before = rows(move.destination)
    result = move.copy()
    assert (result.inserted, result.updated, result.unchanged, result.conflicts) == (0, 0, 0, ())
    (kept,) = result.kept
    assert (kept.principal, kept.key, kept.reason) == ("acct_A", "k1", KeptReason.HIGHER_GENERATION)
    assert (kept.source_generation, kept.destination_generation) == (1, 2)
    assert rows(move.destination) == kept_before


def test_a_row_completed_in_the_destination_is_kept_over_the_sources_pending_one(move: Move) -> None:
    reservation = move.source.claim("acct_A", "k1", "fp")
    assert reservation is not None
    move.copy()
    assert move.destination.complete(reservation, 201, {}, b"finished after the move").stored
    result = move.copy()
    assert [(k.key, k.reason) for k in result.kept] == [("k1", KeptReason.COMPLETED)]
    assert rows(move.destination)[0].response_body == b"finished after the move"


def test_a_key_holding_another_request_in_the_destination_is_a_conflict_and_not_overwritten(move: Move) -> None:
    order(move.source, "k1")
    move.destination.claim("acct_A", "k1", "another-fingerprint")
    held = rows(move.destination)
    result = move.copy()
    assert (result.inserted, result.updated, result.unchanged, result.kept) == (0, 0, 0, ())
    (conflict,) = result.conflicts
    assert (conflict.principal, conflict.key) == ("acct_A", "k1")
    assert conflict.destination_fingerprint == "another-fingerprint"
    assert conflict.source_fingerprint == fingerprint("POST", "/orders", {}, BODY)
    assert not result.complete
    assert rows(move.destination) == held


def test_a_dry_run_writes_nothing_and_counts_what_a_copy_would_do(move: Move) -> None:
    a_live_ledger(move)
    order(move.destination, "binary", body=b"already here, another answer")
    before = rows(move.destination)
    result = move.copy(dry_run=True)
    assert result.dry_run
    assert (result.rows_read, result.inserted, result.updated, result.unchanged) == (7, 6, 0, 0)
    assert [(k.key, k.reason) for k in result.kept] == [("binary", KeptReason.WRITTEN_LATER)]
    assert (result.fenced_copied, result.fenced_unchanged) == (1, 0)
    assert rows(move.destination) == before
    assert events(move.destination) == []


def test_an_owner_that_began_before_the_move_stores_its_answer_on_the_destination(move: Move) -> None:
    ticket = move.source.begin("acct_A", "k1", "POST", "/orders", {}, BODY)
    move.copy()
    answer = move.destination.finish(ticket, 201, {"location": "/orders/1"}, b"made")  # type: ignore[arg-type]
    assert (answer.outcome, answer.status, answer.body) == (Outcome.EXECUTED, 201, b"made")
    replay = order(move.destination, "k1", status=500, body=b"ran twice")
    assert (replay.outcome, replay.body, replay.header("location")) == (Outcome.REPLAYED, b"made", "/orders/1")


def test_an_owner_superseded_before_the_move_is_fenced_out_on_the_destination(move: Move) -> None:
    late = move.source.begin("acct_A", "k1", "POST", "/orders", {}, BODY)
    move.clock.advance(POLICY.pending_ttl_ms + 1)
    newer = move.source.begin("acct_A", "k1", "POST", "/orders", {}, BODY)
    assert newer.outcome is Outcome.TAKEN_OVER
    move.copy()
    answer = move.destination.finish(late, 201, {}, b"late")  # type: ignore[arg-type]
    assert answer.outcome is Outcome.FENCED_OUT
    assert events(move.destination) == [("acct_A", "k1", 1, 2, 201, move.clock.now)]
    (row,) = rows(move.destination)
    assert (row.status, row.generation) == ("pending", 2)
    assert move.destination.finish(newer, 201, {}, b"winner").outcome is Outcome.TAKEN_OVER  # type: ignore[arg-type]


def test_an_owner_whose_key_was_released_and_claimed_again_is_fenced_by_its_token_on_the_destination(
    move: Move,
) -> None:
    first = move.source.claim("acct_A", "k1", "fp")
    assert first is not None
    move.copy()
    assert move.source.release(first)
    move.clock.advance(10)
    second = move.source.claim("acct_A", "k1", "fp")
    assert second is not None and second.generation == first.generation == 1
    assert move.copy().updated == 1  # same generation, same status, written later
    assert not move.destination.complete(first, 201, {}, b"stale owner").stored
    assert move.destination.complete(second, 201, {}, b"current owner").stored


def test_a_destination_row_taken_over_between_the_read_and_the_write_is_not_overwritten(
    move: Move, monkeypatch: pytest.MonkeyPatch
) -> None:
    reservation = move.source.claim("acct_A", "k1", "fp")
    assert reservation is not None
    move.copy()
    assert move.source.complete(reservation, 201, {}, b"from the source").stored
    move.clock.advance(POLICY.pending_ttl_ms + 1)
    read = move.destination.store.rows_at
    raced: list[int] = []

    def read_then_a_takeover_lands(keys):  # type: ignore[no-untyped-def]
        seen = read(keys)
        if not raced:
            taken = move.destination.takeover("acct_A", "k1", "fp")
            raced.append(taken.generation if taken else 0)
        return seen

    monkeypatch.setattr(move.destination.store, "rows_at", read_then_a_takeover_lands)
    result = move.copy()
    assert raced == [2]
    assert (result.inserted, result.updated, result.unchanged) == (0, 0, 0)
    assert [(k.key, k.reason, k.destination_generation) for k in result.kept] == [
        ("k1", KeptReason.HIGHER_GENERATION, 2)
    ]
    (row,) = rows(move.destination)
    assert (row.status, row.generation, row.response_body) == ("pending", 2, None)


def test_a_key_claimed_in_the_destination_between_the_read_and_the_insert_is_not_overwritten(
    move: Move, monkeypatch: pytest.MonkeyPatch
) -> None:
    order(move.source, "k1")
    read = move.destination.store.rows_at
    raced: list[bool] = []

    def read_then_a_claim_lands(keys):  # type: ignore[no-untyped-def]
        seen = read(keys)
        if not raced:
            raced.append(move.destination.claim("acct_A", "k1", "another-fingerprint") is not None)
        return seen

    monkeypatch.setattr(move.destination.store, "rows_at", read_then_a_claim_lands)
    result = move.copy()
    assert raced == [True]
    assert (result.inserted, result.updated, [c.key for c in result.conflicts]) == (0, 0, ["k1"])
    (row,) = rows(move.destination)
    assert (row.fingerprint, row.status) == ("another-fingerprint", "pending")


def test_a_copy_while_the_source_takes_requests_then_a_second_one_after_they_stop_misses_nothing(
    move: Move,
) -> None:
    stop = threading.Event()
    errors: list[BaseException] = []
    # Each app thread writes at least 20 requests and at most `per_thread`: a
    # copy that pages more slowly than the threads write (a loaded machine)
    # chases them only this far, and every row written stays within what
    # `rows` reads back (10 000), so the comparisons below see them all.
    per_thread = 1000

    def app_thread(n: int) -> None:
        try:
            i = 0
            while i < 20 or (not stop.is_set() and i < per_thread):
                key = f"t{n}-{i:04d}"
                ticket = move.source.begin(f"acct_{n}", key, "POST", "/orders", {}, BODY)
                move.source.finish(ticket, 201, {}, f"answer {key}".encode())  # type: ignore[arg-type]
                i += 1
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=app_thread, args=(n,)) for n in range(3)]
    for t in threads:
        t.start()
    try:
        while len(rows(move.source)) < 30:
            time.sleep(0.01)
        live = move.copy(batch=7)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert errors == []
    final = move.copy(batch=7)
    written = rows(move.source)
    assert live.rows_read >= 30 and final.rows_read == len(written) >= 60
    # The live copy inserted what existed page by page; the second inserts
    # the rest and completes the rows that were still pending then.
    assert (live.updated, live.kept, final.kept, final.conflicts) == (0, (), (), ())
    assert final.inserted == len(written) - live.inserted
    assert final.updated + final.unchanged == live.inserted
    assert sorted(rows(move.destination)) == sorted(written)
    assert move.copy().unchanged == len(written)


def test_keys_that_differ_only_in_case_or_a_trailing_space_stay_apart_across_pages(move: Move) -> None:
    # MariaDB/MySQL compare principals and keys byte for byte (VARBINARY): a
    # padding or case-blind comparison would merge these rows, and the page
    # boundaries (batch 2) fall between them.
    for principal in ("acct_A", "acct_A ", "Acct_a", "acct_Zoë"):
        for key in ("k", "k ", "K"):
            order(move.source, key, principal=principal, body=f"{principal}|{key}".encode())
    result = move.copy(batch=2)
    assert (result.rows_read, result.inserted, result.conflicts) == (12, 12, ())
    assert sorted(rows(move.destination)) == sorted(rows(move.source))
    replay = order(move.destination, "k ", principal="acct_A ", status=500)
    assert (replay.outcome, replay.body) == (Outcome.REPLAYED, b"acct_A |k ")
    assert move.copy(batch=2).unchanged == 12


def test_a_copy_of_more_rows_than_one_batch_reads_page_by_page_and_misses_none(move: Move) -> None:
    for i in range(23):
        move.source.claim(f"acct_{i % 3}", f"k-{i:02d}", "fp")
    seen: list[CopyProgress] = []
    result = move.copy(batch=5, on_progress=seen.append)
    assert [p.rows_read for p in seen] == [5, 10, 15, 20, 23]
    assert (result.rows_read, result.inserted) == (23, 23)
    assert sorted(rows(move.destination)) == sorted(rows(move.source))
    assert move.copy(batch=5).unchanged == 23


def test_the_source_is_only_read(move: Move, targets: tuple[str, str]) -> None:
    a_live_ledger(move)
    on_file = not targets[0].startswith(SERVERS)
    digest = hashlib.sha256(Path(targets[0]).read_bytes()).hexdigest() if on_file else None
    before = (rows(move.source), events(move.source))
    assert move.copy().copied == 7
    assert move.copy().unchanged == 7
    assert (rows(move.source), events(move.source)) == before
    if on_file:
        assert hashlib.sha256(Path(targets[0]).read_bytes()).hexdigest() == digest
    # What the copies read from refuses any write.
    with pytest.raises(ReadOnlyDatabaseError):
        move.reader.claim("acct_A", "new", "fp")


def test_a_destination_without_the_current_schema_is_refused(targets: tuple[str, str], clock: FakeClock) -> None:
    source = Ledger.open(targets[0], clock=clock)
    source.init()
    destination = Ledger.open(targets[1], clock=clock)
    try:
        with pytest.raises(SchemaMissingError):
            source.operator.copy_to(destination)
    finally:
        source.close()
        destination.close()


# -- the command ------------------------------------------------------------------------


def idemctl(*args: str):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(app, list(args))


@pytest.fixture
def cli_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clean_env(monkeypatch, tmp_path)


def test_the_command_copies_once_then_finds_everything_already_there(
    move: Move, targets: tuple[str, str], cli_env: None
) -> None:
    a_live_ledger(move)
    source, destination = move.source.describe(), move.destination.describe()
    first = idemctl("--db", targets[0], "copy", "--to", targets[1])
    assert (first.exit_code, first.stderr) == (0, "")  # no progress bar when stderr is not a terminal
    assert first.stdout == (
        f"copied 7 of 7 row(s) from {source} to {destination} (7 new, 0 updated), 0 already there, "
        "0 kept newer in the destination, 0 conflict(s); fenced-out log: 1 of 1 event(s) copied\n"
    )
    again = idemctl("--db", targets[0], "copy", "--to", targets[1], "--batch", "2")
    assert (again.exit_code, again.stderr) == (0, "")
    assert again.stdout == (
        f"copied 0 of 7 row(s) from {source} to {destination} (0 new, 0 updated), 7 already there, "
        "0 kept newer in the destination, 0 conflict(s); fenced-out log: 0 of 1 event(s) copied\n"
    )
    assert sorted(rows(move.destination)) == sorted(rows(move.source))


def test_the_command_names_each_kept_row_and_why_and_exits_0(
    move: Move, targets: tuple[str, str], cli_env: None
) -> None:
    move.source.claim("acct_A", "k1", "fp")
    move.copy()
    move.clock.advance(POLICY.pending_ttl_ms + 1)
    assert move.destination.takeover("acct_A", "k1", "fp") is not None
    done = idemctl("--db", targets[0], "copy", "--to", targets[1])
    assert done.exit_code == 0
    assert done.stdout.splitlines()[1:] == [
        "kept acct_A/k1 (generation 2 in the destination, 1 in the source): "
        "the destination's row has a higher generation (taken over there)"
    ]
    assert "0 new, 0 updated), 0 already there, 1 kept newer in the destination, 0 conflict(s)" in done.stdout


def test_the_command_reports_conflicts_escaped_and_exits_1(move: Move, targets: tuple[str, str], cli_env: None) -> None:
    principal = "acct_\x1b[31mred"
    order(move.source, "k1", principal=principal)
    move.destination.claim(principal, "k1", "another-fingerprint")
    done = idemctl("--db", targets[0], "copy", "--to", targets[1])
    assert done.exit_code == 1
    assert "\x1b" not in done.stdout + done.stderr
    assert "1 conflict(s)" in done.stdout
    assert done.stdout.splitlines()[1].startswith(
        "conflict acct_\\x1b[31mred/k1: the destination holds another request under this key (fingerprint anoth"
    )
    assert done.stderr == (
        "1 key(s) hold another request in the destination and were not copied: inspect both rows before moving\n"
    )
    as_json = idemctl("--db", targets[0], "copy", "--to", targets[1], "--json")
    assert as_json.exit_code == 1
    doc = json.loads(as_json.stdout)
    assert doc["conflicts"] == [
        {
            "principal": principal,
            "key": "k1",
            "source_fingerprint": fingerprint("POST", "/orders", {}, BODY),
            "destination_fingerprint": "another-fingerprint",
        }
    ]
    assert (doc["copied"], doc["unchanged"], doc["kept_newer"]) == (0, 0, [])


def test_the_command_json_summary(move: Move, targets: tuple[str, str], cli_env: None) -> None:
    a_live_ledger(move)
    done = idemctl("--db", targets[0], "copy", "--to", targets[1], "--json", "--batch", "3")
    assert (done.exit_code, done.stderr) == (0, "")
    assert json.loads(done.stdout) == {
        "source": move.source.describe(),
        "destination": move.destination.describe(),
        "dry_run": False,
        "rows_read": 7,
        "copied": 7,
        "inserted": 7,
        "updated": 0,
        "unchanged": 0,
        "kept_newer": [],
        "conflicts": [],
        "fenced_read": 1,
        "fenced_copied": 1,
        "fenced_unchanged": 0,
    }


def test_the_command_dry_run_writes_nothing(move: Move, targets: tuple[str, str], cli_env: None) -> None:
    a_live_ledger(move)
    done = idemctl("--db", targets[0], "copy", "--to", targets[1], "--dry-run")
    assert done.exit_code == 0
    assert done.stdout.startswith("would copy 7 of 7 row(s)")
    assert "fenced-out log: 1 of 1 event(s) would be copied\ndry run: nothing written\n" in done.stdout
    assert rows(move.destination) == [] and events(move.destination) == []


def test_the_command_refuses_an_uninitialised_destination_unless_told_to_init_it(
    targets: tuple[str, str], clock: FakeClock, cli_env: None
) -> None:
    source = Ledger.open(targets[0], clock=clock)
    source.init()
    order(source, "k1")
    refused = idemctl("--db", targets[0], "copy", "--to", targets[1])
    assert (refused.exit_code, refused.stdout) == (2, "")
    assert refused.stderr.startswith("error: the destination")
    assert refused.stderr.endswith(": pass --init to create or upgrade it\n") and refused.stderr.count("\n") == 1
    dry = idemctl("--db", targets[0], "copy", "--to", targets[1], "--init", "--dry-run")
    assert dry.exit_code == 2 and "a dry run writes nothing, not even a schema" in dry.stderr
    done = idemctl("--db", targets[0], "copy", "--to", targets[1], "--init")
    assert done.exit_code == 0 and "copied 1 of 1 row(s)" in done.stdout
    destination = Ledger.open(targets[1], clock=clock)
    try:
        assert order(destination, "k1", status=500).outcome is Outcome.REPLAYED
    finally:
        destination.close()
        source.close()


def test_the_command_refuses_a_bad_batch_and_a_missing_destination_as_usage_errors(
    tmp_path: Path, cli_env: None
) -> None:
    source = Ledger.open(str(tmp_path / "source.db"))
    source.init()
    source.close()
    no_to = idemctl("--db", "source.db", "copy")
    assert no_to.exit_code == 2 and "--to" in no_to.stderr and no_to.stdout == ""
    zero = idemctl("--db", "source.db", "copy", "--to", "other.db", "--batch", "0")
    assert zero.exit_code == 2 and "--batch" in zero.stderr
    onto_itself = idemctl("--db", "source.db", "copy", "--to", "source.db")
    assert onto_itself.exit_code == 2 and onto_itself.stderr == "error: cannot copy source.db onto itself\n"


def test_a_ledger_the_recipe_wrote_is_copied_with_no_token_and_no_fenced_log(
    targets: tuple[str, str], clock: FakeClock
) -> None:
    sql_source_only(targets)
    from idemctl.schema import schema_files

    if targets[0].startswith(("mysql://", "mariadb://")):
        pytest.skip("no recipe-written ledger exists on MariaDB/MySQL: idemctl creates its own table there")
    recipe = schema_files("postgres" if targets[0].startswith("postgresql://") else "sqlite")[0].sql
    row = ("acct_A", "k1", fingerprint("POST", "/orders", {}, BODY), "completed", 1, 201, b"made", "{}", 1000, 2000)
    insert = (
        "INSERT INTO idempotency_keys (principal, key, fingerprint, status, generation, response_status,"
        " response_body, response_headers, created_at, updated_at) VALUES (%s)"
    )
    if targets[0].startswith("postgresql://"):
        import psycopg
        from psycopg.conninfo import conninfo_to_dict, make_conninfo

        # The URL's search_path set inside the transaction, as a pooler in
        # front of the server (which refuses startup options) requires.
        params = conninfo_to_dict(targets[0])
        schema = str(params.pop("options")).removeprefix("-csearch_path=")
        with psycopg.connect(make_conninfo("", **params), autocommit=True) as conn, conn.transaction():
            conn.execute(psycopg.sql.SQL("SET LOCAL search_path = {}").format(psycopg.sql.Identifier(schema)))
            conn.execute(recipe)
            conn.execute(insert % ", ".join(["%s"] * 10), row)
    else:
        with sqlite3.connect(targets[0]) as conn:
            conn.executescript(recipe)
            conn.execute(insert % ", ".join(["?"] * 10), (*row[:6], "made", *row[7:]))
        conn.close()
    source = Ledger.open(targets[0], clock=clock, readonly=True)
    destination = Ledger.open(targets[1], clock=clock)
    try:
        assert source.schema_version() == 0
        destination.init()
        result = source.operator.copy_to(destination)
        assert (result.inserted, result.fenced_read) == (1, 0)
        (copied,) = rows(destination)
        assert (copied.token, copied.generation, copied.response_body, copied.updated_at) == (None, 1, b"made", 2000)
        clock.now = 3000
        assert order(destination, "k1", status=500).wire[2] == b"made"
    finally:
        source.close()
        destination.close()


def test_a_quoted_key_the_destination_holds_bare_is_kept_there_not_copied_twice(
    move: Move, targets: tuple[str, str]
) -> None:
    sql_source_only(targets)
    # The source's row as an older writer stored the header "k1"; the
    # destination's claimed by idemctl as k1: one key, so the copy keeps
    # the destination's and says why, instead of failing or adding a second.
    writer = RecipeWriter(move.source_target)
    try:
        writer.insert_completed("acct_A", '"k1"', "fp", 201, "{}", "from the source", move.clock.now)
    finally:
        writer.close()
    move.destination.claim("acct_A", "k1", "fp")
    held = rows(move.destination)
    result = move.copy()
    assert (result.inserted, result.updated, result.conflicts) == (0, 0, ())
    assert [(k.key, k.reason, k.destination_generation) for k in result.kept] == [('"k1"', KeptReason.OTHER_FORM, 1)]
    assert rows(move.destination) == held
