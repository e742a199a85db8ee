"""phasewise on a CUDA GPU: prefill MFU and decode MBU on a model's shape, CUDA graphs against
eager steps, and HF transformers beside it in the same run.

Built for one call on a lent GPU machine (it downloads nothing and writes no weights): the
model is a random-weight checkpoint (``load_format="dummy"``) of Llama-3.1-8B's shape by
default, whose folder this script writes (config.json and a word-level tokenizer.json that
names every one of the 128,256 ids, so any sampled id decodes).

Figures, each beside the roofline analyser's entry for the accelerator (``--accelerator``,
default h200: its datasheet peaks) and beside this GPU's own ceilings measured first
(bf16 8192^3 matmul, device-to-device copy and a read):

* prefill of 512 .. 4096 tokens: time to first token (one engine step, prompt and first
  token), the analyser's FLOPs for it, MFU against the datasheet and the measured peak;
* decode at batch 1, 8, 32, 64 (128-token prompts, 128 new tokens): the median decode-only
  engine step (sampling and detokenization included), tokens/s, and MBU = the analyser's
  bytes for that step (weights + K/V) / time / bandwidth; with CUDA graphs and with
  ``enforce_eager``, and the ratio;
* HF transformers (the machine's own, eager, SDPA) on the same shape: prefill time and
  greedy ``generate`` decode rate, and phasewise's ratio to it.

Each ceiling is judged as ``phasewise measure`` judges its figures (``harness.PeakRuns``: its
two best runs within ``STABLE_BAND``; on a CPU dry run, other processes' load too); an
unstable one is named after the ceilings, and each MFU / MBU "of measured" computed from it is
marked ``(UNSTABLE peak: ...)``.

    python -m benchmarks.bench_cuda                      # on the GPU machine
    python -m benchmarks.bench_cuda --device cpu --shape tiny --skip-hf   # a dry run here
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from benchmarks.harness import PeakNotes, PeakRuns
from phasewise import LLM, SamplingParams
from phasewise.perf.hardware import ACCELERATORS
from phasewise.perf.models import ModelShape
from phasewise.perf.roofline import Roofline

SHAPES = {
    # meta-llama/Llama-3.1-8B's config.json, less its weights
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=128000,
        eos_token_id=128001, hidden_act="silu", attention_bias=False, mlp_bias=False),
    # a dry run's shape (CPU)
    "tiny": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=256,
        intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, head_dim=32, vocab_size=2048, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
        torch_dtype="bfloat16", bos_token_id=0, eos_token_id=1, hidden_act="silu",
        attention_bias=False, mlp_bias=False),
}


def say(msg: str) -> None:
    print(msg, flush=True)


def write_folder(out: Path, cfg: dict) -> Path:
    """config.json, generation_config.json and a word-level tokenizer of ``vocab_size``
    words ``t0 ..``: every id decodes to text."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}))
    tok = Tokenizer(WordLevel({f"t{i}": i for i in range(cfg["vocab_size"])}, unk_token="t0"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    return out


class Timer:
    """Wall time of a block, the device synchronised at both ends."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.s = 0.0

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __enter__(self) -> Timer:
        self.sync()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.sync()
        self.s = time.perf_counter() - self.t0


def ceilings(device: torch.device, quick: bool) -> tuple[dict, PeakNotes]:
    """This device's bf16 matmul rate, copy and read bandwidth (best of several), and which
    of them are unstable (named ``bf16``, ``copy``, ``mem_bandwidth``)."""
    runs = PeakRuns(cpu_load=device.type == "cpu")
    n = 2048 if quick else 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    mm: list[float] = []
    for i in range(8):
        with Timer(device) as t:
            for _ in range(4):
                a @ b
        if i >= 2:
            mm.append(t.s / 4)
    flops = 2 * n**3 / min(mm)
    del a, b
    nbytes = (64 << 20) if quick else (4 << 30)
    x = torch.ones(nbytes // 2, device=device, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    copies: list[float] = []
    reads: list[float] = []
    for i in range(8):
        with Timer(device) as t:
            y.copy_(x)
        if i >= 2:
            copies.append(t.s)
        with Timer(device) as t:
            x.sum(dtype=torch.float32)
        if i >= 2:
            reads.append(t.s)
    del x, y
    for name, times in (("bf16", mm), ("copy", copies), ("mem_bandwidth", reads)):
        runs.add(name, times)
    return ({"bf16_flops": flops, "copy_Bps": 2 * nbytes / min(copies),
             "read_Bps": nbytes / min(reads)}, runs.notes())


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n, length), generator=g).tolist()


def engine_kwargs(args, device: str, **over) -> dict:
    kw = dict(device=device, dtype="bfloat16", load_format="dummy",
              max_model_len=args.max_model_len, kv_cache_memory=args.kv_cache_memory,
              max_num_batched_tokens=max(args.prefill), max_num_seqs=max(args.batches),
              enable_prefix_caching=False)
    kw.update(over)
    return kw


def run_prefill(llm: LLM, lengths: list[int], vocab: int, roof: Roofline, peaks: dict,
                dev: torch.device) -> list[dict]:
    rows = []
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for length in lengths:
        best = float("inf")
        for rep in range(3):  # the first is a warm-up (cuBLAS picks its kernels)
            prompt = random_prompts(1, length, vocab, seed=length * 10 + rep)
            with Timer(dev) as t:
                llm.generate(prompt, one)
            if rep:
                best = min(best, t.s)
        cost = roof.prefill(length)
        rows.append({"tokens": length, "ttft_s": best, "flops": cost.flops,
                     "roofline_s": cost.time, "bound": cost.bound,
                     "mfu_datasheet": cost.flops / best / roof.peak_flops,
                     "mfu_measured": cost.flops / best / peaks["bf16_flops"]})
    return rows


def run_decode(llm: LLM, batches: list[int], prompt_len: int, new: int, vocab: int,
               roof: Roofline, peaks: dict) -> list[dict]:
    rows = []
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    for b in batches:
        llm.engine.step_stats.clear()
        t0 = time.perf_counter()
        llm.generate(random_prompts(b, prompt_len, vocab, seed=b), params)
        wall = time.perf_counter() - t0
        steps = [s.duration_s for s in llm.engine.step_stats
                 if s.num_prefill_tokens == 0 and s.num_decode_tokens == b]
        step = statistics.median(steps)
        ctx = prompt_len + new // 2  # the middle step's context
        cost = roof.decode(batch=b, context=ctx)
        rows.append({"batch": b, "step_s": step, "tok_s": b / step,
                     "wall_tok_s": b * new / wall, "bytes": cost.bytes,
                     "roofline_s": cost.time, "bound": cost.bound,
                     "mbu_datasheet": cost.bytes / step / roof.bandwidth,
                     "mbu_read": cost.bytes / step / peaks["read_Bps"],
                     "decode_steps": len(steps)})
    return rows


def run_hf(cfg: dict, lengths: list[int], batches: list[int], prompt_len: int,
           new: int, dev: torch.device) -> dict:
    import transformers

    hf_cfg = transformers.LlamaConfig(**{k: v for k, v in cfg.items()
                                         if k not in ("architectures", "torch_dtype")})
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(dev):
            model = transformers.LlamaForCausalLM(hf_cfg).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    out: dict = {"version": transformers.__version__, "prefill": [], "decode": []}
    vocab = cfg["vocab_size"]
    with torch.inference_mode():
        for length in lengths:
            best = float("inf")
            for rep in range(3):
                ids = torch.tensor(random_prompts(1, length, vocab, seed=rep), device=dev)
                with Timer(dev) as t:
                    model(input_ids=ids, logits_to_keep=1)
                if rep:
                    best = min(best, t.s)
            out["prefill"].append({"tokens": length, "s": best})
        for b in batches:
            ids = torch.tensor(random_prompts(b, prompt_len, vocab, seed=b), device=dev)
            kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0,
                      attention_mask=torch.ones_like(ids))
            model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)  # warm-up
            with Timer(dev) as t1:
                model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
            with Timer(dev) as t:
                model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
            step = (t.s - t1.s) / (new - 1)
            out["decode"].append({"batch": b, "step_s": step, "tok_s": b / step})
    del model
    return out


CHECKS = {"graphs": dict(), "eager": dict(enforce_eager=True),
          "torch-ops": dict(kernels="torch", enforce_eager=True)}


def check_paths(tmp: Path, device: str) -> dict:
    """Greedy tokens of the tiny shape in fp32 through captured graphs, eagerly, and eagerly
    with torch's operations only (the reference), for batches that pad and contexts that
    cross a table-width bucket: each should give the reference's tokens."""
    folder = write_folder(tmp / "check", SHAPES["tiny"])
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    outs = {}
    for name, kw in CHECKS.items():
        llm = LLM(str(folder), device=device, dtype="float32", load_format="dummy",
                  max_model_len=1024, kv_cache_memory="256MiB", **kw)
        got = []
        for b, length in ((1, 20), (3, 230), (8, 40)):
            prompts = random_prompts(b, length, SHAPES["tiny"]["vocab_size"], seed=b)
            got += [o.token_ids for o in llm.generate(prompts, params)]
        graphs = llm.engine.runner.graphs
        outs[name] = (got, None if graphs is None else graphs.replays,
                      llm.engine.gpu_kernels)
        del llm
    ref = outs["torch-ops"][0]
    return {name: {"identical": sum(a == b for a, b in zip(got, ref)), "sequences": len(ref),
                   "replays": replays, "kernels": kernels}
            for name, (got, replays, kernels) in outs.items()}


def unsplit(llm: LLM) -> None:
    """Decode attention one program a (row, KV head), as before the split kernels: set before
    the first decode step, so every graph captures it."""
    llm.engine.model.ops.decode_programs = 0


# (name, engine options, whether it runs the prefill figures, a change after it loads)
MODES = [("triton+graphs", dict(), True, None), ("torch+graphs", dict(kernels="torch"), True, None),
         ("triton+graphs, unsplit attention", dict(), False, unsplit),
         ("triton eager", dict(enforce_eager=True), False, None)]


def attention_kernels(dev: torch.device, cfg: dict, batches: list[int],
                      contexts: list[int]) -> list[dict]:
    """One layer's paged decode attention alone, on the model's heads: the Triton kernel with
    rows' blocks split across programs (``decode_splits``, the engine's default on a GPU),
    one program a (row, KV head), and torch's gather path, each timed with CUDA events over
    repeated calls on shuffled block tables, with the largest difference from torch's."""
    n_heads, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
    rows = []
    for ctx in contexts:
        for b in batches:
            if b * ctx * n_kv * hd * 2 * 2 <= (8 << 30):  # K and V within 8 GiB
                rows.append(attention_case(dev, b, ctx, n_heads, n_kv, hd))
    return rows


def attention_case(dev: torch.device, b: int, ctx: int, n_heads: int, n_kv: int, hd: int,
                   bs: int = 16, reps: int = 50) -> dict:
    from phasewise.model.attention import AttentionMetadata, decode_attention_torch
    from phasewise.model.triton_ops import TritonOps, decode_splits

    split, whole = TritonOps(), TritonOps(decode_programs=0)
    per_row = -(-ctx // bs)
    g = torch.Generator().manual_seed(ctx + b)
    k = torch.randn(b * per_row + 1, bs, n_kv, hd, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    order = (torch.randperm(b * per_row, generator=g) + 1).view(b, per_row).tolist()
    meta = AttentionMetadata.build(chunk_lens=[1] * b, context_lens=[ctx - 1] * b,
                                   block_tables=order, block_size=bs, device=dev)
    q = torch.randn(b, n_heads, hd, device=dev, dtype=torch.bfloat16)
    scale = hd ** -0.5
    methods = {"split": split.decode_attention, "one program a head": whole.decode_attention}
    ref = None
    if b * ctx <= 64 * 4096:  # torch's gathers copy every row's padded context
        methods["torch"] = decode_attention_torch
        ref = decode_attention_torch(q, k, v, meta, scale).float()
    row = {"batch": b, "context": ctx,
           "splits": decode_splits(b, n_kv, per_row, split._programs(dev))}
    for name, fn in methods.items():
        out = fn(q, k, v, meta, scale)
        if ref is not None:
            row[f"{name} max diff"] = float((out.float() - ref).abs().max())
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        best = float("inf")
        for _ in range(3):
            start.record()
            for _ in range(reps):
                fn(q, k, v, meta, scale)
            end.record()
            torch.cuda.synchronize(dev)
            best = min(best, start.elapsed_time(end) * 1e3 / reps)
        row[f"{name} us"] = best
    return row


def step_anatomy(llm: LLM, dev: torch.device, prompt_len: int, vocab: int) -> dict:
    """Where a batch-1 decode step's time goes: the captured graph's replay alone (CUDA
    events, the GPU's time for the whole forward pass), the runner's ``execute`` (inputs, the
    replay, logits), and the rest of the engine's step (scheduling, sampling, text, stats);
    and the top of a profile of those steps."""
    import cProfile
    import io
    import pstats

    eng = llm.engine
    spent = {"execute": 0.0}
    inner = eng.runner.execute

    def timed(*a, **k):
        t0 = time.perf_counter()
        out = inner(*a, **k)
        spent["execute"] += time.perf_counter() - t0
        return out

    eng.runner.execute = timed
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    llm.generate(random_prompts(1, prompt_len, vocab, seed=7), params)  # warm
    eng.step_stats.clear()
    spent["execute"] = 0.0
    prof = cProfile.Profile()
    prof.enable()
    llm.generate(random_prompts(1, prompt_len, vocab, seed=8), params)
    prof.disable()
    eng.runner.execute = inner
    n = len(eng.step_stats)
    out = {"step_ms": 1e3 * sum(s.duration_s for s in eng.step_stats) / n,
           "execute_ms": 1e3 * spent["execute"] / n}
    graphs = eng.runner.graphs
    if graphs is not None and dev.type == "cuda" and graphs.graphs:
        key = min(graphs.graphs)
        graph = graphs.graphs[key][0]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()
        start.record()
        for _ in range(50):
            graph.replay()
        end.record()
        torch.cuda.synchronize(dev)
        out["replay_ms"] = start.elapsed_time(end) / 50
        out["replay_bucket"] = key
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(18)
    out["profile"] = text.getvalue()
    if dev.type == "cuda":  # the GPU's kernels of eager batch-1 steps (the graph's, one by one)
        from torch.profiler import ProfilerActivity, profile

        saved, eng.runner.graphs = eng.runner.graphs, None
        try:
            params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
            prompt = random_prompts(1, prompt_len, vocab, seed=9)
            llm.generate(prompt, params)
            with profile(activities=[ProfilerActivity.CUDA]) as gpu_prof:
                llm.generate(prompt, params)
            out["kernels"] = gpu_prof.key_averages().table(
                sort_by="cuda_time_total", row_limit=22, max_name_column_width=60)
        finally:
            eng.runner.graphs = saved
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    p.add_argument("--accelerator", default="h200", choices=sorted(ACCELERATORS))
    p.add_argument("--prefill", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--kv-cache-memory", default="16GiB")
    p.add_argument("--attention-contexts", type=int, nargs="+",
                   default=[192, 1024, 4096, 16384],
                   help="keys a row for the attention kernels alone (CUDA only)")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-eager", action="store_true",
                   help="leave out the eager engine (enforce_eager) of the comparison")
    p.add_argument("--out", default=None, help="write the figures here as JSON")
    args = p.parse_args()
    dev = torch.device(args.device)
    quick = dev.type != "cuda"
    res: dict = {"torch": torch.__version__, "shape": args.shape, "errors": []}
    if dev.type == "cuda":
        prop = torch.cuda.get_device_properties(dev)
        res["gpu"] = f"{prop.name}, {prop.multi_processor_count} SMs, " \
                     f"{prop.total_memory / 2**30:.0f} GiB"
    say(f"torch {torch.__version__}; device {res.get('gpu', dev)}")

    peaks, notes = ceilings(dev, quick)
    res["ceilings"] = peaks
    res["ceilings_unstable"] = notes.unstable
    accel = ACCELERATORS[args.accelerator]
    say(f"measured: bf16 matmul {peaks['bf16_flops'] / 1e12:.0f} TFLOP/s, copy "
        f"{peaks['copy_Bps'] / 1e12:.2f} TB/s (read+write), read {peaks['read_Bps'] / 1e12:.2f}"
        f" TB/s; analyser's {accel.key}: bf16 {accel.peak_flops_for('bf16') / 1e12:.0f} "
        f"TFLOP/s, {accel.mem_bandwidth / 1e12:.2f} TB/s")
    say(notes.header("this device's measured ceilings; the datasheet's are not measured"))

    with tempfile.TemporaryDirectory() as tmp:
        try:
            res["check"] = check = check_paths(Path(tmp), args.device)
            for name, c in check.items():
                say(f"check, tiny fp32, {name} ({c['kernels']}, {c['replays']} graph "
                    f"replays): {c['identical']}/{c['sequences']} greedy sequences as torch's")
        except Exception:
            res["errors"].append(f"check: {traceback.format_exc()}")
            say(traceback.format_exc())
        folder = write_folder(Path(tmp) / args.shape, SHAPES[args.shape])
        roof = Roofline(ModelShape.from_path(folder), accel, "bf16")
        cfg = SHAPES[args.shape]
        if dev.type == "cuda":
            try:
                res["attention"] = rows = attention_kernels(dev, cfg, args.batches,
                                                            args.attention_contexts)
                for r in rows:
                    times = ", ".join(f"{k[:-3]} {v:.1f} us" for k, v in r.items()
                                      if k.endswith(" us"))
                    diffs = ", ".join(f"{k[:-9]} {v:.1e}" for k, v in r.items()
                                      if k.endswith(" max diff"))
                    ratio = r["one program a head us"] / r["split us"]
                    say(f"attention b{r['batch']:<3d} x {r['context']:6d} keys ({r['splits']} "
                        f"splits): {times}; split x{ratio:.2f} one program a head; "
                        f"largest difference from torch: {diffs or 'not run'}")
            except Exception:
                res["errors"].append(f"attention: {traceback.format_exc()}")
                say(traceback.format_exc())
        for mode, over, with_prefill, change in MODES:
            if mode.endswith("eager") and args.skip_eager:
                continue
            if change is not None and dev.type != "cuda":
                continue  # the Triton kernels run on CUDA alone
            try:
                t0 = time.perf_counter()
                llm = LLM(str(folder), **engine_kwargs(args, args.device, **over))
                if change is not None:
                    change(llm)
                say(f"[{mode}] engine ready in {time.perf_counter() - t0:.1f}s "
                    f"(kernels: {llm.engine.gpu_kernels})")
                if with_prefill:
                    res[f"prefill {mode}"] = rows = run_prefill(
                        llm, args.prefill, cfg["vocab_size"], roof, peaks, dev)
                    for r in rows:
                        say(f"[{mode}] prefill {r['tokens']:5d}: {r['ttft_s'] * 1e3:8.2f} ms, "
                            f"MFU {r['mfu_datasheet']:.0%} of {accel.key}'s datasheet "
                            f"({r['mfu_measured']:.0%} of measured{notes.mark('bf16')}), "
                            f"roofline "
                            f"{r['roofline_s'] * 1e3:.2f} ms ({r['bound']})")
                res[f"decode {mode}"] = rows = run_decode(
                    llm, args.batches, args.prompt_len, args.new_tokens, cfg["vocab_size"],
                    roof, peaks)
                for r in rows:
                    say(f"[{mode}] decode b{r['batch']:<3d}: step {r['step_s'] * 1e3:7.2f} ms, "
                        f"{r['tok_s']:8.1f} tok/s, MBU {r['mbu_datasheet']:.0%} of datasheet "
                        f"({r['mbu_read']:.0%} of measured read"
                        f"{notes.mark('mem_bandwidth')}), roofline "
                        f"{r['roofline_s'] * 1e3:.2f} ms ({r['bound']})")
                if mode == "triton+graphs":
                    res["anatomy"] = a = step_anatomy(llm, dev, args.prompt_len,
                                                      cfg["vocab_size"])
                    say(f"[{mode}] b1 step anatomy: step {a['step_ms']:.2f} ms, execute "
                        f"{a['execute_ms']:.2f} ms, graph replay alone "
                        f"{a.get('replay_ms', float('nan')):.2f} ms "
                        f"(bucket {a.get('replay_bucket')})")
                    say(a["profile"])
                    say(a.get("kernels", ""))
                graphs = llm.engine.runner.graphs
                res[f"graphs {mode}"] = (None if graphs is None else
                                         {"captured": sorted(graphs.graphs),
                                          "replays": graphs.replays})
                del llm
            except Exception:
                res["errors"].append(f"{mode}: {traceback.format_exc()}")
                say(traceback.format_exc())
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        best = res.get("decode triton+graphs", [])
        for other in ("torch+graphs", "triton+graphs, unsplit attention", "triton eager"):
            for g, e in zip(best, res.get(f"decode {other}", [])):
                say(f"triton+graphs / {other}, decode b{g['batch']}: "
                    f"x{e['step_s'] / g['step_s']:.2f}")
        for g, e in zip(res.get("prefill triton+graphs", []), res.get("prefill torch+graphs", [])):
            say(f"triton / torch ops, prefill {g['tokens']}: x{e['ttft_s'] / g['ttft_s']:.2f}")
        if not args.skip_hf:
            try:
                hf = res["hf"] = run_hf(cfg, args.prefill, args.batches,
                                        args.prompt_len, args.new_tokens, dev)
                for ours, theirs in zip(res.get("prefill triton+graphs", []), hf["prefill"]):
                    say(f"prefill {ours['tokens']:5d}: HF {theirs['s'] * 1e3:8.2f} ms; "
                        f"phasewise x{theirs['s'] / ours['ttft_s']:.2f}")
                for ours, theirs in zip(res.get("decode triton+graphs", []), hf["decode"]):
                    say(f"decode b{ours['batch']:<3d}: HF {theirs['tok_s']:8.1f} tok/s; "
                        f"phasewise x{ours['tok_s'] / theirs['tok_s']:.2f}")
            except Exception:
                res["errors"].append(f"hf: {traceback.format_exc()}")
                say(traceback.format_exc())
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1, default=str))
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
