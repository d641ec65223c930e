"""D1's HTTP API when things go wrong, through the stand-in on workerd: a
refused token, a wrong account or database (typed errors, never "cannot
reach"), a 429 storm (retried, Retry-After honoured), a 5xx and a call
that times out (a read retried, a write not: its outcome is unknown), and
the token kept out of every message, repr, log line and CLI output."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from idemctl.errors import ConnectionFailedError, LedgerNotFoundError, StorageError
from idemctl.storage import Store, open_engine
from idemctl.storage.d1 import (
    D1AccountError,
    D1DatabaseNotFoundError,
    D1Engine,
    D1Location,
    D1RateLimitedError,
    D1TimeoutError,
    D1TokenRefusedError,
)
from idemctl.storage.d1.api import D1Api

from .runtime import ACCOUNT, DATABASE, TOKEN, Runtime

pytestmark = pytest.mark.slow

WRONG = "wrong-token-31337"


def cli(runtime: Runtime, *args: str, token: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("IDEMCTL_", "CLOUDFLARE_"))}
    env.update(runtime.env(token))
    return subprocess.run(
        [sys.executable, "-m", "idemctl", "--db", runtime.ledger_url, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_refused_token_is_a_typed_error_that_never_shows_the_token(
    runtime: Runtime, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    engine = D1Engine(runtime.ledger_url, environ=runtime.env(WRONG))
    with pytest.raises(D1TokenRefusedError) as refused:
        engine.read("SELECT 1", {})
    assert "(403, code 10000: Authentication error)" in str(refused.value)
    assert "cannot reach" not in str(refused.value)
    shown = [str(refused.value), repr(engine), repr(engine.api), repr(engine.location), caplog.text]
    assert not any(WRONG in text for text in shown)
    out = cli(runtime, "stats", token=WRONG)
    assert out.returncode != 0
    assert out.stdout == ""
    assert out.stderr.count("\n") == 1 and "refused the API token" in out.stderr
    assert WRONG not in out.stderr and "Traceback" not in out.stderr
    doctor = cli(runtime, "doctor", token=WRONG)
    assert doctor.returncode != 0 and WRONG not in doctor.stdout + doctor.stderr


def test_a_wrong_account_or_database_is_named_as_such(runtime: Runtime) -> None:
    env = runtime.env()
    with pytest.raises(D1AccountError, match="cannot reach the account"):
        D1Engine(f"d1://ffffffffffffffffffffffffffffffff/{DATABASE}", environ=env).read("SELECT 1", {})
    with pytest.raises(D1DatabaseNotFoundError, match="no D1 database at d1://") as missing:
        D1Engine(f"d1://{ACCOUNT}/no-such-database", environ=env).read("SELECT 1", {})
    assert isinstance(missing.value, LedgerNotFoundError)


def test_the_url_and_the_environment_are_checked_before_any_call() -> None:
    with pytest.raises(StorageError, match="CLOUDFLARE_API_TOKEN"):
        D1Engine("d1://acct/db", environ={})
    with pytest.raises(StorageError, match=r"d1://ACCOUNT_ID/DATABASE_ID"):
        D1Engine("d1://acct", environ={"CLOUDFLARE_API_TOKEN": "t"})
    with pytest.raises(StorageError, match="plain http:// only to a loopback"):
        D1Engine(
            "d1://acct/db",
            environ={"CLOUDFLARE_API_TOKEN": "t", "CLOUDFLARE_BASE_URL": "http://api.example.com/client/v4"},
        )
    assert D1Location.parse("d1://a/b", {"CLOUDFLARE_API_TOKEN": "t"}).endpoint("raw") == (
        "https://api.cloudflare.com/client/v4/accounts/a/d1/database/b/raw"
    )


def test_a_429_storm_is_retried_with_the_wait_cloudflare_asks_for(runtime: Runtime) -> None:
    waits: list[float] = []
    location = D1Location.parse(runtime.ledger_url, runtime.env())
    api = D1Api(location, retries=4, sleep=waits.append)
    runtime.faults(rateLimited=3, retryAfter="2")
    assert api.run([("SELECT 41 + 1", [])], write=True) == [[[42]]]
    assert waits == [2.0, 2.0, 2.0]
    runtime.faults(rateLimited=6, retryAfter="1")
    with pytest.raises(D1RateLimitedError, match="429, code 971"):
        api.run([("SELECT 1", [])], write=False)
    # Under load workerd itself may answer one of these reads with a 5xx,
    # which the engine retries with its own back-off (under a second): the
    # 429s each waited exactly what they asked.
    rest = waits[3:]
    assert len(rest) == 4 and rest.count(1.0) >= 3 and all(wait <= 1.0 for wait in rest), rest
    runtime.faults(rateLimited=0)


def test_a_5xx_retries_a_read_but_not_a_write(runtime: Runtime) -> None:
    location = D1Location.parse(runtime.ledger_url, runtime.env())
    api = D1Api(location, retries=4, sleep=lambda _: None)
    runtime.faults(unavailable=2)
    assert api.run([("SELECT 7", [])], write=False) == [[[7]]]
    runtime.faults(unavailable=1)
    with pytest.raises(ConnectionFailedError, match="failed to answer"):
        api.run([("SELECT 7", [])], write=True)
    assert runtime.faults()["unavailable"] == 0


def test_a_call_that_times_out_is_a_typed_error_and_a_read_is_tried_again(runtime: Runtime) -> None:
    engine = D1Engine(runtime.ledger_url, environ=runtime.env(), timeout_s=0.5, backoff_s=0.01)
    store = Store(engine)
    store.init(1, False)
    runtime.faults(delays=1, delayMs=2000)
    assert engine.read("SELECT 5", {}) == [(5,)]  # the first try timed out, the second answered
    runtime.faults(delays=1, delayMs=2000)
    with pytest.raises(D1TimeoutError, match=r"did not answer within 0.5 s"):
        engine.write("DELETE FROM idempotency_keys WHERE key = 'none'", {})
    runtime.faults(delays=0)
    store.close()


def test_open_engine_takes_a_d1_url(runtime: Runtime) -> None:
    engine = open_engine(runtime.ledger_url)
    assert isinstance(engine, D1Engine)
    assert engine.read("SELECT 'x'", {}) == [("x",)]
    assert TOKEN not in repr(engine)
