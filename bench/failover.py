"""What a PostgreSQL failover does to the ledger, measured on a real primary
and streaming standby (bench/replica.py).

Writer processes run `Ledger.handle` through a URL naming both servers with
`target_session_attrs=read-write`, each on keys of its own, one request at a
time, retrying on 503 and 409 with the same key. Mid-load the primary is
stopped hard (`pg_ctl stop -m immediate`) and the standby promoted. Then,
once the pending TTL has passed, every key any writer used is sent once
more with the same key and body, as a client that retries everything would.

    python -m bench.failover                 # the table in docs/postgres.md
    python -m bench.failover --settings async --writers 2

Counted per setting:
- acknowledged: answers whose completion the primary acknowledged (`handle`
  returned them stored);
- lost: of those, rows missing or still pending on the promoted standby;
- double runs: acknowledged keys whose mutation ran again on the final retry;
- in flight: answers computed while the primary went away, whose completion
  never reached it (AnswerNotStoredError: the client got the answer, the row
  stays pending), and how many of them ran again once the TTL let a retry take
  the reservation over;
- 503s: requests refused because no server accepted writes, and the longest
  stretch a writer saw refusals, from its first 503 to its next answer."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from idemctl import AnswerNotStoredError, Ledger, Policy, StorageError
from idemctl.outcomes import Status

from .replica import ReplicaPair

PRINCIPAL = "acct_failover"
HEADERS = {"content-type": "application/json"}
BODY = b'{"amount": 100}'
SPAWN = mp.get_context("spawn")
PAUSE_S = 0.02  # between retries of one key: fine enough to time a 503 stretch


@dataclass(frozen=True)
class Setting:
    name: str
    label: str
    synchronous: bool
    synchronous_commit: str = "on"


SETTINGS = {
    "async": Setting("async", "asynchronous (default), synchronous_commit=on", False),
    "sync": Setting("sync", "synchronous_standby_names='*', synchronous_commit=on", True, "on"),
    "remote_apply": Setting(
        "remote_apply", "synchronous_standby_names='*', synchronous_commit=remote_apply", True, "remote_apply"
    ),
}


@dataclass
class FailoverRun:
    setting: Setting
    writers: int
    pending_ttl_ms: int
    lag_s: float
    acknowledged: list[str] = field(default_factory=list)
    lost_missing: list[str] = field(default_factory=list)
    lost_pending: list[str] = field(default_factory=list)
    in_flight: list[str] = field(default_factory=list)
    in_flight_pending: list[str] = field(default_factory=list)
    in_flight_completed: list[str] = field(default_factory=list)
    unanswered: list[str] = field(default_factory=list)
    runs: Counter[str] = field(default_factory=Counter)
    final_outcomes: Counter[str] = field(default_factory=Counter)
    refused: int = 0
    longest_refusal_s: float = 0.0
    promote_s: float = 0.0
    acknowledged_after_failover: int = 0

    @property
    def lost(self) -> list[str]:
        return self.lost_missing + self.lost_pending

    @property
    def double_runs(self) -> list[str]:
        """Acknowledged completions whose mutation ran more than once."""
        return sorted(k for k in self.acknowledged if self.runs[k] > 1)

    @property
    def in_flight_rerun(self) -> list[str]:
        return sorted(k for k in self.in_flight if self.runs[k] > 1)

    def row(self) -> dict[str, Any]:
        return {
            "setting": self.setting.label,
            "lag_s": self.lag_s,
            "acknowledged": len(self.acknowledged),
            "lost": len(self.lost),
            "lost_missing": len(self.lost_missing),
            "lost_pending": len(self.lost_pending),
            "double_runs": len(self.double_runs),
            "in_flight": len(self.in_flight),
            "in_flight_rerun": len(self.in_flight_rerun),
            "refused_503": self.refused,
            "longest_503_s": round(self.longest_refusal_s, 2),
            "promote_s": round(self.promote_s, 2),
            "most_runs_of_one_key": max(self.runs.values(), default=0),
        }


def _writer(url: str, index: int, ttl_ms: int, deadline: float, stop: Any, acks: Any, out: Any) -> None:
    """One client process: new keys one after another until told to stop."""
    ledger = Ledger.open(url, policy=Policy(pending_ttl_ms=ttl_ms))
    runs: Counter[str] = Counter()
    stored: list[str] = []
    unstored: list[str] = []
    unanswered: list[str] = []
    refused = 0
    longest = 0.0
    outage_since: float | None = None
    n = 0
    while not stop.is_set() and time.monotonic() < deadline:
        key = f"w{index}-{n}"
        n += 1

        def mutation(body: bytes, key: str = key) -> tuple[int, dict[str, str], bytes]:
            runs[key] += 1
            return 201, HEADERS, json.dumps({"key": key, "run": runs[key]}).encode()

        while True:
            if time.monotonic() > deadline:
                unanswered.append(key)
                break
            try:
                answer = ledger.handle(PRINCIPAL, key, "POST", "/payments", HEADERS, BODY, mutation)
            except AnswerNotStoredError:
                # The middleware sends this answer (computed, not stored).
                unstored.append(key)
                break
            except StorageError:
                refused += 1  # the middleware's 503 + Retry-After
                if outage_since is None:
                    outage_since = time.monotonic()
                time.sleep(PAUSE_S)
                continue
            if outage_since is not None:
                longest = max(longest, time.monotonic() - outage_since)
                outage_since = None
            if answer.status == 201:
                stored.append(key)
                with acks.get_lock():
                    acks.value += 1
                break
            time.sleep(PAUSE_S)  # 409: a reservation whose claim committed but whose answer was lost
    if outage_since is not None:
        longest = max(longest, time.monotonic() - outage_since)
    ledger.close()
    out.put(
        {
            "runs": dict(runs),
            "stored": stored,
            "unstored": unstored,
            "unanswered": unanswered,
            "refused": refused,
            "longest": longest,
        }
    )


def _wait_for(acks: Any, target: int, deadline: float, procs: list[Any]) -> None:
    while acks.value < target and time.monotonic() < deadline:
        dead = [p for p in procs if p.exitcode is not None]
        if dead:
            raise RuntimeError(f"writer process {dead[0].name} exited early with code {dead[0].exitcode}")
        time.sleep(0.02)


def measure(
    setting: Setting,
    *,
    writers: int = 4,
    before: int = 150,
    after: int = 150,
    pending_ttl_ms: int = 2000,
    lag_s: float = 0.3,
    budget_s: float = 40.0,
    before_load: Callable[[ReplicaPair], None] | None = None,
) -> FailoverRun:
    """One failover under load: `before` acknowledged answers, then the
    replication link stalled for `lag_s` (the standby falls that far behind),
    then the primary killed and the standby promoted, then `after` more
    answers; all within `budget_s` (writers give up on a key at the deadline).
    `before_load` gets the pair once the ledger is initialised."""
    result = FailoverRun(setting, writers, pending_ttl_ms, lag_s)
    with ReplicaPair.start(synchronous=setting.synchronous, synchronous_commit=setting.synchronous_commit) as pair:
        url = pair.url()
        with Ledger.open(url) as ledger:
            ledger.init()
        if before_load is not None:
            before_load(pair)
        deadline = time.monotonic() + budget_s
        stop = SPAWN.Event()
        acks = SPAWN.Value("i", 0)
        out = SPAWN.Queue()
        procs = [
            SPAWN.Process(target=_writer, args=(url, i, pending_ttl_ms, deadline, stop, acks, out), daemon=True)
            for i in range(writers)
        ]
        for p in procs:
            p.start()
        try:
            _wait_for(acks, before, deadline - budget_s / 2, procs)
            if lag_s > 0:
                pair.stall_replication()
                time.sleep(lag_s)
            pair.kill_primary()
            t0 = time.monotonic()
            pair.promote_standby()
            result.promote_s = time.monotonic() - t0
            at_failover = acks.value
            _wait_for(acks, at_failover + after, deadline - pending_ttl_ms / 1000 - 5, procs)
            result.acknowledged_after_failover = acks.value - at_failover
            stop.set()
            reports = [out.get(timeout=max(1.0, deadline - time.monotonic() + 5)) for _ in procs]
        finally:
            stop.set()
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
        for report in reports:
            result.runs.update(report["runs"])
            result.acknowledged += report["stored"]
            result.in_flight += report["unstored"]
            result.unanswered += report["unanswered"]
            result.refused += report["refused"]
            result.longest_refusal_s = max(result.longest_refusal_s, report["longest"])
        stopped_at = time.monotonic()
        # What the promoted standby holds, read before anything retries.
        with Ledger.open(pair.url(pair.standby_port), policy=Policy(pending_ttl_ms=pending_ttl_ms)) as new_primary:
            for key in result.acknowledged:
                row = new_primary.lookup(PRINCIPAL, key)
                if row is None:
                    result.lost_missing.append(key)
                elif row.status is not Status.COMPLETED:
                    result.lost_pending.append(key)
            for key in result.in_flight:
                row = new_primary.lookup(PRINCIPAL, key)
                if row is not None and row.status is Status.PENDING:
                    result.in_flight_pending.append(key)
                elif row is not None:
                    result.in_flight_completed.append(key)
            # Every key once more, as a client that retries everything: after
            # the TTL, so that a pending reservation is taken over, not 409.
            time.sleep(max(0.0, stopped_at + pending_ttl_ms / 1000 + 0.1 - time.monotonic()))
            for key in result.acknowledged + result.in_flight + result.unanswered:

                def again(body: bytes, key: str = key) -> tuple[int, dict[str, str], bytes]:
                    result.runs[key] += 1
                    return 201, HEADERS, json.dumps({"key": key, "run": result.runs[key]}).encode()

                answer = new_primary.handle(PRINCIPAL, key, "POST", "/payments", HEADERS, BODY, again)
                result.final_outcomes[answer.outcome.value] += 1
    return result


def render(runs: list[FailoverRun]) -> str:
    lines = [
        "| replication | standby behind | acknowledged | lost acknowledged completions | double runs | in flight (ran again after the TTL) | 503s | longest 503 stretch | promotion took |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in runs:
        r = run.row()
        lines.append(
            f"| {r['setting']} | {r['lag_s'] * 1000:g} ms | {r['acknowledged']} | {r['lost']} ({r['lost_missing']} missing, {r['lost_pending']} pending) "
            f"| {r['double_runs']} | {r['in_flight']} ({r['in_flight_rerun']}) | {r['refused_503']} | {r['longest_503_s']:.1f} s | {r['promote_s']:.1f} s |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.failover", description=__doc__.split("\n\n")[0])
    p.add_argument("--settings", default="async,sync,remote_apply", help=f"comma-separated: {', '.join(SETTINGS)}")
    p.add_argument("--writers", type=int, default=4, help="writer processes (default 4)")
    p.add_argument("--lag", default="0,0.3", help="seconds the standby falls behind before the crash (default 0,0.3)")
    p.add_argument("--repeat", type=int, default=1, help="failovers per setting (default 1)")
    p.add_argument("--json", action="store_true", help="one JSON object per failover instead of the table")
    args = p.parse_args(argv)
    reason = ReplicaPair.unavailable()
    if reason:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    runs = []
    for name in args.settings.split(","):
        for lag in (float(x) for x in args.lag.split(",")):
            for _ in range(args.repeat):
                run = measure(SETTINGS[name.strip()], writers=args.writers, lag_s=lag)
                runs.append(run)
                if args.json:
                    print(json.dumps(run.row()), flush=True)
    if not args.json:
        print(f"{args.writers} writer processes, pending TTL {runs[0].pending_ttl_ms} ms, on {os.cpu_count()} cores")
        print(render(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
