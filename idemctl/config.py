"""One set of environment variables for every process that opens a ledger:
apps, the examples and the CLI read them through `Settings.from_env`, so
a value means the same thing everywhere.

    IDEMCTL_DB                ledger: a SQLite path, a postgresql:// URL or libpq
                              connection string (host=… dbname=…), a mysql:// URL
    IDEMCTL_PENDING_TTL       duration with a unit, e.g. 30s
    IDEMCTL_RETENTION         e.g. 24h
    IDEMCTL_FENCED_RETENTION  e.g. 30d
    IDEMCTL_BUSY_TIMEOUT      e.g. 5s

Durations always carry a unit (ms, s, m, h, d): a bare number is refused
rather than guessed, since 30 could mean 30 ms or 30 s.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .durations import human_duration, parse_duration
from .errors import ConfigError
from .ledger import Ledger
from .policy import DEFAULT_BUSY_TIMEOUT_MS, Policy

DEFAULT_DB = "idempotency.db"
ENV_DB = "IDEMCTL_DB"
ENV_PENDING_TTL = "IDEMCTL_PENDING_TTL"
ENV_RETENTION = "IDEMCTL_RETENTION"
ENV_FENCED_RETENTION = "IDEMCTL_FENCED_RETENTION"
ENV_BUSY_TIMEOUT = "IDEMCTL_BUSY_TIMEOUT"
# Names once read with other meanings: refused loudly instead of ignored.
RETIRED = {"IDEMCTL_PENDING_TTL_MS": ENV_PENDING_TTL, "IDEMCTL_RETENTION_MS": ENV_RETENTION}


def env_duration(environ: Mapping[str, str], name: str) -> int | None:
    """A duration variable in milliseconds, None when unset or empty.

    >>> env_duration({"IDEMCTL_PENDING_TTL": "45s"}, "IDEMCTL_PENDING_TTL")
    45000
    >>> try:
    ...     env_duration({"IDEMCTL_PENDING_TTL": "10000"}, "IDEMCTL_PENDING_TTL")
    ... except ConfigError as exc:
    ...     print(exc)
    IDEMCTL_PENDING_TTL=10000 needs a unit (ms, s, m, h or d): 10000ms is 10 s, 10000s is 2 h 47 min
    """
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    if raw.replace(".", "", 1).isdigit():
        # Both readings, spelled out: 10000 meant as ms is not 10000 s (2.8 h).
        as_ms, as_s = human_duration(round(float(raw))), human_duration(round(float(raw) * 1000))
        message = f"{name}={raw} needs a unit (ms, s, m, h or d): {raw}ms is {as_ms}, {raw}s is {as_s}"
        raise ConfigError(name, raw, message)
    try:
        return parse_duration(raw)
    except ValueError as exc:
        raise ConfigError(name, raw, f"{name}={raw!r}: {exc}") from None


@dataclass(frozen=True)
class Settings:
    """Where the ledger is and the contract's durations, from the environment.

    >>> s = Settings.from_env({"IDEMCTL_DB": "/var/lib/app/idem.db", "IDEMCTL_PENDING_TTL": "10s"})
    >>> s.db, s.policy().pending_ttl_ms, s.busy_timeout_ms
    ('/var/lib/app/idem.db', 10000, 5000)
    """

    db: str = DEFAULT_DB
    pending_ttl_ms: int | None = None
    retention_ms: int | None = None
    fenced_retention_ms: int | None = None
    busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS
    policy_defaults: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        for old, new in RETIRED.items():
            if env.get(old, "").strip():
                value = env[old].strip()
                raise ConfigError(old, value, f"{old} is not read: set {new} with a unit instead, e.g. {new}={value}ms")
        busy = env_duration(env, ENV_BUSY_TIMEOUT)
        return cls(
            db=env.get(ENV_DB, "").strip() or DEFAULT_DB,
            pending_ttl_ms=env_duration(env, ENV_PENDING_TTL),
            retention_ms=env_duration(env, ENV_RETENTION),
            fenced_retention_ms=env_duration(env, ENV_FENCED_RETENTION),
            busy_timeout_ms=DEFAULT_BUSY_TIMEOUT_MS if busy is None else busy,
        )

    def policy(self, **overrides: Any) -> Policy:
        """A Policy with these durations (unset ones keep Policy's defaults)."""
        values: dict[str, Any] = dict(self.policy_defaults)
        for name, value in (
            ("pending_ttl_ms", self.pending_ttl_ms),
            ("retention_ms", self.retention_ms),
            ("fenced_retention_ms", self.fenced_retention_ms),
        ):
            if value is not None:
                values[name] = value
        values.update(overrides)
        return Policy(**values)

    def open_ledger(self, **options: Any) -> Ledger:
        """`Ledger.open` on this ledger with this policy and busy timeout."""
        options.setdefault("busy_timeout_ms", self.busy_timeout_ms)
        policy = options.pop("policy", None) or self.policy()
        return Ledger.open(self.db, policy=policy, **options)
