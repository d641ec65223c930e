"""Every knob of the Idempotency-Key contract, in one frozen object."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from .errors import PolicyError

DEFAULT_FINGERPRINT_HEADERS: tuple[str, ...] = ("content-type", "x-api-version")
DEFAULT_REPLAYABLE_HEADERS: tuple[str, ...] = ("content-type", "location")
DEFAULT_PROTECTED_METHODS: frozenset[str] = frozenset({"POST", "PATCH", "DELETE"})
# How long a statement waits for a lock held by another writer before it
# fails (SQLite's busy timeout, the servers' lock timeout): every engine's
# default, the CLI's and the configuration's.
DEFAULT_BUSY_TIMEOUT_MS = 5000


def _lower_names(names: Iterable[str], what: str) -> tuple[str, ...]:
    if isinstance(names, str):
        raise PolicyError(f"{what} must be a list of header names, not one string")
    out = tuple(str(n).strip().lower() for n in names)
    if any(not n for n in out):
        raise PolicyError(f"{what} contains an empty header name")
    if len(set(out)) != len(out):
        raise PolicyError(f"{what} names a header twice")
    return out


@dataclass(frozen=True)
class Policy:
    """The contract's settings. The retention the API advertises and the one
    the sweep enforces are the same field, so they cannot drift apart.

    >>> Policy(pending_ttl_ms=60_000).retry_after_seconds
    60
    """

    pending_ttl_ms: int = 30_000
    retention_ms: int = 24 * 60 * 60 * 1000
    sweep_batch: int = 20
    body_cap_bytes: int = 16_384
    # The replayable headers as stored (their JSON text, in UTF-8 bytes): an
    # answer over it is stored as the same loud 500 as an oversize body.
    header_cap_bytes: int = 8_192
    fingerprint_headers: tuple[str, ...] = DEFAULT_FINGERPRINT_HEADERS
    replayable_headers: tuple[str, ...] = DEFAULT_REPLAYABLE_HEADERS
    protected_methods: frozenset[str] = field(default=DEFAULT_PROTECTED_METHODS)
    reuse_status: int = 409
    # The fenced-out log is the record that a mutation may have run twice: it
    # outlives the rows it is about.
    fenced_retention_ms: int = 30 * 24 * 60 * 60 * 1000
    # Opt-in contract options; the defaults are the recipe's behaviour.
    # A duplicate that finds the key in progress waits up to this long for the
    # first answer (polling reads, no lock held) before answering 409.
    in_progress_wait_ms: int = 0
    # 409 in progress says how long until a takeover, not the whole TTL.
    retry_after_from_row: bool = False
    # Answers (first and replayed) carry this header with the instant until
    # which the key's answer is replayed (HTTP-date), e.g. "idempotency-expires".
    expires_header: str | None = None
    # keep_answer(status, headers) -> False: the answer is not stored and the
    # reservation is released, so a retry runs again (e.g. do not keep 5xx).
    keep_answer: Callable[[int, tuple[tuple[str, str], ...]], bool] | None = None
    # "raw": the recipe's byte-exact body. "json": a JSON body is fingerprinted
    # in canonical form (key order and whitespace do not matter), without the
    # fields named in fingerprint_ignore_fields (dotted paths: "meta.sent_at").
    fingerprint_body: str = "raw"
    fingerprint_ignore_fields: tuple[str, ...] = ()
    # Answers the ledger and the adapters make themselves (400, 401, 409,
    # 411, 413, 422, 503) as RFC 9457 application/problem+json instead of
    # the recipe's {"error": ...}; the app's own answers are never touched.
    problem_details: bool = False
    # A live owner renews its reservations every third of the TTL, so a short
    # TTL never takes over a slow but live mutation; renewal stops after
    # lease_max_ms, so a hung one is taken over in the end (leases.py).
    # lease_max_ms is read only with renewal on, and must then exceed the TTL.
    lease_renewal: bool = False
    lease_max_ms: int = 10 * 60 * 1000

    def __post_init__(self) -> None:
        for name in (
            "pending_ttl_ms",
            "retention_ms",
            "fenced_retention_ms",
            "sweep_batch",
            "body_cap_bytes",
            "header_cap_bytes",
            "reuse_status",
            "in_progress_wait_ms",
            "lease_max_ms",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise PolicyError(f"{name} must be an integer, got {value!r}")
        if self.pending_ttl_ms <= 0:
            raise PolicyError(f"pending_ttl_ms must be > 0, got {self.pending_ttl_ms}")
        if self.retention_ms <= self.pending_ttl_ms:
            raise PolicyError(
                f"retention_ms ({self.retention_ms}) must be longer than pending_ttl_ms ({self.pending_ttl_ms})"
            )
        if self.fenced_retention_ms <= 0:
            raise PolicyError(f"fenced_retention_ms must be > 0, got {self.fenced_retention_ms}")
        if self.sweep_batch < 1:
            raise PolicyError(f"sweep_batch must be >= 1, got {self.sweep_batch}")
        if self.body_cap_bytes < 0:
            raise PolicyError(f"body_cap_bytes must be >= 0, got {self.body_cap_bytes}")
        if self.header_cap_bytes < 2:
            # "{}", the stored form of no headers at all, must fit.
            raise PolicyError(f"header_cap_bytes must be >= 2, got {self.header_cap_bytes}")
        if self.reuse_status not in (409, 422):
            raise PolicyError(f"reuse_status must be 409 or 422, got {self.reuse_status}")
        if self.in_progress_wait_ms < 0:
            raise PolicyError(f"in_progress_wait_ms must be >= 0, got {self.in_progress_wait_ms}")
        if self.in_progress_wait_ms >= self.pending_ttl_ms:
            # Waiting past the TTL would outlive the reservation it waits for.
            raise PolicyError(
                f"in_progress_wait_ms ({self.in_progress_wait_ms}) must be shorter than pending_ttl_ms "
                f"({self.pending_ttl_ms})"
            )
        if self.lease_max_ms <= 0:
            raise PolicyError(f"lease_max_ms must be > 0, got {self.lease_max_ms}")
        if self.lease_renewal and self.lease_max_ms <= self.pending_ttl_ms:
            # Only renewal reads lease_max_ms: without it, a TTL of any
            # length is the whole story (keep it above the slowest mutation).
            raise PolicyError(
                f"lease_max_ms ({self.lease_max_ms}) must be longer than pending_ttl_ms ({self.pending_ttl_ms})"
                " when lease_renewal is on: raise lease_max_ms, or shorten the TTL (renewal makes a short one safe)"
            )
        if self.keep_answer is not None and not callable(self.keep_answer):
            raise PolicyError("keep_answer must be a callable (status, headers) -> bool")
        if self.fingerprint_body not in ("raw", "json"):
            raise PolicyError(f"fingerprint_body must be 'raw' or 'json', got {self.fingerprint_body!r}")
        if isinstance(self.fingerprint_ignore_fields, str):
            raise PolicyError("fingerprint_ignore_fields must be a list of field names, not one string")
        object.__setattr__(self, "fingerprint_ignore_fields", tuple(self.fingerprint_ignore_fields))
        if self.fingerprint_ignore_fields and self.fingerprint_body != "json":
            raise PolicyError("fingerprint_ignore_fields needs fingerprint_body='json'")
        if self.expires_header is not None:
            name = str(self.expires_header).strip().lower()
            if not name or not all(c.isalnum() or c in "-_" for c in name):
                raise PolicyError(f"expires_header must be a header name, got {self.expires_header!r}")
            object.__setattr__(self, "expires_header", name)
        # Normalise so that comparisons elsewhere never worry about case.
        object.__setattr__(self, "fingerprint_headers", _lower_names(self.fingerprint_headers, "fingerprint_headers"))
        object.__setattr__(self, "replayable_headers", _lower_names(self.replayable_headers, "replayable_headers"))
        if isinstance(self.protected_methods, str):
            raise PolicyError("protected_methods must be a set of method names, not one string")
        methods = frozenset(str(m).strip().upper() for m in self.protected_methods)
        if not methods or any(not m for m in methods):
            raise PolicyError("protected_methods must name at least one method")
        object.__setattr__(self, "protected_methods", methods)

    @property
    def retry_after_seconds(self) -> int:
        """`Retry-After` for a request that finds its key in progress: ceil(TTL / 1000)."""
        return math.ceil(self.pending_ttl_ms / 1000)

    def protects(self, method: str) -> bool:
        """Whether requests with this method need an Idempotency-Key."""
        return method.upper() in self.protected_methods
