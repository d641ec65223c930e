"""Render results (bench/results/latest.json) as tables, and as the whole
of docs/performance.md: `render` gives the tables alone (what a run prints),
`render_page` the page around them, with every figure taken from the results."""

from __future__ import annotations

import re
from typing import Any, TypeGuard


def _n(v: float | None, digits: int = 0) -> str:
    if v is None:
        return "–"
    if digits == 0:
        return f"{v:,.0f}".replace(",", " ")
    return f"{v:.{digits}f}"


def _sp(s: dict[str, Any] | None, digits: int = 2) -> str:
    """median (min–max)"""
    if not s:
        return "–"
    return f"{_n(s['median'], digits)} ({_n(s['min'], digits)}–{_n(s['max'], digits)})"


def measured_apart(res: dict[str, Any]) -> list[str]:
    """The line saying when a benchmark merged into the results was measured."""
    m = res.get("measured")
    if not m:
        return []
    load = "/".join(f"{x:.1f}" for x in m.get("loadavg", ()))
    conditions = (m.get("conditions") or "").rstrip()
    tail = f" {conditions}" + ("" if conditions.endswith((".", "!", "?")) else ".") if conditions else ""
    return [
        f"_Measured apart from the rest of this run: {m['started_utc']} at commit `{m['commit']}`, "
        f"load average {load} at the end._{tail}",
        "",
    ]


def _gap(name: str, res: dict[str, Any] | None) -> str | None:
    if res is None:
        return f"_{name}: not run._"
    if "missing" in res:
        return f"_{name}: **gap** — {res['missing']}._"
    if "error" in res:
        return f"_{name}: **failed** — {res['error']}._"
    return None


def _machine(r: dict[str, Any]) -> str:
    m = r["machine"]
    fs = m["filesystem"]
    load = (
        "/".join(f"{x:.1f}" for x in m.get("loadavg_start", ()))
        + " → "
        + "/".join(f"{x:.1f}" for x in m.get("loadavg_end", ()))
    )
    lines = [
        f"Measured {r['started_utc']} – {r['finished_utc']} ({r['elapsed_s'] / 60:.1f} min{', **quick mode: not figures**' if r['quick'] else ''}) "
        f"at commit `{m['commit']}`: {m['nproc']} × {m['cpu']}, Python {m['python']}, SQLite {m['sqlite']}, "
        f"files on {fs['type']} ({fs['device']}, mounted at {fs['mount']}, directory `{m['workdir']}`), "
        f"load average (1/5/15 min) {load}.",
    ]
    if r.get("conditions"):
        conditions = r["conditions"].rstrip()
        lines.append(f"Conditions: {conditions}" + ("" if conditions.endswith((".", "!", "?")) else "."))
    return " ".join(lines)


def _cycle(res: dict[str, Any]) -> list[str]:
    out = [
        "| (1) request cycle | ours | floor | ratio median (min–max) |",
        "|---|---|---|---|",
    ]
    for key, label in (("full", "FULL"), ("normal", "NORMAL")):
        c = res[key]
        floor = c["floor"]["ops_per_s"]["median"]
        out.append(
            f"| `handle`, synchronous={label} | {_n(c['handle']['ops_per_s']['median'])}/s | {_n(floor)} pairs/s "
            f"| {_sp(c['handle']['ratio'])} |"
        )
        out.append(
            f"| `handle` without the writer queue, {label} | {_n(c['handle_no_queue']['ops_per_s']['median'])}/s "
            f"| {_n(floor)} pairs/s | {_sp(c['handle_no_queue']['ratio'])} (queue on ÷ off: {_sp(c['queue_on_vs_off'])}) |"
        )
        out.append(
            f"| `handle` + `after_response`, {label} | {_n(c['handle_after_response']['ops_per_s']['median'])}/s "
            f"| {_n(floor)} pairs/s | {_sp(c['handle_after_response']['ratio'])} |"
        )
    p = res["paths"]
    floor = p["floor"]["ops_per_s"]["median"]
    out.append(
        f"| raw claim attempt + SELECT (what claim-first costs) | {_n(p['claim_attempt_and_select']['ops_per_s']['median'])}/s "
        f"| {_n(floor)} PK SELECTs/s | {_sp(p['claim_attempt_and_select']['ratio'])} |"
    )
    for key, label in (("replay", "replay"), ("reused_409", "409 key reused"), ("in_progress_409", "409 in progress")):
        f = p[key]
        out.append(
            f"| {label} | {_n(f['ops_per_s']['median'])}/s | {_n(floor)} PK SELECTs/s | {_sp(f['ratio'])} "
            f"(vs claim attempt + SELECT: {_sp(f['ratio_vs_claim_attempt_and_select'])}) |"
        )
    return out


def _middleware(res: dict[str, Any]) -> list[str]:
    out = [
        "| (2) middleware, in-process | ours | `handle` + `after_response` | ratio median (min–max) | vs raw floor |",
        "|---|---|---|---|---|",
    ]
    for key, label in (("full", "FULL"), ("normal", "NORMAL")):
        c = res[key]
        out.append(
            f"| `IdempotencyMiddleware`, {label} | {_n(c['middleware_ops_per_s']['median'])}/s "
            f"| {_n(c['library_ops_per_s']['median'])}/s | {_sp(c['ratio_to_library'])} | {_sp(c['ratio_to_floor'])} |"
        )
    return out


