"""The systems the peers benchmark and tests/adapters/test_peers_correctness.py put
side by side, each through its own real entry point on its own real store:

- idemctl on PostgreSQL: `idemctl.wsgi.IdempotencyMiddleware`,
  `idemctl.asgi.IdempotencyMiddleware` and, beside Powertools, the function
  decorator `Ledger.idempotent`;
- idemkit on PostgreSQL (asyncpg): `WSGIIdempotencyMiddleware` (its sync
  bridge to a background event loop) and its ASGI `IdempotencyMiddleware`;
- Powertools for AWS Lambda: `idempotent_function` with its Redis
  persistence layer, a NON-durable reference when Redis runs without
  persistence (a restart forgets every key).

A system is built from a JSON-able spec (store coordinates, TTL), so a child
process can build the same one and be killed in the middle of a handler.
Every store is private to one run: a PostgreSQL schema per system, created
and dropped here, and a Redis key prefix whose keys are deleted afterwards."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Any
from urllib.parse import quote

from idemctl import Ledger, Policy
from idemctl.exchange.scope import Receive, Scope, Send

from .common import (
    BODY_1K,
    REQUEST_PATH,
    REQUEST_PRINCIPAL,
    STORED_1K,
    asgi_scope,
    call_asgi_scope,
    wsgi_environ,
)

PG_DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/test"
PG_URL_ENV = "IDEMCTL_BENCH_POSTGRES_URL"
REDIS_DEFAULT_URL = "redis://127.0.0.1:6379/0"
REDIS_URL_ENV = "IDEMCTL_BENCH_REDIS_URL"

PRINCIPAL = REQUEST_PRINCIPAL
PATH = REQUEST_PATH
HANDLER_KEY = "peers.handler"  # the per-call handler travels in the WSGI environ / ASGI scope
Handler = Callable[[], bytes]


def pg_base() -> str:
    return os.environ.get(PG_URL_ENV, PG_DEFAULT_URL)


def redis_url() -> str:
    return os.environ.get(REDIS_URL_ENV, REDIS_DEFAULT_URL)


def new_tag() -> str:
    """Unique per run: schema names and the Redis key prefix derive from it."""
    return f"{os.getpid()}_{secrets.token_hex(3)}"


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    return {
        name: _version(name) for name in ("idemctl", "psycopg", "idemkit", "asyncpg", "aws-lambda-powertools", "redis")
    }


def missing() -> dict[str, str]:
    """{system: why it cannot run here}, empty when every peer is importable."""
    out: dict[str, str] = {}
    try:
        import psycopg  # noqa: F401

        from idemctl.storage.postgres import PostgresEngine  # noqa: F401
    except ImportError as exc:
        out["idemctl"] = f"idemctl's PostgreSQL backend is not importable ({exc}): pip install -e '.[postgres]'"
    try:
        import asyncpg  # noqa: F401
        import idemkit  # noqa: F401
    except ImportError as exc:
        out["idemkit"] = f"idemkit or asyncpg is not installed ({exc.name}): pip install -e '.[bench]'"
    try:
        import redis  # noqa: F401
        from aws_lambda_powertools.utilities.idempotency import idempotent_function  # noqa: F401
    except ImportError as exc:
        out["powertools"] = f"aws-lambda-powertools or redis is not installed ({exc.name}): pip install -e '.[bench]'"
    return out


# -- stores -----------------------------------------------------------------------------
def psycopg_url(base: str, schema: str) -> str:
    """libpq URL whose connections see only `schema` (idemctl, the raw floor)."""
    sep = "&" if "?" in base else "?"
    return f"{base}{sep}options={quote(f'-csearch_path={schema}')}"


def asyncpg_url(base: str, schema: str) -> str:
    """The same for asyncpg, which sends unknown query parameters as server settings."""
    sep = "&" if "?" in base else "?"
    return f"{base}{sep}search_path={schema}"


def create_schema(base: str, schema: str) -> None:
    import psycopg

    with psycopg.connect(base, autocommit=True, connect_timeout=5) as admin:
        admin.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        admin.execute(f'CREATE SCHEMA "{schema}"')


def drop_schema(base: str, schema: str) -> None:
    import psycopg

    with psycopg.connect(base, autocommit=True, connect_timeout=5) as admin:
        # A killed child's backend may linger for a moment holding locks.
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE pid <> pg_backend_pid() AND query ILIKE %s",
            (f"%{schema}%",),
        )
        admin.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def delete_redis_keys(url: str, prefix: str) -> int:
    import redis

    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        for i in range(0, len(keys), 500):
            client.delete(*keys[i : i + 500])
        return len(keys)
    finally:
        client.close()


def provision(spec: dict[str, Any]) -> None:
    """Create what `spec`'s system stores into (a schema and its tables)."""
    system = spec["system"]
    if system == "idemctl":
        create_schema(spec["pg_base"], spec["schema"])
        ledger = Ledger.open(psycopg_url(spec["pg_base"], spec["schema"]))
        try:
            ledger.init()
        finally:
            ledger.close()
    elif system == "idemkit":
        from idemkit.backends.postgres import init_pg

        create_schema(spec["pg_base"], spec["schema"])
        # Its own DDL through its own entry point (what `idemkit init-pg` runs).
        asyncio.run(init_pg(asyncpg_url(spec["pg_base"], spec["schema"])))


