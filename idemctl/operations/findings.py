"""A finding of `idemctl doctor`: its types live with the facts that make
them (`idemctl.storage.failover.findings`); this path keeps working."""

from __future__ import annotations

from ..storage.failover.findings import Finding, Severity

__all__ = ["Finding", "Severity"]
