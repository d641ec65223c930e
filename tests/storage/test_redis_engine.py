"""What only the Redis engine has to prove: its keys stay in one hash slot
per step, rows expire at the end of their retention while fencing tokens
stay unique, its URLs (cluster from any node, Sentinel, passwords never
shown), and its faults: Redis down, a read-only replica, a full server with
noeviction, resharding under load. The contract itself runs on Redis
through the engine-parametrised suite (tests/conftest.py)."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest

from idemctl import Ledger, Outcome, Policy, Status
from idemctl.errors import ConnectionFailedError, ReadOnlyDatabaseError, SchemaMissingError, StorageError
from idemctl.storage.redis.errors import RedisOutOfMemoryError
from idemctl.storage.redis.keys import BUCKETS, Layout
from idemctl.storage.redis.url import parse
from idemctl.wsgi import IdempotencyMiddleware
from tests import redis_servers

pytestmark = pytest.mark.slow

redis = pytest.importorskip("redis")


def ok_app(environ, start_response):
    start_response("201 Created", [("Content-Type", "text/plain")])
    return [b"made"]


def wsgi_post(app, key: str) -> tuple[str, dict[str, str], bytes]:
    from wsgiref.util import setup_testing_defaults

    environ: dict[str, object] = {}
    setup_testing_defaults(environ)
    environ.update(REQUEST_METHOD="POST", PATH_INFO="/orders", HTTP_IDEMPOTENCY_KEY=key, REMOTE_USER="acct")
    got: dict[str, object] = {}

    def start_response(status, headers, exc_info=None):
        got["status"], got["headers"] = status, dict(headers)

    body = b"".join(app(environ, start_response))
    return str(got["status"]), dict(got["headers"]), body  # type: ignore[arg-type]


@pytest.fixture
def standalone(redis_standalone) -> str:
    redis_standalone.flush()
    return redis_standalone.url


@pytest.fixture
def cluster(redis_cluster) -> redis_servers.Cluster:
    redis_cluster.flush()
    return redis_cluster


def own_server(*extra: str) -> Iterator[redis_servers.Standalone]:
    reason = redis_servers.missing()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    server = redis_servers.Standalone(*extra)
    try:
        yield server.start()
    finally:
        server.stop()


# -- keys: one slot per step ------------------------------------------------------------


def test_every_key_a_step_touches_is_in_one_hash_slot_for_any_principal_and_key():
    from redis.crc import key_slot

    layout = Layout("idemctl")
    pairs = [(f"acct_{i}", f"k-{i}") for i in range(2000)] + [("a{b}", "}{"), ("", "k"), ("ü", "\n")]
    for principal, key in pairs:
        bucket, _, keys = layout.where(principal, key)
        _, fenced = layout.fenced_keys(principal, key)
        slots = {key_slot(k) for k in keys + fenced}
        assert len(slots) == 1 and slots == {key_slot(layout.tag(bucket))}


def test_keys_of_two_buckets_in_one_script_are_refused_by_the_cluster_so_the_store_never_builds_them(cluster):
    from redis.cluster import RedisCluster
    from redis.crc import key_slot

    layout = Layout("idemctl")
    a, b = next(
        (a, b) for a in range(BUCKETS) for b in range(BUCKETS) if key_slot(layout.tag(a)) != key_slot(layout.tag(b))
    )
    client = RedisCluster.from_url(cluster.url.rsplit("/", 1)[0])
    try:
        with pytest.raises(redis.exceptions.RedisClusterException, match="all keys must map to the same key slot"):
            client.eval("return 1", 2, layout.rows_by_time(a), layout.rows_by_time(b))
        # and the server itself, asked directly:
        node = client.get_node_from_key(layout.rows_by_time(a)).redis_connection
        with pytest.raises(redis.ResponseError, match="hash to the same slot"):  # CROSSSLOT
            node.eval("return 1", 2, layout.rows_by_time(a), layout.rows_by_time(b))
    finally:
        client.close()


# -- expiry and fencing tokens ----------------------------------------------------------


def test_a_row_expires_at_the_end_of_its_retention_and_its_old_owner_stays_fenced_out(standalone):
    ledger = Ledger.open(standalone, policy=Policy(pending_ttl_ms=100, retention_ms=400))
    ledger.init()
    client = redis.Redis.from_url(standalone)
    try:
        old = ledger.claim("acct", "k", "fp")
        row_key = Layout("idemctl").where("acct", "k")[2][0]
        assert 300 < client.pttl(row_key) <= 400
        deadline = time.monotonic() + 5
        while client.exists(row_key) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not client.exists(row_key) and ledger.lookup("acct", "k") is None
        new = ledger.claim("acct", "k", "fp")
        assert (old.generation, new.generation) == (1, 1) and old.token != new.token
        late = ledger.complete(old, 201, {}, b"old")
        assert late.stored is False and late.event.current_generation == 1
        assert ledger.complete(new, 201, {}, b"new").stored is True
        row = ledger.lookup("acct", "k")
        assert (row.status, row.body_bytes) == (Status.COMPLETED, b"new")
        # The sweep removes the index entries expiry left behind, nothing else.
        time.sleep(0.5)
        assert ledger.operator.sweep().keys_deleted == 1  # the index entry of the key, expired again
        assert ledger.operator.stats().total == 0
    finally:
        client.close()
        ledger.close()


def test_tokens_are_drawn_anew_for_every_claim_of_a_deleted_key(standalone):
    ledger = Ledger.open(standalone)
    ledger.init()
    tokens = set()
    for _ in range(200):
        reservation = ledger.claim("acct", "k", "fp")
        tokens.add(reservation.token)
        assert ledger.release(reservation) is True
    assert len(tokens) == 200
    ledger.close()


def test_the_database_clock_is_the_servers_time(standalone):
    client = redis.Redis.from_url(standalone)
    seconds, micros = client.time()
    client.close()
    ledger = Ledger.open(standalone, clock="database")
    ledger.init()
    made = ledger.handle("acct", "k", "POST", "/o", {}, b"", lambda body: (201, {}, b""))
    row = ledger.lookup("acct", "k")
    assert made.outcome is Outcome.EXECUTED
    assert abs(row.created_at - (seconds * 1000 + micros // 1000)) < 5000
    ledger.close()


def test_a_ledger_without_init_refuses_to_write(standalone):
    ledger = Ledger.open(standalone)
    with pytest.raises(SchemaMissingError):
        ledger.claim("acct", "k", "fp")
    assert ledger.schema_version() is None
    ledger.close()


# -- URLs -------------------------------------------------------------------------------


def test_urls_as_redis_py_reads_them_with_idemctls_options_taken_out():
    loc = parse("rediss://app:pa%2Fss@cache.example:6380/3?prefix=pay&ssl_cert_reqs=none&wait_replicas=2")
    assert (loc.url, loc.prefix, loc.wait_replicas, loc.db, loc.tls) == (
        "rediss://app:pa%2Fss@cache.example:6380/3?ssl_cert_reqs=none",
        "pay",
        2,
        3,
        True,
    )
    assert "pa%2Fss" not in loc.shown and "pa/ss" not in loc.shown and loc.shown.startswith("rediss://app:***@")
    sentinel = parse("redis+sentinel://:pw@s1:26379,s2:26380/orders/2?sentinel_password=spw")
    assert (sentinel.sentinels, sentinel.service, sentinel.db, sentinel.password, sentinel.sentinel_password) == (
        (("s1", 26379), ("s2", 26380)),
        "orders",
        2,
        "pw",
        "spw",
    )
    assert "pw" not in sentinel.shown.replace("redis+sentinel", "") and "spw" not in sentinel.shown


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("wait_replicas=two", "wait_replicas='two' is not a number"),
        ("wait_timeout_ms=-5", "wait_timeout_ms must be >= 0, got -5"),
    ],
)
def test_a_malformed_number_option_is_refused_naming_the_url_without_its_password(query: str, message: str):
    with pytest.raises(StorageError) as refused:
        parse(f"redis://:s3cret@cache:6379/0?{query}")
    assert str(refused.value) == f"redis://:***@cache:6379/0?{query}: {message}"


def test_a_password_never_shows_in_describe_repr_or_the_error_of_an_unreachable_redis():
    port = redis_servers.free_port()
    ledger = Ledger.open(f"redis://app:s3cret-pw@127.0.0.1:{port}/0", busy_timeout_ms=500)
    assert "s3cret-pw" not in ledger.describe() and "s3cret-pw" not in repr(ledger.store.engine)
    with pytest.raises(ConnectionFailedError) as caught:
        ledger.claim("acct", "k", "fp")
    assert "s3cret-pw" not in str(caught.value) and "127.0.0.1" in str(caught.value)
    ledger.close()


def test_redis_down_is_a_503_with_retry_after_in_bounded_time():
    port = redis_servers.free_port()
    ledger = Ledger.open(f"redis://127.0.0.1:{port}/0", busy_timeout_ms=500)
    app = IdempotencyMiddleware(ok_app, ledger, principal=lambda environ: "acct")
    started = time.monotonic()
    status, headers, _ = wsgi_post(app, "k1")
    assert status.startswith("503") and "retry-after" in {name.lower() for name in headers}
    assert time.monotonic() - started < 5
    ledger.close()


@pytest.fixture
def frozen_server() -> Iterator[redis_servers.Standalone]:
    yield from own_server()


def test_a_redis_that_stops_answering_is_a_503_within_the_bound_on_the_event_loop_then_serves_again(frozen_server):
    # The asyncio client's sockets have no timeout of their own: the engine
    # bounds each operation (idemctl.storage.deadlines). A server stopped
    # with SIGSTOP keeps its connections open and never answers.
    import asyncio
    import signal

    from idemctl.asgi import IdempotencyMiddleware as AsgiMiddleware
    from tests.helpers import asgi_exchange, post_scope

    async def made(scope, receive, send):  # type: ignore[no-untyped-def]
        await send({"type": "http.response.start", "status": 201, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"made"})

    ledger = Ledger.open(frozen_server.url, busy_timeout_ms=400)
    ledger.init()
    app = AsgiMiddleware(made, ledger, principal=lambda scope: "acct")
    pid = frozen_server.server.process.pid

    async def go() -> list[tuple[int, float]]:
        seen = []
        for key, freeze in (("before", False), ("frozen", True), ("after", False)):
            if freeze:
                os.kill(pid, signal.SIGSTOP)
            started = time.monotonic()
            try:
                sent = await asgi_exchange(app, post_scope(key))
            finally:
                if freeze:
                    os.kill(pid, signal.SIGCONT)
            seen.append((sent[0]["status"], time.monotonic() - started))
        await ledger.aclose()
        return seen

    (first, _), (frozen, waited), (after, _) = asyncio.run(go())
    assert (first, frozen, after) == (201, 503, 201)
    assert 0.35 < waited < 2.0
    # Whether the claim reached the server before it froze is unknown to the
    # client, as after a crash: never completed, at most a pending reservation.
    row = ledger.lookup("acct", "frozen")
    assert row is None or row.status is Status.PENDING
    ledger.close()


def test_any_node_of_a_cluster_is_recognised_and_serves_the_ledger_a_replica_included(cluster):
    replica = cluster.replicas()[0]
    ledger = Ledger.open(replica.url)
    ledger.init()
    for i in range(50):
        made = ledger.handle("acct", f"k{i}", "POST", "/o", {}, b"", lambda body: (201, {}, b"x"))
        assert made.outcome is Outcome.EXECUTED
    assert ledger.store.engine.kind == "cluster"
    assert ledger.operator.stats().completed == 50
    assert sorted(key for key in (f"k{i}" for i in range(50)) if ledger.lookup("acct", key)) == sorted(
        f"k{i}" for i in range(50)
    )
    ledger.close()


@pytest.mark.parametrize("by_text", [False, True], ids=["by-digest", "by-text"])
def test_a_clusters_pipelines_run_the_scripts_by_digest_or_by_their_text_on_both_engines(cluster, by_text, monkeypatch):
    # redis-py before 8.2 refuses EVALSHA in a cluster's pipeline (the sweep's
    # turn, the batches): there the scripts go with their text instead.
    import asyncio

    from idemctl.storage.redis import ops

    if not by_text and ops.SCRIPTS_BY_TEXT_IN_CLUSTER_PIPELINES:
        pytest.skip(f"redis-py {redis.__version__} refuses EVALSHA in a cluster's pipeline")
    monkeypatch.setattr(ops, "SCRIPTS_BY_TEXT_IN_CLUSTER_PIPELINES", by_text)
    ledger = Ledger.open(cluster.url, policy=Policy(pending_ttl_ms=100, retention_ms=300))
    ledger.init()
    for i in range(12):
        made = ledger.handle("acct", f"k{i}", "POST", "/o", {}, b"", lambda body: (201, {}, b"x"))
        assert made.outcome is Outcome.EXECUTED
    time.sleep(0.5)  # every row expired: the sweep's scripts remove their index entries
    assert ledger.operator.sweep().keys_deleted == 12
    lay = Layout("idemctl")
    # Buckets whose keys live on different primaries: one pipeline per node.
    turn = [("sweep_rows", {"keys": [lay.rows_by_time(b), lay.pending(b)], "args": [0]}) for b in (0, 1, 2, 3)]

    async def on_the_loop() -> object:
        store = ledger.core.async_store()
        assert store is not None
        try:
            return await store.engine.write_turn(turn)
        finally:
            await ledger.aclose()

    assert asyncio.run(on_the_loop()) == [[(0,)]] * 4
    ledger.close()


def test_listings_visit_every_primary_of_the_cluster(cluster):
    ledger = Ledger.open(cluster.url)
    ledger.init()
    for i in range(40):
        ledger.claim("acct", f"p{i:02d}", "fp")
    per_primary = [int(s.cli("dbsize")) for s in cluster.primaries()]
    assert all(n > 0 for n in per_primary)  # the rows really are spread
    assert sorted(v.row.key for v in ledger.operator.pending()) == [f"p{i:02d}" for i in range(40)]
    ledger.close()


# -- faults -----------------------------------------------------------------------------


@pytest.fixture
def replica_of_standalone(redis_standalone) -> Iterator[str]:
    host_port = redis_standalone.url.split("//")[1].split("/")[0]
    host, port = host_port.split(":")
    yield from (s.url for s in own_server("--replicaof", host, port))


def test_a_read_only_replica_named_in_the_url_answers_503_and_says_to_point_at_the_primary(
    redis_standalone, replica_of_standalone
):
    redis_standalone.flush()
    with Ledger.open(redis_standalone.url) as primary:
        primary.init()
    deadline = time.monotonic() + 10
    ledger = Ledger.open(replica_of_standalone)
    while ledger.schema_version() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(ReadOnlyDatabaseError, match="read-only replica"):
        ledger.claim("acct", "k", "fp")
    app = IdempotencyMiddleware(ok_app, ledger, principal=lambda environ: "acct")
    assert wsgi_post(app, "k")[0].startswith("503")
    ledger.close()


@pytest.fixture
def small_server() -> Iterator[str]:
    yield from (s.url for s in own_server("--maxmemory", "3mb", "--maxmemory-policy", "noeviction"))


def test_a_full_server_with_noeviction_refuses_the_claim_and_writes_nothing(small_server):
    ledger = Ledger.open(small_server)
    ledger.init()
    client = redis.Redis.from_url(small_server)
    # Filled with large values, then small ones, until even a small write is
    # refused (after a large one is refused, memory may sit just under the limit).
    for size in (100_000, 10):
        with pytest.raises(redis.ResponseError, match="maxmemory"):
            for i in range(100_000):
                client.set(f"filler:{size}:{i}", b"x" * size)
    before = client.dbsize()
    with pytest.raises(RedisOutOfMemoryError, match="out of memory"):
        ledger.claim("acct", "k", "fp")
    assert client.dbsize() == before and ledger.lookup("acct", "k") is None
    client.close()
    ledger.close()


def test_resharding_under_load_moves_slots_and_every_mutation_still_runs_once(cluster):
    ledger = Ledger.open(cluster.url)
    ledger.init()
    runs: dict[str, int] = {}
    errors: list[BaseException] = []
    stop = threading.Event()

    def load() -> None:
        i = 0
        while not stop.is_set():
            key = f"r{i}"
            for _ in range(2):  # a first call and its retry
                try:
                    ledger.handle(
                        "acct",
                        key,
                        "POST",
                        "/o",
                        {},
                        b"",
                        lambda body, key=key: runs.__setitem__(key, runs.get(key, 0) + 1) or (201, {}, b""),
                    )
                except BaseException as exc:  # pragma: no cover - reported below
                    errors.append(exc)
            i += 1

    worker = threading.Thread(target=load)
    worker.start()
    try:
        primaries = cluster.primaries()
        ids = [p.cli("cluster", "myid") for p in primaries]
        done = subprocess.run(
            ["redis-cli", "--cluster", "reshard", f"127.0.0.1:{primaries[0].port}", "--cluster-from", ids[0],
             "--cluster-to", ids[1], "--cluster-slots", "300", "--cluster-yes", "--cluster-pipeline", "5"],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout[-500:]
    finally:
        time.sleep(0.3)
        stop.set()
        worker.join(30)
    assert errors == []
    assert runs and set(runs.values()) == {1}
    assert ledger.operator.stats().completed == len(runs)
    ledger.close()


def test_doctor_findings_on_a_server_without_persistence_say_which_settings_to_change(standalone):
    from idemctl.operations.replication import check_failover

    with Ledger.open(standalone) as ledger:
        check = check_failover(ledger.operator)
    messages = " ".join(f.message for f in check.findings)
    assert check.engine.startswith("Redis 7") and not check.ok
    assert "appendonly is no" in messages and "set appendonly yes" in messages
    assert "no replica" in messages


def test_doctor_on_a_cluster_checks_every_primary_and_the_slot_coverage(cluster):
    from idemctl.operations.replication import check_failover

    with Ledger.open(cluster.url) as ledger:
        check = check_failover(ledger.operator)
    messages = [f.message for f in check.findings]
    assert "cluster of 3 primaries" in check.engine
    assert sum("appendonly is no" in m for m in messages) == 3
    assert sum("replication is asynchronous (1 replica(s))" in m for m in messages) == 3
    assert "cluster_state ok, all 16384 slots served" in messages


@pytest.fixture
def sentinel() -> Iterator[redis_servers.WithSentinel]:
    reason = redis_servers.missing()
    if reason is not None:
        pytest.skip(reason)
    servers = redis_servers.WithSentinel()
    try:
        yield servers.start()
    finally:
        servers.stop()


def test_a_sentinel_url_serves_the_ledger_from_the_primary_it_names(sentinel):
    ledger = Ledger.open(sentinel.url)
    ledger.init()
    made = ledger.handle("acct", "k", "POST", "/o", {}, b"", lambda body: (201, {}, b"x"))
    assert made.outcome is Outcome.EXECUTED and ledger.store.engine.kind == "sentinel"
    assert int(sentinel.primary.cli("exists", Layout("idemctl").where("acct", "k")[2][0].decode())) == 1
    ledger.close()


def test_the_asynchronous_path_awaits_redis_on_the_event_loop(standalone):
    import asyncio

    from idemctl.decision import run_async
    from idemctl.storage.redis.aio import AsyncRedisEngine

    ledger = Ledger.open(standalone)
    ledger.init()

    async def go() -> object:
        store = ledger.core.async_store()
        assert store is not None and isinstance(store.engine, AsyncRedisEngine)

        def no_thread(*args: object) -> object:
            raise AssertionError("handed to a thread")

        made = await run_async(ledger.decide("acct", "k", "fp"), no_thread, store=store)
        await ledger.aclose()
        return made

    made = asyncio.run(go())
    assert type(made).__name__ == "Claimed"
    ledger.close()


def test_wait_replicas_acknowledges_a_completion_once_a_replica_holds_it_and_refuses_one_none_can(cluster):
    import asyncio

    from idemctl.errors import StorageError

    with Ledger.open(f"{cluster.url}?wait_replicas=1") as ledger:
        ledger.init()
        assert ledger.complete(ledger.claim("acct", "k1", "fp"), 201, {}, b"x").stored is True

        runs: list[str] = []

        @ledger.idempotent(key=lambda ref: ref, principal="billing")
        async def send(ref: str) -> dict[str, str]:  # the event-loop path WAITs the same way
            runs.append(ref)
            return {"sent": ref}

        async def twice() -> tuple[object, object]:
            got = await send("r-1"), await send("r-1")
            await ledger.aclose()
            return got

        assert asyncio.run(twice()) == ({"sent": "r-1"}, {"sent": "r-1"}) and runs == ["r-1"]
    with Ledger.open(f"{cluster.url}?wait_replicas=2&wait_timeout_ms=100") as ledger:
        reservation = ledger.claim("acct", "k3", "fp")
        with pytest.raises(StorageError, match="reached 1 of the 2 replicas"):
            ledger.complete(reservation, 201, {}, b"z")


@pytest.fixture
def password_server() -> Iterator[str]:
    yield from (s.url.replace("redis://", "redis://:s3cret-pw@") for s in own_server("--requirepass", "s3cret-pw"))


def test_doctor_and_the_cli_never_print_the_urls_password(password_server, monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from idemctl.cli import app
    from tests.helpers import clean_env

    clean_env(monkeypatch, tmp_path)
    runner = CliRunner()
    assert runner.invoke(app, ["init", "--db", password_server]).exit_code == 0
    doctor = runner.invoke(app, ["doctor", "--db", password_server])
    as_json = runner.invoke(app, ["doctor", "--db", password_server, "--json"])
    wrong = runner.invoke(app, ["stats", "--db", password_server.replace("s3cret-pw", "wrong-pw")])
    assert (doctor.exit_code, as_json.exit_code) == (1, 1)  # appendonly is no: a warning
    assert "appendonly is no" in doctor.stdout and ":***@" in doctor.stdout
    assert wrong.exit_code != 0 and "refused the credentials" in wrong.stderr
    for result in (doctor, as_json, wrong):
        assert "s3cret-pw" not in result.output and "wrong-pw" not in result.output