def deprovision(spec: dict[str, Any]) -> None:
    if spec["system"] in ("idemctl", "idemkit"):
        drop_schema(spec["pg_base"], spec["schema"])
    elif spec["system"] == "powertools":
        delete_redis_keys(spec["redis_url"], spec["prefix"])


def spec_for(
    system: str, tag: str, ttl_s: float, *, wait_s: float | None = None, purpose: str = "bench"
) -> dict[str, Any]:
    return {
        "system": system,
        "pg_base": pg_base(),
        "redis_url": redis_url(),
        "schema": f"peers_{purpose}_{system}_{tag}",
        "prefix": f"idemctl-peers-{purpose}-{tag}",
        "ttl_s": ttl_s,
        "wait_s": wait_s,
    }


# -- the request every system serves -------------------------------------------------------
@dataclass
class Reply:
    """What a caller got: `kind` is ran (the handler ran for this call),
    replayed, in_progress (refused because another attempt holds the key) or
    refused (anything else; `detail` says what)."""

    kind: str
    status: int | None
    body: bytes
    detail: str = ""


def _counted(handler: Handler | None) -> tuple[Handler, list[bool]]:
    ran: list[bool] = []

    def run() -> bytes:
        ran.append(True)
        return handler() if handler is not None else STORED_1K

    return run, ran


