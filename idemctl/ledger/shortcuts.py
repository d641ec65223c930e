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
        """Decorator: run a function once per (principal, key): see :meth:`idemctl.Ledger.idempotent`."""
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
        """One idempotent call as a context manager: see :meth:`idemctl.Ledger.idempotent_call`."""
        settings = functions.CallSettings(name, serializer, release_on_error)
        return functions.IdempotentCall(self, principal=principal, key=key, args=args, settings=settings)
