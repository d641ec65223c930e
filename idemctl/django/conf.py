"""``settings.IDEMCTL`` read into a `Config`, and the ledger it names,
opened once per process.

Everything is configured in one settings dict, every entry optional::

    IDEMCTL = {
        "LEDGER": "/var/lib/app/idempotency.db",  # or "postgresql://..."; default $IDEMCTL_DB
        "POLICY": {"pending_ttl_ms": 30_000},     # Policy fields
        "EXEMPT_PATHS": ["/webhooks/"],           # prefixes, compiled regexes or callables
    }

The ledger is opened at the first protected request of each process, never
at import, so Django's autoreloader and a pre-forking server (gunicorn,
with or without ``--preload``) each get their own.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

# Not `from django.conf import settings`: tools that inspect this module's
# names (doctest) would touch the lazy settings before Django is configured.
from django import conf as django_conf
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from ..config import Settings
from ..exchange import gate as gates
from ..exchange.gate import Gate, LazyGate
from ..exchange.wire import DEFAULT_MAX_BODY_BYTES, DEFAULT_UNAVAILABLE_RETRY_AFTER_MS
from ..ledger import Ledger
from ..outcomes import InitResult
from ..policy import Policy

log = logging.getLogger("idemctl.django")

SETTING = "IDEMCTL"
KEYS = frozenset(
    {
        "LEDGER",
        "POLICY",
        "PROTECTED_METHODS",
        "EXEMPT_PATHS",
        "PRINCIPAL",
        "MAX_BODY_BYTES",
        "REPLAYED_HEADER",
        "RELEASE_ON_ERROR",
        "UNAVAILABLE_RETRY_AFTER_MS",
    }
)

ExemptPath = str | re.Pattern[str] | Callable[[Any], bool]


@dataclass(frozen=True)
class Config:
    """``settings.IDEMCTL``, read and checked once (see :func:`current_config`)."""

    ledger_target: str | None
    ledger_instance: Ledger | None
    policy: Policy
    busy_timeout_ms: int
    exempt_paths: tuple[ExemptPath, ...]
    principal: Callable[[Any], str | None]
    max_body_bytes: int
    replayed_header: bool
    release_on_error: bool | Callable[[Any], bool]
    unavailable_retry_after_ms: int

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> Config:
        """Check every entry; a mistake raises ImproperlyConfigured naming it.
        Whatever is not set comes from the IDEMCTL_* environment (idemctl.config)."""
        if not isinstance(raw, Mapping):
            raise ImproperlyConfigured(f"settings.{SETTING} must be a dict, got {type(raw).__name__}")
        unknown = sorted(set(raw) - KEYS)
        if unknown:
            raise ImproperlyConfigured(f"settings.{SETTING} has unknown entries {unknown}; known: {sorted(KEYS)}")
        env = Settings.from_env(environ)
        target = raw.get("LEDGER")
        instance = target if isinstance(target, Ledger) else None
        if instance is not None:
            if "POLICY" in raw or "PROTECTED_METHODS" in raw:
                raise ImproperlyConfigured(
                    f'settings.{SETTING}["LEDGER"] is a Ledger, which carries its own policy: '
                    'leave out "POLICY" and "PROTECTED_METHODS"'
                )
            policy = instance.policy
            target = None
        else:
            if target is None:
                target = env.db
            if not isinstance(target, str | os.PathLike):
                raise ImproperlyConfigured(
                    f'settings.{SETTING}["LEDGER"] must be a path, a postgresql:// URL or a Ledger, got {target!r}'
                )
            target = os.fspath(target)
            policy = _policy(env, raw)
        return cls(
            ledger_target=target,
            ledger_instance=instance,
            policy=policy,
            busy_timeout_ms=env.busy_timeout_ms,
            exempt_paths=_exempt_paths(raw.get("EXEMPT_PATHS", ())),
            principal=_principal(raw.get("PRINCIPAL")),
            max_body_bytes=_count(raw, "MAX_BODY_BYTES", DEFAULT_MAX_BODY_BYTES, 0),
            replayed_header=_flag(raw, "REPLAYED_HEADER"),
            release_on_error=_release_on_error(raw.get("RELEASE_ON_ERROR", False)),
            unavailable_retry_after_ms=_count(raw, "UNAVAILABLE_RETRY_AFTER_MS", DEFAULT_UNAVAILABLE_RETRY_AFTER_MS, 1),
        )

    def ledger(self) -> Ledger:
        """The ledger, opened on first use in this process."""
        if self.ledger_instance is not None:
            return self.ledger_instance
        assert self.ledger_target is not None
        return _process_ledger(self.ledger_target, self.policy, self.busy_timeout_ms)

    def path_is_exempt(self, request: Any) -> bool:
        path = str(request.path_info)
        for entry in self.exempt_paths:
            if isinstance(entry, str):
                if path.startswith(entry):
                    return True
            elif isinstance(entry, re.Pattern):
                if entry.match(path):
                    return True
            elif entry(request):
                return True
        return False

    def release(self, request: Any) -> bool:
        return gates.release_wanted(self.release_on_error, request)

    @functools.cached_property
    def gate(self) -> Gate:
        """The gate every protected request of this configuration goes through."""
        options: dict[str, Any] = {
            "max_body_bytes": self.max_body_bytes,
            "replayed_header": self.replayed_header,
            "unavailable_retry_after_ms": self.unavailable_retry_after_ms,
            "logger": log,
        }
        # A Ledger given in the settings is held as it is: the gate then reads
        # an attribute each time, not this configuration's `ledger()` method.
        if self.ledger_instance is not None:
            return Gate(self.ledger_instance, **options)
        return LazyGate(self.ledger, **options)


def _policy(env: Settings, raw: Mapping[str, Any]) -> Policy:
    fields = raw.get("POLICY", {})
    if not isinstance(fields, Mapping):
        raise ImproperlyConfigured(f'settings.{SETTING}["POLICY"] must be a dict of Policy fields')
    overrides = dict(fields)
    if "PROTECTED_METHODS" in raw:
        overrides["protected_methods"] = raw["PROTECTED_METHODS"]
    try:
        return env.policy(**overrides)
    except (TypeError, ValueError) as exc:
        raise ImproperlyConfigured(f'settings.{SETTING}["POLICY"]: {exc}') from exc


def _exempt_paths(value: object) -> tuple[ExemptPath, ...]:
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise ImproperlyConfigured(f'settings.{SETTING}["EXEMPT_PATHS"] must be a list, got {value!r}')
    entries: list[ExemptPath] = []
    for entry in value:
        if not (isinstance(entry, str | re.Pattern) or callable(entry)):
            raise ImproperlyConfigured(
                f'settings.{SETTING}["EXEMPT_PATHS"]: {entry!r} is not a path prefix, a compiled regex or a callable'
            )
        entries.append(entry)
    return tuple(entries)


def _principal(value: object) -> Callable[[Any], str | None]:
    if value is None:
        return user_principal
    if isinstance(value, str):
        try:
            value = import_string(value)
        except ImportError as exc:
            raise ImproperlyConfigured(f'settings.{SETTING}["PRINCIPAL"]: {exc}') from exc
    if not callable(value):
        raise ImproperlyConfigured(f'settings.{SETTING}["PRINCIPAL"] must name a callable request -> str | None')
    resolver: Callable[[Any], str | None] = value
    return resolver


def _release_on_error(value: object) -> bool | Callable[[Any], bool]:
    if isinstance(value, bool):
        return value
    if callable(value):
        predicate: Callable[[Any], bool] = value
        return predicate
    raise ImproperlyConfigured(f'settings.{SETTING}["RELEASE_ON_ERROR"] must be a bool or a callable request -> bool')


def _flag(raw: Mapping[str, Any], name: str) -> bool:
    value = raw.get(name, False)
    if not isinstance(value, bool):
        raise ImproperlyConfigured(f'settings.{SETTING}["{name}"] must be True or False, got {value!r}')
    return value


def _count(raw: Mapping[str, Any], name: str, default: int, minimum: int) -> int:
    value = raw.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ImproperlyConfigured(f'settings.{SETTING}["{name}"] must be an integer >= {minimum}, got {value!r}')
    return value


_NOT_SET: Mapping[str, Any] = {}
_config_lock = threading.Lock()
_config_cache: tuple[object, Config] | None = None


def current_config() -> Config:
    """The configuration ``settings.IDEMCTL`` holds now. Read again only when
    the setting is replaced (override_settings in tests, for instance)."""
    global _config_cache
    raw = getattr(django_conf.settings, SETTING, _NOT_SET)
    cached = _config_cache
    if cached is not None and cached[0] is raw:
        return cached[1]
    config = Config.from_mapping(raw)
    with _config_lock:
        _config_cache = (raw, config)
    return config


# One ledger per (target, policy, busy timeout) and process. A forked child
# opens its own and leaves the one it inherited referenced and untouched:
# closing it there would close connections the parent still uses.
_ledgers_lock = threading.Lock()
_ledgers: dict[tuple[str, Policy, int], tuple[int, Ledger]] = {}
_inherited: list[Ledger] = []


def _process_ledger(target: str, policy: Policy, busy_timeout_ms: int) -> Ledger:
    key = (target, policy, busy_timeout_ms)
    pid = os.getpid()
    entry = _ledgers.get(key)
    if entry is not None and entry[0] == pid:
        return entry[1]
    with _ledgers_lock:
        entry = _ledgers.get(key)
        if entry is not None and entry[0] == pid:
            return entry[1]
        if entry is not None:
            _inherited.append(entry[1])
        ledger = Ledger.open(target, policy=policy, busy_timeout_ms=busy_timeout_ms)
        _ledgers[key] = (pid, ledger)
        return ledger


def init_ledger(**signal_arguments: Any) -> InitResult:
    """Create or upgrade the schema of the ledger ``settings.IDEMCTL`` names;
    safe to run any number of times, from any number of processes. Connect
    it to ``post_migrate`` (in an AppConfig's ``ready``) and ``manage.py
    migrate`` creates the ledger along with the project's tables; or run
    ``idemctl --db ... init`` instead."""
    config = current_config()
    result = config.ledger().init()
    log.info("idempotency ledger %s: %s", config.ledger().describe(), result.describe())
    return result


def user_principal(request: Any) -> str | None:
    """The default principal: the authenticated user's primary key, as a
    string; None (the contract's 401) for an anonymous user. On a DRF view
    using the mixin, `request.user` is the user DRF's authentication found."""
    try:
        user = request.user
    except AttributeError:
        raise ImproperlyConfigured(
            "idemctl needs request.user: add django.contrib.auth.middleware.AuthenticationMiddleware to "
            f'MIDDLEWARE, or name a principal callable in settings.{SETTING}["PRINCIPAL"]'
        ) from None
    if user is None or not getattr(user, "is_authenticated", False):
        return None
    return str(user.pk)


__all__ = ["KEYS", "SETTING", "Config", "current_config", "init_ledger", "user_principal"]
