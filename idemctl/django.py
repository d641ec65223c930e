"""Django and Django REST framework: the Idempotency-Key contract for views.

`IdempotencyMiddleware` protects every view of a project. Its principal is
the primary key of the user Django's `AuthenticationMiddleware` resolved
(anonymous requests get the contract's 401), or whatever the callable
named by ``IDEMCTL["PRINCIPAL"]`` returns. DRF authenticates inside the
view (token, JWT, ...), after every middleware has run, so a DRF view adds
`IdempotencyMixin` instead: the key is claimed after DRF's authentication,
permission and throttle checks, with DRF's user as the principal. The
middleware leaves views that use the mixin to it.

Everything is configured in one settings dict, every entry optional::

    IDEMCTL = {
        "LEDGER": "/var/lib/app/idempotency.db",  # or "postgresql://..."; default $IDEMCTL_DB
        "POLICY": {"pending_ttl_ms": 30_000},     # Policy fields
        "EXEMPT_PATHS": ["/webhooks/"],           # prefixes, compiled regexes or callables
    }

Answers are the WSGI middleware's, byte for byte: the app's response
(streamed or not) is collected whole, stored, and the answer built from
what was stored is sent. The ledger is opened at the first protected
request of each process, never at import, so Django's autoreloader and a
pre-forking server (gunicorn, with or without ``--preload``) each get
their own. Needs the `django` extra.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

# Not `from django.conf import settings`: tools that inspect this module's
# names (doctest) would touch the lazy settings before Django is configured.
from django import conf as django_conf
from django.core.exceptions import ImproperlyConfigured, RequestDataTooBig
from django.core.signals import got_request_exception
from django.http import HttpResponse, RawPostDataException, UnreadablePostError
from django.utils.module_loading import import_string

from . import asgi, responses
from . import gate as gates
from .capture import Capture
from .config import Settings
from .gate import BodyRefused, Delivery, Gate
from .ledger import Ledger
from .outcomes import Answer, InitResult, Outcome, Ticket
from .policy import Policy
from .wire import DEFAULT_MAX_BODY_BYTES, DEFAULT_UNAVAILABLE_RETRY_AFTER_MS, wire_headers
from .wsgi import PRINCIPAL_ENVIRON_KEY, environ_headers, request_target, status_line

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

EXEMPT = "exempt"
KEY_OPTIONAL = "key_optional"
KEY_REQUIRED = "key_required"
_MODE_ATTR = "idemctl_mode"
_STATE_ATTR = "_idemctl_state"
_ANSWER_ATTR = "_idemctl_answer"

V = TypeVar("V")
ExemptPath = str | re.Pattern[str] | Callable[[Any], bool]


# -- configuration -------------------------------------------------------------------------
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
        return bool(self.release_on_error(request)) if callable(self.release_on_error) else self.release_on_error

    @functools.cached_property
    def gate(self) -> Gate:
        """The gate every protected request of this configuration goes through."""
        return Gate(
            self.ledger,
            max_body_bytes=self.max_body_bytes,
            replayed_header=self.replayed_header,
            unavailable_retry_after_ms=self.unavailable_retry_after_ms,
            logger=log,
        )


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


# -- principals and per-view marks ---------------------------------------------------------
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


def _marked(view: V, mode: str) -> V:
    setattr(view, _MODE_ATTR, mode)
    return view


def idempotency_exempt(view: V) -> V:
    """A view (function, class, or a DRF handler or viewset action method)
    that the ledger leaves alone: requests pass as if idemctl were not there.
    Put it above ``@api_view`` and ``@csrf_exempt``."""
    return _marked(view, EXEMPT)


def idempotency_key_optional(view: V) -> V:
    """Requests to this view without an `Idempotency-Key` header run
    unprotected (only for views harmless to repeat); with one they are
    protected as usual."""
    return _marked(view, KEY_OPTIONAL)


def idempotency_key_required(view: V) -> V:
    """This view is protected even under one of ``EXEMPT_PATHS``: every
    request with a protected method needs a key (the default elsewhere)."""
    return _marked(view, KEY_REQUIRED)


def _mode_of(candidates: Iterable[object]) -> str | None:
    for candidate in candidates:
        mode = getattr(candidate, _MODE_ATTR, None)
        if mode in (EXEMPT, KEY_OPTIONAL, KEY_REQUIRED):
            return str(mode)
    return None


def _view_mode(view_func: Any, method: str) -> str | None:
    """The mark that applies to this request: on the method handler (a
    class-based view's `post`, a viewset's action), the view function, or
    the view class; the most specific wins."""
    cls = getattr(view_func, "cls", None) or getattr(view_func, "view_class", None)
    candidates: list[object] = []
    if isinstance(cls, type):
        actions = getattr(view_func, "actions", None)
        name = actions.get(method.lower()) if isinstance(actions, Mapping) else method.lower()
        if name:
            candidates.append(getattr(cls, name, None))
    candidates += [view_func, cls]
    return _mode_of(candidates)


def _uses_mixin(view_func: Any) -> bool:
    cls = getattr(view_func, "cls", None)
    return isinstance(cls, type) and issubclass(cls, IdempotencyMixin)


# -- one request: body, decision, completion -----------------------------------------------
def _is_asgi(request: Any) -> bool:
    return isinstance(getattr(request, "scope", None), dict)


def _request_target(request: Any) -> str:
    """What the fingerprint covers: the target the WSGI middleware (or, under
    ASGI, the ASGI middleware) would see for this request."""
    if not _is_asgi(request):
        return request_target(request.META)
    scope = dict(request.scope)
    query = scope.get("query_string")
    if isinstance(query, str):  # Django's AsyncClient puts a str where servers put bytes
        scope["query_string"] = query.encode("latin-1")
    return asgi.request_target(scope)


def _read_body(request: Any, limit: int) -> bytes:
    """The request body, refused (400, 411, 413) by the gate's rules."""
    meta = request.META
    declared = gates.declared_length(meta.get("CONTENT_LENGTH"), limit)
    if declared is None and meta.get("HTTP_TRANSFER_ENCODING") and not _is_asgi(request):
        # Django reads a WSGI body by its Content-Length alone: a chunked one
        # would reach the view (and the fingerprint) empty.
        raise gates.length_required()
    try:
        body = request.body
    except RequestDataTooBig:
        raise BodyRefused(responses.body_too_large(int(django_conf.settings.DATA_UPLOAD_MAX_MEMORY_SIZE))) from None
    except UnreadablePostError as exc:
        log.info("client disconnected mid-body: %s", exc)
        raise gates.incomplete() from None
    except RawPostDataException:
        raise ImproperlyConfigured(
            "the request body was parsed as a stream (request.POST of a multipart body) before idemctl could "
            "read it for the fingerprint: list IdempotencyMiddleware before the middleware that reads it"
        ) from None
    if not isinstance(body, bytes):
        raise TypeError(f"request.body must be bytes, got {type(body).__name__}")
    gates.check_read(len(body), limit)
    gates.check_complete(len(body), declared)
    return body


