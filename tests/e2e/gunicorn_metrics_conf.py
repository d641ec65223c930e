"""gunicorn settings for prometheus_client's multi-process mode, as
docs/observability.md tells a user: a dead worker's live values go."""

from __future__ import annotations

from typing import Any

from idemctl.prometheus import mark_process_dead


def child_exit(server: Any, worker: Any) -> None:
    mark_process_dead(worker.pid)
