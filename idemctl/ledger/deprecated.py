"""The operator's methods under their old names on the ledger
(``ledger.stats()``, ...): deprecated, each says so once per name per
process with a DeprecationWarning and then answers what
``ledger.operator``'s method of that name answers."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar, cast

from .operator import Operator

P = ParamSpec("P")
R = TypeVar("R")

# The old names that have warned in this process: each warns once.
_warned: set[str] = set()


class HasOperator(Protocol):
    """A ledger: what an old name forwards to."""

    @property
    def operator(self) -> Operator: ...


def warn_once(name: str) -> None:
    """Warn about ``Ledger.<name>`` the first time this process uses it;
    the warning points at the caller's line (two frames up).

    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     warn_once("doctest_example"), warn_once("doctest_example")
    (None, None)
    >>> [str(w.message) for w in caught]  # doctest: +NORMALIZE_WHITESPACE
    ['Ledger.doctest_example is deprecated: call ledger.operator.doctest_example,
      which answers the same']
    """
    if name in _warned:
        return
    _warned.add(name)
    warnings.warn(
        f"Ledger.{name} is deprecated: call ledger.operator.{name}, which answers the same",
        DeprecationWarning,
        stacklevel=3,
    )


def operator_alias(method: Callable[Concatenate[Any, P], R]) -> Callable[Concatenate[HasOperator, P], R]:
    """The ledger's deprecated method of `method`'s name: it warns once
    (:func:`warn_once`), then calls ``ledger.operator``'s method of that
    name. `method` gives the name, the signature and the types."""
    name = method.__name__

    def alias(ledger: HasOperator, /, *args: P.args, **kwargs: P.kwargs) -> R:
        warn_once(name)
        return cast(R, getattr(ledger.operator, name)(*args, **kwargs))

    alias.__name__, alias.__qualname__ = name, f"Ledger.{name}"
    alias.__doc__ = (
        f"Deprecated: call ``ledger.operator.{name}(...)``, which this calls. The first use of this name "
        "in a process emits a DeprecationWarning (once per name per process), and every use answers the same."
    )
    alias.__signature__ = inspect.signature(method)  # type: ignore[attr-defined]
    return alias