def _buffer_multipart(request: Any, limit: int) -> None:
    """Read a multipart body into memory before anything parses it as a
    stream (CsrfViewMiddleware and DRF's SessionAuthentication read
    request.POST), which would leave nothing for the fingerprint. Other
    bodies are read by their parsers through request.body anyway."""
    if not str(request.META.get("CONTENT_TYPE", "")).lower().startswith("multipart/"):
        return
    with contextlib.suppress(BodyRefused):  # answered when the request is decided, if its view is protected
        _read_body(request, limit)


def _begin(config: Config, request: Any, who: object) -> Answer | Ticket:
    """The gate's decision for a protected request (Django's HttpRequest)."""
    gate = config.gate
    method = str(request.method).upper()
    target = _request_target(request)
    # Django's handlers join repeated header fields before the view sees them.
    key = request.META.get("HTTP_IDEMPOTENCY_KEY")
    principal = gate.principal(who, key=key, method=method, target=target)
    if isinstance(principal, Answer):
        return principal
    try:
        body = _read_body(request, config.max_body_bytes)
    except BodyRefused as refused:
        return gate.refused(refused, principal=principal, key=key, method=method, target=target)
    headers = environ_headers(request.META, config.policy.fingerprint_headers)
    return gate.begin(principal, key, method, target, headers, body)


