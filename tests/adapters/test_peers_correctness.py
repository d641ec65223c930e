"""The correctness facts behind the peers' figures (docs/performance.md, table
(10)), for every system through its real entry point on its real store:
idemctl on PostgreSQL (WSGI middleware), idemkit on PostgreSQL (its WSGI
middleware) and Powertools for AWS Lambda (`idempotent_function`, Redis).

idemctl's behaviour is asserted exactly. The peers' is asserted as observed
(idemkit 1.0.2, Powertools 3.37.0), with why, so that a change in theirs
fails here and the published table is re-examined. The scenarios themselves
are bench/peers_facts.py, which `python -m bench --peers` runs too.

Each system gets its own PostgreSQL schema (created and dropped here) or a
Redis key prefix unique to the run (its keys deleted afterwards). No timing
is asserted: the TTLs are short so the scenarios take seconds, and only the
order of events is checked."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from bench import peers_facts, peers_systems
from bench.peers_facts import ANSWER_A, ANSWER_B

TTL_S = 2.0  # short, so that waiting past it takes seconds


def _require(system: str) -> None:
    """A peer that is not installed skips here (the peers are the `bench`
    extra, which `.ci/run` installs); a store that does not answer skips, or
    fails under CI, as the PostgreSQL half does."""
    reason = peers_systems.missing().get(system)
    if reason is not None:
        pytest.skip(f"the peers' correctness facts need the bench extra: {reason}")
    if system == "powertools":
        try:
            import redis

            redis.Redis.from_url(peers_systems.redis_url(), socket_connect_timeout=3).ping()
        except Exception as exc:
            reason = f"no Redis at {peers_systems.redis_url()}: {exc} (set {peers_systems.REDIS_URL_ENV})"
    if reason is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"CI runs the peers' correctness facts: {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(params=["idemctl", "idemkit", "powertools"])
def spec(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """The system's spec on a store of its own, provisioned and removed afterwards."""
    name = request.param
    if name in ("idemctl", "idemkit"):
        base = request.getfixturevalue("postgres_server")  # skips (fails under CI) without a server
        monkeypatch.setenv(peers_systems.PG_URL_ENV, base)
    _require(name)
    spec = peers_systems.spec_for(name, peers_systems.new_tag(), TTL_S, purpose="test")
    peers_systems.provision(spec)
    try:
        yield spec
    finally:
        peers_systems.deprovision(spec)


@pytest.fixture
def system(spec: dict[str, Any]) -> Iterator[peers_systems.System]:
    built = peers_systems.build(spec)
    try:
        yield built
    finally:
        built.close()


def test_sixteen_threads_racing_one_key_run_the_handler_once(system: peers_systems.System) -> None:
    facts = peers_facts.race(system, threads=16, hold_s=0.3)
    assert facts["errors"] == []
    assert facts["executions"] == 1
    assert facts["replies"]["ran"] == 1
    assert facts["distinct_answers"] == 1
    others = {kind: n for kind, n in facts["replies"].items() if kind != "ran"}
    assert sum(others.values()) == 15
    if system.name == "idemkit":
        # It makes a duplicate wait for the in-flight attempt (10 s by default)
        # and replays its answer, rather than refusing it.
        assert set(others) <= {"replayed"}, facts
    else:
        # idemctl (in_progress_wait_ms=0 by default) and Powertools refuse a
        # duplicate while the first runs; one arriving after it would be replayed.
        assert set(others) <= {"in_progress", "replayed"}, facts


def test_a_late_writer_after_a_takeover_leaves_the_newer_answer_stored_or_overwrites_it(
    system: peers_systems.System,
) -> None:
    facts = peers_facts.late_writer(system, TTL_S)
    assert facts["b_reply"] == "ran B"  # B took the stalled key over and ran
    assert facts["stored_after_b"] == "B"
    if system.name == "powertools":
        # Its completion is a plain SET of the key: nothing fences the owner
        # whose in-progress record expired, so A's answer replaces B's.
        assert facts["stored_after_a"] == "A"
        assert facts["late_writer_overwrote"] is True
    else:
        # idemctl fences the completion by generation, idemkit by its claim token.
        assert facts["stored_after_a"] == "B"
        assert facts["late_writer_overwrote"] is False
    # Every system still hands A's client the answer A computed.
    assert facts["a_client_got"] == "ran A"


@pytest.mark.slow
def test_a_retry_after_a_sigkill_mid_handler_runs_once_the_reservation_expires(spec: dict[str, Any]) -> None:
    # idemkit's duplicates otherwise wait 10 s for the dead attempt before answering 423.
    facts = peers_facts.recovery({**spec, "wait_s": 0.1 if spec["system"] == "idemkit" else None}, poll_s=0.05)
    assert facts["recovered_s"] is not None, facts
    assert facts["retry_executions"] == 1
    assert facts["next_retry"] == "replayed"
    assert facts["replies"]["ran"] == 1
    # Before the TTL, retries are told the key is in progress (idemctl 409,
    # idemkit 423, Powertools IdempotencyAlreadyInProgressError); checked only
    # when the first retry really came before the TTL on this machine.
    if facts["first_retry"]["after_s"] < TTL_S * 0.5:
        assert facts["first_retry"]["kind"] == "in_progress", facts
    expected_setting = {
        "idemctl": ("Policy.pending_ttl_ms", 30.0),
        "idemkit": ("HttpConfig.lease_ttl_seconds", 30.0),
        # Outside Lambda no context bounds an in-progress record: it lives as
        # long as a completed one, an hour by default.
        "powertools": ("IdempotencyConfig.expires_after_seconds", 3600.0),
    }[spec["system"]]
    assert (facts["ttl_setting"], facts["ttl_default_s"]) == expected_setting


def test_powertools_with_payload_validation_refuses_the_retry_of_a_completed_call() -> None:
    _require("powertools")
    spec = peers_systems.spec_for("powertools", peers_systems.new_tag(), TTL_S, purpose="test")
    try:
        facts = peers_facts.replay_with_validation(spec)
    finally:
        peers_systems.deprovision(spec)
    # Its Redis layer writes the completed record without the validation
    # hash, so the very retry it should replay fails validation.
    assert facts == {"first": "ran", "retry": "refused", "retry_detail": "IdempotencyValidationError"}


def test_each_system_stores_the_answer_it_replays(system: peers_systems.System) -> None:
    first = system.call("stored-check", lambda: ANSWER_B)
    again = system.call("stored-check", lambda: ANSWER_A)
    assert (first.kind, first.body) == ("ran", ANSWER_B)
    assert (again.kind, again.body) == ("replayed", ANSWER_B)
    assert system.stored("stored-check") == ANSWER_B
    assert system.stored("never-used") is None
