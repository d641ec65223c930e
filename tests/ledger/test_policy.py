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


@pytest.mark.parametrize("ttl_ms", [600_000, 20 * 60_000, 6 * 60 * 60_000])
def test_a_pending_ttl_of_ten_minutes_or_more_is_accepted_without_lease_renewal(ttl_ms):
    # The docs tell users to keep the TTL above their slowest mutation: a
    # long one is the whole point when nothing renews leases.
    policy = Policy(pending_ttl_ms=ttl_ms)
    assert (policy.pending_ttl_ms, policy.lease_renewal, policy.lease_max_ms) == (ttl_ms, False, 600_000)
    assert policy.retry_after_seconds == ttl_ms // 1000


def test_lease_max_must_still_exceed_the_ttl_when_renewal_is_on():
    with pytest.raises(PolicyError) as caught:
        Policy(pending_ttl_ms=600_000, lease_renewal=True)
    assert str(caught.value) == (
        "lease_max_ms (600000) must be longer than pending_ttl_ms (600000) when lease_renewal is on: "
        "raise lease_max_ms, or shorten the TTL (renewal makes a short one safe)"
    )
    with pytest.raises(PolicyError, match="when lease_renewal is on"):
        Policy(pending_ttl_ms=20_000, lease_renewal=True, lease_max_ms=20_000)
    ok = Policy(pending_ttl_ms=20 * 60_000, lease_renewal=True, lease_max_ms=60 * 60_000)
    assert (ok.pending_ttl_ms, ok.lease_max_ms) == (1_200_000, 3_600_000)


@pytest.mark.parametrize("lease_max_ms", [0, -1])
def test_a_lease_max_that_is_not_positive_is_refused_even_with_renewal_off(lease_max_ms):
    with pytest.raises(PolicyError, match=f"lease_max_ms must be > 0, got {lease_max_ms}"):
        Policy(lease_max_ms=lease_max_ms)


def test_settings_from_the_environment_accept_a_fifteen_minute_ttl():
    from idemctl.config import Settings

    settings = Settings.from_env({"IDEMCTL_PENDING_TTL": "15m"})
    assert settings.pending_ttl_ms == 900_000
    assert settings.policy().pending_ttl_ms == 900_000
    with pytest.raises(PolicyError, match="when lease_renewal is on"):
        settings.policy(lease_renewal=True)
    assert settings.policy(lease_renewal=True, lease_max_ms=3_600_000).lease_max_ms == 3_600_000
