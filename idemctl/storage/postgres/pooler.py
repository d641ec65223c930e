"""A connection pooler (PgBouncer) between idemctl and PostgreSQL.

A direct connection carries idemctl's settings (lock timeout, read-only,
the URL's own ``-c name=value``, such as search_path) as startup options:
nothing per statement. A pooler refuses those options (PgBouncer's
default: "unsupported startup parameter: options") or drops them
(``ignore_startup_parameters = options``), and in transaction or statement
pooling the server session behind a connection changes between
transactions, so neither session settings nor server-side prepared
statements survive. Behind such a pooler every statement carries its
settings in the same implicit transaction, as one simple-protocol query
(one round trip)::

    SET LOCAL transaction_read_only = 'on'; SELECT set_config('lock_timeout', '5000', true), ...; <statement>

and explicit transactions apply them right after BEGIN.

How the URL leads to the server (the ``pooler`` URL parameter, url.py's
POOLER_MODES) is detected when a pool opens: refused options, or options
whose marker setting (MARKER_SETTING) the session does not have, mean a
pooler; each new physical connection of a direct pool checks the marker
again, once."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import sql

from ...errors import StorageError
from .errors import PoolerError, Translator
from .url import MARKER_SETTING, ServerSettings

# Settings that must be set before the transaction's first query (its
# snapshot): SET LOCAL, ahead of the set_config() query.
_BEFORE_SNAPSHOT = frozenset({"transaction_isolation", "transaction_read_only", "transaction_deferrable"})

MARKER_QUERY = f"SELECT current_setting('{MARKER_SETTING}', true)"


def settings_sql(settings: Sequence[tuple[str, str]], *, local: bool) -> str:
    """The query that applies `settings` to the current transaction
    (`local`) or to the session, values quoted as literals.

    >>> print(settings_sql([("search_path", "a,b"), ("transaction_read_only", "on")], local=True))
    SET LOCAL transaction_read_only = 'on'; SELECT set_config('search_path', 'a,b', true)
    """
    parts: list[str] = []
    calls: list[str] = []
    # set_config takes a value exactly as a startup option does (a list
    # such as search_path=a,b stays a list); SET's literal would not.
    for name, value in settings:
        if local and name.lower() in _BEFORE_SNAPSHOT:
            # (the name is one of _BEFORE_SNAPSHOT's, never the URL's spelling)
            parts.append(sql.SQL("SET LOCAL {} = {}").format(sql.SQL(name.lower()), sql.Literal(value)).as_string(None))
        else:
            calls.append(
                sql.SQL("set_config({}, {}, {})")
                .format(sql.Literal(name), sql.Literal(value), sql.Literal(local))
                .as_string(None)
            )
    if calls:
        parts.append("SELECT " + ", ".join(calls))
    return "; ".join(parts)


def refused_startup(exc: BaseException) -> bool:
    """Whether a connection failed because the server (a pooler) refuses
    a startup parameter."""
    return "unsupported startup parameter" in str(exc)


def honoured(marker: object) -> bool:
    """Whether MARKER_QUERY's answer says the startup options reached the server."""
    return marker == "on"


OPTIONS_LOST = (
    " (a connection pooler with ignore_startup_parameters=options?): its lock timeout, read-only mode and"
    " search_path would be lost; let idemctl detect the pooler (pooler=auto, the default) or name its pool mode"
    " (pooler=transaction, session or statement)"
)


def options_lost(where: str) -> PoolerError:
    """A session without the startup options it was opened with."""
    return PoolerError(f"{where} ignored idemctl's startup options" + OPTIONS_LOST)


