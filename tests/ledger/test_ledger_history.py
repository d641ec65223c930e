"""A recorded history of real concurrency, checked key by key (issue 9, section 10).

Several processes, each with a few threads, hammer a few keys at a time with
`Ledger.handle` on one real database and the real clock: thread i of every
process sends lane i's requests in order, each until it gets an answer, so
every key is contended by one thread of each process. Mutations stall for
random times around the pending TTL (so takeovers and fenced-out completions
really happen), some raise, some of those release their reservation, and the
test SIGKILLs workers mid-run and starts replacements.

Every mutation run appends a line to its process's journal (fsynced before
the mutation goes on) naming the key and a unique run id, which the response
body carries; after `handle` returns, the process journals what it returned.
Then every key's history is checked against what the contract guarantees:

- a mutation runs again only after a takeover (its owner was stale) or a
  release (its run failed); no more than one run of a key is ever answered
  as stored (EXECUTED / TAKEN_OVER), and the stored answer is that run's,
  or, if none was journaled, a run of a process that was killed before it
  could journal;
- every replay is that stored answer, byte for byte;
- every FENCED_OUT answer has its fenced-out event in the durable log (and
  the log holds no more events than fenced-out answers plus runs whose
  process died before journaling what happened), and a reservation is only
  ever fenced out once it was older than the TTL: nobody may supersede it
  before (the check reads the wall clock the ledger itself uses).

Only the outcomes are asserted, never how long anything took."""

from __future__ import annotations

import collections
import json
import multiprocessing as mp
import os
import random
import threading
import time
from pathlib import Path

import pytest

from idemctl import Ledger, Outcome, Policy, Status, wall_clock_ms
from idemctl.storage import SqliteOptions, Store
from tests.helpers import EveryWriteInOneTransaction

pytestmark = pytest.mark.slow

TTL_MS = 400
# Long enough that nothing the test writes is swept while it runs.
POLICY = Policy(pending_ttl_ms=TTL_MS, retention_ms=3_600_000)
PRINCIPAL = "acct-history"
HEADERS = {"content-type": "application/json"}
PROCESSES = 4
THREADS = 3
RUN_SECONDS = 9.0
KILLS = 5
MAX_REQUESTS_PER_THREAD = 20_000  # a bound only: the workers stop at RUN_SECONDS
STORED = {Outcome.EXECUTED.value, Outcome.TAKEN_OVER.value}
RAN = STORED | {Outcome.FENCED_OUT.value, "raised"}
DID_NOT_RUN = {Outcome.REPLAYED.value, Outcome.IN_PROGRESS.value, Outcome.RETRY.value}


class RolledBack(Exception):
    """The mutation failed and undid itself."""


def _stall_seconds(rng: random.Random) -> float:
    """Mostly quick, often around the TTL (taken over while still running),
    sometimes well past it."""
    r = rng.random()
    if r < 0.55:
        return rng.uniform(0, 0.03)
    if r < 0.85:
        return rng.uniform(0.7, 1.4) * TTL_MS / 1000
    return rng.uniform(1.5, 2.2) * TTL_MS / 1000


