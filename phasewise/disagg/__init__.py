"""Prefill/decode disaggregation (issue 18).

- ``wire``: the protocol. Layout compatibility, the authenticated handshake, control messages,
  KV frames and the receiver's :class:`~phasewise.disagg.wire.FrameGate`. Pure Python.
- ``transport``: the pyzmq endpoints (``KVServer`` on the decode worker's KV port, ``KVClient``
  on the prefill worker), heartbeats and a deterministic ``FaultInjector`` for tests.
- ``connector``: the engine's KV connector (``PushConnector``, modelled on vLLM v1's): K/V
  into and out of an engine's pool. ``LLMEngine`` holds one.
- ``kv``: blocks as bytes and back. ``worker``: the decode and prefill sides of a remote
  prefill around an ``AsyncEngine``. ``metrics``: their ``/metrics``.
- ``router`` (``phasewise router``): a ``ServingBackend`` over decode workers;
  ``launch`` (``phasewise pd``): one prefill worker, one decode worker and a router.

Nothing is imported here, so ``import phasewise.disagg.wire`` needs neither torch nor pyzmq.
"""
