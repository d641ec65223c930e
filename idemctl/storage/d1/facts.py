"""What `idemctl doctor` reads of a D1 ledger: Cloudflare runs D1's
replication, so the facts are the token's reach, the latency of one call,
and the schema and rows the token sees (storage/failover's FailoverFacts)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from ..failover.findings import Finding, Severity

_WANTED = ("idx_idempotency_keys_updated_at", "idx_idempotency_keys_key_id", "idemctl_fenced_out")


class _Reads(Protocol):
    def describe(self) -> str: ...
    def read(self, sql: str, params: dict[str, Any]) -> list[tuple[Any, ...]]: ...
    def call_latency_s(self) -> float: ...


@dataclass(frozen=True)
class D1Facts:
    """What doctor read: where, one call's latency (the best of three), the
    schema version (None: the recipe's table only; -1: no ledger table),
    the ledger's rows, and which of idemctl's tables and indexes are missing.

    >>> D1Facts("d1://a/b", 0.021, 3, 10, ()).assess()[0].message
    'the API token reaches d1://a/b (one call: 21 ms)'
    """

    where: str
    latency_s: float
    schema_version: int | None
    rows: int
    missing: tuple[str, ...]

    @property
    def product(self) -> str:
        return "Cloudflare D1"

    def assess(self) -> tuple[Finding, ...]:
        found = [
            Finding(Severity.OK, f"the API token reaches {self.where} (one call: {self.latency_s * 1000:.0f} ms)"),
            Finding(
                Severity.OK,
                "Cloudflare D1: the database's primary acknowledges a write once it is durable; "
                "Cloudflare runs its replication, and there is no failover for idemctl to check",
            ),
        ]
        if self.schema_version == -1:
            found.append(Finding(Severity.WARNING, "no ledger table (idempotency_keys): run idemctl init"))
            return tuple(found)
        schema = "the recipe's table only" if self.schema_version is None else f"schema version {self.schema_version}"
        missing = f"; missing: {', '.join(self.missing)} (run idemctl init)" if self.missing else ""
        severity = Severity.WARNING if self.missing else Severity.OK
        found.append(Finding(severity, f"{schema}, {self.rows} rows in idempotency_keys{missing}"))
        return tuple(found)

    def document(self) -> dict[str, Any]:
        return {
            "latency_ms": round(self.latency_s * 1000, 1),
            "schema_version": self.schema_version,
            "rows": self.rows,
            "missing": list(self.missing),
        }


def read_facts(engine: _Reads) -> D1Facts:
    """Five calls: three `SELECT 1` (the best is the latency), the catalog,
    then the version and the row count."""
    latency = min(engine.call_latency_s() for _ in range(3))
    names = {str(r[0]) for r in engine.read("SELECT name FROM sqlite_master WHERE type IN ('table', 'index')", {})}
    where = engine.describe()
    if "idempotency_keys" not in names:
        return D1Facts(where, latency, -1, 0, ())
    version = None
    if "idemctl_schema_version" in names:
        version = engine.read("SELECT max(version) FROM idemctl_schema_version", {})[0][0]
    rows = int(engine.read("SELECT count(*) FROM idempotency_keys", {})[0][0])
    return D1Facts(where, latency, version, rows, tuple(n for n in _WANTED if n not in names))