def _capture(response: Any, capture: Capture) -> None:
    """A Django response fed into the bounded capture (a streamed one is
    consumed), its resources closed as a server would close them."""
    try:
        headers = [(str(k), str(v)) for k, v in response.items()]
        headers += [("Set-Cookie", morsel.output(header="").strip()) for morsel in response.cookies.values()]
        capture.start(int(response.status_code), headers)
        if response.streaming:
            for chunk in response:
                capture.add(chunk)
        else:
            capture.add(bytes(response.content))
    finally:
        # What response.close() does, minus the request_finished signal: the
        # request is not finished, the answer built from it is still to go out.
        closers = list(getattr(response, "_resource_closers", ()))
        getattr(response, "_resource_closers", []).clear()
        for close in closers:
            try:
                close()
            except Exception:
                log.exception("closing the view's response failed")


def _complete(config: Config, ticket: Ticket, response: Any, request: Any) -> Delivery:
    """Store the view's answer: what to send, and whether to sweep after it."""
    capture = config.gate.capture()
    try:
        _capture(response, capture)
    except BaseException:
        # A stream that fails after the view returned: the view's failure.
        config.gate.abandon(ticket, release=config.release(request))
        raise
    return config.gate.finish(ticket, capture)


def answer_response(answer: Answer, *, replayed_header: bool = False, sweep: Ledger | None = None) -> HttpResponse:
    """An Answer as a Django response carrying exactly the WSGI middleware's
    status line, headers and body. With `sweep`, the bounded sweep runs
    when the server closes the response, after the answer has gone out."""
    gate = Gate(sweep, replayed_header=replayed_header) if sweep is not None else None
    return _response(Delivery(answer, sweep is not None), replayed_header, gate)


def _response(delivery: Delivery, replayed_header: bool, gate: Gate | None) -> HttpResponse:
    answer = delivery.answer
    response = HttpResponse(answer.body, status=answer.status)
    response.reason_phrase = status_line(answer.status)[4:]
    del response["Content-Type"]  # HttpResponse's default; the answer says what it has
    seen: dict[str, str] = {}
    for name, value in wire_headers(answer, replayed_header=replayed_header):
        lname = name.lower()
        if lname == "set-cookie":
            # Django sends cookies from response.cookies, one field each: never folded.
            response.cookies.load(value)
        elif lname in seen:
            # Django holds one value per name: a repeated field is joined, as
            # RFC 9110 §5.3 allows for every field but Set-Cookie.
            seen[lname] = response[name] = f"{seen[lname]}, {value}"
        else:
            seen[lname] = response[name] = value
    sweep = gate.sweep_after(delivery) if gate is not None else None
    if sweep is not None:
        response._resource_closers.append(sweep)
    setattr(response, _ANSWER_ATTR, True)
    return response


class _State:
    """One request's passage through the middleware."""

    __slots__ = ("answer", "config", "decided", "path_exempt", "raised", "ticket")

    def __init__(self, config: Config, path_exempt: bool) -> None:
        self.config = config
        self.path_exempt = path_exempt
        self.decided = False
        self.answer: Answer | None = None
        self.ticket: Ticket | None = None
        self.raised = False

    def abandon(self, request: Any) -> None:
        ticket, self.ticket = self.ticket, None
        if ticket is not None:
            self.config.gate.abandon(ticket, release=self.config.release(request))