def _contention(res: dict[str, Any], pg: bool = False, server: str | None = None) -> list[str]:
    head = f"(7b) {server} contention" if server else "(7) PostgreSQL contention" if pg else "(3) contention"
    out = [
        f"| {head} | procs | req/s median (min–max over 1 s windows) | vs 1 process | p50 ms | p99 ms | max ms | > 100 ms | > 1 s | errors | requests per process |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in res["configs"]:
        label = server or ("PostgreSQL" if pg else f"{c['synchronous']}, queue {'on' if c['write_queue'] else 'off'}")
        lat = c["latency"]
        out.append(
            f"| {label} | {c['workers']} | {_sp(c['throughput'], 0)} | {c['ratio_to_single']['total']:.2f} "
            f"| {lat['p50_ms']:.1f} | {lat['p99_ms']:.1f} | {lat['max_ms']:.0f} | {lat['over_100ms']} | {lat['over_1s']} "
            f"| {c['error_count']} | {' / '.join(str(x) for x in c['per_worker'])} |"
        )
    return out


def _growth(res: dict[str, Any]) -> list[str]:
    out = [
        "| (4) growth: rows already present | claim µs, FULL | floor µs | ratio (min–max) | claim µs, NORMAL | floor µs | ratio (min–max) |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in res["sizes"]:
        f, n = s["full"], s["normal"]
        out.append(
            f"| {_n(s['rows'])} | {_n(f['claim_us']['median'], 1)} | {_n(f['floor_us']['median'], 1)} | {_sp(f['ratio'])} "
            f"| {_n(n['claim_us']['median'], 1)} | {_n(n['floor_us']['median'], 1)} | {_sp(n['ratio'])} |"
        )
    return out


def _growth_gap(gr: dict[str, Any]) -> str:
    """What a claim costs beyond the raw statement under NORMAL, where no
    fsync hides it: the same at every size, so it is not growth."""
    first, last = gr["sizes"][0]["normal"], gr["sizes"][-1]["normal"]
    if "extra_us" not in last:
        return ""
    floor_growth = last["floor_us"]["median"] - first["floor_us"]["median"]
    ours_growth = last["claim_us"]["median"] - first["claim_us"]["median"]
    queue_us = last["claim_us"]["median"] - last["claim_no_queue_us"]["median"]
    # Within 2 µs (a few percent of a claim) counts as the same growth.
    verdict = (
        "so the gap is a constant per call, not growth"
        if ours_growth <= floor_growth + 2.0
        else "so ours grew more than the statement it runs"
    )
    return (
        f" Under NORMAL a claim costs {first['extra_us']['median']:.1f} µs more than the raw one at "
        f"{_n(gr['sizes'][0]['rows'])} rows and {last['extra_us']['median']:.1f} µs more at "
        f"{_n(gr['sizes'][-1]['rows'])} ({_sp(last['ratio'])}×): from the smallest to the largest table the raw "
        f"claim grew by {floor_growth:+.1f} µs and ours by {ours_growth:+.1f} µs, {verdict}. "
        + (
            f"Of the gap at the largest size, the writer queue's lock is {queue_us:.1f} µs"
            if queue_us >= 1.0
            else "At the largest size the writer queue's lock is lost in the noise"
        )
        + f" (a claim without the queue: {last['claim_no_queue_us']['median']:.1f} µs); the rest is idemctl's "
        "Python per call (checking the "
        "principal and key, drawing the fencing token, the call through store and engine), which an fsync "
        "under FULL hides."
    )


def _claimer(c: dict[str, Any]) -> str:
    return f"{c['error_count']} errors, p99 {c['p99_ms']:.0f} ms, max {c['max_ms']:.0f} ms"


def _sweep(res: dict[str, Any]) -> list[str]:
    fl, pr = res["floor"], res["per_request_batch"]
    runs = [(res["cli"], res["timed_batches"], res["ratio_delete_only"])] + [
        (o["cli"], o["timed"], o["ratio_delete_only"]) for o in res["cli_other_batches"]
    ]

    def row(label: str, cells: list[str], floor: str) -> str:
        return f"| {label} | {' | '.join(cells)} | {floor} |"

    heads = [
        f"`--batch-size {c['batch_size']}`" + (" (the CLI's default on SQLite)" if c is res["cli"] else "")
        for c, _, _ in runs
    ]
    out = [
        f"| (5) sweep: {_n(res['expired_rows'])} expired + {_n(res['live_rows'])} live rows, `idemctl sweep` with | "
        + " | ".join(heads)
        + " | floor: one unbounded DELETE |",
        "|---" * (len(runs) + 2) + "|",
        row(
            "time to drain (process start to exit)",
            [f"{c['sweep_s']:.1f} s" for c, _, _ in runs],
            f"{fl['delete_s']:.1f} s",
        ),
        row("ratio to the floor", [f"{r:.2f}" for _, _, r in runs], "1"),
        row(
            "… with the checkpoint afterwards",
            [f"{c['total_s']:.1f} s ({c['total_s'] / fl['total_s']:.2f})" for c, _, _ in runs],
            f"{fl['total_s']:.1f} s",
        ),
        row(
            "longest transaction (batches timed one by one)",
            [
                f"{t['max_ms']:.0f} ms (p99 {t['p99_ms']:.0f}, median {t['median_ms']:.0f}; {t['batches']} batches)"
                for _, t, _ in runs
            ],
            f"{fl['longest_transaction_ms']:.0f} ms",
        ),
        row("WAL at its largest", [f"{c['wal_max_mib']:.0f} MiB" for c, _, _ in runs], f"{fl['wal_max_mib']:.0f} MiB"),
        row(
            "a claiming process meanwhile (1 request / 5 ms)",
            [_claimer(c["claimer"]) for c, _, _ in runs],
            _claimer(fl["claimer"]),
        ),
        row(
            "live rows afterwards",
            [f"{_n(c['live_rows_after'])} of {_n(res['live_rows'])}" for c, _, _ in runs],
            "–",
        ),
        "",
        "| (5) per-request sweep batch (20 rows), FULL | at 10⁶ rows | at 10³ rows | ratio median (min–max) |",
        "|---|---|---|---|",
        f"| `ledger.operator.sweep(batch=20)` | {_sp(pr['big_ms'])} ms at {_n(res['expired_rows'])} rows "
        f"| {_sp(pr['small_ms'])} ms at {_n(pr['rows_small'])} → {_n(pr['rows_small_after'])} rows "
        f"| {_sp(pr['ratio_big_to_small'])} |",
    ]
    return out


def _memory(sw: dict[str, Any] | None, mem: dict[str, Any] | None) -> list[str]:
    out = ["| (6) memory | peak RSS | floor | ratio |", "|---|---|---|---|"]
    if sw and "memory_reads" in sw:
        mr = sw["memory_reads"]
        floor = mr["import_floor_mib"]
        out.append(
            f"| `idemctl sweep` on the {_n(sw['expired_rows'])}-row backlog | {sw['cli']['peak_rss_mib']:.0f} MiB "
            f"| {floor:.0f} MiB (`import idemctl.cli`) | {sw['cli']['peak_rss_mib'] / floor:.2f} |"
        )
        out.append(
            f"| `idemctl stats --json` on {_n(sw['expired_rows'] + sw['live_rows'])} rows | {mr['stats']['peak_rss_mib']:.0f} MiB "
            f"| {floor:.0f} MiB | {mr['stats']['ratio_to_import_floor']:.2f} |"
        )
        out.append(
            f"| `idemctl pending --limit 0 --json` ({_n(mr['pending']['rows_listed'])} pending rows, {mr['pending']['output_mib']:.0f} MiB of JSON) "
            f"| {mr['pending']['peak_rss_mib']:.0f} MiB | {floor:.0f} MiB | {mr['pending']['ratio_to_import_floor']:.2f} |"
        )
    if mem and "growth_mib" in mem:
        out.append(
            f"| worker after {_n(mem['requests'])} requests (16 KiB bodies in and out) | {mem['rss_at_end_mib']:.1f} MiB "
            f"| {mem['rss_after_first_tenth_mib']:.1f} MiB after the first tenth | {mem['ratio_end_to_first_tenth']:.3f} "
            f"(+{mem['growth_mib']:.1f} MiB) |"
        )
    return out


def _get(res: Any, *path: str) -> Any:
    for name in path:
        if not isinstance(res, dict) or name not in res:
            return None
        res = res[name]
    return res


def aims(b: dict[str, Any], cores: int = 2) -> str:
    """The request path's aims, each with what this run measured (`cores`:
    the machine's, above which a load average means other work)."""
    ins = b.get("instructions")
    if not _usable(ins):
        return ""
    a = ins["aims"]
    rows: list[tuple[str, str, float | None, float, bool]] = [
        # (aim, where, measured, bound, measured must be at most the bound)
        ("first call ÷ raw pair, in instructions", "(0)", a["first_ratio"], a["first_aim"], True),
        ("replay ÷ raw claim attempt + SELECT, in instructions", "(0)", a["replay_ratio"], a["replay_aim"], True),
    ]
    seconds = [
        ("`handle` ÷ raw pair, FULL, in seconds", "(1)", ("cycle", "full", "handle", "ratio", "median"), 0.95, False),
        (
            "`handle` ÷ raw pair, NORMAL, in seconds",
            "(1)",
            ("cycle", "normal", "handle", "ratio", "median"),
            0.85,
            False,
        ),
        (
            "replay ÷ raw claim attempt + SELECT, in seconds",
            "(1)",
            ("cycle", "paths", "replay", "ratio_vs_claim_attempt_and_select", "median"),
            0.6,
            False,
        ),
        (
            "ASGI adapter's own µs per first call, NORMAL",
            "(8)",
            ("asgi", "normal", "first", "overhead_us", "median"),
            100,
            True,
        ),
        (
            "FastAPI inside the middleware ÷ both floors",
            "(8)",
            ("asgi", "normal", "fastapi", "middleware_first", "ratio_to_both", "median"),
            0.9,
            False,
        ),
        (
            "PostgreSQL `handle` ÷ raw psycopg pair",
            "(7)",
            ("postgres", "cycle", "handle", "ratio", "median"),
            0.9,
            False,
        ),
    ]
    pg_cycle = (b.get("postgres") or {}).get("cycle") or {}
    if "claim_or_read" in pg_cycle:
        seconds.append(
            (
                "PostgreSQL replay ÷ raw claim that reads its row",
                "(7)",
                ("postgres", "cycle", "replay", "ratio", "median"),
                0.8,
                False,
            )
        )
    else:
        seconds.append(
            ("PostgreSQL replay ÷ raw PK SELECT", "(7)", ("postgres", "cycle", "replay", "ratio", "median"), 0.6, False)
        )
    for label, where, path, bound, at_most in seconds:
        rows.append((label, where, _get(b, *path), bound, at_most))
    out = [
        "## The request path's aims",
        "",
        "| aim | section | measured | bound | holds |",
        "|---|---|---|---|---|",
    ]
    for label, where, got, bound, at_most in rows:
        if got is None:
            verdict, shown = "not measured", "–"
        else:
            ok = got <= bound if at_most else got >= bound
            verdict, shown = ("yes" if ok else "**no**"), (f"{got:.0f}" if bound >= 100 else f"{got:.2f}")
        out.append(f"| {label} | {where} | {shown} | {'≤' if at_most else '≥'} {bound:g} | {verdict} |")
    apart = [
        b[name]["measured"] for name in ("cycle", "asgi", "postgres") if _usable(b.get(name)) and "measured" in b[name]
    ]
    loads = [x for m in apart for x in m.get("loadavg", ())]
    if loads and max(loads) > cores:
        out += [
            "",
            f"Some of the seconds were measured apart from the whole run below, while other work kept the machine busy "
            f"(load average {min(loads):.0f}–{max(loads):.0f} at the end of each): their ratios are lower and "
            "noisier than on an idle machine. The instruction counts are not affected by load.",
        ]
    elif apart:
        out += ["", "Some of the seconds were measured apart from the whole run below (each table says when)."]
    out += ["", LEFT_OVER, ""]
    return "\n".join(out)


LEFT_OVER = """\
What is left, and why. The SQLite library does the same work under the
ledger as under the raw statements (callgrind's inclusive cost of
`sqlite3_step`, below (0)): everything above the raw figures is Python, in
three parts. First the storage layer's plumbing around each statement,
counted alone beside the raw statement: about 20 000 instructions on a
claim and 19 000 on a completion, 17 000 around a replay's claim attempt
and 19 000 around its lookup, 10 000 of them decoding the row (one check
of every column's type in one expression, and the ten-field `StoredRow`;
a row another program wrote still gets every check, with its message).
What is in it: the writer queue's two `flock` calls (about 3 000 by
themselves), the fork gate, the thread's connection and its process
check, the statement value and its parameters, the schema guard, the
decoding; the fencing token (`new_token`, 63 bits from `os.urandom`)
costs 3 500 more. Each of these is a thing the contract or safety needs
(writers of several processes take turns; a fork never copies SQLite
mid-statement; a foreign row is checked), done once, in a few calls each.
Then the sha256 of the fingerprint, about 36 000 a request (1 KiB body), a
fifth of the raw pair by itself: the raw floor never hashes, and the
contract cannot do without it. The rest is the ledger's own Python, at
CPython's price of about 500 instructions a function call: the principal,
key and request-line checks (about 10 000), picking the fingerprint headers
and writing the hashed head (16 000), picking, checking and writing the
replayable headers and the body's column (`to_store`, 30 000), the decision
loop and the values it hands out (reservation, ticket, answer; with the
token and the wrappers of begin and finish, the phase table's rest of about
25 000), and on a replay the answer rebuilt from its row (about 10 000 once
its headers column has been seen). Each is a check or a value the contract
needs once; the savings kept (listed in (0)) removed what did nothing for
it. A first call's bound of 1.6× leaves about 100 000 instructions above
the raw pair, of which the storage plumbing, the token and the sha256
already take about 80 000, leaving 20 000 for the ledger's own checks and
values (about 113 000 now); a replay's bound of 2.0× leaves about 93 000,
of which the storage plumbing and the sha256 take about 72 000, leaving
21 000 for a part that is about 73 000: neither bound can be reached in
Python without dropping checks.

In seconds the same Python weighs more than its share of instructions:
the raw statements run about 3.2 instructions a nanosecond here (SQLite's
own C), the ledger's Python about 2.2 (the interpreter's dispatch), so a
replay at 2.6× the instructions of its raw pair takes about 3.5× its time
(0.28×). The seconds bounds ask for less than the instruction bounds: 0.6×
for a replay leaves about 19 µs above the raw 29 µs, some 45 000
instructions at Python's rate, and the sha256 alone is 36 000; 0.85× under
NORMAL leaves about 37 µs above the raw pair's 210 µs, some 90 000
instructions, where the ledger adds 193 000. Under FULL the fsyncs hide
more of it (0.83×). On PostgreSQL a replay is one statement, the claim
that reads the row in its way, and holds its bound; a first call pays,
beyond the ledger's own Python (about 80 µs, as on SQLite), a checkout
from psycopg's pool for each of its two statements (17 to 32 µs each,
measured beside a plain connection), which is what lets threads share
the ledger and replaces a pool a failover broke; the raw floor uses one
connection. The ASGI adapter hands each first call to a worker thread
twice (the claim, then the completion: the app runs between them, so on
SQLite there is no one hand-off for both) where the floor crosses once;
one extra `run_in_executor` round trip of a no-op takes about 100 µs here
(the (8) note), the whole bound, and costs about 170 000 instructions of
executor, futures and loop wake-up. With the shield that lets a claim land
for a cancelled caller and the task that keeps a mutation running for a
client that left, that is most of the adapter's own count, and the same
hand-offs are what FastAPI inside the middleware pays beyond both floors.
On PostgreSQL the asynchronous store hands nothing to a thread (the
in-flight table (8)/(10)); on SQLite, running the statements on the loop
instead is what the event-loop lag table (8) shows not to do."""


# What each saving on the request path bought, counted as (0) counts (30
# requests a row, ledger rows only) at the commit before and after it.
SAVINGS = """\
Savings kept, each counted before and after (instructions per request, `Ledger.handle`):

| change | first call | replay |
|---|---|---|
| before (`8eabe71`) | 463 388 | 313 796 |
| an `Event` built only when a listener or the INFO log hears it (events phase 20 816 → about 5 000, the check alone, for routine outcomes); the first answer built from the stored columns' own checked pairs and bytes, not by decoding the JSON and checking every header again (store phase −33 000); control characters in the request line found by one regex, not a Python step per character (fingerprint phase −12 500) | 399 370 | 283 333 |
| the JSON encoder built once; a free writer queue taken without reading the clock twice; fingerprint and replayable headers picked in one pass with no list of every pair; the headers column written with JSON's own string encoder instead of an encoder object per answer; a header pair once found sendable not matched against three patterns again (a bounded memo) | 379 125 | 274 145 |
| the values built per request (answer, ticket, reservation, row, completion, stored columns, event) filled in one step instead of one `object.__setattr__` call per field | 352 267 | 260 158 |
| counted again at `3eaf498`, after the decision loop learnt to yield its statements (one loop for threads and event loops) and the ledger was split into parts | 428 735 | 320 974 |
| the drivers call the store straight from the operation the steps yield, with no step value, outcome pair or bound method per statement; the loop's values filled in one step | 406 689 | 305 672 |
| the fingerprint hashed in one pass from the policy's lower-case names and the body already checked as bytes (fingerprint phase 75 644 → 63 052); a clock that is not the database's read without a generator; finish builds its answer from the one it already holds, with no `Completion` in between | 385 379 | 291 942 |
| the replayable headers picked, checked and written as the headers column in one function, the sendable memo asked before any call (`to_store` alone 40 200 → 30 800) | 376 217 | 292 758 |
| `handle` drives the steps of begin and finish itself, not through wrappers that repacked every argument; `Outcome` members hashed by identity (Enum's own `__hash__` is a Python call, made by every check of whether an event is heard) | 370 120 | 289 211 |
| a replay reuses the checked pairs of a headers column it replayed before (a bounded memo of columns whose every pair may be sent; a column with one that may not is logged on every replay, as before) | 370 493 | 271 407 |
| the statement message (`decision.Call`) slotted and not frozen; the control-character pattern asked directly | 365 324 | 266 032 |
| the passes over the request's and the answer's headers ask whether they are a dict before asking the `Mapping` ABC (its `isinstance` is a Python call): 362 115 and 264 355; then one helper picks the headers for both passes and for `header_values`, instead of three copies of its loop (a call more, kept for clarity) | 363 178 | 265 225 |
| `handle` goes through `begin` and `finish` again, undoing the first half of the fifth row above: driving their steps itself skipped them as the methods a subclass or a patch replaces | 367 703 | 267 335 |
| counted again at `46fb4c7`, after the modules were reshaped into packages | 380 488 | 272 956 |
| the storage layer's own plumbing, each part counted alone: a row decoded by one check of every column's type, with the detailed checks only when it fails (26 200 → 10 700 a row); the fork gate passed without a lock, a statement in flight being one item of a list (6 300 → 2 700 a statement); a `Statement` slotted and not frozen (5 100 → 2 700); one write run without the list of a writer-queue turn (−6 000 a write); the fencing token read from `os.urandom` directly (4 400 → 3 500) | 354 851 | 234 380 |
| the decision loop claims through `Store.claim_or_read` (on PostgreSQL one statement that also reads the row in the way, a replay's one round trip; on SQLite the claim and then the lookup, called by the store) | 355 940 | 232 176 |
| two mends after a review, chosen for clarity: a lone write and a sweep's turn share one skeleton in the SQLite engine (about 2 300 a write more than the copy they replace), and the lookup after a lost claim is the decision loop's again, not repeated inside the store | 359 724 | 238 184 |
| counted again at `7db0f07` (keys found by `key_id` everywhere, and the work merged since) | 386 997 | 242 846 |
| one vocabulary between the loop and the stores: the loop yields the Store's own `Statement`s and a driver runs each with `store.run(op)`, with no `decision.Call` built, no method looked up by name and no wrapper method per statement (409 key reused 253 227 → 244 352, 409 in progress 336 816 → 323 381) | 375 557 | 234 032 |

The adapters, counted the same way: the ASGI middleware hands each step to a
worker thread as the executor's own future instead of a coroutine around it,
which cost a task per hand-off (first call 1 192 009 → 1 146 379, replay
734 430 → 684 925); WSGI builds each status line once (`HTTPStatus(code)` is
a Python call; Flask and Django ask for it too) and copies the environ once
for the app, not twice (first call 485 097 → 477 529, replay 341 792 →
335 769); a resting `after_response` builds its `SweepResult` in one step
(16 500 → 12 300). Since the request sequence yields from the ledger's own
steps, `decision.run` holds the one synchronous store loop itself (the
worker-thread path runs each operation through a small helper instead of a
copy of it): about 1 400 fewer a `handle`.

Tried and not kept: Python's built-in `_sha256` instead of OpenSSL's (54 000
instructions for 1 KiB against 35 000); copying a prepared sha256 object
instead of making one (no difference in time); filling the values by one
dictionary store per field instead of one `update` (no gain over a whole
request: 371 671 → 372 230); on an event loop over SQLite, resuming the
request sequence in the worker thread once the body is in and once the app
ran, so that the ledger's own Python before a statement (the checks, the
fingerprint, the answer's columns) runs there as well as the statements
(ASGI first call 1 010 909 → 1 040 335: the loop and the worker then
contend for the interpreter lock; it runs on the loop, as on PostgreSQL).
Not done: one pre-built statement per step, since the store's cache already
hands back the spelled text for a dictionary lookup."""


# Each door's own instructions per request, at most: a first call's bound,
# and a replay's (half of what the door cost before its request sequence
# was written once). FastAPI is counted twice: its `idempotent_route`, and
# a FastAPI app under the ASGI middleware.
DOOR_BOUNDS = {
    "wsgi": (35_000, 25_024),
    "django": (100_000, 69_919),
    "flask": (100_000, 42_586),
    "asgi": (200_000, 155_868),
    "fastapi": (500_000, 859_426),
    "fastapi_middleware": (500_000, 859_426),
}

# Each door's whole request ("ours" in (0)), first call and replay, counted
# by (0) at the commit before a change to the request kit and after it.
DOOR_HISTORY = """\
Each door's whole request (the ours column of (0)), first call / replay, counted before and after a change to the request kit (`handle` for reference):

| measured | commit | change | handle | wsgi | django | flask | asgi | fastapi | fastapi_middleware |
|---|---|---|---|---|---|---|---|---|---|
| 2026-12-07 | `b4b2c7a` | before: the request sequence and the ledger's steps two generators joined by the gate's begin/finish/abandon (and their event-loop twins) | 378 062 / 236 245 | 484 196 / 304 672 | 960 771 / 764 073 | 898 157 / 653 016 | 1 034 531 / 592 765 | 2 045 283 / 1 641 998 | 1 983 489 / 594 788 |
| 2026-12-07 | `596850e` | after: the request sequence yields from the ledger's own steps, one driver per kind runs the store's work; the gate's twins, the second async driver and three need types gone | 376 428 / 234 861 | 463 070 / 294 410 | 939 011 / 753 137 | 879 984 / 645 657 | 1 010 909 / 579 084 | 2 006 599 / 1 627 064 | 1 951 859 / 581 181 |
| 2026-12-07 | `07b0a43` | before: a shield (and its outer future) around the app's task, every psycopg write and every hand-off to a worker thread; a fencing token from `os.urandom` | 381 609 / 236 327 | 467 052 / 295 596 | 945 080 / 755 902 | 883 275 / 644 990 | 998 702 / 569 363 | 2 031 765 / 1 641 730 | 1 992 375 / 571 680 |
| 2026-12-07 | `5e3c03e` | after: that work awaited through `landing.Outlasting` (the shield's behaviour, no outer future, one turn of the loop fewer); one coroutine fewer a statement in the event-loop driver; a fencing token from the random module's generator | 379 526 / 235 510 | 466 252 / 294 958 | 941 216 / 753 172 | 882 712 / 644 101 | 927 298 / 562 087 | 2 004 966 / 1 611 247 | 1 905 214 / 540 259 |
"""


# Why a door misses its bound, from callgrind profiles of the door alone.
DOOR_MISSES = """\
Where a door is over its bound, its profile says why:

- **ASGI and FastAPI on SQLite** (first calls): the ledger's statements run in a worker thread, so that a
  claim waiting on SQLite's writer lock (up to the busy timeout) never blocks the event loop. Each hand-off
  to a worker thread and back costs about 110 000 instructions (a thread wake-up, the loop's self-pipe, a
  future resolved across threads; `run_in_executor`'s chained futures cost 167 000), and a first call makes
  two: the claim, then the completion. The app's own task, shielded so that a client that leaves
  mid-mutation still finds its answer stored, is another 91 000. That is about 310 000 before a line of the
  door's own Python (about 150 000, spread over some fifty small functions: parsing the scope, the sequence,
  the capture, the headers). Reaching 200 000 would mean running SQLite statements on the loop itself,
  where one waiting for the writer lock would stall every request the process serves: refused. On
  PostgreSQL there is no hand-off (the statements are awaited on the loop), and the ledger's asynchronous
  path costs about what the synchronous one does.
- **The synchronous doors** (WSGI, Flask, Django): what is left is the one request sequence itself, the
  price of writing the contract's order once for every door: a generator resumed four to six times a
  request (about 15 000 instructions inclusive in a WSGI replay's profile), six small objects a request
  (the parsed request, the door, the needs, the delivery: about 9 000 to build and 6 000 to free), one door
  method per need, and nine `environ.get` to parse the request. Asking for the principal and the body in
  one step would save a resume but break the contract's order (a 401 comes before any body refusal).
  Django's own count is mostly Django: two `HttpResponse` builds per protected request (the answer, and the
  stand-in `process_view` returns so that inner middleware cannot alter it), each converting every header's
  charset twice. Flask's first call pays Werkzeug's `get_wsgi_headers` and `iter_encoded` on the view's
  response, which the capture needs in order to store what a server would have sent. Flask's replay row is
  flattered by the subtraction: the bare app it subtracts builds a dearer response than a replayed answer.
"""


def _door_bounds(res: dict[str, Any]) -> list[str]:
    """Each door's own instructions against its bound."""
    own = {row["name"]: row.get("adapter_own") for row in res["rows"]}
    out = [
        "",
        "Each door's own instructions per request (the adapter's own column above) against its bound:",
        "",
        "| door | first call | bound | holds | replay | bound | holds |",
        "|---|---|---|---|---|---|---|",
    ]

    def verdict(got: float | None, bound: float) -> str:
        return "not measured" if got is None else ("yes" if got <= bound else "**no**")

    for door, (first_bound, replay_bound) in DOOR_BOUNDS.items():
        first, replay = own.get(f"{door}_first"), own.get(f"{door}_replay")
        out.append(
            f"| {door} | {_n(first)} | ≤ {_n(first_bound)} | {verdict(first, first_bound)} "
            f"| {_n(replay)} | ≤ {_n(replay_bound)} | {verdict(replay, replay_bound)} |"
        )
    return [*out, "", DOOR_HISTORY.rstrip(), "", DOOR_MISSES.rstrip()]


def _instructions(res: dict[str, Any]) -> list[str]:
    aims = res["aims"]
    out = [
        f"Counted by valgrind's callgrind over {res['requests_per_segment']} requests per row, after "
        f"{res['warm_up']} warm-up requests (SQLite, `synchronous=OFF`, 1 KiB bodies in and out, Python "
        f"{res['python']}, commit `{res['commit']}`). Instruction counts are the same on a busy machine as on an "
        "idle one: they are the headline, and a change that adds work to the request path shows here as a number.",
        "",
        "| (0) instructions per request | ours | floor | ours ÷ floor | the app alone | the adapter's own |",
        "|---|---|---|---|---|---|",
    ]
    floors = {
        "raw_first": f"{_n(res['raw_first'])} (raw pair)",
        "raw_replay": f"{_n(res['raw_replay'])} (claim attempt + SELECT)",
    }
    for row in res["rows"]:
        if row["name"].startswith("raw_"):
            continue
        out.append(
            f"| {row['what']} | {_n(row['instructions'])} | {floors[row['floor']]} | {row['ratio']:.2f} "
            f"| {_n(row.get('app_alone'))} | {_n(row.get('adapter_own'))} |"
        )
    out += _door_bounds(res)
    out += [
        "",
        "Where a first call's instructions go (each phase counted alone with the arguments a request passes it; "
        "the rest is what is left of the whole):",
        "",
        "| (0) phase of a first call | instructions | raw statement |",
        "|---|---|---|",
    ]
    for ph in res["phases"]:
        out.append(f"| {ph['phase']} | {_n(ph['instructions'])} | {_n(ph.get('raw'))} |")
    lib = res.get("sqlite_library") or {}
    if lib:
        out += [
            "",
            "Of these, SQLite's own library (callgrind's inclusive cost of `sqlite3_step` and "
            f"`sqlite3_prepare_v2`): {_n(lib.get('handle_first'))} a first call ({_n(lib.get('raw_first'))} raw), "
            f"{_n(lib.get('handle_replay'))} a replay ({_n(lib.get('raw_replay'))} raw).",
        ]
    out += ["", SAVINGS]

    def held(got: float | None, aim: float) -> str:
        return "holds" if got is not None and got <= aim else "**missed**"

    out += [
        "",
        f"Aims: first calls ≤ {aims['first_aim']}× raw: {aims['first_ratio']:.2f}, {held(aims['first_ratio'], aims['first_aim'])}; "
        f"replays ≤ {aims['replay_aim']}×: {aims['replay_ratio']:.2f}, {held(aims['replay_ratio'], aims['replay_aim'])}.",
    ]
    return out


def _postgres(res: dict[str, Any]) -> list[str]:
    s = res["server"]
    c = res["cycle"]
    out = [
        f"PostgreSQL {s['server_version']} on the same machine (synchronous_commit={s['synchronous_commit']}, "
        f"fsync={s['fsync']}, shared_buffers={s['shared_buffers']}).",
        "",
        "| (7) PostgreSQL | ours | floor (raw psycopg, same statements) | ratio median (min–max) |",
        "|---|---|---|---|",
        f"| `handle` | {_n(c['handle']['ops_per_s']['median'])}/s | {_n(c['floor']['ops_per_s']['median'])} pairs/s "
        f"| {_sp(c['handle']['ratio'])} |",
    ]
    if "handle_after" in c:
        out.append(
            f"| `handle` + `after_response` | {_n(c['handle_after']['ops_per_s']['median'])}/s "
            f"| {_n(c['floor']['ops_per_s']['median'])} pairs/s | {_sp(c['handle_after']['ratio'])} |"
        )
    if "claim_or_read" in c:  # the replay's floor: its one statement, raw
        out.append(
            f"| replay | {_n(c['replay']['ops_per_s']['median'])}/s | {_n(c['claim_or_read']['ops_per_s']['median'])} "
            f"claims that read the row/s | {_sp(c['replay']['ratio'])} |"
        )
        out.append(
            f"| replay | {_n(c['replay']['ops_per_s']['median'])}/s | {_n(c['pk_select']['ops_per_s']['median'])} PK "
            f"SELECTs/s | {_sp(c['replay']['ratio_vs_pk_select'])} |"
        )
    else:
        out.append(
            f"| replay | {_n(c['replay']['ops_per_s']['median'])}/s | {_n(c['pk_select']['ops_per_s']['median'])} PK "
            f"SELECTs/s | {_sp(c['replay']['ratio'])} |"
        )
    sw = res["sweep"]
    out.append(
        f"| `idemctl sweep` of {_n(sw['expired_rows'])} rows (batch {sw['cli']['batch_size']}) | {sw['cli']['sweep_s']:.1f} s "
        f"| {sw['floor']['delete_s']:.1f} s (one DELETE) | {sw['ratio_total']:.2f} |"
    )
    out.append(
        f"| a claiming process meanwhile | {_claimer(sw['cli']['claimer'])} | {_claimer(sw['floor']['claimer'])} | – |"
    )
    if (bp := sw.get("batch_profile")) and bp.get("rows") and sw["floor"].get("deleted"):
        ours_us = bp["execution_ms"] * 1000 / bp["rows"]
        floor_us = sw["floor"]["delete_s"] * 1e6 / sw["floor"]["deleted"]
        out.append(
            f"| … one batch of {_n(bp['rows'])} inside the server (EXPLAIN ANALYZE) | {bp['execution_ms']:.1f} ms, "
            f"{ours_us:.2f} µs a row | {floor_us:.2f} µs a row (the DELETE, client-timed) | {ours_us / floor_us:.2f} |"
        )
    out.append("")
    out.extend(_contention(res["contention"], pg=True))
    return out


def _mysql(res: dict[str, Any]) -> list[str]:
    s = res["server"]
    c = res["cycle"]
    sw = res["sweep"]
    when = f"measured {res['measured_utc']}" + (f", {res['conditions']}" if res.get("conditions") else "")
    out = [
        f"MariaDB {s['version'].split('-')[0]} on the same machine ({when}; "
        f"innodb_flush_log_at_trx_commit={s['innodb_flush_log_at_trx_commit']}, log_bin={s['log_bin']}, "
        f"innodb_buffer_pool_size={_n(int(s['innodb_buffer_pool_size']) // 2**20)} MiB).",
        "",
        "| (7b) MariaDB | ours | floor (raw PyMySQL, same statements) | ratio median (min–max) |",
        "|---|---|---|---|",
        f"| `handle` | {_n(c['handle']['ops_per_s']['median'])}/s | {_n(c['floor']['ops_per_s']['median'])} pairs/s "
        f"| {_sp(c['handle']['ratio'])} |",
        f"| `handle` + `after_response` | {_n(c['handle_after']['ops_per_s']['median'])}/s "
        f"| {_n(c['floor']['ops_per_s']['median'])} pairs/s | {_sp(c['handle_after']['ratio'])} |",
        f"| replay | {_n(c['replay']['ops_per_s']['median'])}/s | {_n(c['pk_select']['ops_per_s']['median'])} PK SELECTs/s "
        f"| {_sp(c['replay']['ratio'])} |",
        f"| `idemctl sweep` of {_n(sw['expired_rows'])} rows (batch {sw['cli']['batch_size']}) | {sw['cli']['sweep_s']:.1f} s "
        f"| {sw['floor']['delete_s']:.1f} s (one DELETE) | {sw['ratio_total']:.2f} |",
        f"| a claiming process meanwhile | {_claimer(sw['cli']['claimer'])} | {_claimer(sw['floor']['claimer'])} | – |",
        "",
        "The single DELETE reads the table in primary-key order. A bounded batch takes the oldest rows through "
        "the updated_at index (a range scan of one batch's entries, as EXPLAIN shows), and their primary-key "
        "entries (random keys) are scattered over a table larger than the buffer pool, so each deleted row is "
        "likely a random page read: that is where the sweep's extra time goes. Under READ COMMITTED the single "
        "DELETE locks only expired rows, so it did not hold up the claiming process either: on MariaDB the "
        "bounded drain buys short statements (a small undo log, no long replication lag), not claim latency.",
        "",
    ]
    out.extend(_contention(res["contention"], server="MariaDB"))
    return out


def _signed(s: dict[str, Any]) -> str:
    """median (min to max) of a figure that can fall below zero, with true minus signs."""

    def one(v: float) -> str:
        return f"{v:+.0f}".replace("-", "−")

    return f"{one(s['median'])} ({one(s['min'])} to {one(s['max'])})"


def _asgi(res: dict[str, Any]) -> list[str]:
    out = [
        "| (8) ASGI middleware, in-process | ours | ledger floor | ÷ ledger floor | app floor | ÷ app floor "
        "| ÷ both floors | the adapter's own µs per request |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def row(label: str, fig: dict[str, Any], ledger: float, ledger_label: str, app: float, app_label: str) -> str:
        return (
            f"| {label} | {_n(fig['ops_per_s']['median'])}/s | {_n(ledger)}/s {ledger_label} | {_sp(fig['ratio_to_ledger'])} "
            f"| {_n(app)}/s {app_label} | {_sp(fig['ratio_to_bare'], 4)} | {_sp(fig['ratio_to_both'])} "
            f"| {_signed(fig['overhead_us'])} |"
        )

    in_thread = "(`handle` in a thread)"
    for key, label in (("full", "FULL"), ("normal", "NORMAL")):
        c = res[key]
        bare = c["bare_ops_per_s"]["median"]
        out.append(
            row(
                f"`IdempotencyMiddleware`, first calls, {label}",
                c["first"],
                c["ledger_first_ops_per_s"]["median"],
                in_thread,
                bare,
                "(bare app)",
            )
        )
        out.append(
            row(
                f"… replays, {label}",
                c["replay"],
                c["ledger_replay_ops_per_s"]["median"],
                in_thread,
                bare,
                "(bare app)",
            )
        )
    normal = res["normal"]
    if "on_loop" in normal:
        ol = normal["on_loop"]
        out.append(
            row(
                "… its ledger calls made on the loop, first calls, NORMAL",
                ol["first"],
                ol["ledger_direct_ops_per_s"]["median"],
                "(`handle` called directly)",
                normal["bare_ops_per_s"]["median"],
                "(bare app)",
            )
        )
    fa = normal.get("fastapi")
    if fa:
        plain = fa["plain_ops_per_s"]["median"]
        for key, label in (
            ("middleware_first", "FastAPI app inside `IdempotencyMiddleware`, first calls, NORMAL"),
            ("route_first", "FastAPI `idempotent_route`, first calls, NORMAL"),
            ("middleware_replay", "FastAPI app inside `IdempotencyMiddleware`, replays, NORMAL"),
            ("route_replay", "FastAPI `idempotent_route`, replays, NORMAL"),
        ):
            ledger = normal["ledger_first_ops_per_s" if key.endswith("first") else "ledger_replay_ops_per_s"]["median"]
            out.append(row(label, fa[key], ledger, in_thread, plain, "(plain FastAPI)"))
    hops = ", ".join(
        f"{c['executor_hop_us']['median']:.0f} µs ({c['synchronous']} run)" for c in (res["full"], res["normal"])
    )
    out += ["", f"One `run_in_executor` round trip of a no-op, the unit of a hand-off to the ledger's thread: {hops}."]
    if "hand_offs_per_request" in res["normal"]:
        h = res["normal"]["hand_offs_per_request"]
        out[-1] += f" Hand-offs per request: {h['first']} per first call, {h['replay']} per replay; the floor 1."
    if fa:
        versions = ", ".join(f"{name} {v}" for name, v in fa["versions"].items())
        out[-1] += f" FastAPI rows: {versions}, driven by the same in-process caller (no server)."
    lag = res["lag"]
    first = next(iter(lag.values()))
    out += [
        "",
        f"| (8) event-loop lag: a {first['tick_ms']:g} ms ticker on the loop | lag p50 ms | p99 ms | max ms "
        "| p99 ÷ no requests (per round) | requests/s | request p50 / p99 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    labels = {
        "idle": "no requests (the floor)",
        "threaded": f"{first['concurrency']} concurrent first calls, ledger in the default executor",
        "blocking": f"{first['concurrency']} concurrent first calls, ledger called on the loop (naive)",
    }
    for lv in lag.values():
        for condition, label in labels.items():
            f = lv[condition]
            lg = f["lag"]
            if condition == "idle":
                extra = "1 | – | –"
            else:
                rq = f["request_ms"]
                extra = f"{_sp(f['lag_p99_ratio_to_idle'], 1)} | {_sp(f['requests_per_s'], 0)} | {rq['p50_ms']:.0f} / {rq['p99_ms']:.0f}"
            out.append(
                f"| {lv['synchronous']}, {label} | {lg['p50_ms']:.2f} | {lg['p99_ms']:.2f} | {lg['max_ms']:.1f} | {extra} |"
            )
    return out


def _group_commit(res: dict[str, Any]) -> list[str]:
    out = [
        f"| (9) group commit, {res['synchronous']}: pairs/s ÷ floor | threads | without | with | with ÷ without "
        "| statements per commit | p99 ms without / with | p99 with ÷ without |",
        "|---|---|---|---|---|---|---|---|",
    ]
    labels = {
        "engine": "the floor's statements through the engine",
        "ledger": "`Ledger.claim` + `Ledger.complete`",
    }
    by_key = {(c["level"], c["threads"], c["group_commit"]): c for c in res["configs"]}
    for level, label in labels.items():
        threads = sorted({c["threads"] for c in res["configs"] if c["level"] == level})
        for n, t in enumerate(threads):
            off, on = by_key.get((level, t, False)), by_key.get((level, t, True))
            if off is None or on is None:
                continue
            out.append(
                f"| {label if n == 0 else '…'} | {t} | {_sp(off['ratio_to_floor'])} | {_sp(on['ratio_to_floor'])} "
                f"| {_sp(on['ratio_to_off'])} | {on['statements_per_commit']:.1f} "
                f"| {off['latency']['p99_ms']:.1f} / {on['latency']['p99_ms']:.1f} | {_sp(on['p99_ratio_to_off'])} |"
            )
    fl = res["floor_pairs_per_s"]
    run = res.get("run")  # a section measured in a run of its own, merged into the results
    measured = (
        f"Measured in a run of its own, {run['started_utc']} – {run['finished_utc']}, at commit `{run['commit']}` "
        f"on the same machine and file system, load average {'/'.join(f'{x:.1f}' for x in run['loadavg_start'])} "
        f"→ {'/'.join(f'{x:.1f}' for x in run['loadavg_end'])}. "
        if run
        else ""
    )
    out += [
        "",
        f"{measured}Floor: the raw claim + completion on one thread and one connection, {_sp(fl, 0)} pairs/s over "
        f"{res['rounds']} rounds of {res['seconds_per_config']:g} s per configuration; each figure is divided by "
        "the floor measured next to it. Latency is one pair's (both statements), over all rounds.",
    ]
    ceilings = res.get("ledger_ceiling_off", [])
    if ceilings:
        each = " and ".join(
            f"{_sp(c['ratio_to_floor'])}× the floor on {c['threads']} thread{'s' if c['threads'] > 1 else ''}"
            for c in ceilings
        )
        out[-1] += (
            f" With `synchronous=OFF` (no fsync at all) and no group commit, `Ledger.claim` + `Ledger.complete` "
            f"run at {each}: what idemctl's Python allows on this machine."
        )
    return out


PEERS_NON_DURABLE = "non-durable reference (Redis without persistence)"
_PEER_NAMES = {"idemctl": "idemctl", "idemkit": "idemkit", "powertools": "Powertools"}


def _store_label(res: dict[str, Any], floor: str) -> str:
    sv = res["servers"]
    if floor == "postgres":
        return f"PostgreSQL {sv['postgres']['server_version'].split()[0]}"
    redis = sv.get("redis", {})
    persistence = "with persistence" if redis.get("persistence") else "without persistence"
    return f"Redis {redis.get('version', '?')} {persistence}"


def _peers(res: dict[str, Any]) -> list[str]:
    """(10): the peers' throughput against the floors of the same rounds, and
    the correctness facts the figures rest on."""
    v = res["versions"]
    t = res["throughput"]
    pg = res["servers"]["postgres"]
    out = [
        "| (10) peers, in-process, same callers | store | first calls/s | ÷ floor | p99 ms | replays/s | ÷ floor | p99 ms |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def fig(f: dict[str, Any], floor: bool = False) -> str:
        ratio = "1" if floor else _sp(f["ratio"])
        return f"{_n(f['ops_per_s']['median'])} | {ratio} | {f['latency']['p99_ms']:.1f}"

    floor_labels = {
        "postgres": "floor: raw psycopg claim + fenced completion; a PK SELECT for replays",
        "redis": "floor: raw Redis SET NX + SET of the same sizes; a GET for replays",
    }
    for floor in ("postgres", "redis"):
        if floor not in t["floors"]:
            continue
        fl = t["floors"][floor]
        out.append(
            f"| {floor_labels[floor]} | {_store_label(res, floor)} | {fig(fl['first'], True)} | {fig(fl['replay'], True)} |"
        )
        for row in t["rows"]:
            if row["floor"] != floor:
                continue
            label = row["label"]
            if not row["durable"]:
                label += f" — **{PEERS_NON_DURABLE}**"
            out.append(f"| {label} | {_store_label(res, floor)} | {fig(row['first'])} | {fig(row['replay'])} |")
    versions = ", ".join(f"{name} {ver}" for name, ver in v.items() if ver)
    rq = t["requests_per_round"]
    out += [
        "",
        f"Versions: {versions}. PostgreSQL synchronous_commit={pg['synchronous_commit']}, fsync={pg['fsync']}. "
        f"{t['rounds']} rounds of {rq['first']} first calls and {rq['replay']} replays (of {rq['replay_keys']} keys) "
        "per variant, every variant once per round in rotating order; each ratio is taken within its round. "
        "Each system runs with its defaults apart from the principal (a scope per account) and, for Powertools, "
        "the key's JMESPath.",
    ]
    if res.get("gaps"):
        out[-1] += " Not measured: " + "; ".join(f"{k}: {why}" for k, why in res["gaps"].items()) + "."
    facts = res.get("facts", {})
    if facts:
        out += [
            "",
            "| (10) correctness facts | race: runs of one key sent by real threads at once (what the others got) "
            "| crash (SIGKILL inside the handler): a retry with the key runs after | that wait is | "
            "late writer: stored answer once the stalled owner A finishes after B took over (A's client got) |",
            "|---|---|---|---|---|",
        ]
        for name, f in facts.items():
            race, rec, late = f["race"], f["recovery"], f["late_writer"]
            label = _PEER_NAMES.get(name, name) + (f" — **{PEERS_NON_DURABLE}**" if name == "powertools" else "")
            others = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in race["replies"].items() if k != "ran")
            ran = f"**{race['executions']}** of {race['threads']} ({others or 'none else'})"
            if race.get("errors"):
                ran += f"; errors: {'; '.join(race['errors'])}"
            recovered = (
                f"{rec['recovered_s']:.2f} s (first retry: {rec['first_retry']['kind'].replace('_', ' ')})"
                if rec["recovered_s"] is not None
                else f"not within {rec['gave_up_after_s']:.0f} s"
            )
            governed = f"`{rec['ttl_setting']}`, set to {rec['ttl_s']:g} s here (default {rec['ttl_default_s']:g} s)"
            stored = late["stored_after_a"]
            verdict = (
                "B: A is fenced out"
                if stored == "B"
                else ("**A: the late writer overwrote B**" if stored == "A" else stored)
            )
            out.append(
                f"| {label} | {ran} | {recovered} | {governed} | {verdict} (A's client: {late['a_client_got'].split()[-1]}) |"
            )
        out += ["", *_peer_fact_notes(facts)]
    return out


def _peer_fact_notes(facts: dict[str, Any]) -> list[str]:
    notes = [
        "Facts measured with short TTLs so that they take seconds; the recovery time counts from the moment the "
        "killed attempt reported being inside its handler (just after its claim), with a retry every "
        f"{next(iter(facts.values()))['recovery']['poll_s'] * 1000:.0f} ms."
    ]
    if "idemkit" in facts:
        notes[-1] += (
            " idemkit's duplicates wait for the first attempt (`wait_timeout_seconds`, 10 s by default, kept in the "
            "race) and are then replayed; the crash retries wait 0.1 s, so that they measure its lease, not the wait."
        )
    if "powertools" in facts:
        pv = facts["powertools"].get("replay_with_validation")
        notes[-1] += (
            " Outside Lambda, Powertools has no context to bound an in-progress record, so a crashed attempt "
            "blocks its key for `expires_after_seconds`, the same setting that keeps completed answers."
        )
        if pv:
            notes[-1] += (
                f" With `payload_validation_jmespath` set (its request fingerprint), its Redis layer answered a "
                f"plain retry of a completed call with `{pv['retry_detail'] or pv['retry']}`: the completed record "
                "is written without the validation hash. So the figures above run it without validation, its default."
            )
    return notes


def render(r: dict[str, Any]) -> str:
    b = r["benchmarks"]
    parts: list[str] = [_machine(r), ""]
    if "instructions" in b:  # results from before it existed have no such section
        gap = _gap("instructions", b["instructions"])
        parts += ([gap] if gap else measured_apart(b["instructions"]) + _instructions(b["instructions"])) + [""]
    sections = [
        ("cycle", _cycle),
        ("middleware", _middleware),
        ("contention", _contention),
        ("growth", _growth),
        ("sweep", _sweep),
    ]
    for name, fn in sections:
        gap = _gap(name, b.get(name))
        if gap:
            parts += [gap, ""]
            continue
        parts += measured_apart(b[name]) + fn(b[name]) + [""]
    sw = b.get("sweep") if b.get("sweep") and "error" not in b["sweep"] else None
    mem = b.get("memory") if b.get("memory") and "error" not in b["memory"] else None
    parts += _memory(sw, mem) + [""]
    if b.get("memory") and "error" in b["memory"]:
        parts += [_gap("memory", b["memory"]) or "", ""]
    gap = _gap("postgres", b.get("postgres"))
    parts += ([gap] if gap else measured_apart(b["postgres"]) + _postgres(b["postgres"])) + [""]
    if "mysql" in b:  # results from before it existed have no such section
        gap = _gap("mysql", b["mysql"])
        parts += ([gap] if gap else _mysql(b["mysql"])) + [""]
    gap = _gap("asgi", b.get("asgi"))
    parts += ([gap] if gap else measured_apart(b["asgi"]) + _asgi(b["asgi"])) + [""]
    if "group_commit" in b:  # results from before it existed have no such section
        gap = _gap("group_commit", b["group_commit"])
        parts += ([gap] if gap else _group_commit(b["group_commit"])) + [""]
    if "peers" in b:  # optional: only a run with --peers has it
        gap = _gap("peers", b["peers"])
        parts += ([gap] if gap else _peers(b["peers"])) + [""]
    if "inflight" in b:  # optional: only a run with --only inflight has it
        gap = _gap("inflight", b["inflight"])
        parts += ([gap] if gap else _inflight(b["inflight"])) + [""]
    if "move" in b:  # measured in a run of its own: python -m bench.move
        gap = _gap("move", b["move"])
        parts += ([gap] if gap else move_table(b["move"])) + [""]
    if "renewal" in b:  # measured in a run of its own: python -m bench.renewal
        gap = _gap("renewal", b["renewal"])
        parts += ([gap] if gap else renewal_table(b["renewal"])) + [""]
    if "redis_peers" in b:  # measured in a run of its own: python -m bench.redis_peers
        gap = _gap("redis_peers", b["redis_peers"])
        parts += ([gap] if gap else redis_peers_table(b["redis_peers"])) + [""]
    return "\n".join(parts).rstrip() + "\n"


_RENEWAL_FORMS = {
    "each": "one `UPDATE` per reservation by the key's unique index, one transaction",
    "or": "`FORCE INDEX (idx_idempotency_keys_key_id)`, an `OR` of key equalities",
    "values": "`(principal, key_id, generation, token) IN (VALUES …)`",
}


def _postgres_renewal_note(res: dict[str, Any]) -> str:
    pg = res["engines"].get("postgres") or {}
    scanned = [p["rows"] for p in pg.get("points", []) if "Seq Scan" in p["now_plan"]]
    if not scanned:
        return ""
    return (
        "PostgreSQL's planner chooses by its own costs: a hash join over a sequential scan of the table while "
        f"it is small (here up to {max(scanned):,} rows), the key's unique index beyond that, so its tick is bounded "
        "by what a scan costs at that crossover and stops growing after it. "
    )


def renewal_table(res: dict[str, Any]) -> list[str]:
    """(12) What one lease renewal tick costs as the ledger grows."""
    sizes = res["sizes"]
    out = [
        f"| lease renewal: one tick of {res['held']} live reservations, ms (median) | "
        + " | ".join(f"{n:,} rows" for n in sizes)
        + " | plan at the largest size |",
        "|---|" + "---|" * len(sizes) + "---|",
    ]
    missing = []
    for key in ("sqlite", "postgres", "mysql"):
        engine = res["engines"].get(key)
        if engine is None:
            continue
        if "missing" in engine:
            missing.append(f"{key}: {engine['missing']}")
            continue
        points = {p["rows"]: p for p in engine["points"]}
        last = points[sizes[-1]]
        name = engine["engine"]

        def plan(text: str) -> str:
            # The step that reads the ledger's table, whatever else the plan holds.
            steps = [s.replace("->", "").strip() for s in text.split(";")]
            step = next((s for s in steps if "idempotency_keys" in s), steps[0])
            return re.sub(r"\s*\(cost=[^)]*\)", "", step)

        if "before_ms" in last:
            out.append(
                f"| {name}, before: {_RENEWAL_FORMS['values']} | "
                + " | ".join(_n(points[n]["before_ms"], 1) for n in sizes)
                + f" | {plan(last['before_plan'])} |"
            )
        label = "now" if "before_ms" in last else "unchanged"
        out.append(
            f"| {name}, {label}: {_RENEWAL_FORMS[engine['form']]} | "
            + " | ".join(_n(points[n]["now_ms"], 1) for n in sizes)
            + f" | {plan(last['now_plan'])} |"
        )
    run = res["run"]
    out += [
        "",
        f"Measured in a run of its own (`python -m bench.renewal`), {run['started_utc']} – {run['finished_utc']}, "
        f"at commit `{run['commit']}`, load average {'/'.join(f'{x:.1f}' for x in run['loadavg_start'])} → "
        f"{'/'.join(f'{x:.1f}' for x in run['loadavg_end'])}, on the servers of the sections above. The ledger "
        "holds the given number of completed rows of another principal beside the live reservations; a tick is "
        'what the lease keeper runs every third of the TTL (`Store.renew`), the "before" line the single '
        "statement every engine ran until this release. The keeper calls a renewal late once reservations have "
        "gone half the TTL without one (they normally go a third), so a tick must stay well under a sixth of "
        "the TTL: with the old statement, ticks of a second and more on a 10^6-row MariaDB ledger let a retry "
        "take a live owner over under a TTL of a few seconds and run its mutation twice "
        "(tests/ledger/test_lease_renewal_at_scale.py shows it with a 1.5 s TTL). "
        + (
            "With the load average far above the core count, every figure here is slower than on an idle machine. "
            if run["loadavg_start"][0] > 2 * run.get("nproc", 2)
            else ""
        )
        + _postgres_renewal_note(res)
        + "SQLite and MariaDB are told to take the key. The plan column is the engine's own EXPLAIN at the "
        "largest size.",
    ]
    if missing:
        out += ["", "Not measured: " + "; ".join(missing) + "."]
    return out


def move_table(res: dict[str, Any]) -> list[str]:
    rows, floor = res["rows"], res["floor"]["seconds"]
    out = [
        f"| moving a ledger: `idemctl copy`, {rows:,} SQLite rows → PostgreSQL | rows read | written | seconds "
        "| rows read/s | peak RSS MiB | ÷ floor |",
        "|---|---|---|---|---|---|---|",
        f"| floor: `COPY … FROM STDIN` of the same rows | {rows:,} | {rows:,} | {floor:.1f} | {rows / floor:,.0f} "
        "| – | 1 |",
    ]
    for name, label in (
        ("first", "first copy, into an empty ledger (copy while live)"),
        ("again", "the same copy again, nothing changed"),
        ("after_changes", f"after {res['changed_rows']:,} rows changed (the paused pass)"),
    ):
        p = res[name]
        written = p["inserted"] + p["updated"]
        out.append(
            f"| {label} | {p['rows_read']:,} | {written:,} | {p['seconds']:.1f} | {p['rows_read'] / p['seconds']:,.0f} "
            f"| {p['peak_rss_mib']:.0f} | {p['seconds'] / floor:.1f} |"
        )
    run = res["run"]
    server = res["server"]
    out += [
        "",
        f"Measured in a run of its own (`python -m bench.move`), {run['started_utc']} – {run['finished_utc']}, at "
        f"commit `{run['commit']}`, load average {'/'.join(f'{x:.1f}' for x in run['loadavg_start'])} → "
        f"{'/'.join(f'{x:.1f}' for x in run['loadavg_end'])}; PostgreSQL {server['server_version']} on the same "
        f"machine (synchronous_commit={server['synchronous_commit']}, fsync={server['fsync']}). The source holds "
        f"{rows:,} rows (256-byte bodies, one in ten pending, a token on each) and {res['fenced_events']:,} "
        "fenced-out events; each pass is `idemctl copy --json` run as its own process with the default batch. "
        "The floor moves the rows and nothing else; the copy also compares every row with the destination's, "
        "writes only what differs through statements that never overwrite a newer row, and copies the "
        "fenced-out log. Peak RSS stays flat whatever the size: the copy holds one batch at a time. "
        "The paused pass costs about what reading and comparing every row costs (the second line), however few "
        "rows changed: the [cutover procedure](runbook.md#moving-the-ledger-to-another-database) pauses writers "
        "only for it. With the load average far above the core count, every figure here, the floor's included, "
        "is slower than on an idle machine; the ratios are what carries over.",
    ]
    return out


def _beside_idemkit(first: list[str], kit: bool) -> list[str]:
    """The head and rule of a table of idemctl beside a floor (and idemkit, when measured)."""
    cols = [*first, "idemctl/s", "÷ floor", *(("idemkit/s", "÷ floor", "idemctl ÷ idemkit") if kit else ())]
    return ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]


# The in-flight systems, as the table names them (a run from before the
# asyncpg floor had only "idemctl" and "idemkit", against psycopg's floor).
INFLIGHT_SYSTEMS = (
    ("idemctl", "idemctl ASGI"),
    ("idemctl_fastapi", "idemctl FastAPI"),
    ("idemctl_psycopg", "idemctl ASGI on psycopg"),
    ("idemkit", "idemkit"),
    ("idemkit_fastapi", "idemkit FastAPI"),
)
# Whom each idemctl system is set beside (a run from before idemkit ran
# FastAPI set both against the bare app's idemkit).
INFLIGHT_PEERS = {"idemctl": "idemkit", "idemctl_fastapi": "idemkit_fastapi"}


def _inflight(res: dict[str, Any]) -> list[str]:
    """(8)/(10) in flight: idemctl and idemkit through their ASGI middleware
    on PostgreSQL at 1, 10 and 50 requests in flight, against the raw
    asynchronous floors (psycopg, asyncpg) of the same rounds."""
    first_cell = res["levels"][next(iter(res["levels"]))]["first"]
    two_floors = "limit" in first_cell
    systems = [(k, label) for k, label in INFLIGHT_SYSTEMS if k in first_cell]
    kit = "idemkit" in first_cell
    head = "| (8)/(10) ASGI + PostgreSQL, in flight | kind |"
    head += " psycopg floor/s | asyncpg floor/s | limit |" if two_floors else " raw async floor/s |"
    for _, label in systems:
        head += f" {label}/s | ÷ {'limit' if two_floors else 'floor'} |"
    ratios = [k for k, _ in systems[:2] if k != "idemkit"] if kit else []
    names = dict(INFLIGHT_SYSTEMS)
    peers = {k: (INFLIGHT_PEERS[k] if INFLIGHT_PEERS[k] in first_cell else "idemkit") for k in ratios}
    head += "".join(f" {names[k]} ÷ {names[peers[k]]} |" for k in ratios)
    lines = [head, "|" + "---|" * head.count(" |")]
    for level, row in res["levels"].items():
        for kind in ("first", "replay"):
            c = row[kind]
            cells = [f"{level}", "first calls" if kind == "first" else "replays"]
            if two_floors:
                cells += [_sp(c["floor_psycopg"], 0), _sp(c["floor_asyncpg"], 0), c["limit"]]
            else:
                cells.append(_sp(c["floor"], 0))
            for k, _ in systems:
                cells += [_sp(c[k], 0), _sp(c[f"{k}_vs_floor"])]
            cells += [_sp(c[f"{k}_vs_idemkit"]) for k in ratios]
            lines.append("| " + " | ".join(cells) + " |")
    v = res.get("versions", {})
    lag, threads = res["lag_50_first_ms"], res["lag_50_first_threads_ms"]
    measured = res.get("measured")
    when = ""
    if measured:  # published beside a page measured at another time: its own conditions
        # A run merged by the harness records the load at its end; one stamped by hand, at its start.
        at_start = "loadavg_start" in measured
        load = "/".join(f"{x:.1f}" for x in measured["loadavg_start" if at_start else "loadavg"])
        when = (
            f"Measured {measured['started_utc']} at commit `{measured['commit']}`, load average {load}"
            f"{'' if at_start else ' at the end'}"
            + (f" ({measured['conditions']})" if measured.get("conditions") else "")
            + ". "
        )
    if two_floors:
        floors = (
            ". The floors run idemctl's own statements (a first call is the claim and the fenced completion, a "
            "replay the one statement that tries the claim, finds the key taken and reads its row) on psycopg's "
            "AsyncConnection from an AsyncConnectionPool and on asyncpg (connections from a LIFO queue, each "
            "statement prepared once per connection); the faster floor of each row is its limit, and every ratio "
            f"is taken against it. idemctl's store runs on {res.get('driver') or 'the driver it chose'}; "
            '"on psycopg" is the same middleware with `async_driver=psycopg` (the path before asyncpg).'
        )
        if "idemkit_fastapi" in first_cell:
            floors += (
                " Each middleware wraps the same two apps: the bare ASGI app and a FastAPI app with one route "
                "(idemctl FastAPI ÷ idemkit FastAPI compares like with like)."
            )
    else:
        floors = (
            ". The floor runs idemctl's own statements on psycopg's AsyncConnection: a first call is the claim "
            "and the fenced completion, a replay the one statement that tries the claim, finds the key taken and "
            "reads its row."
        )
    lines += [
        "",
        when + f"{res['rounds']} alternated rounds of {res['requests_per_round']} requests per variant and level "
        f"(median and min–max); pools of {res['pool_max_size']} connections; psycopg {v.get('psycopg')}, "
        f"asyncpg {v.get('asyncpg')}" + (f", idemkit {v.get('idemkit')}" if kit else "") + floors,
        "",
        "| (8) event-loop lag: a 1 ms ticker, 50 first calls in flight through idemctl's middleware "
        "| lag p50 ms | p99 ms | max ms |",
        "|---|---|---|---|",
        f"| statements awaited on the loop (PostgreSQL's asynchronous store) | {_n(lag['p50_ms'], 2)} "
        f"| {_n(lag['p99_ms'], 2)} | {_n(lag['max_ms'], 2)} |",
        f"| statements handed to the default executor | {_n(threads['p50_ms'], 2)} "
        f"| {_n(threads['p99_ms'], 2)} | {_n(threads['max_ms'], 2)} |",
    ]
    return lines + _postgres_instructions(res.get("instructions"))


def _postgres_instructions(ins: dict[str, Any] | None) -> list[str]:
    """(8)/(10) and (7) in instructions: one request at a time, callgrind."""
    if not ins:
        return []
    if "missing" in ins:
        return ["", f"(8)/(10) instructions: not counted ({ins['missing']})."]
    names = {
        ("asgi", "floor-asyncpg"): "raw statements on asyncpg (the ASGI floor)",
        ("asgi", "floor-psycopg"): "raw statements on psycopg's AsyncConnection",
        ("asgi", "idemctl"): "idemctl, ASGI `IdempotencyMiddleware` (asyncpg)",
        ("asgi", "idemctl-psycopg"): "idemctl, ASGI `IdempotencyMiddleware` on psycopg",
        ("sync", "floor"): "raw statements on one psycopg connection (the synchronous floor)",
        ("sync", "handle"): "idemctl, `Ledger.handle`",
    }
    by = {(r["door"], r["system"], r["kind"]): r for r in ins["rows"]}
    lines = _instruction_table("(8)/(10), (7) instructions a request on PostgreSQL (callgrind)", names, by)
    lines += [
        "",
        f"Counted by valgrind's callgrind in the same run, {ins['requests_per_segment']} requests a segment after a "
        "warm-up, one at a time (an ASGI request driven to its end on the loop): the instructions of the Python "
        "process only (PostgreSQL's own work is in its server processes), so they hold on a busy machine. Each "
        "ASGI row is divided by the asyncpg floor, each synchronous row by the raw psycopg statements.",
    ]
    ours, floor = by.get(("asgi", "idemctl", "first")), by.get(("asgi", "floor-asyncpg", "first"))
    ours_r, floor_r = by.get(("asgi", "idemctl", "replay")), by.get(("asgi", "floor-asyncpg", "replay"))
    if ours and floor and ours_r and floor_r:
        aims = INFLIGHT_AIMS
        lines[-1] += (
            f" Were this process's instructions the whole cost of a request, a first call at "
            f"{aims['vs_floor_first']:g}× the "
            f"floor's rate could spend {_n(round(floor['instructions'] / aims['vs_floor_first'] - floor['instructions']))}"
            f" instructions above asyncpg's and a replay at {aims['vs_floor_replay']:g}× "
            f"{_n(round(floor_r['instructions'] / aims['vs_floor_replay'] - floor_r['instructions']))}; idemctl "
            f"spends {_n(ours['instructions'] - floor['instructions'])} and "
            f"{_n(ours_r['instructions'] - floor_r['instructions'])} (the ASGI exchange, the request sequence, the "
            "fingerprint, the decision, the stored answer's headers, a write awaited whole)."
        )
    return lines + _postgres_parts(by, ins.get("census")) + ["", PG_INSTRUCTION_HISTORY, "", PG_CEILING]


def _postgres_parts(by: dict[tuple[str, str, str], dict[str, Any]], census: dict[str, Any] | None) -> list[str]:
    """Where an ASGI request's instructions go, idemctl's beside the floor's."""
    cells = [by.get(("asgi", system, kind)) for kind in ("first", "replay") for system in ("floor-asyncpg", "idemctl")]
    if not all(c and "parts" in c for c in cells):
        return []
    floor_f, ours_f, floor_r, ours_r = (c["parts"] for c in cells if c)
    lines = [
        "",
        "Where an ASGI request's instructions go on asyncpg, by the C function that runs them (each function's own "
        "cost; Python 3.11 shows callgrind no Python function):",
        "",
        "| part | floor, first call | idemctl, first call | above the floor | floor, replay | idemctl, replay | above the floor |",
        "|---|---|---|---|---|---|---|",
    ]
    for part in floor_f:
        lines.append(
            f"| {part} | {_n(floor_f[part])} | {_n(ours_f[part])} | {_n(ours_f[part] - floor_f[part])} "
            f"| {_n(floor_r[part])} | {_n(ours_r[part])} | {_n(ours_r[part] - floor_r[part])} |"
        )
    above = sum(ours_f.values()) - sum(floor_f.values())
    python = sum(ours_f[p] - floor_f[p] for p in list(floor_f)[:4])
    sha = ours_f["SHA-256 (OpenSSL)"]
    driver = ours_f["the driver's C code"] - floor_f["the driver's C code"]
    lines += [
        "",
        f"Of the {_n(above)} instructions a first call spends above the floor, {_n(python)} "
        f"({python / above * 100:.0f} %) are CPython running idemctl's Python: the bytecode, and the frames, "
        "objects and lookups it makes, spread over every step of the request rather than in one. The statements "
        f"themselves cost what the floor's do (the driver's C code differs by {_n(driver)}), and the fingerprint's "
        f"SHA-256 of the 1 KiB body is {_n(sha)}.",
    ]
    if census:
        packages = sorted({k for row in census.values() for k in row if k != "event-loop turns"})
        lines += [
            "",
            "Python functions entered per request (a coroutine's or generator's resumption counts as an entry), "
            "and the event loop's turns (`sys.setprofile`, the same requests):",
            "",
            "| | " + " | ".join(packages) + " | event-loop turns |",
            "|---|" + "---|" * (len(packages) + 1),
        ]
        for name, row in census.items():
            system, _, kind = name.partition(":")
            label = f"{'idemctl' if system == 'idemctl' else 'floor'}, {'first call' if kind == 'first' else 'replay'}"
            lines.append(
                f"| {label} | "
                + " | ".join(_n(row.get(p, 0), 1) for p in packages)
                + f" | {_n(row['event-loop turns'], 1)} |"
            )
    return lines


# PostgreSQL's request paths (bench/pg_instructions.py) counted before and
# after each change to them, on the machine of the day.
PG_INSTRUCTION_HISTORY = """The same counts before and after each change to PostgreSQL's asynchronous path, first call / replay:

| measured | commit | change | ASGI on asyncpg | ASGI on psycopg | `Ledger.handle` |
|---|---|---|---|---|---|
| 2026-12-07 | `e9f8b4e` | before: every write a task and a shield of its own; asyncpg's timer per statement | 915 405 / 567 482 | 1 233 934 / 736 320 | – |
| 2026-12-07 | `4220380` | a write awaited in the request's own task (`landing.Landing`); one deadline watcher per loop; header names compared as bytes | 820 801 / 478 738 | 1 208 837 / 717 825 | 415 880 / 284 423 |
| 2026-12-07 | `5e3c03e` | the app's task and psycopg's writes awaited through `landing.Outlasting`, no shield's outer future; one coroutine fewer a statement; no system call for a fencing token | 788 006 / 475 345 | 1 146 525 / 683 706 | 414 114 / 282 735 |
| 2026-12-07 | `958a387` | the event-loop doors hand the driver the principal and the body's awaitable, not a coroutine of their own | 785 473 / 472 758 | 1 146 315 / 683 083 | 414 040 / 282 575 |

Where a replay's time goes beyond the floor, measured one request at a time on this machine: the same replay against a store that answers at once (no server, no socket) costs 25 µs of Python in a tight loop, and the engine's statement alone costs within 10–20 µs of asyncpg's raw one; yet a real replay takes 70–90 µs longer than the floor's. idemctl's Python runs at about half its tight-loop speed when each request alternates with the server and the kernel (its code and data no longer in the processor's caches), which is why its instruction count, not a single slow step, decides the rate. In alternated rounds on one machine the same afternoon, ÷ the limit at 1 / 10 / 50 in flight: `4220380` (one run) first calls 0.71 / 0.71 / 0.63, replays 0.68 / 0.62 / 0.53; this code (`5e3c03e` to `c96091f`, five runs) first calls 0.72–0.81 / 0.67–0.75 / 0.55–0.65, replays 0.68–0.74 / 0.51–0.66 / 0.45–0.55. The counts fell; the rates moved less than the runs differ (in the last two the floors themselves ran a fifth slower: other work on the host)."""


# What the asynchronous aims would take, from the counts above and one
# experiment that is not part of the benchmark.
PG_CEILING = """What the aims of ≥ 0.85× / ≥ 0.8× the asyncpg floor would take. With one request in flight, idemctl's extra CPU time per request would have to shrink into the room the aim leaves (the note on the in-flight rounds sets the two side by side, from the run: a quarter to a third less on this machine). With 10 or 50 in flight the client's core is the bottleneck (the server shares the machine's two cores), and the rate follows the instruction count: at 0.85× a first call could spend about 58 000 instructions above asyncpg's floor, less than the fingerprint's SHA-256 and the ASGI exchange's parsing alone, against about 463 000 now. That work is spread over about 150 Python function entries of idemctl's per first call and 84 per replay (the table above), each doing one step of the contract; trimming one saves about a thousand instructions. Compiling did not change the picture: ten of the request path's modules (the decision loop, `landing`, the exchange's drive, sequence, scope and body, the deadlines, the fingerprint, the outcomes, the asyncpg engine) compiled with mypyc at `c1a2134` cut the ASGI first call on asyncpg from 788 350 to 734 715 instructions (−6.8 %) and a replay from 473 490 to 444 234 (−6.2 %), after changes mypyc requires (no slotted or generic dataclasses in a compiled module, interpreted subclasses of the ledger's classes, no import cycle through a compiled module); it is not shipped. The first call's two extra turns of the event loop are the app's own task, which lets the app and its completion outlive a cancelled request."""


def _usable(res: dict[str, Any] | None) -> TypeGuard[dict[str, Any]]:
    return res is not None and "missing" not in res and "error" not in res


def glance(b: dict[str, Any]) -> str:
    """What a user wants first: the cost of a request, and what to choose."""
    out = ["## At a glance", ""]
    ins = b.get("instructions")
    if _usable(ins):
        first = next(r for r in ins["rows"] if r["name"] == "handle_first")
        replay = next(r for r in ins["rows"] if r["name"] == "handle_replay")
        out += [
            f"- **Cost per request, in CPU work** (0): a first call through `Ledger.handle` is "
            f"{_n(first['instructions'])} instructions, {first['ratio']:.2f}× the "
            f"{_n(ins['raw_first'])} of its two raw statements through `sqlite3`; a replay "
            f"{_n(replay['instructions'])}, {replay['ratio']:.2f}× a raw claim attempt + primary-key SELECT. "
            "These counts do not move with the machine's load: a change that makes them grow is a regression.",
        ]
    cyc = b.get("cycle")
    if _usable(cyc):
        full, normal = cyc["full"], cyc["normal"]
        out += [
            f"- **In seconds** (1), on one core: `handle` runs at {full['handle']['ratio']['median']:.2f}× the raw "
            f"statement pair under `synchronous=FULL` ({_n(full['handle']['ops_per_s']['median'])} requests/s), "
            f"{normal['handle']['ratio']['median']:.2f}× under NORMAL ({_n(normal['handle']['ops_per_s']['median'])}/s)"
            + (" (measured apart, on a busy machine: see the note at (1))." if cyc.get("measured") else "."),
        ]
    out += [
        "- **Which engine**: SQLite for one host (any number of worker processes on it); PostgreSQL when "
        "several hosts share one ledger, or when the app's data already lives there (7).",
        "- **Which settings on SQLite**: `synchronous=FULL` (the default) is what makes a stored answer survive "
        "a power cut; on it the fsync is most of a request, and `group_commit=True` lets threads of one process "
        "share it (9). `synchronous=NORMAL` survives an application crash but can lose the last commits on "
        "power loss, and runs several times faster. Keep the writer queue on (the default) when several "
        "processes write.",
        "",
    ]
    return "\n".join(out)


INTRO_HEAD = """\
# Performance

An idempotency ledger sits on every mutating request, so its cost is part of
every API call. First what that means for a deployment, from the run below;
then how it is measured, and every table.
"""


INTRO = """\
## How it is measured

`bench/` measures that cost against a floor measured in the
same run: the least the contract needs, as raw `sqlite3` (or `psycopg`, or
`PyMySQL`) statements on connections configured exactly like idemctl's own (WAL,
auto-commit, the same `synchronous` level and busy timeout), on the same
file system. Every figure is a ratio ours ÷ floor, given as the median and
the min–max over several repetitions (seven paired blocks for (1), five for
(2) and (4), six rotated blocks for (7), the one-second windows of a 10 s run for contention;
for (8) eleven rounds under FULL, five under NORMAL, and five one-second
rounds of each event-loop condition; five rounds for (9)), because shared
machines are noisy.

This page is written by `python -m bench --report` from
[`bench/results/latest.json`](../bench/results/latest.json); edit
`bench/report.py`, not the page.

```sh
python -m bench            # the whole suite, about 11 minutes on 2 cores; writes bench/results/latest.json
python -m bench --peers    # the same, then idemctl beside idemkit and Powertools (10): pip install -e '.[bench]'
python -m bench --only postgres,inflight --peers --merge  # PostgreSQL alone: (7), (10) and (8)/(10) in flight with both drivers' floors, about 6 minutes; merged, page re-rendered
python -m bench --report   # renders this page from bench/results/latest.json
python -m bench --instructions  # (0) alone, with valgrind: merged into latest.json, page re-rendered
python -m bench.pg_instructions  # PostgreSQL's request paths in instructions alone (both drivers' ASGI, handle, the floors), about a minute: JSON on stdout
python -m bench --quick    # every benchmark at tiny sizes, about 2 minutes (valgrind starting Python is most of it): checks the harness only
```

The database files go to a fresh directory under the system temporary
directory (`--dir PATH` or `IDEMCTL_BENCH_DIR` to choose). Put it on the file
system your ledger will live on: on tmpfs an fsync costs nothing and every
floor is meaningless (the harness warns). `--only cycle,sweep` runs a subset;
`IDEMCTL_BENCH_POSTGRES_URL` points (7) at another server,
`IDEMCTL_BENCH_MYSQL_URL` (7b). The test suite
runs `--quick`, which checks only that every benchmark ran and the tables
came out.

## The floors

0. **Instructions**: the raw statements of (1), counted by valgrind's
   callgrind in the same process as the ledger (`synchronous=OFF`, so that
   no fsync hides the CPU); each adapter also against its framework's least
   app alone, so what is left over is the adapter's own.
1. **Request cycle**: a claim `INSERT … ON CONFLICT DO NOTHING RETURNING`
   plus a fenced `UPDATE … RETURNING` storing a 1 KiB body; for replays and
   409s, a primary-key `SELECT`.
2. **Middleware**: `Ledger.handle` + `after_response`, which is what the
   middleware does per request.
3. **Contention**: one process with the same settings.
4. **Growth**: the raw claim on the same file at the same size.
5. **Sweep**: one unbounded `DELETE … WHERE updated_at < cutoff` of the same
   rows, on an identical copy of the file, with the same claiming process
   running beside it.
6. **Memory**: the interpreter importing `idemctl.cli` and nothing else; for
   a worker, its own RSS after the first tenth of its requests.
7. **PostgreSQL**: the same statements sent through one auto-commit
   `psycopg` connection to the same server, in a schema of their own.
   **(7b) MariaDB**: the same, through one auto-commit `PyMySQL` connection
   set up like idemctl's (READ COMMITTED, the same lock wait), in a
   database of their own: the claim `INSERT … ON DUPLICATE KEY UPDATE` and
   the fenced `UPDATE` that MariaDB and MySQL run instead of `RETURNING`.
8. **ASGI middleware**: for throughput, the bare ASGI app alone (the
   framework part) and `Ledger.handle` + `after_response` called in one
   executor thread per request (the ledger part), both driven by the same
   in-process ASGI caller; around FastAPI, the plain FastAPI app. "÷ both
   floors" sets ours against the two floors' times added up, and what is
   left over is the adapter's own time per request. For event-loop lag, the
   same 1 ms ticker on the same loop with no requests.
9. **Group commit**: the request cycle's raw statement pair on one thread,
   the most one thread can do per fsync, against many threads of one process
   with and without `group_commit`.
10. **Peers**: on PostgreSQL, the same raw statement pair (and primary-key
   SELECT) as (7), measured in every round beside each system; for the
   Redis reference, a raw `SET NX` + `SET` (and `GET`) of the same sizes.

Each measured request has a 1 KiB body and stores a 1 KiB answer; the 10⁶
pre-existing rows store 256 bytes with random 128-bit keys, one in ten left
pending.

## Results
"""

WRITER_QUEUE = """\
## The writer queue (SQLite)

SQLite's busy handler makes a waiting writer sleep and retry, sleeping longer
each time (1, 2, 5, 10 … up to 100 ms), and hands the lock to whoever happens
to retry right after it is freed. With several writer processes, one request
can lose that race for seconds while the others go through ("queue off" in
table (3)).

So every write statement on SQLite first takes an exclusive `flock` on
`<ledger>-idemctl.lock`, a file next to the ledger, and waits for it in the
kernel. A waiter is woken the moment the lock is released and tries again at
once, so nobody falls behind for long ("queue on").

- Reads never queue (`get`, `lookup`, `stats`, `pending`). A replay or a 409
  does, because its first step is the claim, a write attempt.
- The per-request sweep first reads the oldest row's and event's time (one
  index step each); when nothing is past retention it takes no write lock and
  no turn, and until the earliest moment anything can expire it runs no
  statement at all.
- Time spent queueing counts against the busy timeout, so writers stuck
  behind a foreign writer still fail with `DatabaseLockedError` after about
  one busy timeout, not one per waiter.
- The kernel releases the lock when a process dies. A process *frozen* in the
  middle of a write (SIGSTOP, a debugger) holds it, and the others wait until
  it resumes or dies, where plain SQLite would fail them after the busy
  timeout.
- Writers that are not idemctl (the `sqlite3` shell, a migration) do not
  queue; SQLite's own lock still serialises them, so correctness never
  depends on the queue. If the lock file cannot be created (read-only
  directory, no `flock`), idemctl falls back to SQLite alone.
- Its cost for one process is two `flock` calls per write statement, shown in
  (1) as "queue on ÷ off". `Ledger.open(path, write_queue=False)` turns it
  off.
"""


def _ok(b: dict[str, Any], name: str) -> dict[str, Any] | None:
    res = b.get(name)
    return res if res and _gap(name, res) is None else None


def _config(res: dict[str, Any], synchronous: str, queue: bool, workers: int) -> dict[str, Any] | None:
    configs: list[dict[str, Any]] = res["configs"]
    for c in configs:
        if (c["synchronous"], c["write_queue"], c["workers"]) == (synchronous, queue, workers):
            return c
    return None


def _count(n: int) -> str:
    return "none" if n == 0 else str(n)


def _notes(b: dict[str, Any]) -> list[str]:
    """What the tables show, in words, with the figures taken from them."""
    notes: list[str] = []
    if cy := _ok(b, "cycle"):
        full, normal, paths = cy["full"], cy["normal"], cy["paths"]
        notes.append(
            f"- **Request cycle (1).** `handle` runs at {full['handle']['ratio']['median']:.2f}× the raw statement "
            f"pair under `synchronous=FULL` and {normal['handle']['ratio']['median']:.2f}× under NORMAL. The "
            "statements are the floor's; the rest is idemctl's Python per request (fingerprint, header matching, "
            "building the stored answer), which weighs more where an fsync is cheap. A replay runs at "
            f"{paths['replay']['ratio']['median']:.2f}× the rate of a bare primary-key SELECT because idemctl "
            "claims first, so that one atomic statement decides; a raw claim attempt plus the SELECT alone runs "
            f"at {paths['claim_attempt_and_select']['ratio']['median']:.2f}× it. In exchange a first attempt, most "
            "of the traffic, pays no extra read."
        )
    if mw := _ok(b, "middleware"):
        notes.append(
            f"- **Middleware (2).** The WSGI layer runs at {mw['full']['ratio_to_library']['median']:.2f}× "
            f"(FULL) and {mw['normal']['ratio_to_library']['median']:.2f}× (NORMAL) of the library calls it "
            "makes: reading the environ and body, the principal callback and assembling the response."
        )
    if ct := _ok(b, "contention"):
        on, off = _config(ct, "FULL", True, 4), _config(ct, "FULL", False, 4)
        if on and off:
            notes.append(
                f"- **Contention (3).** With 4 processes under FULL and the writer queue, the slowest request took "
                f"{on['latency']['max_ms']:.0f} ms, {_count(on['latency']['over_100ms'])} took over 100 ms, and the "
                f"processes served {' / '.join(str(x) for x in on['per_worker'])} requests; without the queue the "
                f"slowest took {off['latency']['max_ms']:.0f} ms, {_count(off['latency']['over_100ms'])} took over "
                f"100 ms, and the counts were {' / '.join(str(x) for x in off['per_worker'])}. Fair turns cost "
                f"throughput: {on['ratio_to_single']['total']:.2f}× a single process with the queue, "
                f"{off['ratio_to_single']['total']:.2f}× without it."
            )
    if gr := _ok(b, "growth"):
        ratios = [s["full"]["ratio"]["median"] for s in gr["sizes"]]
        notes.append(
            f"- **Growth (4).** From {_n(gr['sizes'][0]['rows'])} to {_n(gr['sizes'][-1]['rows'])} rows already "
            f"present, a claim stays within {min(ratios):.2f}–{max(ratios):.2f}× the raw claim under FULL: its "
            "cost follows the floor's, which grows only by a B-tree level." + _growth_gap(gr)
        )
    if sw := _ok(b, "sweep"):
        runs = [(sw["cli"], sw["ratio_delete_only"])] + [
            (o["cli"], o["ratio_delete_only"]) for o in sw["cli_other_batches"]
        ]
        default = sw["cli"]
        others = "; ".join(
            f"{c['batch_size']}-row batches drain in {r:.1f}× with a p99 of {c['claimer']['p99_ms']:.0f} ms"
            for c, r in runs[1:]
        )
        notes.append(
            f"- **Sweep (5).** The batch size trades drain time against the traffic served meanwhile. The "
            f"SQLite default, {default['batch_size']} rows, drains in {sw['ratio_delete_only']:.1f}× the "
            f"unbounded DELETE while a claiming process sees a p99 of {default['claimer']['p99_ms']:.0f} ms "
            f"and {default['claimer']['error_count']} errors; {others}; the single DELETE gave it a p99 of "
            f"{sw['floor']['claimer']['p99_ms']:.0f} ms and {sw['floor']['claimer']['error_count']} errors, and "
            f"grew the WAL to {sw['floor']['wal_max_mib']:.0f} MiB against {default['wal_max_mib']:.0f} MiB. "
            "Each batch deletes rows whose primary-key entries are scattered over the whole index, which is "
            "where the extra time goes. A drain with no traffic to protect can pass `--batch-size 10000`."
        )
    if (sw := _ok(b, "sweep")) and (mem := _ok(b, "memory")) and "memory_reads" in sw:
        notes.append(
            f"- **Memory (6).** `sweep`, `stats` and `pending --limit 0` stream: they peak at "
            f"{max(sw['cli']['peak_rss_mib'], sw['memory_reads']['stats']['peak_rss_mib'], sw['memory_reads']['pending']['peak_rss_mib']):.0f} MiB "
            f"on a {_n(sw['expired_rows'] + sw['live_rows'])}-row ledger; a worker grows by "
            f"{mem['growth_mib']:.1f} MiB over {_n(mem['requests'])} requests."
        )
    if pg := _ok(b, "postgres"):
        one = pg["contention"]["configs"][0]
        many = pg["contention"]["configs"][-1]
        sw = pg["sweep"]
        cli = sw["cli"]
        sweep_words = f"The sweep takes {sw['ratio_total']:.1f}× one DELETE. "
        if (bp := sw.get("batch_profile")) and bp.get("rows") and cli.get("drain_ms") is not None:
            ours_us = bp["execution_ms"] * 1000 / bp["rows"]
            floor_us = sw["floor"]["delete_s"] * 1e6 / sw["floor"]["deleted"]
            outside_s = cli["sweep_s"] - cli["drain_ms"] / 1000
            sweep_words += (
                f"Inside the server a batch costs {ours_us:.2f} µs a row against the DELETE's {floor_us:.2f} "
                f"({ours_us / floor_us:.1f}×; {bp['collect_ms']:.1f} of its {bp['execution_ms']:.1f} ms collect the "
                "rows' addresses through the updated_at index, where the DELETE reads the table in order). "
                "The rest is what a "
                f"bounded drain pays around its statements: {_n(cli['batches'])} round trips and commits, "
                f"{outside_s:.1f} s of process start and the backlog count before the first batch, and the "
                "closing walk from the start of the index (over the deleted rows' entries, which only VACUUM "
                "removes) that makes sure no row written below the drain's path is left. "
            )
        notes.append(
            f"- **PostgreSQL (7).** `handle` runs at {pg['cycle']['handle']['ratio']['median']:.2f}× the raw "
            + (
                f"pair, and with `after_response` (the middleware's per-request sweep, which rests while nothing "
                f"can expire) at {pg['cycle']['handle_after']['ratio']['median']:.2f}×"
                if "handle_after" in pg["cycle"]
                else "pair"
            )
            + "; nearly all of a request is psycopg and the round trips, and idemctl's own part is its "
            f"Python per request (the same as on SQLite). {sweep_words}A claiming process beside the drain saw "
            f"a p99 of {cli['claimer']['p99_ms']:.0f} ms: a batch locks only the expired rows it deletes. With "
            f"{many['workers']} processes the server gives {many['ratio_to_single']['total']:.1f}× the throughput "
            f"of {one['workers']}, with even counts per process: its row locks queue waiters fairly."
        )
    if asg := _ok(b, "asgi"):
        notes += _asgi_notes(asg)
    if gc := _ok(b, "group_commit"):
        notes.append(_group_commit_note(gc))
    if fl := _ok(b, "inflight"):
        notes += _inflight_notes(fl)
    return notes


# The aims of the asynchronous path: ahead of idemkit at every level, and
# near the raw asynchronous floor at 10 in flight.
INFLIGHT_AIMS = {"vs_idemkit": 1.5, "vs_floor_first": 0.85, "vs_floor_replay": 0.8}


def _inflight_notes(res: dict[str, Any]) -> list[str]:
    levels = res["levels"]
    first_cell = levels[next(iter(levels))]["first"]
    kit = "idemctl_vs_idemkit" in first_cell
    ours = [k for k in ("idemctl", "idemctl_fastapi") if k in first_cell]
    parts = []
    if kit:
        per = ", ".join(
            f"{lv}: {row['first']['idemctl_vs_idemkit']['median']:.2f}× / {row['replay']['idemctl_vs_idemkit']['median']:.2f}×"
            for lv, row in levels.items()
        )
        parts.append(f"idemctl ÷ idemkit, first calls / replays, by requests in flight: {per}")
    per_floor = ", ".join(
        f"{lv}: {row['first']['idemctl_vs_floor']['median']:.2f}× / {row['replay']['idemctl_vs_floor']['median']:.2f}×"
        for lv, row in levels.items()
    )
    limit = "the limit (the faster driver's floor)" if "limit" in first_cell else "the raw async floor"
    parts.append(f"idemctl ÷ {limit}, first calls / replays: {per_floor}")
    missed = []
    for lv, row in levels.items():
        for kind in ("first", "replay"):
            for system in ours:
                if kit and row[kind].get(f"{system}_vs_idemkit", {"median": 9})["median"] < INFLIGHT_AIMS["vs_idemkit"]:
                    missed.append(f"{system} {kind} ÷ idemkit at {lv}")
                if row[kind][f"{system}_vs_floor"]["median"] < INFLIGHT_AIMS[f"vs_floor_{kind}"]:
                    missed.append(f"{system} {kind} ÷ limit at {lv}")
    lag, threads = res["lag_50_first_ms"], res["lag_50_first_threads_ms"]
    note = (
        f"- **ASGI + PostgreSQL in flight (8)/(10).** With the ledger's statements awaited on the loop, {'; '.join(parts)} "
        f"(aims: ≥ {INFLIGHT_AIMS['vs_idemkit']:g}× idemkit everywhere, ≥ {INFLIGHT_AIMS['vs_floor_first']:g}× / "
        f"≥ {INFLIGHT_AIMS['vs_floor_replay']:g}× the limit at every level, bare ASGI and FastAPI; "
        + ("all met)." if not missed else f"not met: {', '.join(missed)}).")
        + f" Under 50 first calls in flight the 1 ms ticker wakes late by {lag['p99_ms']:.1f} ms at p99 with the "
        f"statements on the loop, {threads['p99_ms']:.1f} ms with them in the executor."
    )
    notes = [note]
    one = levels.get("1", {})
    if all("cpu_us" in one.get(kind, {}) for kind in ("first", "replay")):
        parts = []
        for kind in ("first", "replay"):
            cell = one[kind]
            cpu = {system: v["median"] for system, v in cell["cpu_us"].items()}
            floor_cpu, ours_cpu = cpu[cell["limit"]], cpu["idemctl"]
            floor_wall = 1e6 / cell["floor"]["median"]
            room = floor_wall / INFLIGHT_AIMS[f"vs_floor_{kind}"] - floor_wall
            parts.append(
                f"{'a first call' if kind == 'first' else 'a replay'}: the floor {_n(floor_cpu)} µs of CPU in "
                f"{_n(floor_wall)} µs of wall time, idemctl {_n(ours_cpu)} µs, {_n(ours_cpu - floor_cpu)} µs more, "
                f"where {INFLIGHT_AIMS[f'vs_floor_{kind}']:g}× the floor's rate leaves room for {_n(room)} µs"
            )
        notes.append(
            "- **With one request in flight the client waits for the server, and idemctl's extra wall time is its "
            "extra CPU time** (this process's user and system time per request, median of the rounds): "
            + "; ".join(parts)
            + "."
        )
    profile = res.get("profile_10_in_flight")
    if profile and missed:
        lines = []
        names = [("first", "idemctl, first calls"), ("replay", "idemctl, replays")]
        for kind in ("first", "replay"):
            for floor in ("floor", "psycopg", "asyncpg"):
                if f"{floor}_{kind}" in profile:
                    names.append(
                        (f"{floor}_{kind}", f"{floor} floor, {'first calls' if kind == 'first' else 'replays'}")
                    )
        for name, label in names:
            p = profile[name]
            shares = ", ".join(f"{g} {v * 100:.0f} %" for g, v in p["share"].items() if v >= 0.02)
            lines.append(f"{label}: {p['us_per_request']:.0f} µs of profiled time a request ({shares})")
        top = ", ".join(f"`{t['function']}` {t['us_per_request']:.0f} µs" for t in profile["replay"]["idemctl_top"][:5])
        notes.append(
            "- **What is left (profile at 10 in flight, cProfile's internal time by package).** "
            + "; ".join(lines)
            + f". idemctl's heaviest functions on a replay: {top}."
        )
    return notes


def _group_commit_note(res: dict[str, Any]) -> str:
    by_key: dict[tuple[str, int, bool], dict[str, Any]] = {
        (c["level"], c["threads"], c["group_commit"]): c for c in res["configs"]
    }

    def on(level: str, threads: int) -> dict[str, Any]:
        return by_key[(level, threads, True)]

    def ratio(level: str, threads: int, mode: bool) -> float:
        return float(by_key[(level, threads, mode)]["ratio_to_floor"]["median"])

    most = max(c["threads"] for c in res["configs"])
    top = [c for c in res.get("ledger_ceiling_off", []) if c["threads"] == most]
    ceiling = (
        f": idemctl's Python per request, serialised by the interpreter's lock, weighs as much as the disk (even "
        f"with no fsync at all, {most} threads make only {top[0]['ratio_to_floor']['median']:.2f}× the floor "
        "through the ledger), and the callers of a batch wait while it commits instead of running"
        if top
        else ""
    )
    return (
        f"- **Group commit (9).** Without it, threads of one process take turns at the writer queue and each "
        f"pays its own fsync: at {most} threads the engine's statement pairs run at {ratio('engine', most, False):.2f}× "
        f"the one-thread floor and a pair's p99 is {by_key[('engine', most, False)]['latency']['p99_ms']:.0f} ms. "
        f"With `group_commit=True` the waiting statements share one commit: {on('engine', 16)['statements_per_commit']:.1f} "
        f"statements per commit at 16 threads and {on('engine', most)['statements_per_commit']:.1f} at {most}, for "
        f"{ratio('engine', 16, True):.2f}× and {ratio('engine', most, True):.2f}× the floor, with a p99 of "
        f"{on('engine', 16)['latency']['p99_ms']:.0f} and {on('engine', most)['latency']['p99_ms']:.0f} ms. Through "
        f"`Ledger.claim` + `Ledger.complete` the same threads reach {ratio('ledger', 16, True):.2f}× and "
        f"{ratio('ledger', most, True):.2f}× (without: {ratio('ledger', 16, False):.2f}× and "
        f"{ratio('ledger', most, False):.2f}×){ceiling}. One thread alone runs at "
        f"{on('engine', 1)['ratio_to_off']['median']:.2f}× (engine) and {on('ledger', 1)['ratio_to_off']['median']:.2f}× "
        f"(ledger) of its speed without group commit: a statement with no company is a plain write. The figures "
        f"drift with the disk's other traffic (min–max in the table); the ratio with ÷ without is taken within "
        f"each round."
    )


def _asgi_notes(res: dict[str, Any]) -> list[str]:
    full, normal = res["full"], res["normal"]

    def med(fig: dict[str, Any]) -> float:
        return float(fig["median"])

    hops = normal.get("hand_offs_per_request", {})
    text = (
        f"- **ASGI middleware (8).** Under NORMAL, first calls through `IdempotencyMiddleware` run at "
        f"{med(normal['first']['ratio_to_ledger']):.2f}× `Ledger.handle` + `after_response` called in an executor "
        f"thread, and replays at {med(normal['replay']['ratio_to_ledger']):.2f}×; the bare ASGI app takes "
        f"{1e6 / med(normal['bare_ops_per_s']):.1f} µs a request, next to nothing. The middleware's own cost beyond "
        f"both floors is {med(normal['first']['overhead_us']):.0f} µs per first call and "
        f"{med(normal['replay']['overhead_us']):.0f} µs per replay."
    )
    if hops:
        replay = (
            f"a replay {hops['replay']} times (`begin`, then the post-response call, which has nothing to do "
            "for a replay)"
            if hops["replay"] > 1
            else "a replay once"
        )
        first = (
            f"{hops['first']} times (`begin`, `finish`, the sweep after the answer)"
            if hops["first"] > 2
            else f"{hops['first']} times (`begin`, `finish`; the sweep after the answer costs no hand-off while "
            "nothing can expire)"
        )
        text += (
            f" The middleware hands a first call to a worker thread {first} and {replay}, where the floor crosses "
            f"once; a no-op round trip alone takes {med(normal['executor_hop_us']):.0f} µs here."
        )
    if "on_loop" in normal:
        ol = normal["on_loop"]
        own_on_loop = med(ol["first"]["overhead_us"])
        own_threaded = med(normal["first"]["overhead_us"])
        share = (
            "so most of the middleware's own cost is the hand-offs"
            if own_on_loop < own_threaded / 2
            else "so the hand-offs are not the larger part of its own cost"
        )
        text += (
            f" With its ledger calls made on the loop instead, the same middleware runs at "
            f"{med(ol['first']['ratio_to_ledger']):.2f}× `handle` called directly ({own_on_loop:.0f} µs of its own, "
            f"{share}), and the threaded one at {med(ol['threaded_vs_on_loop']):.2f}× that: the price, per "
            "sequential request, of keeping the loop free."
        )
    r = full["first"]["ratio_to_ledger"]
    text += (
        f" Under FULL the two fsyncs dominate and first calls run at {r['median']:.2f}× the floor "
        f"({r['min']:.2f}–{r['max']:.2f} over {full['rounds']} rounds: the fsync's cost drifts with the disk's "
        f"other traffic), replays at {med(full['replay']['ratio_to_ledger']):.2f}×."
    )
    fa = normal.get("fastapi")
    if fa:
        text += (
            f" Around a FastAPI app (NORMAL), first calls run at {med(fa['middleware_first']['ratio_to_bare']):.2f}× "
            f"the plain app with the middleware and {med(fa['route_first']['ratio_to_bare']):.2f}× with "
            f"`idempotent_route`; the middleware answers a replay before the app runs "
            f"({med(fa['middleware_replay']['ratio_to_bare']):.2f}× the plain app), the route class only after "
            f"FastAPI has routed the request and resolved its dependencies ({med(fa['route_replay']['ratio_to_bare']):.2f}×)."
        )
    notes = [text]
    lag = res["lag"]
    if "full" in lag and "normal" in lag:
        lf, ln = lag["full"], lag["normal"]

        def p99(lv: dict[str, Any], condition: str) -> float:
            return float(lv[condition]["lag"]["p99_ms"])

        notes.append(
            f"- **Event-loop lag (8).** With {lf['concurrency']} concurrent first calls and the ledger in the "
            f"default executor, a {lf['tick_ms']:g} ms ticker on the same loop wakes late by {p99(lf, 'threaded'):.1f} ms "
            f"at the 99th percentile under FULL and {p99(ln, 'threaded'):.1f} ms under NORMAL, against "
            f"{p99(lf, 'idle'):.1f} and {p99(ln, 'idle'):.1f} ms with no requests. With the ledger called on the "
            f"loop, as a naive adapter does, it is {p99(lf, 'blocking'):.0f} and {p99(ln, 'blocking'):.0f} ms: every "
            "statement (and under FULL its fsync) then stops every other coroutine. That variant completes "
            f"{lf['blocking']['requests_per_s']['median']:.0f} and {ln['blocking']['requests_per_s']['median']:.0f} "
            f"requests/s against {lf['threaded']['requests_per_s']['median']:.0f} and "
            f"{ln['threaded']['requests_per_s']['median']:.0f} with the executor, having no hand-offs to pay; "
            "whatever else the loop serves waits meanwhile. What lag remains with the "
            "executor is the loop's own share of the requests (the app, capturing and sending each answer) and the "
            "CPU it shares with the executor's threads and any other process."
        )
    return notes


def render_page(r: dict[str, Any]) -> str:
    """All of docs/performance.md."""
    notes = _notes(r["benchmarks"])
    parts = [
        INTRO_HEAD,
        glance(r["benchmarks"]),
        aims(r["benchmarks"], int((r.get("machine") or {}).get("nproc") or 2)),
        INTRO,
        render(r),
    ]
    if notes:
        parts += ["## Reading the tables\n", "\n".join(notes) + "\n"]
    parts.append(WRITER_QUEUE)
    return "\n".join(parts)


def write_page(path: str, results: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_page(results))


def redis_peers_table(res: dict[str, Any]) -> list[str]:
    """(13) The page's table: requests per second of each system through
    each door and level, as a ratio to the floor and idemctl's to idemkit's
    (each ratio taken within a round; median and min–max of the rounds)."""
    if "rows" not in res:  # results from before the doors and levels: one request at a time
        return [
            "(13) Redis: the published results predate the run through both doors at 1, 10 and 50 in flight; "
            "run `python -m bench.redis_peers`."
        ]
    kit = "idemctl_vs_idemkit" in res["rows"][0]
    lines = _beside_idemkit(["(13) Redis", "in flight", "kind", "raw redis-py floor/s"], kit)
    missed = []
    for c in res["rows"]:
        door = "WSGI, threads" if c["door"] == "wsgi" else "ASGI, tasks"
        kind = "first calls" if c["kind"] == "first" else "replays"
        cells = [door, str(c["level"]), kind, _sp(c["floor"], 0), _sp(c["idemctl"], 0), _sp(c["idemctl_vs_floor"])]
        if kit:
            cells += [_sp(c["idemkit"], 0), _sp(c["idemkit_vs_floor"]), _sp(c["idemctl_vs_idemkit"])]
            if c["idemctl_vs_idemkit"]["median"] < res["aim"]:
                missed.append(f"{c['door'].upper()} {kind} at {c['level']}")
        lines.append("| " + " | ".join(cells) + " |")
    v = res["versions"]
    lines += [
        "",
        f"Measured in a run of its own (`python -m bench.redis_peers`, {res['elapsed_s']:.0f} s), {res['started_utc']}, "
        f"at commit `{res['commit']}`, load average {res['load']} at the start and {res['load_end']} at the end, "
        f"{res['nproc']} cores; redis-server {res['server']} on loopback, redis-py {v.get('redis')}, "
        f"idemctl {v.get('idemctl')}" + (f", idemkit {v.get('idemkit')}" if kit else "") + ". "
        f"{res['rounds']} alternated rounds of {res['requests_per_round']} requests per variant "
        "(median and min–max; each ratio within a round). WSGI: the middleware called from that many threads; "
        "ASGI: that many tasks on one event loop. The floor is what any Redis ledger sends: SET NX + SET XX "
        "for a first call, one GET for a replay (redis-py's synchronous client for WSGI, `redis.asyncio` for ASGI). "
        "idemctl sends the floor's round trips (two scripts a first call; a replay is the claim, which hands back "
        "the row in its way); the rest is its Python per request and EVALSHA's cost over a plain SET. idemkit's "
        "WSGI middleware runs its asyncio backend on a loop of its own through a bridge.",
    ]
    if kit:
        lines += [
            "",
            f"The aim is idemctl ≥ {res['aim']}× idemkit on every row: "
            + (f"missed on {', '.join(missed)}." if missed else "met on every row."),
        ]
    if "profile" in res:
        lines += ["", _redis_profile(res["profile"])]
    return lines + _redis_instructions(res.get("instructions"))


def _instruction_table(
    title: str, labels: dict[tuple[str, str], str], by: dict[tuple[str, str, str], dict[str, Any]]
) -> list[str]:
    """Callgrind's rows as a first-call / replay table, a line per (door,
    system) of `labels` in its order; what was not counted is left out."""
    lines = ["", f"| {title} | first call | ÷ floor | replay | ÷ floor |", "|---|---|---|---|---|"]
    for (door, system), label in labels.items():
        if (door, system, "first") in by:
            first, replay = by[(door, system, "first")], by[(door, system, "replay")]
            lines.append(
                f"| {label} | {_n(first['instructions'])} | {first['vs_floor']:.2f} "
                f"| {_n(replay['instructions'])} | {replay['vs_floor']:.2f} |"
            )
    return lines


def _redis_instructions(ins: dict[str, Any] | None) -> list[str]:
    """(13) instructions: one request at a time through each door, callgrind."""
    if not ins:
        return []
    if "missing" in ins:
        return ["", f"(13) instructions: not counted ({ins['missing']})."]
    names = {
        "floor": ("raw redis-py (SET NX + SET XX; GET)", "raw `redis.asyncio` (SET NX + SET XX; GET)"),
        "idemctl": ("idemctl, WSGI `IdempotencyMiddleware`", "idemctl, ASGI `IdempotencyMiddleware`"),
        "idemkit": (
            "idemkit, `WSGIIdempotencyMiddleware` + `RedisBackend`",
            "idemkit, ASGI `IdempotencyMiddleware` + `RedisBackend`",
        ),
    }
    # Rows counted before the ASGI door was counted carry no door: WSGI's.
    by = {(r.get("door", "wsgi"), r["system"], r["kind"]): r for r in ins["rows"]}
    labelled = {
        (door, system): labels[d] for d, door in enumerate(("wsgi", "asgi")) for system, labels in names.items()
    }
    lines = _instruction_table("(13) instructions a request on Redis (callgrind)", labelled, by)
    lines += [
        "",
        f"Counted by valgrind's callgrind in the same run, {ins['requests_per_segment']} requests a segment after a "
        "warm-up, one at a time (an ASGI request driven to its end on the loop): the instructions of the Python "
        "process only (the client's side: redis-server's own work is not counted), so they hold on a busy "
        "machine. idemkit's WSGI count includes its bridge's background event loop, which runs its backend for "
        "the WSGI middleware.",
    ]
    kit, floor = by.get(("asgi", "idemkit", "first")), by.get(("asgi", "floor", "first"))
    if kit is not None and floor is not None:
        room = kit["instructions"] / 1.5 - floor["instructions"]
        lines[-1] += (
            f" On ASGI, redis-py's asyncio client is most of every system's count: its two commands are the "
            f"floor's whole first call ({_n(floor['instructions'])}), so a first call at 1.5× idemkit's rate "
            f"would leave {_n(max(0, round(room)))} instructions for everything else (the ASGI exchange, the "
            f"contract, the request's fingerprint), where idemkit spends "
            f"{_n(kit['instructions'] - floor['instructions'])}."
        )
    return lines


def _redis_profile(profile: dict[str, Any]) -> str:
    """Where idemctl's (and idemkit's) time goes on Redis, from the run's cProfile passes."""
    names = {
        "wsgi_first_1": "idemctl, WSGI first call, 1 in flight",
        "wsgi_replay_1": "idemctl, WSGI replay, 1 in flight",
        "asgi_first_10": "idemctl, ASGI first call, 10 in flight",
        "asgi_replay_10": "idemctl, ASGI replay, 10 in flight",
        "asgi_first_10_idemkit": "idemkit, ASGI first call, 10 in flight",
        "asgi_replay_10_idemkit": "idemkit, ASGI replay, 10 in flight",
    }
    groups = ("idemctl's store", "idemctl", "idemkit", "redis-py", "asyncio", "C calls and the rest")
    shown = {"idemctl": "the rest of idemctl", "idemkit": "idemkit's own"}
    parts = []
    for key, label in names.items():
        p = profile.get(key)
        if p:
            share = p["share"]
            cells = ", ".join(f"{shown.get(g, g)} {share[g] * 100:.0f}%" for g in groups if g in share)
            parts.append(f"{label}: {p['us_per_request']:.0f} µs ({cells})")
    text = (
        "Where the time goes (cProfile's internal time by package, after the rounds; the profiler slows "
        "every call, so compare shares, not µs with the table): " + "; ".join(parts) + "."
    )

    def own(key: str, groups: tuple[str, ...]) -> float:
        p = profile[key]
        return float(sum(p["share"].get(g, 0.0) for g in groups) * p["us_per_request"])

    if "asgi_first_10" in profile and "asgi_first_10_idemkit" in profile:
        ours, theirs = own("asgi_first_10", ("idemctl", "idemctl's store")), own("asgi_first_10_idemkit", ("idemkit",))
        store = own("asgi_first_10", ("idemctl's store",))
        text += (
            f" On ASGI a first call spends {ours:.0f} µs (under the profiler) in idemctl's own Python, "
            f"{store:.0f} µs of it in the store, against {theirs:.0f} µs in idemkit's: the gap is the request "
            "machinery every engine shares (the exchange, the decision loop, the fingerprint, the task that "
            "shields each write from a cancelled request), not the Redis store."
        )
    return text
