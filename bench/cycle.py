"""(1) The request cycle: one full `Ledger.handle` against the raw floor.

Floor: the claim `INSERT … RETURNING` plus the fenced completion
`UPDATE … RETURNING` storing a 1 KiB body, on a plain sqlite3 connection with
the same settings, on the same file. Ours: fingerprint of a 1 KiB body, claim,
a mutation that does nothing, fenced completion, the answer rebuilt from what
was stored. Both run in alternating blocks on one file, so they see the same
table size, page cache and disk; every repetition gives one paired ratio.

The replay and 409 paths are read-mostly; their floor is one raw primary-key
SELECT. Because idemctl claims first (one atomic statement decides), each of
them also pays a claim attempt that finds the row; a second floor, the raw
claim attempt plus the SELECT, shows what that design costs by itself."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from idemctl import Ledger, Outcome

from .common import (
    BODY_1K,
    FINGERPRINT,
    HEADERS,
    RAW_CLAIM,
    RAW_LOOKUP,
    Context,
    noop_mutation,
    now_ms,
    raw_connect,
    raw_pair,
    spread,
    timed,
)

PRINCIPAL = "acct_bench"


def _paired(reps: int, n: int, variants: dict[str, Callable[[int, int], None]]) -> dict[str, list[float]]:
    """Run each variant n times per repetition, rotating their order; rates in ops/s."""
    names = list(variants)
    rates: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            fn = variants[name]
            rates[name].append(n / timed(lambda: fn(rep, n)))
    return rates


def _figure(rates: list[float], floor: list[float]) -> dict[str, Any]:
    return {
        "ops_per_s": spread(rates, 1),
        "ratio": spread([a / b for a, b in zip(rates, floor)]),
    }


def request_cycle(ctx: Context, synchronous: str) -> dict[str, Any]:
    n = ctx.size(1500 if synchronous == "FULL" else 4000, 40)
    reps = ctx.size(7, 2)
    path = ctx.path(f"cycle-{synchronous.lower()}.db")
    ledger = Ledger.open(path, synchronous=synchronous)
    ledger.init()
    raw = raw_connect(path, synchronous)
    handle = ledger.handle
    # The same ledger without the writer queue, on the same file: what the
    # queue costs one process that never has to wait in it.
    unqueued = Ledger.open(path, synchronous=synchronous, write_queue=False)

    def floor(rep: int, n: int) -> None:
        now = now_ms()
        for i in range(n):
            raw_pair(raw, PRINCIPAL, f"raw-{rep}-{i}", now)

    def ours(rep: int, n: int) -> None:
        for i in range(n):
            handle(PRINCIPAL, f"led-{rep}-{i}", "POST", "/orders", HEADERS, BODY_1K, noop_mutation)

    def ours_unqueued(rep: int, n: int) -> None:
        for i in range(n):
            unqueued.handle(PRINCIPAL, f"nq-{rep}-{i}", "POST", "/orders", HEADERS, BODY_1K, noop_mutation)

    def ours_with_sweep(rep: int, n: int) -> None:
        for i in range(n):
            ledger.after_response(
                handle(PRINCIPAL, f"sw-{rep}-{i}", "POST", "/orders", HEADERS, BODY_1K, noop_mutation)
            )

    check = handle(PRINCIPAL, "check", "POST", "/orders", HEADERS, BODY_1K, noop_mutation)
    assert check.outcome is Outcome.EXECUTED and check.body == b"r" * 1024, check
    rates = _paired(
        reps,
        n,
        {"floor": floor, "handle": ours, "handle_after_response": ours_with_sweep, "handle_no_queue": ours_unqueued},
    )
    ledger.close()
    unqueued.close()
    raw.close()
    return {
        "synchronous": synchronous,
        "requests_per_rep": n,
        "floor": {"ops_per_s": spread(rates["floor"], 1)},
        "handle": _figure(rates["handle"], rates["floor"]),
        "handle_after_response": _figure(rates["handle_after_response"], rates["floor"]),
        "handle_no_queue": _figure(rates["handle_no_queue"], rates["floor"]),
        "queue_on_vs_off": spread([a / b for a, b in zip(rates["handle"], rates["handle_no_queue"])]),
    }


def read_paths(ctx: Context) -> dict[str, Any]:
    """Replay, 409 reused and 409 in progress, against a raw primary-key SELECT."""
    n = ctx.size(3000, 40)
    reps = ctx.size(5, 2)
    keys = ctx.size(500, 20)
    path = ctx.path("paths.db")
    ledger = Ledger.open(path)
    ledger.init()
    for i in range(keys):
        ledger.handle(PRINCIPAL, f"done-{i}", "POST", "/orders", HEADERS, BODY_1K, noop_mutation)
        ledger.claim(PRINCIPAL, f"busy-{i}", ledger_fp(ledger))
    raw = raw_connect(path)
    other = b"x" * 1024
    now = now_ms()

    def pk_select(rep: int, n: int) -> None:
        for i in range(n):
            raw.execute(RAW_LOOKUP, {"principal": PRINCIPAL, "key": f"done-{i % keys}"}).fetchall()

    def claim_then_select(rep: int, n: int) -> None:
        for i in range(n):
            key = f"done-{i % keys}"
            raw.execute(
                RAW_CLAIM, {"principal": PRINCIPAL, "key": key, "fingerprint": FINGERPRINT, "token": 1, "now": now}
            ).fetchall()
            raw.execute(RAW_LOOKUP, {"principal": PRINCIPAL, "key": key}).fetchall()

    def run_path(prefix: str, body: bytes) -> Callable[[int, int], None]:
        def go(rep: int, n: int) -> None:
            for i in range(n):
                ledger.handle(PRINCIPAL, f"{prefix}-{i % keys}", "POST", "/orders", HEADERS, body, noop_mutation)

        return go

    expected = {
        "replay": (run_path("done", BODY_1K), "done", BODY_1K, Outcome.REPLAYED),
        "reused_409": (run_path("done", other), "done", other, Outcome.REUSED),
        "in_progress_409": (run_path("busy", BODY_1K), "busy", BODY_1K, Outcome.IN_PROGRESS),
    }
    for name, (_, prefix, body, outcome) in expected.items():
        got = ledger.handle(PRINCIPAL, f"{prefix}-0", "POST", "/orders", HEADERS, body, noop_mutation).outcome
        assert got is outcome, (name, got)
    variants: dict[str, Callable[[int, int], None]] = {
        "pk_select": pk_select,
        "claim_attempt_and_select": claim_then_select,
    }
    variants.update({name: spec[0] for name, spec in expected.items()})
    rates = _paired(reps, n, variants)
    ledger.close()
    raw.close()
    out: dict[str, Any] = {
        "requests_per_rep": n,
        "floor": {"ops_per_s": spread(rates["pk_select"], 1)},
        "claim_attempt_and_select": _figure(rates["claim_attempt_and_select"], rates["pk_select"]),
    }
    for name in expected:
        fig = _figure(rates[name], rates["pk_select"])
        fig["ratio_vs_claim_attempt_and_select"] = spread(
            [a / b for a, b in zip(rates[name], rates["claim_attempt_and_select"])]
        )
        out[name] = fig
    return out


def ledger_fp(ledger: Ledger) -> str:
    from idemctl import fingerprint

    return fingerprint("POST", "/orders", HEADERS, BODY_1K, ledger.policy.fingerprint_headers)


def run(ctx: Context) -> dict[str, Any]:
    return {
        "full": request_cycle(ctx, "FULL"),
        "normal": request_cycle(ctx, "NORMAL"),
        "paths": read_paths(ctx),
    }