def _note_exception(sender: object, request: Any = None, **kwargs: Any) -> None:
    # Django turns an exception of the view into a 500 before the middleware
    # sees the response; this signal is how we learn that the view raised.
    state = getattr(request, _STATE_ATTR, None)
    if isinstance(state, _State) and state.ticket is not None:
        state.raised = True


got_request_exception.connect(_note_exception, dispatch_uid="idemctl.django.note_exception")

_hinted: set[type] = set()


def _hint_drf(view_func: Any, request: Any) -> None:
    cls = getattr(view_func, "cls", None)
    if isinstance(cls, type) and hasattr(cls, "authentication_classes") and cls not in _hinted:
        _hinted.add(cls)
        log.warning(
            "%s %s: %s is a Django REST framework view, which authenticates inside the view; the middleware "
            "saw Django's user (anonymous) and answered 401. Add idemctl.django.IdempotencyMixin to the view "
            "so that the principal is the user DRF authenticates.",
            request.method,
            request.path,
            cls.__name__,
        )


# -- the middleware ------------------------------------------------------------------------
class IdempotencyMiddleware:
    """Every view under the Idempotency-Key contract. Put it after
    ``django.contrib.auth.middleware.AuthenticationMiddleware`` in
    ``MIDDLEWARE``; CSRF and authentication failures then claim nothing.

    Protected methods (POST, PATCH, DELETE by default) are decided once the
    view is known (process_view), so the per-view marks apply; the view runs
    at most once per key, and the answer that was stored is sent. A view
    that raises leaves the reservation pending (or releases it, with
    ``RELEASE_ON_ERROR``) and Django answers 500 as usual. DRF views using
    `IdempotencyMixin` are left to the mixin.
    """

    sync_capable = True
    async_capable = False

    def __init__(self, get_response: Callable[[Any], Any]) -> None:
        self.get_response = get_response
        current_config()  # a mistake in settings.IDEMCTL fails at startup, not at the first POST

    def __call__(self, request: Any) -> Any:
        config = current_config()
        if not config.policy.protects(str(request.method or "GET")):
            return self.get_response(request)
        state = _State(config, config.path_is_exempt(request))
        setattr(request, _STATE_ATTR, state)
        if not state.path_exempt:
            _buffer_multipart(request, config.max_body_bytes)
        try:
            response = self.get_response(request)
        except BaseException:  # DEBUG_PROPAGATE_EXCEPTIONS lets the view's exception through
            state.abandon(request)
            raise
        if state.answer is not None:
            return _response(gates.replied(state.answer), config.replayed_header, config.gate)
        if state.ticket is None:
            return response
        if state.raised:
            state.abandon(request)
            return response
        ticket, state.ticket = state.ticket, None
        return _response(_complete(config, ticket, response, request), config.replayed_header, config.gate)

    def process_view(self, request: Any, view_func: Any, view_args: Any, view_kwargs: Any) -> Any:
        state = getattr(request, _STATE_ATTR, None)
        if not isinstance(state, _State) or state.decided:
            return None
        state.decided = True
        if _uses_mixin(view_func):
            return None
        mode = _view_mode(view_func, str(request.method))
        if mode is None and state.path_exempt:
            mode = EXEMPT
        if mode == EXEMPT:
            return None
        if mode == KEY_OPTIONAL and request.META.get("HTTP_IDEMPOTENCY_KEY") is None:
            return None
        config = state.config
        who = config.principal(request)
        decision = _begin(config, request, who)
        if isinstance(decision, Answer):
            if decision.outcome is Outcome.UNAUTHENTICATED:
                _hint_drf(view_func, request)
            state.answer = decision
            # A stand-in that skips the view; __call__ sends the answer itself,
            # so inner middleware cannot make it differ from a first answer.
            return HttpResponse(status=decision.status)
        state.ticket = decision
        request.META[PRINCIPAL_ENVIRON_KEY] = who  # as the WSGI middleware puts it in the environ
        return None


