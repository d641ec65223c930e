"""The contract for calls in workers, consumers and scripts: the ledger's
`idempotent` decorator and `idempotent_call` context manager."""

from __future__ import annotations

from .. import functions
from ..call_values import SerializerLike
from .core import LedgerCore
from .housekeeping import Housekeeping
from .requests import RequestFlow
from .steps import SingleSteps


class FunctionShortcuts:
    """Idempotent functions made from one ledger's request flow, single
    steps and post-response sweep (see `idemctl.functions`): this object is
    the :class:`~idemctl.functions.CallLedger` its calls run on.

    >>> from idemctl import Ledger
    >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
    >>> with ledger.idempotent_call(principal="billing", key="pay_1", args=1) as call:
    ...     call.store("done")
    >>> call.ledger.policy is ledger.policy
    True
    """

    def __init__(self, core: LedgerCore, steps: SingleSteps, flow: RequestFlow, chores: Housekeeping) -> None:
        self.policy = core.policy
        self.now, self.publish, self.async_store = core.now, core.publish, core.async_store
        self.heard = core.events.heard  # whether an event would reach anyone: none is built otherwise
        self.decide, self.abandon, self.abandon_steps = flow.decide, flow.abandon, flow.abandon_steps
        self.release_steps, self.complete_steps = steps.release_steps, steps.complete_steps
        self.after_response_steps = chores.after_response_steps

    def idempotent(
        self,
        *,
        key: functions.KeySource,
        principal: functions.PrincipalSource,
        args: functions.ArgsSelector | None = None,
        name: str | None = None,
        serializer: SerializerLike | None = None,
        release_on_error: functions.ReleasePolicy = False,
    ) -> functions.IdempotentDecorator:
        """Decorator: run a function (plain or ``async def``) once per
        (principal, key) and store its return value (JSON by default). A
        repeat with the same arguments gets the stored value without running;
        other arguments raise KeyReusedError; a duplicate while the first
        runs raises CallInProgressError (``retry_after``). `key` and
        `principal` are strings or callables of the function's arguments;
        `args` chooses the arguments the fingerprint covers (all by default).
        `serializer` stores a value JSON cannot hold: a ``(dump, load)``
        pair of functions to and from JSON values (or a Powertools output
        serializer), or an object with ``dumps``/``loads`` of bytes; the
        first caller and every repeat get ``load``'s value. See
        docs/workers.md.

        >>> from idemctl import Ledger
        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> runs = []
        >>> @ledger.idempotent(key=lambda payment: payment["id"], principal="billing")
        ... def charge(payment):
        ...     runs.append(payment["id"])
        ...     return {"charged": payment["amount"]}
        >>> charge({"id": "pay_1", "amount": 500}), charge({"id": "pay_1", "amount": 500}), runs
        ({'charged': 500}, {'charged': 500}, ['pay_1'])
        >>> charge({"id": "pay_1", "amount": 900})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        idemctl.errors.KeyReusedError: key 'pay_1' of principal 'billing' was used for a call with other arguments; ...

        A dataclass comes back as the dataclass through the pair it already has:

        >>> from dataclasses import asdict, dataclass
        >>> from decimal import Decimal
        >>> @dataclass
        ... class Receipt:
        ...     payment_id: str
        ...     amount: str
        >>> @ledger.idempotent(key=lambda payment_id, amount: payment_id, principal="billing",
        ...                    serializer=(asdict, lambda d: Receipt(**d)))
        ... def settle(payment_id, amount):
        ...     return Receipt(payment_id, str(Decimal(amount)))
        >>> settle("pay_2", "12.50"), settle("pay_2", "12.50")
        (Receipt(payment_id='pay_2', amount='12.50'), Receipt(payment_id='pay_2', amount='12.50'))
        """
        settings = functions.CallSettings(name, serializer, release_on_error)
        return functions.IdempotentDecorator(self, key=key, principal=principal, args=args, settings=settings)

    def idempotent_call(
        self,
        *,
        principal: str,
        key: str,
        args: object,
        name: str | None = None,
        serializer: SerializerLike | None = None,
        release_on_error: functions.ReleasePolicy = False,
    ) -> functions.IdempotentCall:
        """One idempotent call as a context manager (``with`` or ``async
        with``), for code that is not one function: `args` is the JSON value
        the fingerprint covers. Skip the work when ``call.replayed``; hand the
        result to ``call.store()``; after the block ``call.value`` is what
        every repeat returns.

        >>> from idemctl import Ledger
        >>> ledger = Ledger.open(":memory:"); _ = ledger.init()
        >>> for attempt in (1, 2):
        ...     with ledger.idempotent_call(principal="billing", key="pay_1", args={"amount": 500}) as call:
        ...         if not call.replayed:
        ...             call.store({"charged": 500})
        ...     print(attempt, call.outcome.value, call.value)
        1 executed {'charged': 500}
        2 replayed {'charged': 500}
        """
        settings = functions.CallSettings(name, serializer, release_on_error)
        return functions.IdempotentCall(self, principal=principal, key=key, args=args, settings=settings)
