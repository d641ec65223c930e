from __future__ import annotations

import dataclasses

import pytest

from idemctl import Policy, PolicyError


def test_defaults_match_the_spec():
    p = Policy()
    assert p.pending_ttl_ms == 30_000
    assert p.retention_ms == 86_400_000
    assert p.sweep_batch == 20
    assert p.body_cap_bytes == 16_384
    assert p.fingerprint_headers == ("content-type", "x-api-version")
    assert p.replayable_headers == ("content-type", "location")
    assert p.protected_methods == frozenset({"POST", "PATCH", "DELETE"})
    assert p.reuse_status == 409
    assert p.retry_after_seconds == 30


def test_policy_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Policy().pending_ttl_ms = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"pending_ttl_ms": 0}, "pending_ttl_ms must be > 0"),
        ({"pending_ttl_ms": -5}, "pending_ttl_ms must be > 0"),
        ({"retention_ms": 30_000}, "must be longer than pending_ttl_ms"),
        ({"pending_ttl_ms": 10_000, "retention_ms": 9_000}, "must be longer than pending_ttl_ms"),
        ({"sweep_batch": 0}, "sweep_batch must be >= 1"),
        ({"body_cap_bytes": -1}, "body_cap_bytes must be >= 0"),
        ({"reuse_status": 400}, "reuse_status must be 409 or 422"),
        ({"pending_ttl_ms": 1.5}, "must be an integer"),
        ({"fingerprint_headers": "content-type"}, "not one string"),
        ({"replayable_headers": ("location", "Location")}, "names a header twice"),
        ({"protected_methods": frozenset()}, "at least one method"),
    ],
)
def test_nonsense_settings_are_rejected(kwargs, message):
    with pytest.raises(PolicyError, match=message):
        Policy(**kwargs)


def test_names_are_normalised():
    p = Policy(fingerprint_headers=["Content-Type", "If-Match"], protected_methods={"post", "put"})
    assert p.fingerprint_headers == ("content-type", "if-match")
    assert p.protected_methods == frozenset({"POST", "PUT"})
    assert p.protects("put") and not p.protects("GET")


def test_retry_after_rounds_up():
    assert Policy(pending_ttl_ms=1_001).retry_after_seconds == 2
    assert Policy(pending_ttl_ms=1_000).retry_after_seconds == 1
    assert Policy(reuse_status=422).reuse_status == 422
