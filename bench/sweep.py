"""(5) Sweep and (6) memory of the operator commands, on a backlog of 10^6
expired rows plus 10^4 live rows that must survive.

Floor: one unbounded `DELETE … WHERE updated_at < cutoff` on a plain sqlite3
connection (WAL, FULL), then the checkpoint that its WAL needs. Ours:
`idemctl sweep` with its default batch size, run as a separate process
exactly as an operator would. Both run on identical copies of one file, each
while a separate process keeps claiming new keys (one request every 5 ms);
its errors and latency are part of the result. The longest single sweep
transaction is measured on a third copy with the same `ledger.operator.sweep` batches
timed one by one. The per-request sweep batch (20 rows) is timed on a ledger
of 10^3 rows and on the 10^6 backlog.

Peak RSS (ru_maxrss of the one child process) of `idemctl sweep`,
`idemctl stats --json` and `idemctl pending --limit 0 --json` on the big
ledger is compared with the floor of the same interpreter that only imports
idemctl's CLI."""

from __future__ import annotations

import json
import shutil
import sys
import time
from typing import Any

from idemctl import Ledger

from .backlog import DAY_MS, add_rows, count_rows, init_ledger
from .common import Context, now_ms, raw_connect, remove_db, spread
from .proc import Claimer, WalSampler, cli, run_measured

MIB = 1024 * 1024
# What other batch sizes buy: the knob trades the claimer's wait (one batch
# holds the write lock) against total drain time. (size, batches timed one
# by one in a full run, in a --quick run: the largest drains what is left.)
OTHER_BATCHES = ((1_000, 150, 2), (10_000, 30, 10**6))


def default_cli_batch() -> int:
    """What `idemctl sweep` uses on SQLite when --batch-size is not given."""
    from idemctl.storage.dialect import SQLITE

    return SQLITE.sweep.drain_batch


def _copy(src: str, dst: str) -> None:
    remove_db(dst)
    shutil.copyfile(src, dst)


def _checkpoint(path: str) -> float:
    conn = raw_connect(path)
    t0 = time.perf_counter()
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
    elapsed = time.perf_counter() - t0
    conn.close()
    return elapsed


def per_request_batch(ctx: Context, big: str, reps: int, calls: int) -> dict[str, Any]:
    """sweep(batch=20) latency on a 10^3-row ledger and on the big backlog."""
    small = ctx.path("sweep-small.db")
    init_ledger(small)
    # 10^3 rows left after the last call; the calls delete reps * calls * 20 more.
    small_rows = ctx.size(1000, 200) + reps * calls * 20
    add_rows(small, small_rows, seed=7, updated_at=now_ms() - 2 * DAY_MS)
    ledgers = {"small": Ledger.open(small), "big": Ledger.open(big)}
    lat: dict[str, list[float]] = {"small": [], "big": []}
    for rep in range(reps):
        for name in ("small", "big") if rep % 2 == 0 else ("big", "small"):
            ledger = ledgers[name]
            t0 = time.perf_counter()
            deleted = sum(ledger.operator.sweep(batch=20).keys_deleted for _ in range(calls))
            lat[name].append((time.perf_counter() - t0) / calls * 1000)
            assert deleted == 20 * calls, (name, deleted)
    for ledger in ledgers.values():
        ledger.close()
    return {
        "rows_small": small_rows,
        "rows_small_after": count_rows(small),
        "small_ms": spread(lat["small"]),
        "big_ms": spread(lat["big"]),
        "ratio_big_to_small": spread([b / s for b, s in zip(lat["big"], lat["small"])]),
    }


def unbounded_delete(path: str, cutoff: int) -> dict[str, Any]:
    # The checkpoint runs while the claimer still holds a connection: closing
    # the last connection would checkpoint silently, outside the timing.
    conn = raw_connect(path)
    with Claimer(path) as claimer, WalSampler(path) as wal:
        t0 = time.perf_counter()
        deleted = conn.execute("DELETE FROM idempotency_keys WHERE updated_at < ?", (cutoff,)).rowcount
        delete_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        checkpoint_s = time.perf_counter() - t0
        time.sleep(0.2)
    conn.close()
    return {
        "deleted": deleted,
        "delete_s": round(delete_s, 3),
        "checkpoint_s": round(checkpoint_s, 3),
        "total_s": round(delete_s + checkpoint_s, 3),
        "longest_transaction_ms": round(delete_s * 1000, 1),
        "wal_max_mib": round(wal.max_bytes / MIB, 1),
        "claimer": claimer.result,
    }


