"""The request kit every HTTP door shares.

- :mod:`~idemctl.exchange.sequence`: one protected request in the contract's
  order, as a generator of needs (no I/O);
- :mod:`~idemctl.exchange.drive`: its two drivers, for a thread and for an
  event loop;
- :mod:`~idemctl.exchange.gate`: what each step answers (401, 400, 414, 503,
  the decision, the completion, the sweep after the answer);
- :mod:`~idemctl.exchange.body`: the body rules (400, 411, 413);
- :mod:`~idemctl.exchange.capture`: the app's answer, bounded by the body cap;
- :mod:`~idemctl.exchange.wire`: an Answer's headers and status line on the wire;
- :mod:`~idemctl.exchange.environ`: a WSGI environ read for the sequence;
- :mod:`~idemctl.exchange.scope`: an ASGI scope read for the sequence, and
  the app's ASGI messages captured;
- :mod:`~idemctl.exchange.threads`: blocking work handed to a worker thread.

A door (``idemctl.wsgi``, ``idemctl.asgi``, ``idemctl.fastapi``,
``idemctl.flask``, ``idemctl.django``) parses its framework's request into a
:class:`~idemctl.exchange.sequence.Request` and answers the sequence's needs;
what doors share is here, and no door imports another.
"""
