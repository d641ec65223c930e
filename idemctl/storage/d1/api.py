"""D1's HTTP API, as plain HTTPS calls through httpx (docs/d1.md says why
not Cloudflare's SDK): one call per statement or per batch, the envelope
read, 429 and 5xx retried with back-off that honours Retry-After, a timeout
per call. The token is sent in the Authorization header and nowhere else."""

from __future__ import annotations

import email.utils
import json
import os
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx

from ...errors import ConnectionFailedError, StorageError
from .errors import D1TimeoutError, api_error, sql_error
from .location import D1Location

#: One statement as the API takes it: its SQL and positional parameters.
Query = tuple[str, list[Any]]

_CODES_RETRIED = frozenset({429, 500, 502, 503, 504})
_MAX_RETRY_AFTER_S = 60.0


def retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds a Retry-After header asks for (delta-seconds or an HTTP date).

    >>> retry_after("3"), retry_after(None), retry_after("soon")
    (3.0, None, None)
    """
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError):
        return None
    return max(0.0, when - (time.time() if now is None else now))


class D1Api:
    """Calls to one database's query endpoints, safe to share between threads
    (httpx's client is) and re-made in a forked child."""

    def __init__(
        self,
        location: D1Location,
        *,
        timeout_s: float = 10.0,
        retries: int = 4,
        backoff_s: float = 0.25,
        max_backoff_s: float = 8.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if timeout_s <= 0:
            raise StorageError(f"a D1 call's timeout must be above 0 s, got {timeout_s}")
        self.location = location
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._sleep = sleep
        self._lock = threading.Lock()
        self._client: httpx.Client | None = None
        self._pid = 0
        #: Calls made and the seconds the last one took (doctor, tests).
        self.calls = 0
        self.last_call_s = 0.0
        #: The database's size after the last statement, as D1 reports it.
        self.size_after: int | None = None

    def __repr__(self) -> str:
        return f"D1Api({self.location.describe()})"

    def _http(self) -> httpx.Client:
        client = self._client
        if client is None or self._pid != os.getpid():
            with self._lock:
                if self._client is None or self._pid != os.getpid():
                    # A child after fork gets its own connections (the
                    # parent's sockets are the parent's).
                    self._client = httpx.Client(
                        timeout=httpx.Timeout(self.timeout_s),
                        headers={"Authorization": f"Bearer {self.location.token}"},
                        trust_env=False,
                    )
                    self._pid = os.getpid()
                client = self._client
        return client

    def close(self) -> None:
        with self._lock:
            if self._client is not None and self._pid == os.getpid():
                self._client.close()
            self._client = None

    def run(self, queries: Sequence[Query], *, write: bool) -> list[list[list[Any]]]:
        """Each query's rows (lists in column order), in one call: one
        statement, or a batch D1 runs as one transaction. A write is retried
        only when Cloudflare said it did not run it (429): after a 5xx or a
        timeout nobody knows, and the caller decides (a completion checks
        what was stored)."""
        if len(queries) == 1:
            body: dict[str, Any] = {"sql": queries[0][0], "params": queries[0][1]}
        else:
            body = {"batch": [{"sql": sql, "params": params} for sql, params in queries]}
        payload = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        result = self._call(payload, write)
        if not isinstance(result, list) or len(result) != len(queries):
            raise StorageError(
                f"D1 at {self.location.describe()} answered {len(queries)} statement(s) with a malformed result"
            )
        rows = []
        for item in result:
            results = item.get("results") if isinstance(item, dict) else None
            if not isinstance(results, dict) or not isinstance(results.get("rows", []), list):
                raise StorageError(f"D1 at {self.location.describe()} answered with a malformed result")
            rows.append(results.get("rows") or [])
            meta = item.get("meta")
            if isinstance(meta, dict) and isinstance(meta.get("size_after"), int | float):
                self.size_after = int(meta["size_after"])
        return rows

    def _call(self, payload: bytes, write: bool) -> Any:
        where = self.location.describe()
        url = self.location.endpoint("raw")
        attempt = 0
        while True:
            started = time.perf_counter()
            try:
                response = self._http().post(url, content=payload, headers={"Content-Type": "application/json"})
            except httpx.TimeoutException as exc:
                self.last_call_s = time.perf_counter() - started
                if not write and attempt < self.retries:
                    attempt += 1
                    self._sleep(self._backoff(attempt, None))
                    continue
                raise D1TimeoutError(f"D1 at {where} did not answer within {self.timeout_s:g} s") from exc
            except httpx.HTTPError as exc:
                # Nothing answered: the one case that is "cannot reach".
                if not write and attempt < self.retries:
                    attempt += 1
                    self._sleep(self._backoff(attempt, None))
                    continue
                raise ConnectionFailedError(f"cannot reach D1's API for {where}: {type(exc).__name__}") from exc
            self.calls += 1
            self.last_call_s = time.perf_counter() - started
            status = response.status_code
            if status in _CODES_RETRIED and attempt < self.retries and (status == 429 or not write):
                attempt += 1
                self._sleep(self._backoff(attempt, retry_after(response.headers.get("retry-after"))))
                continue
            return self._result(where, status, response.content)

    def _backoff(self, attempt: int, asked: float | None) -> float:
        if asked is not None:
            return min(asked, _MAX_RETRY_AFTER_S)
        base: float = min(self.backoff_s * 2.0 ** (attempt - 1), self.max_backoff_s)
        return base * (0.75 + 0.25 * random.random())

    def _result(self, where: str, status: int, content: bytes) -> Any:
        try:
            envelope = json.loads(content)
        except ValueError:
            envelope = None
        if not isinstance(envelope, dict):
            if status >= 500 or status == 429:
                raise api_error(where, status, None, f"a {status} answer that is not the API's JSON")
            raise StorageError(f"D1 at {where} answered {status} with something that is not the API's JSON")
        errors = envelope.get("errors") or []
        if status == 200 and envelope.get("success") is True and not errors:
            return envelope.get("result")
        first = errors[0] if errors and isinstance(errors[0], dict) else {}
        code = first.get("code") if isinstance(first.get("code"), int) else None
        message = str(first.get("message", "no message"))
        if code == 7500 and status == 400:
            raise sql_error(where, message)
        raise api_error(where, status, code, message)