def wsgi_app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
    environ["wsgi.input"].read()
    body = environ[HANDLER_KEY]()
    start_response("201 Created", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
    return [body]


def call_wsgi(app: Any, key: str, handler: Handler) -> tuple[int, dict[str, str], bytes]:
    started: list[tuple[str, list[tuple[str, str]]]] = []

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
        started.append((status, headers))
        return lambda data: None

    result = app(wsgi_environ(key, multithread=True, **{HANDLER_KEY: handler}), start_response)
    try:
        body = b"".join(result)
    finally:
        close = getattr(result, "close", None)
        if close is not None:
            close()
    status, headers = started[-1]
    return int(status[:3]), {k.lower(): v for k, v in headers}, body


async def asgi_app(scope: Scope, receive: Receive, send: Send) -> None:
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    body = scope[HANDLER_KEY]()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 201, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def call_asgi(app: Any, key: str, handler: Handler) -> tuple[int, bytes]:
    """One request as a server makes it, the handler riding in the scope."""
    # What an auth layer in front would have set:
    account = [(b"x-account", PRINCIPAL.encode())]
    return await call_asgi_scope(app, asgi_scope(key, headers=account, **{HANDLER_KEY: handler}))


def principal_header(scope: Any) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"x-account":
            return bytes(value).decode("latin-1")
    return None


# -- the systems -------------------------------------------------------------------------------
class System:
    """One system through one real entry point, blocking (real threads may call it)."""

    name = ""
    label = ""
    durable = True
    ttl_setting = ""
    ttl_default_s = 0.0

    def call(self, key: str, handler: Handler | None = None) -> Reply:
        raise NotImplementedError

    def stored(self, key: str) -> bytes | None:
        """The answer the store holds for `key` (None: no completed answer)."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class IdemctlWsgi(System):
    name = "idemctl"
    label = "idemctl, PostgreSQL, WSGI `IdempotencyMiddleware`"
    ttl_setting = "Policy.pending_ttl_ms"
    ttl_default_s = 30.0

    def __init__(self, spec: dict[str, Any]) -> None:
        from idemctl.wsgi import IdempotencyMiddleware

        policy = Policy(pending_ttl_ms=round(spec["ttl_s"] * 1000))
        self.ledger = Ledger.open(psycopg_url(spec["pg_base"], spec["schema"]), policy=policy)
        self.app = IdempotencyMiddleware(wsgi_app, self.ledger, principal=lambda environ: environ.get("REMOTE_USER"))

    def call(self, key: str, handler: Handler | None = None) -> Reply:
        run, ran = _counted(handler)
        status, _, body = call_wsgi(self.app, key, run)
        if 200 <= status < 300:
            return Reply("ran" if ran else "replayed", status, body)
        if status == 409 and b"idempotency_key_in_progress" in body:
            return Reply("in_progress", status, body)
        return Reply("refused", status, body, body[:200].decode("utf-8", "replace"))

    def stored(self, key: str) -> bytes | None:
        view = self.ledger.operator.get(PRINCIPAL, key)
        if view is None or view.row.status != "completed":
            return None
        return view.row.body_bytes

    def close(self) -> None:
        self.ledger.close()


class IdemkitWsgi(System):
    name = "idemkit"
    label = "idemkit, PostgreSQL, `WSGIIdempotencyMiddleware`"
    ttl_setting = "HttpConfig.lease_ttl_seconds"
    ttl_default_s = 30.0

    def __init__(self, spec: dict[str, Any]) -> None:
        from idemkit import PostgresBackend

        self.spec = spec
        self.backend = PostgresBackend.from_url(asyncpg_url(spec["pg_base"], spec["schema"]))
        self.app = idemkit_wsgi_on(self.backend, spec["ttl_s"], spec.get("wait_s"))

    def call(self, key: str, handler: Handler | None = None) -> Reply:
        run, ran = _counted(handler)
        status, headers, body = call_wsgi(self.app, key, run)
        if 200 <= status < 300:
            if ran:
                return Reply("ran", status, body)
            return Reply("replayed" if headers.get("idempotency-replayed") == "true" else "refused", status, body)
        if status == 423:  # urn:idemkit:in-progress
            return Reply("in_progress", status, body)
        return Reply("refused", status, body, body[:200].decode("utf-8", "replace"))

    def stored(self, key: str) -> bytes | None:
        import psycopg
        from idemkit.core.fingerprint import compute_effective_key

        effective = compute_effective_key(key, PRINCIPAL, "POST", PATH)
        with psycopg.connect(psycopg_url(self.spec["pg_base"], self.spec["schema"]), autocommit=True) as conn:
            row = conn.execute(
                "SELECT state, response_body FROM idemkit_records WHERE effective_key = %s", (effective,)
            ).fetchone()
        if row is None or row[0] != "COMPLETED":
            return None
        return bytes(row[1])

    def close(self) -> None:
        from idemkit.core.sync_bridge import run_sync

        # The pool lives on idemkit's background loop: close it there.
        with contextlib.suppress(Exception):
            run_sync(self.backend.aclose())


class Powertools(System):
    name = "powertools"
    label = "Powertools for AWS Lambda, Redis, `idempotent_function`"
    durable = False
    ttl_setting = "IdempotencyConfig.expires_after_seconds"
    ttl_default_s = 3600.0

    def __init__(self, spec: dict[str, Any]) -> None:
        import redis
        from aws_lambda_powertools.utilities.idempotency import IdempotencyConfig, idempotent_function
        from aws_lambda_powertools.utilities.idempotency.persistence.redis import RedisCachePersistenceLayer

        self.client = redis.Redis.from_url(spec["redis_url"])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # the class's v4 rename, not a behaviour
            # redis-py's Redis is what the layer takes, but its stubs' set() spells ex/px
            # narrower than Powertools' RedisClientProtocol: a stub mismatch, not a bug.
            self.layer = RedisCachePersistenceLayer(client=self.client)  # type: ignore[arg-type]
        # The key is the request's Idempotency-Key. Payload validation (its
        # fingerprint) stays at its default, off: its Redis layer drops the
        # validation hash when it completes a record, so with it on every
        # replay raises IdempotencyValidationError (spec["validate"] shows
        # it). Its only expiry setting: outside Lambda no context bounds an
        # in-progress record, so that lives as long as a completed one.
        self.config = IdempotencyConfig(
            event_key_jmespath="key",
            payload_validation_jmespath="body" if spec.get("validate") else "",
            expires_after_seconds=int(spec["ttl_s"]),
        )

        @idempotent_function(  # type: ignore[untyped-decorator]  # Powertools types it as returning Any
            data_keyword_argument="request",
            persistence_store=self.layer,
            config=self.config,
            key_prefix=spec["prefix"],
        )
        def create_order(request: dict[str, Any], handler: Handler) -> dict[str, Any]:
            return {"status": 201, "body": handler().decode("latin-1")}

        self.fn = create_order

    @staticmethod
    def payload(key: str) -> dict[str, Any]:
        return {"key": key, "principal": PRINCIPAL, "body": BODY_1K.decode("latin-1")}

    def call(self, key: str, handler: Handler | None = None) -> Reply:
        from aws_lambda_powertools.utilities.idempotency.exceptions import (
            IdempotencyAlreadyInProgressError,
            IdempotencyValidationError,
        )

        run, ran = _counted(handler)
        try:
            with warnings.catch_warnings():
                # "Couldn't determine the remaining time left": no Lambda context here, by design.
                warnings.simplefilter("ignore", UserWarning)
                out = self.fn(request=self.payload(key), handler=run)
        except IdempotencyAlreadyInProgressError as exc:
            return Reply("in_progress", None, b"", type(exc).__name__)
        except IdempotencyValidationError as exc:
            return Reply("refused", None, b"", type(exc).__name__)
        body = out["body"].encode("latin-1")
        return Reply("ran" if ran else "replayed", out["status"], body)

    def redis_key(self, key: str) -> str:
        # Its own derivation of the record's name (prefix#hash), not a copy of it.
        name = self.layer._get_hashed_idempotency_key(self.payload(key))
        assert name is not None
        return name

    def stored(self, key: str) -> bytes | None:
        raw = self.client.get(self.redis_key(key))
        if raw is None:
            return None
        item = json.loads(raw)
        if item.get("status") != "COMPLETED":
            return None
        return str(json.loads(item["data"])["body"]).encode("latin-1")

    def close(self) -> None:
        self.client.close()


def build(spec: dict[str, Any]) -> System:
    # Each kind's constructor takes the spec (System itself has none to call).
    kinds: dict[str, Callable[[dict[str, Any]], System]] = {
        "idemctl": IdemctlWsgi,
        "idemkit": IdemkitWsgi,
        "powertools": Powertools,
    }
    return kinds[spec["system"]](spec)


# -- ASGI and function-level paths, for the throughput rounds ---------------------------------
def idemctl_asgi(ledger: Ledger) -> Any:
    from idemctl.asgi import IdempotencyMiddleware

    return IdempotencyMiddleware(asgi_app, ledger, principal=principal_header)


def idemkit_asgi(spec: dict[str, Any], pool_size: int = 10) -> tuple[Any, Any]:
    """Its ASGI middleware and the backend, whose pool opens on the calling
    loop: at most `pool_size` connections, as idemctl's pool and the floors'
    (idemkit's default is 20, which also crowds a shared test server)."""
    from idemkit import PostgresBackend

    url = asyncpg_url(spec["pg_base"], spec["schema"])
    backend = PostgresBackend.from_url(url, min_size=min(4, pool_size), max_size=pool_size)
    return idemkit_asgi_on(backend, spec["ttl_s"]), backend


def idemkit_asgi_on(backend: Any, ttl_s: float, app: Any = asgi_app) -> Any:
    """idemkit's ASGI middleware around `app` (the bare one by default) on
    any of its backends (PostgreSQL, Redis), the principal taken from the
    header an auth layer would have set."""
    from idemkit import HttpConfig, IdempotencyMiddleware

    config = HttpConfig(scope=lambda req: req.headers.get("x-account"), lease_ttl_seconds=ttl_s)
    return IdempotencyMiddleware(app, backend=backend, config=config, manage_backend=False)


def idemkit_wsgi_on(backend: Any, ttl_s: float, wait_s: float | None = None) -> Any:
    """idemkit's WSGI middleware on any of its backends, the principal the
    environ's REMOTE_USER."""
    from idemkit import HttpConfig, WSGIIdempotencyMiddleware

    config = HttpConfig(
        scope=lambda req: req.environ.get("REMOTE_USER"),
        lease_ttl_seconds=ttl_s,
        # Its default (10 s) makes a duplicate wait for the first attempt; a
        # test that polls for the end of a lease shortens it.
        wait_timeout_seconds=wait_s,
    )
    return WSGIIdempotencyMiddleware(wsgi_app, backend=backend, config=config)


def idemctl_function(ledger: Ledger) -> Callable[..., Any]:
    """`Ledger.idempotent` shaped like the Powertools function: the same payload in, a 1 KiB answer out."""

    @ledger.idempotent(key=lambda request, handler: request["key"], principal=PRINCIPAL, args=["request"])
    def create_order(request: dict[str, Any], handler: Handler) -> dict[str, Any]:
        return {"status": 201, "body": handler().decode("latin-1")}

    return create_order
