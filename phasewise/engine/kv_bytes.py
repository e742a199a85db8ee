"""K/V blocks as bytes, for the wire between a prefill and a decode worker.

A block range travels as one contiguous tensor ``[layers, 2 (k, v), blocks, block_size,
kv_heads, head_dim]`` (``ModelRunner.read_blocks``' layout), reinterpreted as raw bytes: no
numpy (which has no bf16), no pickle. The receiver rebuilds it from the dtype and shape the
frame's header names, and refuses a byte count that does not match.

In the engine room: the engine's async front decodes the K/V a prefill worker sent
(``AsyncEngine``'s ``LoadRemoteKV``), and the P/D worker (``phasewise.disagg.worker``) encodes
what its engine computed.
"""

from __future__ import annotations

import math

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def kv_to_bytes(data: torch.Tensor) -> bytes:
    """The tensor's elements in memory order (a CPU copy when it lives elsewhere)."""
    return data.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def kv_from_bytes(buf: bytes, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor ``kv_to_bytes`` made, from its dtype name and shape."""
    if dtype not in DTYPES:
        raise ValueError(f"KV dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    elem = torch.empty((), dtype=DTYPES[dtype]).element_size()
    want = math.prod(shape) * elem
    if len(buf) != want:
        raise ValueError(f"KV payload has {len(buf)} bytes; {dtype} of shape {shape} needs "
                         f"{want}")
    flat = torch.frombuffer(bytearray(buf), dtype=torch.uint8)
    return flat.view(DTYPES[dtype]).reshape(shape)
