"""The monitoring files idemctl ships: Prometheus recording and alerting
rules (``rules.yml``) and a Grafana dashboard (``dashboard.json``), over the
metrics of `idemctl.prometheus` and of ``idemctl stats --format prometheus``.

They are plain files inside the package (``idemctl/monitoring/``);
``idemctl monitoring rules`` and ``idemctl monitoring dashboard`` print them,
``--where`` says where they are (docs/observability.md).

>>> "alert: IdemctlFencedOut" in rules_text()
True
>>> "runbook_url: https://wiki.example/idemctl-runbook#fenced-out-events-appeared" in rules_text(
...     runbook_url="https://wiki.example/idemctl-runbook"
... )
True
"""

from __future__ import annotations

import enum
from importlib import resources
from pathlib import Path

from ..errors import IdemctlError

# How the shipped rules name the runbook: the page's path in the source tree.
# `rules_text(runbook_url=...)` puts the address a team reads it at instead.
RUNBOOK_PATH = "docs/runbook.md"


class MonitoringFile(enum.Enum):
    """A file of ``idemctl/monitoring/``, by what it is."""

    RULES = "rules.yml"
    DASHBOARD = "dashboard.json"


class RunbookUrlError(IdemctlError, ValueError):
    """A runbook address the rules cannot carry.

    >>> rules_text(runbook_url="wiki page")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    idemctl.monitoring.RunbookUrlError: the runbook URL must be an address without spaces, quotes or '#' ...
    """


def path(which: MonitoringFile) -> Path:
    """Where the installed file is, for a Prometheus ``rule_files`` entry or
    Grafana's dashboard provisioning to read in place.

    >>> path(MonitoringFile.RULES).name
    'rules.yml'
    """
    return Path(str(resources.files(__package__).joinpath(which.value)))


def text(which: MonitoringFile) -> str:
    """The file's text, as shipped.

    >>> import json
    >>> json.loads(text(MonitoringFile.DASHBOARD))["title"]
    'idemctl'
    """
    return resources.files(__package__).joinpath(which.value).read_text(encoding="utf-8")


def rules_text(*, runbook_url: str | None = None) -> str:
    """The rules file; with `runbook_url`, every alert's ``runbook_url``
    annotation points there (``URL#section``) instead of at
    ``docs/runbook.md#section``: the address where the team reads
    docs/runbook.md (a wiki page, the file on the Git host)."""
    shipped = text(MonitoringFile.RULES)
    if runbook_url is None:
        return shipped
    if not runbook_url or any(c.isspace() or c in "\"'#" for c in runbook_url):
        raise RunbookUrlError(
            f"the runbook URL must be an address without spaces, quotes or '#' (the rules add the section), "
            f"got {runbook_url!r}"
        )
    return shipped.replace(f"runbook_url: {RUNBOOK_PATH}#", f"runbook_url: {runbook_url}#")


__all__ = ["RUNBOOK_PATH", "MonitoringFile", "RunbookUrlError", "path", "rules_text", "text"]