def detect(settings: ServerSettings, translate: Translator) -> str:
    """What the URL leads to now (see url.POOLER_MODES), from one
    connection: also the check that the server is there, so the caller gets
    libpq's reason at once instead of a pool timeout."""
    if settings.pooler == "session":
        _check_session(settings, translate)
        return settings.pooler
    if settings.pooler not in ("auto", "none"):
        _connect(settings.pooled_conninfo, translate).close()
        return settings.pooler
    try:
        conn = psycopg.connect(settings.conninfo, autocommit=True)
    except psycopg.Error as exc:
        if settings.pooler == "auto" and refused_startup(exc):
            _connect(settings.pooled_conninfo, translate).close()
            return "transaction"
        raise translate(exc, connecting=True) from exc
    try:
        row = conn.execute(MARKER_QUERY).fetchone()
    except psycopg.Error as exc:
        raise translate(exc, connecting=True) from exc
    finally:
        conn.close()
    return _mode(settings, translate.where, row[0] if row else None)


async def adetect(settings: ServerSettings, translate: Translator) -> str:
    """`detect` on the running event loop."""
    if settings.pooler == "session":
        await _acheck_session(settings, translate)
        return settings.pooler
    if settings.pooler not in ("auto", "none"):
        await (await _aconnect(settings.pooled_conninfo, translate)).close()
        return settings.pooler
    try:
        conn = await psycopg.AsyncConnection.connect(settings.conninfo, autocommit=True)
    except psycopg.Error as exc:
        if settings.pooler == "auto" and refused_startup(exc):
            await (await _aconnect(settings.pooled_conninfo, translate)).close()
            return "transaction"
        raise translate(exc, connecting=True) from exc
    try:
        row = await (await conn.execute(MARKER_QUERY)).fetchone()
    except psycopg.Error as exc:
        raise translate(exc, connecting=True) from exc
    finally:
        await conn.close()
    return _mode(settings, translate.where, row[0] if row else None)


# pooler=session sets idemctl's settings once per connection, for the
# session. Behind transaction or statement pooling they would not follow the
# connection to its next transaction (another server session answers it), and
# a request could run without its search_path or lock timeout. So the pool
# first proves it is session pooling: connection one sets a random value for
# the session; connection two, opened while one is idle, must not see it (in
# session pooling it has a server session of its own; in transaction pooling
# it is most often given the one connection one has just left), and
# connection one must still have it in its next transaction.
_PROBE_SETTING = "idemctl.session_probe"
_SET_PROBE = f"SELECT set_config('{_PROBE_SETTING}', %s, false)"
_READ_PROBE = f"SELECT current_setting('{_PROBE_SETTING}', true)"


def _not_session(where: str) -> PoolerError:
    return PoolerError(
        f"{where} is not session pooling although the URL says pooler=session: a setting made for the session "
        "did not stay with its connection to the next transaction (PgBouncer in transaction or statement mode?); "
        "idemctl's lock timeout, read-only mode and search_path would be lost: use pooler=transaction, or let "
        "idemctl detect the pooler (pooler=auto, the default)"
    )


def _check_session(settings: ServerSettings, translate: Translator) -> None:
    token = secrets.token_hex(8)
    first = _connect(settings.pooled_conninfo, translate)
    try:
        first.execute(_SET_PROBE, (token,))
        second = _connect(settings.pooled_conninfo, translate)
        try:
            seen = second.execute(_READ_PROBE).fetchone()
        finally:
            second.close()
        kept = first.execute(_READ_PROBE).fetchone()
    except psycopg.Error as exc:
        raise translate(exc, connecting=True) from exc
    finally:
        first.close()
    if (seen and seen[0] == token) or not kept or kept[0] != token:
        raise _not_session(translate.where)


async def _acheck_session(settings: ServerSettings, translate: Translator) -> None:
    """`_check_session` on the running event loop."""
    token = secrets.token_hex(8)
    first = await _aconnect(settings.pooled_conninfo, translate)
    try:
        await first.execute(_SET_PROBE, (token,))
        second = await _aconnect(settings.pooled_conninfo, translate)
        try:
            seen = await (await second.execute(_READ_PROBE)).fetchone()
        finally:
            await second.close()
        kept = await (await first.execute(_READ_PROBE)).fetchone()
    except psycopg.Error as exc:
        raise translate(exc, connecting=True) from exc
    finally:
        await first.close()
    if (seen and seen[0] == token) or not kept or kept[0] != token:
        raise _not_session(translate.where)


