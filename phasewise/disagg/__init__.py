"""Prefill/decode disaggregation (``docs/pd.md``).

- ``wire``: the protocol. Layout compatibility, the authenticated handshake, control messages,
  KV frames and the receiver's :class:`~phasewise.disagg.wire.FrameGate`. Pure Python.
- ``transport``: the pyzmq endpoints (``KVServer`` on the decode worker's KV port, ``KVClient``
  on the prefill worker), heartbeats, and a ``FrameHook`` that tests inject faults through.
- ``worker``: the decode and prefill sides of a remote prefill around an ``AsyncEngine``.
  ``metrics``: their ``/metrics``.
- ``router`` (``phasewise router``): a ``ServingBackend`` over decode workers.

The engine's half of P/D lives in the engine room, below this one: its KV connector
(``phasewise.engine.connector``), K/V as bytes (``phasewise.engine.kv_bytes``) and the relay's
line format (``phasewise.engine.relay``). What starts workers and routers is
``phasewise.launch``, above it.

Nothing is imported here, so ``import phasewise.disagg.wire`` needs neither torch nor pyzmq.
"""