# -- Django REST framework -----------------------------------------------------------------
class _Answered(Exception):
    """The ledger answered without running the handler (replay, 400, 401, 409, 503)."""

    def __init__(self, response: HttpResponse) -> None:
        super().__init__(response.status_code)
        self.response = response


class IdempotencyMixin:
    """For DRF views and viewsets: claims the key after DRF's authentication,
    permission and throttle checks, with ``request.user`` as DRF resolved it
    (token, session, JWT, ...) as the principal. List it before the DRF base::

        class OrderList(IdempotencyMixin, APIView):
            authentication_classes = [TokenAuthentication]
            permission_classes = [IsAuthenticated]

    A request DRF refuses (401, 403, 429) claims nothing. The handler runs at
    most once per key; its response (a DRF ``Response`` is rendered first)
    is stored, and the answer built from what was stored is sent, exactly as
    the middleware sends it. An exception DRF turns into a response (a
    ValidationError's 400) is an answer like any other; one it does not
    leaves the reservation pending, or releases it with ``RELEASE_ON_ERROR``.
    ``settings.IDEMCTL`` configures it; the per-view marks work on the class
    and on handler or action methods. The middleware is not needed for it.
    """

    _idemctl_state: _State | None = None

    def dispatch(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        parent: Any = super()
        self._idemctl_state = None
        try:
            return parent.dispatch(request, *args, **kwargs)
        except BaseException:
            state, self._idemctl_state = self._idemctl_state, None
            if state is not None:
                state.abandon(getattr(request, "_request", request))
            raise

    def initial(self, request: Any, *args: Any, **kwargs: Any) -> None:
        parent: Any = super()
        config = current_config()
        django_request = getattr(request, "_request", request)
        protected = config.policy.protects(str(request.method))
        if protected:
            _buffer_multipart(django_request, config.max_body_bytes)
        parent.initial(request, *args, **kwargs)
        if not protected:
            return
        handler = getattr(self, "action", None) or str(request.method).lower()
        mode = _mode_of([getattr(type(self), handler, None), type(self)])
        if mode is None and config.path_is_exempt(django_request):
            mode = EXEMPT
        if mode == EXEMPT:
            return
        if mode == KEY_OPTIONAL and django_request.META.get("HTTP_IDEMPOTENCY_KEY") is None:
            return
        who = config.principal(request)
        decision = _begin(config, django_request, who)
        if isinstance(decision, Answer):
            raise _Answered(_response(gates.replied(decision), config.replayed_header, config.gate))
        state = _State(config, False)
        state.ticket = decision
        self._idemctl_state = state
        django_request.META[PRINCIPAL_ENVIRON_KEY] = who

    def handle_exception(self, exc: Exception) -> Any:
        if isinstance(exc, _Answered):
            return exc.response
        parent: Any = super()
        return parent.handle_exception(exc)

    def finalize_response(self, request: Any, response: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(response, _ANSWER_ATTR, False):
            return response  # the ledger's answer, sent as the middleware sends it
        parent: Any = super()
        response = parent.finalize_response(request, response, *args, **kwargs)
        state = self._idemctl_state
        if state is None or state.ticket is None:
            return response
        if callable(getattr(response, "render", None)) and not getattr(response, "is_rendered", True):
            response = response.render()
        ticket, self._idemctl_state = state.ticket, None
        config = state.config
        delivery = _complete(config, ticket, response, getattr(request, "_request", request))
        return _response(delivery, config.replayed_header, config.gate)


__all__ = [
    "EXEMPT",
    "KEY_OPTIONAL",
    "KEY_REQUIRED",
    "Config",
    "IdempotencyMiddleware",
    "IdempotencyMixin",
    "answer_response",
    "current_config",
    "idempotency_exempt",
    "idempotency_key_optional",
    "idempotency_key_required",
    "init_ledger",
    "user_principal",
]
