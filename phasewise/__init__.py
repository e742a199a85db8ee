"""phasewise: an LLM inference engine that makes prefill and decode explicit."""

from phasewise.config import EngineConfig
from phasewise.engine.outputs import RequestOutput, StepStats
from phasewise.engine.sampling_params import SamplingParams
from phasewise.llm import LLM

__all__ = ["LLM", "EngineConfig", "RequestOutput", "SamplingParams", "StepStats"]
__version__ = "0.1.0"