def cli_sweep(path: str, batch: int | None = None) -> dict[str, Any]:
    extra = [] if batch is None else ["--batch-size", str(batch)]
    with Claimer(path) as claimer, WalSampler(path) as wal:
        res = run_measured(cli("sweep", "--db", path, "--json", *extra))
        checkpoint_s = _checkpoint(path)
    if res["exit_code"] != 0:
        raise RuntimeError(f"idemctl sweep failed: {res['stderr_tail']}")
    summary = json.loads(res["stdout"])
    return {
        "deleted": summary.get("deleted"),
        "batches": summary.get("batches"),
        "batch_size": summary.get("batch_size"),
        "sweep_s": res["seconds"],  # the process, start to exit, as the operator waits for it
        "sweep_elapsed_s": round(summary.get("elapsed_ms", 0) / 1000, 3),  # its own timing: the batches only
        "checkpoint_s": round(checkpoint_s, 3),
        "total_s": round(res["seconds"] + checkpoint_s, 3),
        "wal_max_mib": round(wal.max_bytes / MIB, 1),
        "peak_rss_mib": res["peak_rss_mib"],
        "claimer": claimer.result,
    }


def timed_batches(ledger: Ledger, path: str, batch: int, max_batches: int) -> dict[str, Any]:
    """The CLI's statements, one `ledger.operator.sweep` batch at a time, each timed."""
    times: list[float] = []
    with WalSampler(path) as wal:
        for _ in range(max_batches):
            t0 = time.perf_counter()
            n = ledger.operator.sweep(batch=batch).keys_deleted
            times.append(time.perf_counter() - t0)
            if n == 0:
                break
    ordered = sorted(times)
    return {
        "batches": len(times),
        "batch_size": batch,
        "median_ms": round(ordered[len(ordered) // 2] * 1000, 1),
        "p99_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000, 1),
        "max_ms": round(ordered[-1] * 1000, 1),
        "over_500ms": sum(1 for t in times if t > 0.5),
        "rows_per_s": round(batch * len(times) / sum(times)),
        "wal_max_mib": round(wal.max_bytes / MIB, 1),
    }


def memory_of_reads(path: str) -> dict[str, Any]:
    floor = run_measured([sys.executable, "-c", "import idemctl.cli"])
    stats = run_measured(cli("stats", "--db", path, "--json"))
    pending = run_measured(cli("pending", "--db", path, "--limit", "0", "--json"))
    out: dict[str, Any] = {"import_floor_mib": floor["peak_rss_mib"]}
    for name, res in (("stats", stats), ("pending", pending)):
        if res["exit_code"] != 0:
            raise RuntimeError(f"idemctl {name} failed: {res['stderr_tail']}")
        out[name] = {
            "seconds": res["seconds"],
            "peak_rss_mib": res["peak_rss_mib"],
            "ratio_to_import_floor": round(res["peak_rss_mib"] / floor["peak_rss_mib"], 2),
            "output_mib": round(len(res["stdout"]) / MIB, 1),
        }
    listed = json.loads(pending["stdout"])
    out["pending"]["rows_listed"] = len(listed["rows"] if isinstance(listed, dict) else listed)
    return out


def _check_survivors(result: dict[str, Any], path: str, cutoff: int, live: int, expired: int) -> None:
    """Every live row is still there, no expired row is left, and the
    sweep says it deleted exactly the expired ones."""
    result["live_rows_after"] = count_rows(path, "updated_at >= ? AND principal <> 'acct_claimer'", (cutoff,))
    result["expired_rows_after"] = count_rows(path, "updated_at < ?", (cutoff,))
    if result["live_rows_after"] != live or result["expired_rows_after"] != 0 or result["deleted"] != expired:
        raise AssertionError(
            f"sweep of {path} lost live rows or left expired ones: live {live} -> {result['live_rows_after']}, "
            f"expired left {result['expired_rows_after']}, deleted {result['deleted']} of {expired}"
        )


def run(ctx: Context) -> dict[str, Any]:
    big = ctx.shared.get("backlog_path")
    if big is None:  # run on its own: build the backlog here
        big = ctx.path("backlog.db")
        init_ledger(big)
        add_rows(big, ctx.size(10**6, 3000), seed=1000, updated_at=now_ms() - 2 * DAY_MS - 10**7)
    live_n = ctx.size(10**4, 100)
    add_rows(big, live_n, seed=99, updated_at=now_ms())
    cutoff = now_ms() - DAY_MS
    expired = count_rows(big, "updated_at < ?", (cutoff,))
    live = count_rows(big, "updated_at >= ?", (cutoff,))
    out: dict[str, Any] = {"expired_rows": expired, "live_rows": live}
    out["per_request_batch"] = per_request_batch(ctx, big, ctx.size(5, 2), ctx.size(10, 3))
    ctx.log(f"  sweep: per-request batch {out['per_request_batch']['ratio_big_to_small']['median']}x at 10^6 vs 10^3")
    out["memory_reads"] = memory_of_reads(big)
    ctx.log(
        f"  memory: stats {out['memory_reads']['stats']['peak_rss_mib']} MiB, pending {out['memory_reads']['pending']['peak_rss_mib']} MiB"
    )
    _checkpoint(big)
    expired = count_rows(big, "updated_at < ?", (cutoff,))
    out["expired_rows"] = expired
    ours = ctx.path("sweep-cli.db")
    timed = ctx.path("sweep-timed.db")
    others = [ctx.path(f"sweep-cli-{batch}.db") for batch, _, _ in OTHER_BATCHES]
    for copy in (ours, timed, *others):
        _copy(big, copy)
    out["floor"] = unbounded_delete(big, cutoff)
    ctx.log(f"  sweep: unbounded DELETE {out['floor']['delete_s']} s + checkpoint {out['floor']['checkpoint_s']} s")
    out["cli"] = cli_sweep(ours)
    ctx.log(
        f"  sweep: idemctl sweep (batch {out['cli']['batch_size']}) {out['cli']['sweep_s']} s, "
        f"WAL max {out['cli']['wal_max_mib']} MiB, claimer p99 {out['cli']['claimer']['p99_ms']} ms"
    )
    _check_survivors(out["cli"], ours, cutoff, live, expired)
    out["ratio_total"] = round(out["cli"]["total_s"] / out["floor"]["total_s"], 3)
    out["ratio_delete_only"] = round(out["cli"]["sweep_s"] / out["floor"]["delete_s"], 3)
    out["cli_other_batches"] = []
    for (batch, _, _), path in zip(OTHER_BATCHES, others):
        run_ = cli_sweep(path, batch)
        _check_survivors(run_, path, cutoff, live, expired)
        out["cli_other_batches"].append(
            {"cli": run_, "ratio_delete_only": round(run_["sweep_s"] / out["floor"]["delete_s"], 3)}
        )
        ctx.log(
            f"  sweep: idemctl sweep --batch-size {batch} {run_['sweep_s']} s, claimer p99 {run_['claimer']['p99_ms']} ms"
        )
    # Transaction lengths, timed one batch at a time on a fresh copy: the
    # first batches of each size, the largest last (it may drain the rest).
    ledger = Ledger.open(timed)
    out["timed_batches"] = timed_batches(ledger, timed, default_cli_batch(), ctx.size(150, 2))
    for (batch, full, quick), other in zip(OTHER_BATCHES, out["cli_other_batches"]):
        other["timed"] = timed_batches(ledger, timed, batch, ctx.size(full, quick))
    ledger.close()
    for p in (big, ours, timed, *others):
        remove_db(p)
    return out
