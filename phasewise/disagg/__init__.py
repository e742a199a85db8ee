"""Prefill/decode disaggregation (issue 18).

- ``wire``: the protocol. Layout compatibility, the authenticated handshake, control messages,
  KV frames and the receiver's :class:`~phasewise.disagg.wire.FrameGate`. Pure Python.
- ``transport``: the pyzmq endpoints (``KVServer`` on the decode worker's KV port, ``KVClient``
  on the prefill worker), heartbeats and a deterministic ``FaultInjector`` for tests.

Nothing is imported here, so ``import phasewise.disagg.wire`` needs neither torch nor pyzmq.
"""
