"""The ledger's events: who listens, and the `idemctl.events` log line."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ..outcomes import Event, Outcome
from ..subscribers import Subscribers

log = logging.getLogger("idemctl")
# One structured line per non-trivial decision; the fields ride in `extra`
# (idemctl_outcome, idemctl_principal, ...) for JSON log formatters.
events_log = logging.getLogger("idemctl.events")

# Routine decisions are counted (listeners, metrics), not logged line by line.
QUIET = frozenset({Outcome.EXECUTED, Outcome.REPLAYED, Outcome.PASSTHROUGH})
LOUD = frozenset({Outcome.FENCED_OUT, Outcome.NOT_STORED, Outcome.UNAVAILABLE})

Listener = Callable[[Event], object]


class EventHub(Subscribers[Listener]):
    """The listeners of one ledger, and its log line per event.

    >>> hub = EventHub()
    >>> seen = []
    >>> stop = hub.subscribe(seen.append)
    >>> hub.heard(Outcome.EXECUTED), stop(), hub.heard(Outcome.EXECUTED)
    (True, None, False)
    """

    def __init__(self) -> None:
        self._listeners: tuple[Listener, ...] = ()
        self._lock = threading.Lock()

    def heard(self, outcome: Outcome) -> bool:
        """Whether an event of this outcome reaches anyone: a listener, or
        the `idemctl.events` log. When not, the request path builds no Event
        at all (most requests of an app without metrics)."""
        return bool(self._listeners) or (outcome not in QUIET and events_log.isEnabledFor(logging.INFO))

    def emit(self, event: Event) -> None:
        """Log the event and call every listener; never raises because of one."""
        if event.outcome not in QUIET and events_log.isEnabledFor(logging.INFO):
            level = logging.ERROR if event.outcome in LOUD else logging.INFO
            events_log.log(
                level,
                "%s %s %s principal=%s key=%s generation=%s status=%s ledger=%.1fms app=%s",
                event.outcome.value,
                event.method,
                event.path,
                event.principal,
                event.key,
                event.generation,
                event.status,
                event.ledger_ms,
                "-" if event.app_ms is None else f"{event.app_ms:.1f}ms",
                extra={f"idemctl_{name}": value for name, value in event_fields(event).items()},
            )
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:  # a listener must never fail the request it observes
                log.exception("an idemctl event listener failed on %s", event.outcome.value)


def event_fields(event: Event) -> dict[str, object]:
    """An event as the flat fields of its log line's `extra`."""
    return {
        "outcome": event.outcome.value,
        "principal": event.principal,
        "key": event.key,
        "generation": event.generation,
        "method": event.method,
        "path": event.path,
        "status": event.status,
        "ledger_ms": round(event.ledger_ms, 3),
        "app_ms": None if event.app_ms is None else round(event.app_ms, 3),
        "at": event.at,
        "waited": event.waited,
    }
