"""Where a Redis ledger keeps what: the key layout.

Every (principal, key) falls in one of BUCKETS buckets, and every key about
it, its row and its bucket's indexes and fenced-out log, carries the
bucket's hash tag ``{n}``: Redis Cluster puts them in one hash slot, so each
request-path step is one script over keys of one slot, and CROSSSLOT cannot
happen. A bucket's indexes are what the operator's listings and the sweep
walk, bucket by bucket (never a KEYS over the keyspace):

- ``P:{n}:r:<member>``   a row: a hash (fields below), expiring at the end of its retention
- ``P:{n}:u``            the bucket's rows by updated_at (a sorted set of members)
- ``P:{n}:q``            its pending rows by updated_at
- ``P:{n}:fe``           its fenced-out events (a hash: sequence number → JSON)
- ``P:{n}:ft``           the same events by fenced_at (a sorted set of sequence numbers)
- ``P:{n}:fs``           the bucket's event sequence (INCR: an event's id is seq * BUCKETS + n)
- ``P:schema``           the version marker ``init`` writes

A member is ``<bytes of the principal>:<principal><key>``, so two pairs never share one."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

# Fixed for a ledger's life (the marker records it): a listing or a sweep
# visits each bucket, pipelined per node; 1024 spread over any cluster's
# primaries evenly enough, and keep a bucket's index small.
BUCKETS = 1024

# The hash fields of a row, and the order a row is read in (ROW_COLUMNS).
ROW_FIELDS = ("p", "k", "f", "s", "g", "rs", "rb", "rh", "c", "u")
COPY_FIELDS = ("p", "k", "f", "s", "g", "t", "rs", "rb", "rh", "c", "u")


def member(principal: str, key: str) -> bytes:
    """The member naming (principal, key) in a bucket's indexes.

    >>> member("acct", "k1")
    b'4:acctk1'
    """
    p = principal.encode("utf-8")
    return b"%d:" % len(p) + p + key.encode("utf-8")


def split_member(value: bytes) -> tuple[str, str]:
    """(principal, key) of a member.

    >>> split_member(b'4:acctk1')
    ('acct', 'k1')
    """
    size, _, rest = value.partition(b":")
    n = int(size)
    return rest[:n].decode("utf-8"), rest[n:].decode("utf-8")


def bucket_of(name: bytes) -> int:
    return zlib.crc32(name) % BUCKETS


@dataclass(frozen=True, slots=True)
class Layout:
    """The keys of one ledger (one prefix)."""

    prefix: str

    def tag(self, bucket: int) -> bytes:
        return f"{self.prefix}:{{{bucket}}}:".encode()

    def row(self, bucket: int, name: bytes) -> bytes:
        return self.tag(bucket) + b"r:" + name

    def rows_by_time(self, bucket: int) -> bytes:
        return self.tag(bucket) + b"u"

    def pending(self, bucket: int) -> bytes:
        return self.tag(bucket) + b"q"

    def events(self, bucket: int) -> bytes:
        return self.tag(bucket) + b"fe"

    def events_by_time(self, bucket: int) -> bytes:
        return self.tag(bucket) + b"ft"

    def event_sequence(self, bucket: int) -> bytes:
        return self.tag(bucket) + b"fs"

    @property
    def marker(self) -> bytes:
        return f"{self.prefix}:schema".encode()

    def where(self, principal: str, key: str) -> tuple[int, bytes, list[bytes]]:
        """(bucket, member, [row, rows by time, pending]): a step's keys, one slot.

        >>> Layout("idemctl").where("acct", "k1")[2][0]
        b'idemctl:{935}:r:4:acctk1'
        """
        name = member(principal, key)
        b = bucket_of(name)
        tag = self.tag(b)
        return b, name, [tag + b"r:" + name, tag + b"u", tag + b"q"]

    def fenced_keys(self, principal: str, key: str) -> tuple[int, list[bytes]]:
        """(bucket, [row, events, events by time, sequence]) for a fenced-out record."""
        name = member(principal, key)
        b = bucket_of(name)
        tag = self.tag(b)
        return b, [tag + b"r:" + name, tag + b"fe", tag + b"ft", tag + b"fs"]
