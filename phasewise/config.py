"""Engine configuration: one frozen, validated dataclass."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# The environment variable serve, router and pd take their --api-key from when the flag is
# not given (a key on a command line is listed to every user of the machine).
API_KEY_ENV = "PHASEWISE_API_KEY"


def check_api_key(value: str) -> str:
    """An API key as ``--api-key`` (or ``PHASEWISE_API_KEY``) gives it: without the spaces
    and line break around it (a secret mounted from a file ends in one), and refused if
    empty or holding a control character, which no client could send in a header. The
    error never repeats the key."""
    key = value.strip()
    if not key:
        raise ValueError("the API key is empty")
    bad = next((i for i, c in enumerate(key) if ord(c) < 0x20 or ord(c) == 0x7F), None)
    if bad is not None:
        raise ValueError(f"the API key holds a control character (a line break, a tab) at "
                         f"position {bad}; no client could send it in a header")
    return key

DEVICES = ("auto", "cpu", "cuda")  # and "cuda:N"
# The engine's load dtypes (phasewise.model.loader maps each one to a torch dtype; a test
# checks the two agree). Kept here, torch-free, so that the CLI's parser can offer them.
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
KERNEL_CHOICES = ("auto", "torch")
# How weights are filled: from the folder's safetensors, or random ("dummy": config.json and a
# tokenizer suffice; for speed work on a model's shape, as vLLM's --load-format dummy).
LOAD_FORMATS = ("safetensors", "dummy")
# Speculative decoding (phasewise.engine.spec): proposers, and --num-speculative-tokens.
SPECULATIVE_CHOICES = ("ngram",)
DEFAULT_SPECULATIVE_TOKENS = 4
# A block of K/V belongs to one sequence: past a few dozen tokens its bookkeeping is already
# amortised, and a longer block only wastes the unfilled tail of each sequence's last block and
# coarsens prefix caching (hits are whole blocks).
MAX_BLOCK_SIZE = 1024
MAX_SPECULATIVE_TOKENS = 16  # the verify rows of one request in a step, at most 1 + this
# The scheduler's policies (phasewise.engine.scheduler runs them; the CLI offers them).
POLICIES = ("chunked", "prefill-first")
LOG_LEVELS = ("debug", "info", "warning", "error")
SERVE_ROLES = ("both", "prefill", "decode")  # phasewise serve --role
# Seconds one round of the engine thread (its commands, then at most one step) may last before
# the engine counts as stuck (serve --step-timeout). A step holds at most the step budget's
# tokens: seconds on a CPU even for an 8B model, so this is far past any step that is merely
# slow, and well inside the patience of an orchestrator's liveness probe.
DEFAULT_STEP_TIMEOUT_S = 120.0
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
          "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12,
          "tib": 2**40}


# The bundled default model (scripts/train_default_model.py writes it; see its README.md).
BUNDLED_MODEL = Path(__file__).resolve().parent / "assets" / "stdlib-coder"


def resolve_model(model: str | Path | None, note: Callable[[str], None] | None = None,
                  catalog: Callable[[str], str | None] | None = None) -> str:
    """The checkpoint folder to load: ``model``, or the bundled default when it is None
    (then ``note``, if given, is told so).

    A file (such as the folder's ``config.json``) is refused with the folder it sits in, and
    a name that is not a path here but that ``catalog`` knows (it returns the catalog's name
    for it, else None: ``phasewise.perf.models.catalog_name``, the roofline's model catalog)
    is refused as a catalog name: both raise with what was found and what is expected. A path
    that does not exist at all is returned as it is, for the engine to report.
    """
    if model is None:
        if not (BUNDLED_MODEL / "config.json").exists():
            raise FileNotFoundError(
                f"no model given and the bundled default is missing ({BUNDLED_MODEL}); pass "
                "--model DIR, or rebuild it from a source checkout: "
                "python scripts/train_default_model.py")
        if note is not None:
            note(f"model: stdlib-coder, the bundled default ({BUNDLED_MODEL}); --model DIR "
                 "for another")
        return str(BUNDLED_MODEL)
    path = Path(model)
    if path.is_file():
        folder = f"{path.parent}{os.sep}"
        if path.name == "config.json":
            raise ValueError(f"{model} is a file; --model takes the checkpoint folder that "
                             f"holds config.json: {folder}")
        hint = (f", such as the one it is in: {folder}"
                if (path.parent / "config.json").is_file() else "")
        raise ValueError(f"{model} is a file; --model takes a checkpoint folder (config.json, "
                         f"*.safetensors, tokenizer.json){hint}")
    if not path.exists() and catalog is not None:
        name = catalog(str(model))
        if name is not None:
            raise FileNotFoundError(
                f"{model!r} is not a folder here but a roofline catalog name ({name}: "
                f"phasewise roofline --model {name}); serve and generate need a local "
                "checkpoint folder (config.json, *.safetensors, tokenizer.json); phasewise "
                "downloads nothing")
    return str(model)


def parse_memory(value: int | str) -> int:
    """Bytes from an int or a string such as ``"512MiB"``, ``"4GiB"``, ``"2GB"``."""
    if isinstance(value, bool):
        raise ValueError(f"memory size must be bytes or a string like '4GiB', got {value!r}")
    if isinstance(value, int):
        n = value
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"memory size must be bytes or a number with a unit "
                             f"(KiB, MiB, GiB, KB, MB, GB), got {value!r}")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ValueError(f"memory size must be > 0, got {value!r}")
    return n


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the system tells it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def check_threads(n: object, name: str = "--threads") -> int:
    """``n`` as a thread count: an integer from 1 to the cores this process may run on (more
    would have threads take turns on a core, each waiting for the others at every kernel's
    end); ValueError naming ``name`` and the range otherwise."""
    cores = usable_cores()
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= cores:
        raise ValueError(f"{name} must be an integer from 1 to {cores} (the cores this process "
                         f"may run on), got {n!r}")
    return n


@dataclass(frozen=True)
class EngineConfig:
    """Everything that shapes an engine. Defaults suit a CPU machine serving a small model.

    ``kv_cache_memory``: bytes (or "4GiB") for the KV block pool; default 1 GiB on CPU and
    90% of the free memory left after the weights on CUDA. The pool never grows beyond what
    ``max_num_seqs`` requests of ``max_model_len`` tokens could use. ``num_kv_blocks`` overrides
    it with an exact block count (tests use this to force preemption).
    ``max_model_len``: default is the checkpoint's ``max_position_embeddings``, lowered to fit
    the pool if needed.
    ``max_num_batched_tokens``: the token budget of one engine step; default 256 on CPU and
    2048 on CUDA. A step's time grows with its tokens, and every running stream waits for the
    step, so the budget bounds how long a prompt chunk can stall decoding. A CPU's step time
    grows about linearly with its tokens past a few dozen, so a small budget costs little
    prefill throughput while it bounds the stall; a GPU's stays nearly flat up to thousands
    of tokens (docs/python-api.md, the options table).
    ``quantization``: ``int8`` stores the decoder layers' projections and the LM head as
    int8 with one scale per output channel, quantized as the checkpoint is read
    (``phasewise.model.cpu.quant``; CPU only), halving the bytes a dense model's decode step
    reads (an MoE model's experts and router keep the checkpoint's dtype); None keeps the
    checkpoint's weights.
    ``speculative``: ``ngram`` turns on speculative decoding with prompt lookup
    (``phasewise.engine.spec``): each decode step also verifies up to
    ``num_speculative_tokens`` tokens (default 4, at most 16) proposed from the request's own
    prompt and outputs; greedy output is unchanged, sampled output keeps its distribution.
    ``kernels``: ``auto`` uses phasewise's CPU kernels for bf16 models on CPU (each linear
    layer's method per batch size from the kernel plan: ``phasewise.model.cpu.plan``), and on
    CUDA its fused Triton kernels between the matrix products
    (``phasewise.model.triton_ops``); ``torch`` uses torch operations only.
    ``kernel_plan``: a kernel plan file (``phasewise tune`` writes them) that the CPU kernels
    follow, pinned; None: the plan ``phasewise tune`` stored for this machine and model, else
    the rule from the CPU's flags. Nothing is timed at start either way.
    ``load_format``: ``safetensors`` reads the checkpoint's weights; ``dummy`` fills them
    with seeded random values instead (the folder needs only config.json and a tokenizer),
    for speed work on a model's shape without its weight files.
    ``enforce_eager``: on CUDA, decode-only steps of up to ``CUDA_GRAPH_MAX_BATCH`` rows
    replay captured CUDA graphs (``phasewise.engine.cuda_graphs``) unless this is True;
    every step then launches its kernels one by one, as on CPU.
    ``num_threads``: the CPU threads the engine's kernels and torch's operations use, 1 to
    the cores this process may run on (``usable_cores``); None keeps torch's own count
    (the cores, as a rule). It is the process's setting: the engine sets it when it starts.
    Fewer threads than cores leave some to other work: every kernel's threads wait for each
    other at its end, so on a machine where other processes run, a thread that loses its
    core holds up the rest (with as many threads as busy cores, a step can take several
    times as long as with fewer). The kernel plan and the measured peaks are kept per thread count.
    """

    model: str
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory: int | str | None = None
    num_kv_blocks: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 128
    policy: str = "chunked"
    enable_prefix_caching: bool = True
    seed: int = 0
    kernels: str = "auto"
    quantization: str | None = None
    speculative: str | None = None
    num_speculative_tokens: int | None = None
    load_format: str = "safetensors"
    enforce_eager: bool = False
    kernel_plan: str | None = None
    num_threads: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}; got {self.dtype!r}")
        if self.device not in DEVICES and not str(self.device).startswith("cuda:"):
            raise ValueError(f"device must be one of {', '.join(DEVICES)} or 'cuda:N'; "
                             f"got {self.device!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {self.policy!r}")
        for name in ("block_size", "max_num_seqs"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.block_size > MAX_BLOCK_SIZE:
            raise ValueError(f"block_size must be in 1..{MAX_BLOCK_SIZE} tokens (default 16), "
                             f"got {self.block_size}")
        for name in ("max_model_len", "num_kv_blocks", "max_num_batched_tokens"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be an integer >= 1 or None, got {v!r}")
        if self.max_model_len == 1:  # (refused before the model loads, not by each request)
            raise ValueError("max_model_len must be at least 2: a prompt token and the token "
                             "generated after it; got 1")
        if self.kernels not in KERNEL_CHOICES:
            raise ValueError(f"kernels must be one of {', '.join(KERNEL_CHOICES)}; "
                             f"got {self.kernels!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}; "
                             f"got {self.load_format!r}")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be True or False, got {self.enforce_eager!r}")
        if self.quantization is not None and self.quantization not in ("int8",):
            raise ValueError(f"quantization must be int8 or None (the checkpoint's own "
                             f"weights); got {self.quantization!r}")
        if self.speculative is not None and self.speculative not in SPECULATIVE_CHOICES:
            raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE_CHOICES)} or "
                             f"None; got {self.speculative!r}")
        k = self.num_speculative_tokens
        if k is not None:
            if self.speculative is None:
                raise ValueError("num_speculative_tokens needs speculative (e.g. 'ngram')")
            if (not isinstance(k, int) or isinstance(k, bool)
                    or not 1 <= k <= MAX_SPECULATIVE_TOKENS):
                raise ValueError(f"num_speculative_tokens must be an integer in 1.."
                                 f"{MAX_SPECULATIVE_TOKENS}, got {k!r}")
        elif self.speculative is not None:
            object.__setattr__(self, "num_speculative_tokens", DEFAULT_SPECULATIVE_TOKENS)
        if self.kv_cache_memory is not None:
            parse_memory(self.kv_cache_memory)
        # (torch takes no seed past 64 bits; a request's own seeds live in this range)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or \
                not -(2**53 - 1) <= self.seed <= 2**53 - 1:
            raise ValueError(f"seed must be an integer in [-(2^53-1), 2^53-1], got "
                             f"{self.seed!r}")
        if self.kernel_plan is not None:
            self._check_kernel_plan()
        if self.num_threads is not None:
            check_threads(self.num_threads, "num_threads")

    def _check_kernel_plan(self) -> None:
        """A pinned plan: the path of a file (its form, and its fit to this machine and model,
        are checked when the engine starts: phasewise.model.cpu.plan; the CLI reads its form
        before loading anything)."""
        if not isinstance(self.kernel_plan, (str, os.PathLike)) or not str(self.kernel_plan):
            raise ValueError(f"kernel_plan must be the path of a plan file phasewise tune wrote,"
                             f" or None (the stored plan, else the rule); got "
                             f"{self.kernel_plan!r}")
        if self.kernels != "auto":
            raise ValueError(f"kernel_plan applies to phasewise's CPU kernels: it needs kernels "
                             f"'auto'; got kernels {self.kernels!r}")
        object.__setattr__(self, "kernel_plan", os.fspath(self.kernel_plan))
        if not Path(self.kernel_plan).is_file():
            raise FileNotFoundError(f"kernel_plan {self.kernel_plan} does not exist (a file "
                                    "phasewise tune wrote; phasewise tune --out FILE writes one)")
