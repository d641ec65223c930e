"""The correctness facts the peers' numbers rest on, measured for each system
through its real entry point (bench/peers_systems.py):

(a) race duplicates: real threads send one key at once to a handler that
    counts its runs; how many times did it run, and what did the others get;
(b) recovery after a crash: a child process claims the key and is killed
    with SIGKILL inside the handler; how long until a retry with the same key
    runs instead of being told "in progress" (polled every `poll_s`);
(c) a late writer: owner A claims and stalls past the TTL, B takes over and
    stores its answer, then A finishes; which answer does the store hold.

tests/adapters/test_peers_correctness.py asserts them (exactly for idemctl, as
observed for the peers); `python -m bench --peers` records and renders them.

    python -m bench.peers_facts crash SPEC_JSON KEY   # the child of (b)
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Any

from .peers_systems import System, build

ANSWER_A = b"A" * 1024
ANSWER_B = b"B" * 1024
CLAIMED = "claimed"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _key(scenario: str) -> str:
    return f"{scenario}-{secrets.token_hex(4)}"


def race(system: System, threads: int = 16, hold_s: float = 0.3) -> dict[str, Any]:
    """`threads` real threads released by one barrier send the same key; the
    handler holds for `hold_s` so that they all arrive while it runs."""
    key = _key("race")
    lock = threading.Lock()
    runs = 0
    barrier = threading.Barrier(threads)
    replies: list[str] = []
    bodies: set[bytes] = set()
    errors: list[str] = []

    def handler() -> bytes:
        nonlocal runs
        with lock:
            runs += 1
        time.sleep(hold_s)
        return ANSWER_A

    def send() -> None:
        try:
            barrier.wait(timeout=30)
            reply = system.call(key, handler)
        except Exception as exc:  # a system that breaks under the race is a fact too
            with lock:
                errors.append(f"{type(exc).__name__}: {exc}")
            return
        with lock:
            replies.append(reply.kind)
            if reply.kind in ("ran", "replayed"):
                bodies.add(reply.body)

    workers = [threading.Thread(target=send, name=f"race-{i}") for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    return {
        "threads": threads,
        "hold_s": hold_s,
        "executions": runs,
        "replies": dict(sorted(Counter(replies).items())),
        "distinct_answers": len(bodies),
        "errors": errors[:3],
    }


def _crashed_child(spec: dict[str, Any], key: str, timeout_s: float = 60.0) -> float:
    """Start a child that claims `key` and blocks in the handler; SIGKILL it
    as soon as it says it is inside. Returns the monotonic time it said so."""
    child = subprocess.Popen(
        [sys.executable, "-m", "bench.peers_facts", "crash", json.dumps(spec), key],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        deadline = time.monotonic() + timeout_s
        line = ""
        while time.monotonic() < deadline:
            line = child.stdout.readline()
            if line.strip() == CLAIMED or not line:
                break
        if line.strip() != CLAIMED:
            child.kill()
            _, err = child.communicate(timeout=10)
            raise RuntimeError(f"the crash child never reached its handler: {err[-2000:]}")
        inside = time.monotonic()
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=10)
        return inside
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)
        for stream in (child.stdout, child.stderr):
            if stream is not None:
                stream.close()


def recovery(spec: dict[str, Any], poll_s: float = 0.05, give_up_s: float | None = None) -> dict[str, Any]:
    """(b): the crash, then a retry every `poll_s` until one runs."""
    key = _key("crash")
    ttl = float(spec["ttl_s"])
    give_up = give_up_s if give_up_s is not None else ttl + 20.0
    system = build(spec)
    try:
        inside = _crashed_child(spec, key)
        runs = 0

        def handler() -> bytes:
            nonlocal runs
            runs += 1
            return ANSWER_B

        replies: Counter[str] = Counter()
        first: dict[str, Any] | None = None
        recovered_s = None
        while True:
            reply = system.call(key, handler)
            elapsed = time.monotonic() - inside
            if first is None:
                first = {"kind": reply.kind, "after_s": round(elapsed, 3)}
            replies[reply.kind] += 1
            if reply.kind == "ran":
                recovered_s = elapsed
                break
            if reply.kind not in ("in_progress",) or elapsed > give_up:
                break
            time.sleep(poll_s)
        after = system.call(key, handler) if recovered_s is not None else None
        return {
            "ttl_setting": system.ttl_setting,
            "ttl_s": ttl,
            "ttl_default_s": system.ttl_default_s,
            "poll_s": poll_s,
            "first_retry": first,
            "replies": dict(sorted(replies.items())),
            "recovered_s": round(recovered_s, 3) if recovered_s is not None else None,
            "gave_up_after_s": None if recovered_s is not None else round(time.monotonic() - inside, 3),
            "retry_executions": runs,
            "next_retry": after.kind if after is not None else None,
        }
    finally:
        system.close()


def late_writer(system: System, ttl_s: float, margin_s: float = 0.3) -> dict[str, Any]:
    """(c): A claims and stalls past the TTL; B then takes the key over and
    stores its answer; A finishes last."""
    key = _key("late")
    a_inside = threading.Event()
    a_go = threading.Event()
    a_reply: list[Any] = []

    def handler_a() -> bytes:
        a_inside.set()
        a_go.wait(timeout=120)
        return ANSWER_A

    def owner_a() -> None:
        try:
            a_reply.append(system.call(key, handler_a))
        except Exception as exc:
            a_reply.append(exc)

    a = threading.Thread(target=owner_a, name="late-writer-A")
    a.start()
    if not a_inside.wait(timeout=60):
        a_go.set()
        a.join(timeout=60)
        raise RuntimeError(f"owner A never reached its handler: {a_reply}")
    time.sleep(ttl_s + margin_s)
    b = system.call(key, lambda: ANSWER_B)
    stored_after_b = system.stored(key)
    a_go.set()
    a.join(timeout=120)
    stored = system.stored(key)

    def which(body: bytes | None) -> str:
        return {ANSWER_A: "A", ANSWER_B: "B", None: "none"}.get(body, "other")

    ra = a_reply[0] if a_reply else None
    a_got = (
        f"error: {type(ra).__name__}"
        if isinstance(ra, Exception)
        else (f"{ra.kind} {which(ra.body)}" if ra else "nothing")
    )
    return {
        "ttl_s": ttl_s,
        "stall_s": round(ttl_s + margin_s, 3),
        "b_reply": f"{b.kind} {which(b.body) if b.kind in ('ran', 'replayed') else ''}".strip(),
        "stored_after_b": which(stored_after_b),
        "stored_after_a": which(stored),
        "a_client_got": a_got,
        "late_writer_overwrote": which(stored) == "A",
    }


def replay_with_validation(spec: dict[str, Any]) -> dict[str, Any]:
    """Powertools only: one call, then its retry, with payload validation on
    (its fingerprint of the request body)."""
    key = _key("validate")
    system = build({**spec, "validate": True})
    try:
        first = system.call(key)
        retry = system.call(key)
    finally:
        system.close()
    return {"first": first.kind, "retry": retry.kind, "retry_detail": retry.detail}


def _child(spec_json: str, key: str) -> int:
    spec = json.loads(spec_json)
    system = build(spec)

    def handler() -> bytes:
        print(CLAIMED, flush=True)
        time.sleep(3600)  # killed here, holding the key
        return ANSWER_A

    system.call(key, handler)
    return 1  # never reached when the parent kills us


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "crash":
        sys.exit(_child(sys.argv[2], sys.argv[3]))
    print(__doc__, file=sys.stderr)
    sys.exit(2)
