"""What a checkpoint says about generating from it: its end-of-sequence tokens and its sampling
defaults, from ``generation_config.json``, ``config.json`` and the tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from phasewise.engine.sampling_params import SamplingParams
from phasewise.model.config import ModelConfig
from phasewise.model.tokenizer import Tokenizer, load_generation_config


@dataclass(frozen=True)
class GenerationDefaults:
    """``config``: ``generation_config.json`` as read ({} where there is none);
    ``eos_token_ids``: every end-of-sequence id the checkpoint names, in the order
    ``generation_config.json``, ``config.json``, the tokenizer, each once."""

    config: dict[str, Any]
    eos_token_ids: tuple[int, ...]

    @classmethod
    def load(cls, model_dir: Path, model_config: ModelConfig,
             tokenizer: Tokenizer) -> GenerationDefaults:
        config = load_generation_config(model_dir)
        ids: list[int] = []
        gen = config.get("eos_token_id")
        for source in (gen, list(model_config.eos_token_ids), tokenizer.eos_token_id):
            if source is None:
                continue
            for t in source if isinstance(source, list) else [source]:
                if t not in ids:
                    ids.append(int(t))
        return cls(config, tuple(ids))

    def sampling_params(self, **overrides: Any) -> SamplingParams:
        """Sampling defaults from ``generation_config.json``, then ``overrides``."""
        g = self.config
        kw: dict[str, Any] = {}
        if g.get("do_sample") is False:
            kw["temperature"] = 0.0
        else:
            for key in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
                if g.get(key) is not None:
                    kw[key] = g[key]
        kw.update(overrides)
        return SamplingParams(**kw)
