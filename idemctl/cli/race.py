"""`simulate race`: N fresh OS processes send the same request at once, each
through its own Ledger and connection, to show that exactly one runs it."""

from __future__ import annotations

import base64
import json
import logging
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..errors import ScenarioError, SchemaMissingError
from ..ledger import Ledger
from ..outcomes import Outcome
from ..policy import Policy
from .scenario import Step, mutation_answer

RACE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class RaceResult:
    """What one racing process saw."""

    worker: int
    pid: int | None
    outcome: Outcome | None  # None: the process failed
    status: int | None = None
    generation: int | None = None
    body: bytes = b""
    retry_after: str | None = None
    error: str = ""


_RACE_CHILD = "from idemctl.cli.race import race_child; race_child()"


# What a racing process takes of the parent's policy (the rest keeps its default).
_CHILD_POLICY = [
    "pending_ttl_ms",
    "retention_ms",
    "sweep_batch",
    "body_cap_bytes",
    "fingerprint_headers",
    "replayable_headers",
    "reuse_status",
]


def _policy_doc(policy: Policy) -> dict[str, Any]:
    doc: dict[str, Any] = {name: getattr(policy, name) for name in _CHILD_POLICY}
    doc["protected_methods"] = sorted(policy.protected_methods)  # a frozenset: JSON has no sets
    return doc


def race_child() -> None:
    """One racing process (started by `race_processes` as ``python -c``): read
    the request on stdin, open its own ledger, say "ready", wait for "go",
    send the request, print the outcome as one JSON line."""
    logging.getLogger("idemctl").addHandler(logging.NullHandler())
    spec = json.loads(sys.stdin.readline())
    try:
        now = int(spec["now"])
        ledger = Ledger.open(spec["target"], policy=Policy(**spec["policy"]), clock=lambda: now, create=False)
        answer_headers = tuple((str(k), str(v)) for k, v in spec["response_headers"])
        answer_body = base64.b64decode(spec["response_body"])

        def mutation(_body: bytes) -> tuple[int, tuple[tuple[str, str], ...], bytes]:
            time.sleep(spec["hold_ms"] / 1000)  # the losers arrive while this one still holds the claim
            return int(spec["response_status"]), answer_headers, answer_body

        print("ready", flush=True)
        if sys.stdin.readline().strip() != "go":
            return  # the parent gave up on the race
        answer = ledger.handle(
            spec["principal"],
            spec["key"],
            spec["method"],
            spec["path"],
            [(str(k), str(v)) for k, v in spec["headers"]],
            base64.b64decode(spec["body"]),
            mutation,
        )
        ledger.close()
        result: dict[str, Any] = {
            "outcome": answer.outcome.value,
            "status": answer.status,
            "generation": answer.generation,
            "body": base64.b64encode(answer.body).decode("ascii"),
            "retry_after": answer.header("Retry-After"),
        }
    except Exception as exc:  # reported as a failed worker
        # A missing ledger's reason, without the library's advice to call init().
        said = exc.reason if isinstance(exc, SchemaMissingError) else str(exc)
        result = {"error": f"{type(exc).__name__}: {' '.join(said.split())}"}
    print(json.dumps(result), flush=True)


def _race_result(worker: int, pid: int, line: str, stderr: str, code: int | None) -> RaceResult:
    try:
        doc = json.loads(line)
    except ValueError:
        last = stderr.strip().splitlines()[-1] if stderr.strip() else "no output"
        return RaceResult(worker, pid, None, error=f"exited with code {code}: {last}")
    if "error" in doc:
        return RaceResult(worker, pid, None, error=doc["error"])
    return RaceResult(
        worker,
        pid,
        Outcome(doc["outcome"]),
        doc["status"],
        doc["generation"],
        base64.b64decode(doc["body"]),
        doc["retry_after"],
    )


def race_processes(target: str, step: Step, policy: Policy, now: int) -> list[RaceResult]:
    """Start `step.workers` fresh Python processes that send the same request
    at once. Each opens its own Ledger and connection and reports "ready";
    only when all are ready does each get "go", so they hit the ledger
    together.

    >>> import os, tempfile
    >>> from idemctl.cli.scenario import builtin
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     target = os.path.join(tmp, "race.db")
    ...     with Ledger.open(target) as ledger:
    ...         _ = ledger.init()
    ...     results = race_processes(target, builtin("race", workers=3).steps[0], Policy(), 1_700_000_000_000)
    >>> len(results), sum(r.outcome is not None and r.outcome.ran_mutation for r in results)
    (3, 1)
    """
    if target == ":memory:":
        raise ScenarioError("race needs a database file or URL that other processes can open, not :memory:")
    # Fresh interpreters rather than multiprocessing: fork copies the caller's
    # threads and locks, and spawn re-imports its __main__ (which breaks under
    # python -c, a REPL or a notebook).
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = package_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    procs: list[subprocess.Popen[str]] = []
    try:
        for worker in range(1, step.workers + 1):
            status, headers, body = mutation_answer(replace(step, actor=f"w{worker}"))
            spec = {
                "target": target,
                "now": now,
                "policy": _policy_doc(policy),
                "principal": step.principal,
                "key": step.key,
                "method": step.method,
                "path": step.path,
                "headers": list(step.headers),
                "body": base64.b64encode(step.body).decode("ascii"),
                "hold_ms": step.hold_ms,
                "response_status": status,
                "response_headers": list(headers),
                "response_body": base64.b64encode(body).decode("ascii"),
            }
            proc = subprocess.Popen(
                [sys.executable, "-c", _RACE_CHILD],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(spec) + "\n")
            proc.stdin.flush()
            procs.append(proc)
        firsts = [(p.stdout.readline() if p.stdout else "").strip() for p in procs]
        # Released in random order: which worker wins is up to the race, not to its number.
        for index in random.sample(range(len(procs)), len(procs)):
            proc = procs[index]
            if firsts[index] == "ready" and proc.stdin is not None:
                proc.stdin.write("go\n")
                proc.stdin.flush()
        results = []
        for worker, (proc, first) in enumerate(zip(procs, firsts, strict=True), start=1):
            try:
                out, err = proc.communicate(timeout=RACE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            line = (out.strip().splitlines() or [""])[-1] if first == "ready" else first
            results.append(_race_result(worker, proc.pid, line, err, proc.returncode))
        return results
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
