"""phasewise: an LLM inference engine that makes prefill and decode explicit.

The engine's names are imported on first use, so that parts that need no torch (the roofline
analyser in ``phasewise.perf``, the load generator in ``phasewise.bench``) start fast and run
where torch is not installed.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["LLM", "EngineConfig", "RequestOutput", "SamplingParams", "StepStats"]
__version__ = "0.1.0"

_LAZY = {
    "LLM": "phasewise.llm",
    "EngineConfig": "phasewise.config",
    "RequestOutput": "phasewise.engine.outputs",
    "StepStats": "phasewise.engine.outputs",
    "SamplingParams": "phasewise.engine.sampling_params",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'phasewise' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