def _worker(target: str, journal_dir: str, name: str, t0: float, stop_at: float, seed: int, group_commit: bool) -> None:
    """One worker process: THREADS threads sending requests until `stop_at`."""
    pid = os.getpid()
    fd = os.open(os.path.join(journal_dir, f"{name}-{pid}.jsonl"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    lock = threading.Lock()

    def journal(**entry: object) -> None:
        line = (json.dumps(entry, separators=(",", ":")) + "\n").encode()
        with lock:
            os.write(fd, line)
            os.fsync(fd)

    journal(e="start", pid=pid, worker=name)
    # With group commit, the threads of one process share commits; here they
    # rarely meet, so every statement goes through a batch's transaction.
    if group_commit:
        engine = EveryWriteInOneTransaction(target, options=SqliteOptions(group_commit=True))
        ledger = Ledger(Store(engine), policy=POLICY)
    else:
        ledger = Ledger.open(target, policy=POLICY)

    def thread_main(tid: int) -> None:
        # A client sending one lane's requests in order, each until it gets a
        # final answer; thread i of every process works the same lane i.
        rng = random.Random(f"{seed}-{tid}")
        index = 0
        for n in range(MAX_REQUESTS_PER_THREAD):
            if time.time() >= stop_at:
                break
            key = f"lane{tid}-{index:04d}"
            run_id = f"{name}.{pid}.{tid}.{n}"
            stall = _stall_seconds(rng)
            fails = rng.random() < 0.2
            release = rng.random() < 0.5
            body = json.dumps({"run": run_id, "key": key}).encode()

            def mutate(
                request_body: bytes,
                key: str = key,
                run_id: str = run_id,
                stall: float = stall,
                fails: bool = fails,
                body: bytes = body,
            ) -> tuple[int, dict[str, str], bytes]:
                journal(e="run", key=key, run=run_id, pid=pid)
                time.sleep(stall)
                if fails:
                    raise RolledBack(run_id)
                return 201, HEADERS, body

            start = wall_clock_ms()
            entry: dict[str, object] = {"e": "result", "key": key, "run": run_id, "pid": pid, "start": start}
            try:
                answer = ledger.handle(
                    PRINCIPAL, key, "POST", "/payments", HEADERS, b'{"amount":1}', mutate, release_on_error=release
                )
            except RolledBack:
                journal(**entry, outcome="raised", released=release, end=wall_clock_ms())
                continue
            except Exception as exc:
                journal(**entry, outcome="error", error=f"{type(exc).__name__}: {exc}", end=wall_clock_ms())
                continue
            end = wall_clock_ms()
            journal(
                **entry,
                outcome=answer.outcome.value,
                generation=answer.generation,
                status=answer.status,
                body=answer.body.decode("utf-8", "replace"),
                end=end,
            )
            ledger.after_response(answer)
            if answer.outcome in (Outcome.IN_PROGRESS, Outcome.RETRY):
                time.sleep(rng.uniform(0.01, 0.04))
            else:
                index += 1  # answered: on to this lane's next request
        journal(e="thread-exit", pid=pid, thread=tid)

    threads = [threading.Thread(target=thread_main, args=(tid,)) for tid in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    shared = {"batches": engine.batches_committed, "statements": engine.statements_committed} if group_commit else {}
    ledger.close()
    journal(e="exit", pid=pid, **shared)
    os.close(fd)


def _pick_victim_mid_run(live: list, journal_dir: Path, rng: random.Random):
    """A live worker with a mutation running (journaled, not answered), if one
    shows up within a second; any live worker otherwise."""
    give_up = time.time() + 1.0
    while True:
        mid_run = []
        for p in live:
            for path in journal_dir.glob(f"*-{p.pid}.jsonl"):
                open_runs: set[str] = set()
                for line in path.read_bytes().splitlines():
                    try:
                        e = json.loads(line)
                    except ValueError:
                        continue
                    if e["e"] == "run":
                        open_runs.add(e["run"])
                    elif e["e"] == "result":
                        open_runs.discard(e["run"])
                if open_runs:
                    mid_run.append(p)
        if mid_run or time.time() >= give_up:
            return rng.choice(mid_run or live)
        time.sleep(0.02)


def _read_journals(journal_dir: Path) -> list[dict]:
    entries = []
    for path in sorted(journal_dir.glob("*.jsonl")):
        lines = path.read_bytes().split(b"\n")
        for i, line in enumerate(lines):
            if not line:
                continue
            try:
                entries.append(json.loads(line))
            except ValueError:
                # Only the last line of a killed process can be cut short.
                assert i == len(lines) - 1, f"{path}: unreadable line {i}: {line!r}"
    return entries


@pytest.mark.parametrize("backend_name", ["sqlite", "sqlite-group", "postgres", "mysql"])
def test_history_of_killed_and_stalling_workers_keeps_one_stored_answer_per_key_and_logs_every_fenced_out_run(
    backend_name: str, ledger_target: str, tmp_path: Path
) -> None:
    with Ledger.open(ledger_target, policy=POLICY) as ledger:
        ledger.init()
    journal_dir = tmp_path / "journal"
    journal_dir.mkdir()
    ctx = mp.get_context("spawn")
    rng = random.Random()
    t0 = time.time()
    stop_at = t0 + RUN_SECONDS
    spawned = 0
    killed_pids: set[int] = set()
    live: list[mp.process.BaseProcess] = []
    finished: list[mp.process.BaseProcess] = []

    def start_worker() -> None:
        nonlocal spawned
        spawned += 1
        p = ctx.Process(
            target=_worker,
            args=(
                ledger_target,
                str(journal_dir),
                f"w{spawned}",
                t0,
                stop_at,
                rng.randrange(2**32),
                backend_name == "sqlite-group",
            ),
            daemon=True,
        )
        p.start()
        live.append(p)

    try:
        for _ in range(PROCESSES):
            start_worker()
        # Every so often SIGKILL a worker that is inside a mutation, and replace it.
        for i in range(KILLS):
            time.sleep(max(0.0, t0 + (i + 1) * RUN_SECONDS / (KILLS + 1) + rng.uniform(-0.2, 0.2) - time.time()))
            victim = _pick_victim_mid_run(live, journal_dir, rng)
            victim.kill()
            victim.join(30)
            assert victim.pid is not None
            killed_pids.add(victim.pid)
            live.remove(victim)
            finished.append(victim)
            start_worker()
        # The rest stop by themselves: they start no request after stop_at.
        deadline = stop_at + 60
        for p in live:
            p.join(max(1.0, deadline - time.time()))
        hung = [p.pid for p in live if p.is_alive()]
        assert hung == [], f"workers {hung} did not stop by themselves"
        assert [p.exitcode for p in live] == [0] * len(live)
    finally:
        for p in live + finished:
            if p.is_alive():
                p.kill()
                p.join(10)

    entries = _read_journals(journal_dir)
    survivors = {e["pid"] for e in entries if e["e"] == "exit"}
    assert survivors.isdisjoint(killed_pids)
    assert survivors == {p.pid for p in live}, "every worker that was not killed journals its exit"
    thread_exits = collections.Counter(e["pid"] for e in entries if e["e"] == "thread-exit")
    assert thread_exits == {pid: THREADS for pid in survivors}, "every thread of a survivor ran to its end"

    runs = {e["run"]: e for e in entries if e["e"] == "run"}
    results = [e for e in entries if e["e"] == "result"]
    assert [e for e in results if e["outcome"] == "error"] == []
    ran_results = {e["run"]: e for e in results if e["outcome"] in RAN}
    assert len(ran_results) == len([e for e in results if e["outcome"] in RAN]), "one result per run"
    assert {e["outcome"] for e in results} <= RAN | DID_NOT_RUN
    # A run journals before its result; every run of a process that was not
    # killed has its result; a run without one belongs to a killed process.
    assert set(ran_results) <= set(runs)
    unfinished = {rid: r for rid, r in runs.items() if rid not in ran_results}
    assert {r["pid"] for r in unfinished.values()} <= killed_pids

    for e in ran_results.values():
        own_body = json.dumps({"run": e["run"], "key": e["key"]})
        if e["outcome"] != "raised":
            # Stored or fenced out, the caller gets what its own run computed.
            assert (e["status"], e["body"]) == (201, own_body), e
        if e["outcome"] == Outcome.EXECUTED.value:
            assert e["generation"] == 1, e
        if e["outcome"] == Outcome.TAKEN_OVER.value:
            assert e["generation"] >= 2, e
        if e["outcome"] == Outcome.FENCED_OUT.value:
            # Superseding a reservation needs it to be older than the TTL.
            assert e["end"] - e["start"] > TTL_MS, f"fenced out before its reservation was stale: {e}"

    by_key: dict[str, dict[str, list[dict]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for rid, r in runs.items():
        by_key[r["key"]]["runs"].append(r)
        by_key[r["key"]][ran_results[rid]["outcome"] if rid in ran_results else "unfinished"].append(r)
    for e in results:
        if e["outcome"] in DID_NOT_RUN:
            by_key[e["key"]][e["outcome"]].append(e)

    totals: collections.Counter[str] = collections.Counter()
    with Ledger.open(ledger_target, policy=POLICY) as ledger:
        for key, history in sorted(by_key.items()):
            for outcome, items in history.items():
                totals[outcome] += len(items)
            row = ledger.lookup(PRINCIPAL, key)
            stored_runs = [
                ran_results[r["run"]] for r in history[Outcome.EXECUTED.value] + history[Outcome.TAKEN_OVER.value]
            ]
            # A completed row never goes back to pending or away here (no purge,
            # nothing past the retention), so at most one run can be told "stored".
            assert len(stored_runs) <= 1, f"{key}: several runs were answered as stored: {stored_runs}"
            if row is not None and row.status is Status.COMPLETED:
                stored_body = row.body_bytes.decode()
                stored_run = json.loads(stored_body)["run"]
                assert stored_run in runs and runs[stored_run]["key"] == key, f"{key}: stored answer of no run: {row}"
                if stored_runs:
                    assert stored_runs[0]["run"] == stored_run, f"{key}: stored {stored_run}, told {stored_runs[0]}"
                    assert stored_runs[0]["generation"] == row.generation
                else:
                    # Stored by a run whose process was killed before it could journal.
                    assert stored_run in unfinished, f"{key}: {stored_run} stored but answered otherwise"
                for replay in history[Outcome.REPLAYED.value]:
                    assert (replay["status"], replay["body"]) == (201, stored_body), f"{key}: replay {replay}"
            else:
                assert stored_runs == [], f"{key}: answered as stored, but the row is {row}"
                assert history[Outcome.REPLAYED.value] == [], f"{key}: replayed, but the row is {row}"

            fenced_answers = [ran_results[r["run"]] for r in history[Outcome.FENCED_OUT.value]]
            events = list(ledger.operator.fenced(principal=PRINCIPAL, key=key))
            assert len(fenced_answers) <= len(events) <= len(fenced_answers) + len(history["unfinished"]), (
                f"{key}: {len(events)} fenced-out events for {len(fenced_answers)} fenced-out answers"
                f" and {len(history['unfinished'])} runs killed before answering"
            )
            logged = collections.Counter(e.superseded_generation for e in events)
            answered = collections.Counter(a["generation"] for a in fenced_answers)
            assert answered - logged == collections.Counter(), f"{key}: fenced-out answers {answered}, log {logged}"

    exits = [e for e in entries if e["e"] == "exit" and "batches" in e]
    commits = f", {sum(e['statements'] for e in exits)} statements in {sum(e['batches'] for e in exits)} commits"
    print(f"history: {len(by_key)} keys, {len(killed_pids)} workers killed, {dict(totals)}{commits if exits else ''}")
    # The history really contained what this test is about.
    assert killed_pids and totals["unfinished"] > 0, totals
    assert totals[Outcome.TAKEN_OVER.value] > 0 and totals[Outcome.FENCED_OUT.value] > 0, totals
    assert totals["raised"] > 0 and totals[Outcome.REPLAYED.value] > 0, totals
