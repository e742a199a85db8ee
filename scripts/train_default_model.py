"""Train phasewise's bundled default model: a tiny Llama that writes Python.

    python scripts/train_default_model.py --threads 2   # hours: resumable, see below

The training text is Python source found on every machine that has phasewise installed:

- **core**: the Python standard library (test suites, IDLE, lib2to3, codec tables and pydoc's
  topic dump left out). Its sorted listing holds every 50th file out for validation, whole
  files, and the tokenizer is trained on the rest;
- **stdlib tests**: the standard library's own test suite (``test/``, PSF licence);
- **packages**: the pure-Python source of torch's own dependencies (sympy, mpmath, networkx,
  jinja2, markupsafe, fsspec, filelock), phasewise's (numpy, fastapi, starlette, pydantic,
  uvicorn, httpx, anyio, click, prometheus_client, pyzmq) and the train extra's
  (transformers, huggingface_hub), each checked against the permissive licence its metadata
  states (``PACKAGES``); a package that is absent or whose metadata names another licence is
  skipped, and the card lists what was used.

Training windows are drawn from the three groups by fixed shares (``MIX``). The script

1. lists the files and holds the core's every 50th out;
2. trains a byte-level BPE tokenizer on the core's training files with ``tokenizers``;
3. trains a Llama (``transformers``' ``LlamaForCausalLM``: the reference implementation of
   the architecture, so the saved checkpoint is exactly what the HF format means) on random
   windows, with AdamW and a cosine schedule; the first ``--short-frac`` of the steps use
   ``--short-seq``-token windows (cheaper attention), the rest the full ``--seq-len``, which
   becomes the model's context;
4. runs the repetition phase (``--repetition-steps``, ``repetition_phase``): from the
   bf16-rounded weights, sequence-level unlikelihood training against the loops that greedy
   decoding of so small a model falls into (a line repeated over and over), beside the usual
   next-token loss; ``--main-from DIR`` takes a checkpoint this script saved as step 3's
   result and runs only this phase;
5. saves it in the standard layout (``config.json``, ``model.safetensors`` in bf16,
   ``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json`` with a chat
   template) and writes the model card (``README.md``) with the data, the losses, a sample
   and the machine it was trained on.

**Resumable.** Every ``--save-every`` seconds, and on Ctrl-C or SIGTERM, the model, the
optimizer, the step and the random generator's state go to ``--work-dir`` (default: a folder
under phasewise's cache, named by the run's settings); running the same command again
continues from there, bit for bit as if never stopped. The repetition phase keeps its own
state there (``repetition.pt``) beside the main training's end. ``--fresh`` discards a saved state.
The state is removed once the model is saved.

Everything is seeded: two runs with the same Python (hence the same stdlib), torch,
transformers and tokenizers versions, installed packages (the data), C++ compiler (the
compiled step's code), CPU and thread count write byte-identical files.
Another thread count or CPU changes the order of floating-point sums, so the weights differ
in their last bits and drift from there; the model's quality does not. Arithmetic is fp32,
or bf16 autocast where the CPU has AMX or AVX-512 bf16 (``--dtype auto``), where it runs
several times faster. The training step is compiled with ``torch.compile`` (``--no-compile``
runs it eagerly), which fuses the pointwise work around the matmuls: twice the steps per
second on a 2-core AMX Xeon. A run resumed after the switch to long windows compiles the
short windows' step again first, so that its long-window step is compiled as an
uninterrupted run's was (with dynamic sizes) and computes the same bits.

Needs the ``train`` extra: ``pip install -e '.[train]'`` (transformers).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import os
import signal
import json
import math
import platform
import random
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from phasewise.model.tiny import BOS, EOS, PAD, train_tokenizer  # noqa: E402

DEFAULT_OUT = REPO / "phasewise" / "assets" / "stdlib-coder"
EXCLUDED_DIRS = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "site-packages",
                 "encodings", "pydoc_data", "ensurepip", "__pycache__"}
HOLDOUT_EVERY = 50
# Installed packages whose source is trained on, with the licence their metadata must name:
# torch's own dependencies, phasewise's, and the train extra's (transformers), so all are
# present wherever this script runs. (pip and setuptools are left out: they vendor packages
# under other licences.)
PACKAGES = {"sympy": "BSD", "mpmath": "BSD", "networkx": "BSD", "jinja2": "BSD",
            "markupsafe": "BSD", "fsspec": "BSD", "filelock": "MIT",
            "numpy": "BSD", "fastapi": "MIT", "starlette": "BSD", "pydantic": "MIT",
            "uvicorn": "BSD", "httpx": "BSD", "anyio": "MIT", "click": "BSD",
            "prometheus_client": "Apache", "zmq": "BSD",
            "transformers": "Apache", "huggingface_hub": "Apache"}
# Distributions whose import name differs (for their metadata).
DIST_NAMES = {"zmq": "pyzmq"}
# Shares of the training windows drawn from each group (renormalised over the groups present).
MIX = {"core": 0.4, "stdlib-tests": 0.2, "packages": 0.4}
SAMPLE_PROMPT = "def fibonacci(n):"
# The repetition phase's prompts: at most this many function heads of the training files;
# and the windows of the training mix whose next-token loss each of its steps keeps.
REPETITION_HEADS = 4000
REPETITION_WINDOWS = 2
# Sampling defaults that phasewise (and transformers) read from generation_config.json:
# greedy decoding of so small a model soon repeats a phrase; a cooled, nucleus-trimmed sample
# reads more like the corpus.
SAMPLING_DEFAULTS = {"do_sample": True, "temperature": 0.5, "top_p": 0.95}

# The model is not instruction-tuned. Chat messages become Python comment lines after the
# start-of-file token and the prompt ends with "def ", so the assistant's reply is a function:
# its name, signature and body (earlier assistant turns are rendered back with their "def ").
CODE_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}def {{ m['content'] }}{{ '\\n' }}"
    "{%- else -%}# {{ m['content'] | replace('\\n', '\\n# ') }}{{ '\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}def {% endif -%}"
)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def corpus_files(root: Path) -> list[Path]:
    files = []
    for path in sorted(root.rglob("*.py")):
        if EXCLUDED_DIRS & set(path.relative_to(root).parts):
            continue
        files.append(path)
    return files


def stdlib_test_files(root: Path, held: set[Path]) -> list[Path]:
    return [p for p in sorted((root / "test").rglob("*.py"))
            if "__pycache__" not in p.parts and p not in held]


def function_heads(files: list[Path], n: int) -> list[str]:
    """Signature + the docstring's first line of the first ``n`` documented functions (top
    level and methods, undecorated, dedented, in file order; no duplicates)."""
    heads: list[str] = []
    for path in files:
        try:
            src = path.read_text(encoding="utf-8")
            tree = ast.parse(src)
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            continue
        lines = src.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if not node.body or ast.get_docstring(node) is None or node.decorator_list:
                continue
            doc = node.body[0]
            head = textwrap.dedent("\n".join(lines[node.lineno - 1:doc.lineno]))
            if len(head) <= 600:
                heads.append(head)
        if len(heads) >= n:
            break
    return sorted(set(heads), key=heads.index)[:n]


def repeated_lines(rows: list[list[int]], newline: set[int], blank: set[int],
                   stop: set[int]) -> list[list[int]]:
    """For each row of generated token ids: 1 at every token of a line that repeats the line
    right before it token for token, 0 elsewhere. A line ends with a token that holds a
    newline (byte-level BPE puts the next line's indentation in it too); a line of blank
    tokens only is not counted; a row ends at its first ``stop`` token (end of text,
    padding). Only the line's first token that is not blank is marked: that is where the
    model chose to start the line again, and the rest of the line follows from it. (Pushing
    down the newline and indentation tokens teaches the model to run lines on; pushing down
    every token of the line, to escape into broken ones. Pushing down repeated 6-grams of
    the docstring a completion starts in, for prose loops that do not line up with lines,
    broke the model as well: every token of them, into broken bytes; the first token of
    each run, into docstrings that never close. Both parsed 0% of the held-out heads.
    Taking up to 4 of a step's 8 heads again while their last completion repeated a line
    also made it worse: parse 17% against 70%, 6 of 30 heads looping against 2, the sample
    head a three-line cycle that this rule does not see. So did running this phase for 600
    steps rather than 300: its share of tokens in repeated lines, 0.2-0.3% from about step
    100 to 350, rose to 1.1-1.3% by the end, and on the held-out heads 30% parsed and 11
    looped, a line repeated 89 times.)"""
    out = []
    for row in rows:
        mask = [0] * len(row)
        end = next((j for j, t in enumerate(row) if t in stop), len(row))
        prev: tuple[int, int] | None = None
        start = 0
        for j in range(end):
            if row[j] not in newline:
                continue
            line = row[start:j + 1]
            if (prev is not None and line == row[prev[0]:prev[1]]
                    and any(t not in blank for t in line)):
                first = next(k for k in range(start, j + 1) if row[k] not in blank)
                mask[first] = 1
            prev, start = (start, j + 1), j + 1
        out.append(mask)
    return out


def package_licence(name: str) -> str:
    from importlib import metadata

    meta = metadata.metadata(name)
    parts = [meta.get("License-Expression") or "", (meta.get("License") or "")[:200]]
    parts += [c for c in (meta.get_all("Classifier") or []) if c.startswith("License")]
    return " | ".join(p for p in parts if p)


def package_files() -> tuple[list[Path], list[dict]]:
    """The source files of PACKAGES that are installed under the licence named there."""
    import importlib.util

    files, used = [], []
    for name, licence in PACKAGES.items():
        dist = DIST_NAMES.get(name, name)
        try:
            spec = importlib.util.find_spec(name)
            stated = package_licence(dist)
        except Exception:  # noqa: BLE001 - absent or without metadata: skipped
            log(f"      package {name}: not installed, skipped")
            continue
        if spec is None or not spec.submodule_search_locations:
            log(f"      package {name}: not installed as a package, skipped")
            continue
        if licence.lower() not in stated.lower() or "gpl" in stated.lower():
            log(f"      package {name}: its metadata says {stated!r}, not {licence}; skipped")
            continue
        root = Path(list(spec.submodule_search_locations)[0])
        found = [p for p in sorted(root.rglob("*.py")) if "__pycache__" not in p.parts]
        from importlib import metadata

        used.append({"name": dist, "version": metadata.version(dist), "licence": stated,
                     "files": len(found)})
        files += found
    return files, used


def read_texts(files: list[Path]) -> list[str]:
    texts = []
    for path in files:
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return texts


def cpu_name() -> str:
    from phasewise.model.cpu.capabilities import capabilities

    return capabilities().model_name or platform.processor() or platform.machine()


def fmt_s(s: float) -> str:
    s = int(s)
    return f"{s // 60}:{s % 60:02d}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default=str(DEFAULT_OUT), help="checkpoint folder to write")
    p.add_argument("--corpus", default=None,
                   help="folder of .py files to train on (default: this Python's stdlib)")
    p.add_argument("--max-files", type=int, default=None, help="use only the first N files")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden-size", type=int, default=384)
    p.add_argument("--intermediate-size", type=int, default=1152)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=1024,
                   help="training window of the last steps (= the model's context)")
    p.add_argument("--short-seq", type=int, default=256,
                   help="window of the first --short-frac of the steps (more windows per "
                   "step, the same tokens); ignored if not below --seq-len")
    p.add_argument("--short-frac", type=float, default=0.75)
    p.add_argument("--batch-size", type=int, default=4,
                   help="--seq-len windows per step")
    p.add_argument("--tokens", type=float, default=36e6, help="training tokens in all")
    p.add_argument("--no-extra-data", action="store_true",
                   help="train on the core (stdlib) files only; --corpus implies it")
    p.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="auto",
                   help="arithmetic: bf16 autocast or fp32; auto takes bf16 where the CPU "
                   "has AMX or AVX-512 bf16")
    p.add_argument("--no-compile", action="store_true",
                   help="run the training step eagerly; by default it is compiled with "
                   "torch.compile (about a minute per window length at the start; x2 the "
                   "steps per second on a 2-core AMX Xeon), falling back to eager where "
                   "compiling fails")
    p.add_argument("--work-dir", default=None,
                   help="where the resumable state goes (default: under phasewise's cache, "
                   "named by the run's settings)")
    p.add_argument("--save-every", type=float, default=300.0,
                   help="seconds between saves of the resumable state")
    p.add_argument("--fresh", action="store_true", help="discard a saved state and start over")
    p.add_argument("--stop-after", type=int, default=None,
                   help="save the state and exit after this many steps of this run (exit "
                   "code 3); the next run continues")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    p.add_argument("--warmup", type=float, default=0.05, help="warm-up share of the steps")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--repetition-steps", type=int, default=300,
                   help="steps of the repetition phase after the main training (0: none)")
    p.add_argument("--repetition-lr", type=float, default=1e-4)
    p.add_argument("--repetition-batch", type=int, default=16,
                   help="function heads completed greedily a repetition step")
    p.add_argument("--repetition-tokens", type=int, default=160,
                   help="tokens each of those completions runs to")
    p.add_argument("--repetition-weight", type=float, default=0.25,
                   help="the unlikelihood loss's weight beside the next-token loss")
    p.add_argument("--main-from", default=None,
                   help="a checkpoint this script saved (with its training.json) to take as "
                   "the main training's result: only the repetition phase runs")
    p.add_argument("--eval-windows", type=int, default=32,
                   help="held-out windows for the validation loss")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's choice; part of what makes a run "
                   "bit-reproducible)")
    p.add_argument("--log-every", type=float, default=15.0, help="seconds between progress lines")
    p.add_argument("--rewrite-card", action="store_true",
                   help="only rewrite --out's model card, sampling defaults and chat template "
                   "from its training.json and this script (after editing them here), "
                   "without training")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError as e:
        log(f"error: {e}. Training needs the train extra: pip install -e '.[train]'")
        return 2

    if a.rewrite_card:
        return rewrite_card(Path(a.out))
    threads_before = torch.get_num_threads()
    if a.threads:
        torch.set_num_threads(a.threads)
    try:
        return train(a)
    finally:
        torch.set_num_threads(threads_before)  # when called in-process (the tests)


def cpu_has_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " amx_bf16" in flags or " avx512_bf16" in flags


def state_dir(a: argparse.Namespace, sources: list[dict]) -> Path:
    """Where this run's resumable state lives: named by every setting that shapes the run,
    and by the data (the packages' versions and file counts)."""
    if a.work_dir:
        return Path(a.work_dir)
    from phasewise.model.cpu.kernels import cache_dir

    keep = {k: v for k, v in sorted(vars(a).items())
            if k not in ("work_dir", "save_every", "fresh", "stop_after", "log_every",
                         "rewrite_card")}
    keep["out"] = str(Path(a.out).resolve())
    keep["data"] = [[src["what"], src.get("files")] for src in sources]
    tag = hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:12]
    return cache_dir() / "train" / f"stdlib-coder-{tag}"


class Stop(BaseException):
    """SIGTERM: save the state and exit, as Ctrl-C does."""


def raise_stop(signum, frame):  # noqa: ARG001 - a signal handler's signature
    raise Stop


def save_training_state(path: Path, model, opt, gen, **fields) -> None:
    """Model, optimizer and random generator with ``fields``, written atomically to ``path``."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(),
                **fields}, tmp)
    os.replace(tmp, path)


def load_training_state(path: Path, model, opt, gen) -> dict:
    """Restore what ``save_training_state`` wrote into model, optimizer and generator; returns
    the file's other fields."""
    import torch

    st = torch.load(path, weights_only=False)  # our own file
    model.load_state_dict(st.pop("model"))
    opt.load_state_dict(st.pop("opt"))
    gen.set_state(st.pop("gen"))
    return st


def train(a: argparse.Namespace) -> int:
    import torch
    import torch.nn.functional as F
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    t_start = time.monotonic()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    # 1. data
    root = Path(a.corpus) if a.corpus else Path(sysconfig.get_paths()["stdlib"])
    files = corpus_files(root)[: a.max_files]
    if len(files) < 2:
        log(f"error: need at least 2 .py files under {root}, found {len(files)}")
        return 2
    held = files[::HOLDOUT_EVERY] if len(files) >= 2 * HOLDOUT_EVERY else files[-1:]
    held_set = set(held)
    train_files = [f for f in files if f not in held_set]
    train_texts, val_texts = read_texts(train_files), read_texts(held)
    corpus_bytes = sum(len(t.encode()) for t in train_texts)
    digest = hashlib.sha256()
    for f, t in zip(train_files, train_texts):
        digest.update(str(f.relative_to(root)).encode() + b"\0" + t.encode() + b"\0")
    groups = {"core": train_texts}
    sources = [{"group": "core", "what": f"Python {platform.python_version()} standard library",
                "licence": "PSF-2.0", "files": len(train_texts), "bytes": corpus_bytes}]
    if not (a.corpus or a.no_extra_data):
        tests = read_texts(stdlib_test_files(root, held_set))
        if tests:
            groups["stdlib-tests"] = tests
            sources.append({"group": "stdlib-tests", "what": "its test suite (test/)",
                            "licence": "PSF-2.0", "files": len(tests),
                            "bytes": sum(len(t.encode()) for t in tests)})
        pkg_files, used = package_files()
        if pkg_files:
            texts = read_texts(pkg_files)
            groups["packages"] = texts
            for u in used:
                sources.append({"group": "packages", "what": f"{u['name']} {u['version']}",
                                "licence": u["licence"], "files": u["files"]})
            sources.append({"group": "packages", "what": "all packages", "licence": "",
                            "files": len(texts), "bytes": sum(len(t.encode()) for t in texts)})
    log(f"[1/5] data: {len(train_texts)} core training files ({corpus_bytes / 1e6:.1f} MB) and "
        f"{len(val_texts)} held out, from {root}; "
        + ", ".join(f"{g} {len(t)} files" for g, t in groups.items()))

    # 2. tokenizer (on the core's training files only, so the held-out tokens stay those of
    # earlier models trained by this script)
    t0 = time.monotonic()
    vocab = train_tokenizer(out, train_texts, vocab_size=a.vocab_size,
                            chat_template=CODE_CHAT_TEMPLATE, model_max_length=a.seq_len)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    bos, eos, pad = (tok.token_to_id(t) for t in (BOS, EOS, PAD))

    def stream(texts: list[str]) -> torch.Tensor:
        ids: list[int] = []
        for enc in tok.encode_batch(texts, add_special_tokens=False):
            ids += [bos, *enc.ids, eos]
        return torch.tensor(ids, dtype=torch.long)

    streams = {g: stream(t) for g, t in groups.items()}
    train_ids, val_ids = streams["core"], stream(val_texts)
    for src in sources:
        if src["what"] in ("all packages",) or src["group"] != "packages":
            src["tokens"] = len(streams[src["group"]])
    log(f"[2/5] tokenizer: {vocab} tokens (byte-level BPE); core stream "
        f"{len(train_ids):,} tokens ({corpus_bytes / len(train_ids):.2f} bytes/token), "
        + "".join(f"{g} {len(s):,}, " for g, s in streams.items() if g != "core")
        + f"held out {len(val_ids):,} ({time.monotonic() - t0:.0f} s)")
    if min(len(s) for s in streams.values()) <= a.seq_len + 1 or len(val_ids) <= a.seq_len + 1:
        log(f"error: the corpus is shorter than one {a.seq_len}-token window; "
            "lower --seq-len or add files")
        return 2
    mix = {g: MIX[g] for g in streams}
    total = sum(mix.values())
    mix = {g: w / total for g, w in mix.items()}
    # the repetition phase's prompts: function heads of the core's training files, the
    # files in a seeded order (never the held-out ones)
    order = list(train_files)
    random.Random(a.seed).shuffle(order)
    rep_heads = function_heads(order, REPETITION_HEADS) if a.repetition_steps > 0 else []
    base = None  # --main-from: the training.json of the main training taken as done
    if a.main_from:
        src = Path(a.main_from)
        try:
            base = json.loads((src / "training.json").read_text())
            same_tok = (src / "tokenizer.json").read_bytes() == (out / "tokenizer.json").read_bytes()
        except (OSError, ValueError) as e:
            log(f"error: --main-from {src}: not a checkpoint this script saved ({e})")
            return 2
        if not same_tok:
            log(f"error: --main-from {src}: its tokenizer is not the one this data and these "
                "settings train")
            return 2

    # 3. model and training
    torch.manual_seed(a.seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
        num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
        head_dim=a.hidden_size // a.heads, max_position_embeddings=a.seq_len,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True, hidden_act="silu",
        bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, initializer_range=0.02)
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
    tokens_per_step = a.batch_size * a.seq_len
    steps = max(1, round(a.tokens / tokens_per_step))
    warmup = max(1, round(a.warmup * steps))
    short = a.short_seq if 0 < a.short_seq < a.seq_len else a.seq_len
    short_steps = round(a.short_frac * steps) if short < a.seq_len else 0
    bf16 = a.dtype == "bf16" or (a.dtype == "auto" and cpu_has_bf16())

    def lr_at(step: int) -> float:
        if step < warmup:
            return a.lr * (step + 1) / warmup
        frac = (step - warmup) / max(1, steps - warmup)
        return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    gen = torch.Generator().manual_seed(a.seed)
    names = sorted(streams)
    weights = torch.tensor([mix[g] for g in names], dtype=torch.float64)

    def windows_of(ids: torch.Tensor, n: int, seq: int, g: torch.Generator) -> torch.Tensor:
        starts = torch.randint(0, len(ids) - seq - 1, (n,), generator=g)
        return torch.stack([ids[s: s + seq + 1] for s in starts.tolist()])

    def train_batch(step: int) -> torch.Tensor:
        seq = short if step < short_steps else a.seq_len
        n = tokens_per_step // seq
        picks = torch.multinomial(weights, n, replacement=True, generator=gen).tolist()
        return torch.cat([windows_of(streams[names[i]], 1, seq, gen) for i in picks])

    def loss_of(batch: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=batch[:, :-1]).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                               batch[:, 1:].reshape(-1))

    def learn(f, batch: torch.Tensor) -> torch.Tensor:
        """One step's forward and backward through the loss function f (grads left set)."""
        opt.zero_grad(set_to_none=True)
        loss = f(batch)
        loss.backward()
        return loss

    # The training step compiled (forward and backward), one graph per window shape; the
    # first call of each shape runs inside a try, so a machine where compiling fails (no C++
    # compiler, an unsupported op) trains on eagerly from that very step. Shapes follow
    # torch's defaults: the second one (the long windows) compiles with dynamic sizes.
    compiled_shapes: set[tuple[int, ...]] = set()
    compile_state = {"on": not a.no_compile, "fn": None}

    def forward_backward(batch: torch.Tensor) -> torch.Tensor:
        if not compile_state["on"]:
            return learn(loss_of, batch)
        shape = tuple(batch.shape)
        if shape in compiled_shapes:
            return learn(compile_state["fn"], batch)
        log(f"      compiling the training step for {shape[0]} x {shape[1] - 1}-token "
            "windows (torch.compile; about a minute)")
        t = time.monotonic()
        try:
            if compile_state["fn"] is None:
                compile_state["fn"] = torch.compile(loss_of)
            loss = learn(compile_state["fn"], batch)
        except Exception as e:  # noqa: BLE001 - no C++ compiler, unsupported op, ... (Stop
            # and Ctrl-C are BaseExceptions: they pass)
            log(f"      compiling failed ({type(e).__name__}: {str(e)[:200]}); "
                "training eagerly")
            compile_state["on"] = False
            return learn(loss_of, batch)
        compiled_shapes.add(shape)
        log(f"      compiled in {time.monotonic() - t:.0f} s")
        return loss

    val_batch = windows_of(val_ids, a.eval_windows, a.seq_len,
                           torch.Generator().manual_seed(a.seed + 1))

    @torch.no_grad()
    def val_loss() -> float:
        model.eval()
        total = sum(loss_of(val_batch[i: i + 4]).item() * len(val_batch[i: i + 4])
                    for i in range(0, len(val_batch), 4))
        model.train()
        return total / len(val_batch)

    # resumable state
    sdir = state_dir(a, sources)
    state_path = sdir / "state.pt"
    rep_path = sdir / "repetition.pt"  # the repetition phase's own state
    # trained_s: wall seconds of the training steps (a machine shared with other work, or a
    # paused process, stretches it); cpu_s: the CPU seconds they used (all threads), the
    # compute the card states
    step, ema, history, trained_s, cpu_s = 0, None, [], 0.0, 0.0
    if a.fresh and state_path.exists():
        state_path.unlink()
    if state_path.exists():
        st = load_training_state(state_path, model, opt, gen)
        step, ema, history, trained_s = st["step"], st["ema"], st["history"], st["trained_s"]
        cpu_s = st.get("cpu_s", 0.0)
        log(f"      resuming from {state_path}: step {step}/{steps}, "
            f"{fmt_s(trained_s)} trained so far")

    if base is not None:
        main = LlamaForCausalLM.from_pretrained(a.main_from, torch_dtype=torch.float32)
        model.load_state_dict(main.state_dict())
        step, ema, history = steps, base["train_loss"], base["loss_history"]
        log(f"      the main training's result taken from {a.main_from}")
    trained_before = trained_s

    def save_state() -> None:
        save_training_state(state_path, model, opt, gen, step=step, ema=ema, history=history,
                            trained_s=trained_s, cpu_s=cpu_s)

    log(f"[3/5] model: Llama, {n_params / 1e6:.2f} M parameters ({a.layers} layers, hidden "
        f"{a.hidden_size}, {a.heads} heads / {a.kv_heads} KV heads, MLP {a.intermediate_size}, "
        f"tied embeddings); {steps} steps x {tokens_per_step} tokens"
        + (f" ({short_steps} of them in {short}-token windows)" if short_steps else "")
        + f", {'bf16 autocast' if bf16 else 'fp32'}, {torch.get_num_threads()} threads; "
        f"state saved to {sdir} every {a.save_every:.0f} s")

    old_term = signal.signal(signal.SIGTERM, raise_stop) if hasattr(signal, "SIGTERM") else None
    model.train()
    t_run, cpu_run = time.monotonic(), time.process_time()
    t_log = t_save = t_run
    first = step
    try:
        if compile_state["on"] and short_steps and short_steps <= step < steps:
            # An uninterrupted run compiled the short windows' shape first, then the long
            # ones with dynamic sizes: so does this resumed one (on a batch of zeros whose
            # gradients are dropped), to compute exactly what that run computed.
            forward_backward(torch.zeros(tokens_per_step // short, short + 1, dtype=torch.long))
            opt.zero_grad(set_to_none=True)
        while step < steps:
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
            loss = forward_backward(train_batch(step))
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            value = loss.item()
            ema = value if ema is None else 0.95 * ema + 0.05 * value
            step += 1
            now = time.monotonic()
            if now - t_log >= a.log_every or step == steps:
                t_log = now
                rate = (step - first) * tokens_per_step / (now - t_run)
                eta = (steps - step) * tokens_per_step / rate
                history.append({"step": step, "loss": round(ema, 4)})
                log(f"      step {step}/{steps}  loss {ema:.3f}  lr {lr_at(step - 1):.2e}  "
                    f"{rate:,.0f} tok/s  trained {fmt_s(trained_s + now - t_run)}  "
                    f"eta {fmt_s(eta)}")
            if step < steps and now - t_save >= a.save_every:
                trained_s += now - t_run
                cpu_s += time.process_time() - cpu_run
                t_run = t_save = now
                cpu_run = time.process_time()
                first = step
                save_state()
            if a.stop_after is not None and step - first >= a.stop_after and step < steps:
                raise Stop
    except (KeyboardInterrupt, Stop):
        trained_s += time.monotonic() - t_run
        cpu_s += time.process_time() - cpu_run
        save_state()
        log(f"      stopped at step {step}/{steps}; state saved to {state_path}: run the same "
            "command again to continue")
        return 3
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
    train_s = trained_s + time.monotonic() - t_run
    cpu_s += time.process_time() - cpu_run
    setup_s = time.monotonic() - t_start - (train_s - trained_before)
    if base is None:
        trained_s, t_run, cpu_run = train_s, time.monotonic(), time.process_time()
        if a.repetition_steps > 0 and not rep_path.exists():
            save_state()  # the main training's end, for a repetition phase that is stopped
        final_val = val_loss()
        log(f"      done in {fmt_s(train_s)}: train loss {ema:.3f}, held-out loss "
            f"{final_val:.3f} (uniform guess: {math.log(vocab):.2f})")
    else:
        final_val = base["held_out_loss_fp32"]

    # 4. what ships is bf16: the repetition phase starts from the bf16-rounded weights, and
    # the held-out loss and the sample are taken again on its bf16-rounded result (computed
    # in fp32, as transformers does on CPU).
    model.eval()
    model.to(torch.bfloat16).float()
    main_val = val_loss()
    rep = None
    if a.repetition_steps > 0:
        rep = repetition_phase(model, tok, rep_heads, a, rep_path, {
            "streams": streams, "names": names, "weights": weights, "windows_of": windows_of,
            "pad": pad, "eos": eos, "vocab": vocab})
        if rep is None:
            return 3
        model.eval()
        model.to(torch.bfloat16).float()
    shipped_val = val_loss() if rep else main_val
    model.eval()
    with torch.no_grad():
        ids = tok.encode(SAMPLE_PROMPT).ids  # the post-processor puts BOS in front
        for _ in range(64):
            nxt = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(nxt)
            if nxt == eos:
                break
    sample = tok.decode(ids, skip_special_tokens=True)
    model.to(torch.bfloat16)
    model.generation_config.bos_token_id = bos
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = pad
    for key, value in SAMPLING_DEFAULTS.items():
        setattr(model.generation_config, key, value)
    model.save_pretrained(out, safe_serialization=True)
    size = checkpoint_bytes(out)
    import tokenizers
    import transformers

    info = {
        "python": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
        "threads": torch.get_num_threads(), "cpu": cpu_name(),
        "corpus_files": len(train_texts), "held_out_files": len(val_texts),
        "corpus_bytes": corpus_bytes, "corpus_sha256": digest.hexdigest(),
        "train_tokens_in_corpus": len(train_ids), "vocab_size": vocab,
        "parameters": n_params, "steps": steps, "tokens_seen": steps * tokens_per_step,
        "train_seconds": round(train_s), "total_seconds": round(train_s + setup_s),
        "train_cpu_seconds": round(cpu_s),
        "sources": sources, "mix": mix, "arithmetic": "bf16 autocast" if bf16 else "fp32",
        "compiled": compile_state["on"],
        "short_steps": short_steps, "short_seq": short,
        "train_loss": round(ema, 4), "held_out_loss_fp32": round(final_val, 4),
        "held_out_loss_main": round(main_val, 4), "held_out_loss": round(shipped_val, 4),
        "loss_history": history, "sample_prompt": SAMPLE_PROMPT, "sample": sample,
        "args": vars(a) | {"out": None, "main_from": None},
    }
    if base is not None:  # the main training's figures are the ones it recorded
        keep = ("python", "torch", "transformers", "tokenizers", "threads", "cpu", "steps",
                "tokens_seen", "train_seconds", "total_seconds", "train_cpu_seconds",
                "arithmetic", "compiled", "short_steps", "short_seq", "train_loss",
                "held_out_loss_fp32", "loss_history")  # not its "quality": measured again
        info |= {k: base[k] for k in keep if k in base}
        info["main_from"] = {"cpu": base.get("cpu"), "threads": base.get("threads")}
    if rep is not None:
        info["repetition"] = rep
        info["total_seconds"] += round(rep["seconds"])
        info["train_cpu_seconds"] += round(rep["cpu_seconds"])
    (out / "training.json").write_text(json.dumps(info, indent=1) + "\n")
    (out / "README.md").write_text(model_card(info, a, size))
    state_path.unlink(missing_ok=True)
    rep_path.unlink(missing_ok=True)
    log(f"[5/5] saved to {out} ({size / 1e6:.1f} MB) in {fmt_s(time.monotonic() - t_start)} "
        f"in all. Greedy sample:\n{sample}")
    return 0


def repetition_phase(model, tok, heads: list[str], a: argparse.Namespace, path: Path,
                     data: dict) -> dict | None:
    """Teach the model not to repeat a line (sequence-level unlikelihood training, Welleck et
    al. 2019, "Neural text generation with unlikelihood training"): greedy decoding of a
    small model falls into loops that its next-token loss never sees, since they are its own
    outputs and not the corpus. Each step completes ``--repetition-batch`` training function
    heads greedily (``--repetition-tokens`` each), and for every token of a line that repeats
    the line before it adds -log(1 - p(token)), pushing that continuation down where the
    model itself chose it; the usual next-token loss on one window of the training mix keeps
    the rest of what it learnt. Seeded, resumable (``path``), progress on stderr. Returns the
    phase's figures, or None when stopped (its state saved)."""
    import torch
    import torch.nn.functional as F

    vocab, pad, eos = data["vocab"], data["pad"], data["eos"]
    texts = [tok.decode([i]) for i in range(vocab)]
    newline = {i for i, t in enumerate(texts) if "\n" in t}
    blank = {i for i, t in enumerate(texts) if not t.strip()}
    prompts = [tok.encode(h).ids for h in heads]  # the post-processor puts BOS in front
    if not prompts:
        log("      no function head in the training files: the repetition phase is skipped")
        return {"steps": 0, "seconds": 0.0, "cpu_seconds": 0.0, "heads": 0}
    seq = min(a.seq_len, 512)
    gen = torch.Generator().manual_seed(a.seed + 2)
    opt = torch.optim.AdamW(model.parameters(), lr=a.repetition_lr, weight_decay=0.0)
    step, seconds, cpu, shares, ul_ema = 0, 0.0, 0.0, [], None
    if path.exists():
        st = load_training_state(path, model, opt, gen)
        step, seconds, cpu, shares = st["step"], st["seconds"], st["cpu"], st["shares"]
        log(f"      resuming the repetition phase from {path}: step {step}/"
            f"{a.repetition_steps}")

    def save() -> None:
        save_training_state(path, model, opt, gen, step=step, seconds=seconds, cpu=cpu,
                            shares=shares)

    def greedy(batch: list[list[int]]) -> tuple:
        """The prompts left-padded, their mask, and their greedy continuations."""
        width = max(map(len, batch))
        x = torch.full((len(batch), width), pad, dtype=torch.long)
        m = torch.zeros_like(x)
        for i, ids in enumerate(batch):
            x[i, width - len(ids):] = torch.tensor(ids)
            m[i, width - len(ids):] = 1
        model.eval()
        with torch.no_grad():
            out = model.generate(input_ids=x, attention_mask=m, do_sample=False,
                                 max_new_tokens=a.repetition_tokens, pad_token_id=pad,
                                 eos_token_id=eos)
        return x, m, out[:, width:]

    log(f"[4/5] repetition: {a.repetition_steps} steps; each completes {a.repetition_batch} of "
        f"{len(prompts)} training function heads greedily ({a.repetition_tokens} tokens) and "
        "pushes down the first token of each line that repeats the line before it "
        f"(unlikelihood, weight {a.repetition_weight}), "
        f"beside the next-token loss on {REPETITION_WINDOWS} {seq}-token windows; state saved "
        f"to {path}")

    old_term = signal.signal(signal.SIGTERM, raise_stop) if hasattr(signal, "SIGTERM") else None
    t_run, cpu_run = time.monotonic(), time.process_time()
    t_log = t_save = t_run
    first = step
    try:
        while step < a.repetition_steps:
            picks = torch.randint(len(prompts), (a.repetition_batch,), generator=gen).tolist()
            x, m, g = greedy([prompts[i] for i in picks])
            mask = torch.tensor(repeated_lines(g.tolist(), newline, blank, {pad, eos}),
                                dtype=torch.float32)
            model.train()
            logits = model(input_ids=torch.cat([x, g], 1),
                           attention_mask=torch.cat([m, (g != pad).long()], 1)).logits
            p = logits[:, x.shape[1] - 1:-1].float().softmax(-1).gather(-1, g[..., None])[..., 0]
            ul = -(torch.log((1 - p).clamp_min(1e-5)) * mask).sum() / mask.sum().clamp_min(1)
            picks = torch.multinomial(data["weights"], REPETITION_WINDOWS, replacement=True,
                                      generator=gen).tolist()
            w = torch.cat([data["windows_of"](data["streams"][data["names"][i]], 1, seq, gen)
                           for i in picks])
            logits = model(input_ids=w[:, :-1]).logits
            mle = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                  w[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            (mle + a.repetition_weight * ul).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            shares.append(round(float(mask.mean()), 4))
            ul_ema = ul.item() if ul_ema is None else 0.9 * ul_ema + 0.1 * ul.item()
            now = time.monotonic()
            if now - t_log >= a.log_every or step == a.repetition_steps:
                t_log = now
                recent = shares[-20:]
                eta = (a.repetition_steps - step) * (now - t_run) / max(step - first, 1)
                log(f"      repetition step {step}/{a.repetition_steps}  next-token loss "
                    f"{mle.item():.3f}  unlikelihood {ul_ema:.3f}  tokens in repeated lines "
                    f"{sum(recent) / len(recent):.1%}  eta {fmt_s(eta)}")
            if step < a.repetition_steps and now - t_save >= a.save_every:
                seconds += now - t_run
                cpu += time.process_time() - cpu_run
                t_run = t_save = now
                cpu_run = time.process_time()
                first = step
                save()
            if (a.stop_after is not None and step - first >= a.stop_after
                    and step < a.repetition_steps):
                raise Stop
    except (KeyboardInterrupt, Stop):
        seconds += time.monotonic() - t_run
        cpu += time.process_time() - cpu_run
        save()
        log(f"      stopped at repetition step {step}/{a.repetition_steps}; state saved to "
            f"{path}: run the same command again to continue")
        return None
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
    seconds += time.monotonic() - t_run
    cpu += time.process_time() - cpu_run
    head, tail = shares[:20], shares[-20:]
    return {"steps": step, "seconds": round(seconds, 1), "cpu_seconds": round(cpu, 1),
            "heads": len(prompts), "batch": a.repetition_batch, "tokens": a.repetition_tokens,
            "lr": a.repetition_lr, "window": seq, "windows": REPETITION_WINDOWS,
            "weight": a.repetition_weight,
            "repeated_share_first": round(sum(head) / max(len(head), 1), 4),
            "repeated_share_last": round(sum(tail) / max(len(tail), 1), 4)}


def checkpoint_bytes(out: Path) -> int:
    return sum(f.stat().st_size for f in out.iterdir()
               if f.is_file() and f.name not in ("README.md", "training.json"))


def rewrite_card(out: Path) -> int:
    from transformers import GenerationConfig

    info = json.loads((out / "training.json").read_text())
    tok_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(tok_path.read_text())
    tok_cfg["chat_template"] = CODE_CHAT_TEMPLATE
    tok_path.write_text(json.dumps(tok_cfg, indent=2))
    gen = GenerationConfig.from_pretrained(out)
    for key, value in SAMPLING_DEFAULTS.items():
        setattr(gen, key, value)
    gen.save_pretrained(out)
    size = checkpoint_bytes(out)
    a = build_parser().parse_args([])
    vars(a).update({k: v for k, v in info["args"].items() if k != "out"})
    (out / "README.md").write_text(model_card(info, a, size))
    log(f"rewrote {out}'s README.md, chat template and sampling defaults")
    return 0


def sources_line(i: dict) -> str:
    """The extra training groups of the card's data row, with their licences and shares."""
    extra = [s for s in i.get("sources", []) if s["group"] != "core"]
    if not extra:
        return ""
    mix = i.get("mix", {})
    parts = []
    for group in ("stdlib-tests", "packages"):
        rows = [s for s in extra if s["group"] == group]
        if not rows:
            continue
        total = rows[-1]
        if group == "packages":
            names = ", ".join(f"{s['what']} ({s['licence']})" for s in rows[:-1])
            parts.append(f"installed packages {names}: {total['files']} files, "
                         f"{total['bytes'] / 1e6:.1f} MB")
        else:
            parts.append(f"the stdlib's test suite ({total['licence']}): {total['files']} "
                         f"files, {total['bytes'] / 1e6:.1f} MB")
    shares = ", ".join(f"{g} {w:.0%}" for g, w in mix.items())
    return "; also " + "; ".join(parts) + f". Windows drawn by shares: {shares}"


def quality_row(i: dict) -> str:
    """The card's quality row, from training.json's "quality" (written from
    benchmarks/bench_model_quality.py's figures, when measured)."""
    q = i.get("quality")
    if not q:
        return ""
    looping = (f" ({q['greedy_looping']} of the {q['heads']} more than 3 times)"
               if "greedy_looping" in q else "")
    return (f"\n| quality | {q['parse_rate']:.0%} of {q['heads']} held-out function heads, "
            f"completed at the default sampling, parse ({q['unfinished']} still unfinished at "
            f"the end of the context); greedy completions repeat one line up to "
            f"{q['greedy_longest_repeat']} times in a row{looping}; held-out loss x"
            f"{q['loss_vs_baseline']:.3f} that of {q['baseline']} "
            f"(`benchmarks/bench_model_quality.py`, {q['cpu']}) |")


def repetition_row(i: dict) -> str:
    """The card's row for the repetition phase, when it ran."""
    r = i.get("repetition")
    if not r or not r.get("steps"):
        return ""
    before = i.get("held_out_loss_main")
    loss = (f"; held-out loss {before:.3f} before it, {i['held_out_loss']:.3f} after"
            if before is not None else "")
    return (f"\n| repetition phase | {r['steps']} steps after the main training (sequence-level "
            f"unlikelihood, `repetition_phase`): each completed {r['batch']} of {r['heads']} "
            f"training function heads greedily ({r['tokens']} tokens) and pushed down the "
            f"first token of each line that repeats the line before it (weight "
            f"{r.get('weight', 0.25)}), beside the next-token loss on {r.get('windows', 1)} "
            f"{r['window']}-token windows; AdamW, LR {r['lr']}, fp32. Tokens in repeated lines: "
            f"{r['repeated_share_first']:.1%} in its first 20 steps, "
            f"{r['repeated_share_last']:.1%} in its last 20{loss}; {r['seconds'] / 60:.0f} min |")


def main_from_line(i: dict) -> str:
    """The card's note when the main training was taken from an earlier run (--main-from)."""
    if not i.get("main_from"):
        return ""
    return ("\n\nThese weights were made in two runs: the main training's result was taken "
            "from an earlier run of this script with the same settings (`--main-from`), and "
            "the repetition phase ran on it; a fresh run does both in one go, to the same "
            "bytes (the tests check that for small runs).")


def short_line(i: dict, a: argparse.Namespace) -> str:
    if not i.get("short_steps"):
        return f" ({a.batch_size} x {a.seq_len}-token windows drawn at random)"
    return (f" (the first {i['short_steps']} in {i['short_seq']}-token windows, the rest in "
            f"{a.batch_size} x {a.seq_len}, drawn at random)")


def model_card(i: dict, a: argparse.Namespace, size: int) -> str:
    return f"""# stdlib-coder

phasewise's bundled default model: a {i['parameters'] / 1e6:.1f} M-parameter Llama that
continues Python code. `phasewise serve` and `phasewise generate` use it when no `--model` is
given. It was trained from scratch by `scripts/train_default_model.py` on the source of the
Python {i['python']} standard library, so anyone can rebuild it from what is on their machine.

## What it is

- A code-completion toy: given the start of a Python file or function, it writes text that
  looks like stdlib Python (indentation, docstrings, `self.`, `return`, `raise`), one token
  at a time.
- A standard Hugging Face checkpoint (`LlamaForCausalLM`, bf16 safetensors, `tokenizer.json`
  from the `tokenizers` library, a chat template): it loads through exactly the path a real
  checkpoint takes, in phasewise and in `transformers`.
- Small enough ({size / 1e6:.1f} MB) to live in the repository and to load in a couple of
  seconds, so the first run of phasewise shows real-looking text streaming with prefill and
  decode measured.

## What it is not

- Not a useful coding assistant. Its code rarely runs: names are invented, logic is
  shallow, long outputs wander. It was trained on {i['tokens_seen'] / 1e6:.1f} M tokens for
  {i['train_seconds'] // 60} minutes on {i['threads']} CPU threads.
- Not an instruction or chat model. The chat template turns every user and system message
  into Python comment lines (`# ...`) and ends the prompt with `def `, so a chat reply is a
  function (its name, signature and body, without the `def `) that a comment might precede
  in the stdlib. It does not follow instructions or answer questions.
- Not a model of natural language: it has seen English only in comments and docstrings.
- Context: {a.seq_len} tokens (its training window); phasewise refuses longer requests.

## Training

| | |
|---|---|
| data | {i['corpus_files']} `.py` files of the Python {i['python']} stdlib ({i['corpus_bytes'] / 1e6:.1f} MB; tests, IDLE, lib2to3, codec tables and pydoc's topics left out; every {HOLDOUT_EVERY}th file held out: {i['held_out_files']} files), sha256 `{i['corpus_sha256'][:16]}`{sources_line(i)} |
| tokenizer | byte-level BPE, {i['vocab_size']} tokens, `<|bos|>` before and `<|eos|>` after every file |
| model | {a.layers} layers, hidden {a.hidden_size}, {a.heads} heads / {a.kv_heads} KV heads (head dim {a.hidden_size // a.heads}), SwiGLU MLP {a.intermediate_size}, RoPE, tied embeddings: {i['parameters']:,} parameters |
| training | {i['steps']} steps of {a.batch_size * a.seq_len} tokens{short_line(i, a)} ({i['tokens_seen']:,} tokens, {i['tokens_seen'] / i['train_tokens_in_corpus']:.2f} times the {i['train_tokens_in_corpus']:,}-token core stream); AdamW (0.9, 0.95), peak LR {a.lr}, {a.warmup:.0%} warm-up, cosine to 10%, weight decay {a.weight_decay}, gradient clip 1.0, {i.get('arithmetic', 'fp32')}, seed {a.seed} |
| loss (nats/token) | train {i['train_loss']:.3f} (last steps, smoothed); held out {i['held_out_loss']:.3f} with the shipped bf16 weights ({i['held_out_loss_fp32']:.3f} before the cast from fp32); a uniform guess scores {math.log(i['vocab_size']):.2f} |{repetition_row(i)}{quality_row(i)}
| trained on | {i['cpu']}, {i['threads']} threads; Python {i['python']}, torch {i['torch']}, transformers {i['transformers']}, tokenizers {i['tokenizers']}: {i['total_seconds'] // 60} min {i['total_seconds'] % 60} s in all, of which training used {i.get('train_cpu_seconds', 0) / 3600:.1f} CPU-hours{' (its step compiled by torch.compile)' if i.get('compiled') else ''} |

Reproduce (the run's settings are in `training.json`):

```bash
pip install -e '.[train]' && python scripts/train_default_model.py --threads {i['threads']}
```

The same Python, library versions, installed packages, C++ compiler, CPU and thread count give
byte-identical files; others
give a different model of the same quality.{main_from_line(i)}

## Sampling defaults

`generation_config.json` sets {", ".join(f"`{k}` {v}" for k, v in SAMPLING_DEFAULTS.items())}:
phasewise and `transformers` use them when a request does not say. Greedy decoding of so
small a model tends to fall into a loop, one line over and over; the repetition phase
(above) is there to make that rare.

## Sample

Greedy continuation of `{i['sample_prompt']}` (64 tokens at most) by the shipped weights, as
written by the training script with `transformers`:

```python
{i['sample']}
```
"""


if __name__ == "__main__":
    raise SystemExit(main())