def _mode(settings: ServerSettings, where: str, marker: object) -> str:
    if honoured(marker):
        return "none"
    if settings.pooler == "none":
        raise options_lost(where)
    return "transaction"


def _connect(conninfo: str, translate: Translator) -> psycopg.Connection[Any]:
    try:
        return psycopg.connect(conninfo, autocommit=True)
    except psycopg.Error as exc:
        raise translate(exc, connecting=True) from exc


async def _aconnect(conninfo: str, translate: Translator) -> psycopg.AsyncConnection[Any]:
    try:
        return await psycopg.AsyncConnection.connect(conninfo, autocommit=True)
    except psycopg.Error as exc:
        raise translate(exc, connecting=True) from exc


def pool_arguments(settings: ServerSettings, mode: str, where: str, cursor: type[Any]) -> tuple[str, dict[str, Any]]:
    """The conninfo and connection arguments of a pool in `mode` (`cursor`:
    the settings cursor class, synchronous or not)."""
    if settings.settings is None and mode != "none":
        raise StorageError(
            f"{where} is behind a connection pooler, which cannot pass on the URL's options="
            f"{settings.url_params.get('options', '')!r}: through a pooler idemctl applies only -c name=value settings"
        )
    kwargs: dict[str, Any] = {"autocommit": True}
    if mode in ("transaction", "statement"):
        kwargs.update(prepare_threshold=None, cursor_factory=cursor)
    elif settings.prepare_threshold_set:
        kwargs["prepare_threshold"] = settings.prepare_threshold
    return (settings.conninfo if mode == "none" else settings.pooled_conninfo), kwargs


class StatementSettings:
    """The prefix a pooled connection's statements carry: as given (a query
    without parameters), and with ``%`` doubled (one with parameters, where
    psycopg reads ``%%`` as ``%``)."""

    __slots__ = ("escaped", "plain")

    def __init__(self, query: str) -> None:
        self.plain = query + "; " if query else ""
        self.escaped = self.plain.replace("%", "%%")

    @classmethod
    def of(cls, settings: ServerSettings) -> StatementSettings:
        return cls(settings_sql(settings.transaction_settings(), local=True))


def _prefixed(query: Any, params: Any, settings: StatementSettings | None) -> Any:
    if settings is None or not settings.plain:
        return query
    if not isinstance(query, str):
        return sql.Composed([sql.SQL(settings.plain if params is None else settings.escaped), query])
    return (settings.plain if params is None else settings.escaped) + query


class SettingsCursor(psycopg.ClientCursor[Any]):
    """A cursor that sends each statement after its connection's settings
    in one simple-protocol query (no server-side prepared statement), and
    stands on the statement's own result."""

    def execute(
        self, query: Any, params: Any = None, *, prepare: bool | None = None, binary: bool | None = None
    ) -> SettingsCursor:
        settings: StatementSettings | None = getattr(self.connection, "idemctl_settings", None)
        super().execute(_prefixed(query, params, settings), params, prepare=prepare, binary=binary)
        while self.nextset():
            pass
        return self


class AsyncSettingsCursor(psycopg.AsyncClientCursor[Any]):
    """SettingsCursor on an AsyncConnection."""

    async def execute(
        self, query: Any, params: Any = None, *, prepare: bool | None = None, binary: bool | None = None
    ) -> AsyncSettingsCursor:
        settings: StatementSettings | None = getattr(self.connection, "idemctl_settings", None)
        await super().execute(_prefixed(query, params, settings), params, prepare=prepare, binary=binary)
        while self.nextset():
            pass
        return self
