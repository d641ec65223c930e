"""Listeners held as a tuple that is replaced whole under a lock: whoever
calls them reads the one attribute, with no lock, on its own path."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

L = TypeVar("L")


class Subscribers(Generic[L]):
    """``subscribe`` for a class that holds ``_lock`` and ``_listeners``.

    >>> class Bell(Subscribers[Callable[[], object]]):
    ...     def __init__(self) -> None:
    ...         self._lock, self._listeners = threading.Lock(), ()
    >>> bell = Bell()
    >>> stop = bell.subscribe(print)
    >>> len(bell._listeners), stop(), len(bell._listeners)
    (1, None, 0)
    """

    _lock: threading.Lock
    _listeners: tuple[L, ...]

    def subscribe(self, listener: L) -> Callable[[], None]:
        """Add a listener; returns the function that removes it."""
        with self._lock:
            self._listeners = (*self._listeners, listener)

        def unsubscribe() -> None:
            with self._lock:
                self._listeners = tuple(x for x in self._listeners if x is not listener)

        return unsubscribe
