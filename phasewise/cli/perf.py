"""``roofline``, ``measure``, ``calibrate``, ``tune``, ``simulate`` and ``plan``: the commands
that predict and measure (``phasewise.perf``, ``phasewise.model.cpu.tune``)."""

from __future__ import annotations

import argparse
import sys

from phasewise.bench.options import positive_float
from phasewise.cli.args import (
    Command,
    add_kernel_plan_arg,
    add_threads_arg,
    engine_defaults,
    model_arg,
    roofline_dtype,
)

# plan --window: seconds of traffic a rate is simulated over (each such rate's requests are
# capped anyway; a longer window only makes a slower plan)
MAX_PLAN_WINDOW = 3600.0


def _plan_window(text: str) -> float:
    v = positive_float(text)
    if v > MAX_PLAN_WINDOW:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_PLAN_WINDOW:g} s, got {text}")
    return v



MAX_PARAMS = 1e15  # roofline --params: far past any model, and within what its sums hold


def add_commands(command: Command) -> None:
    from phasewise.config import DTYPE_CHOICES, KERNEL_CHOICES, LOAD_FORMATS
    from phasewise.perf.roofline import DTYPE_BYTES

    r = command("roofline", "predict which bound each phase hits, for any model x "
                "accelerator x workload (no GPU, no weights, no torch)", cmd_roofline)
    r.add_argument("--model", default=None, help="catalog name or a config.json / folder "
                   "(this or --params is required)")
    r.add_argument("--params", type=positive_float, default=None,
                   help="a generic dense model of this many parameters, e.g. 7e9 (this or "
                   "--model is required)")
    r.add_argument("--gpu", "--accelerator", dest="gpu", default="h100-sxm",
                   help="catalog key (see --list), or cpu-local / gpu-local (phasewise measure)")
    dtypes = ", ".join(DTYPE_BYTES)
    r.add_argument("--dtype", default="bf16", type=roofline_dtype, help=dtypes)
    r.add_argument("--kv-dtype", default=None, type=roofline_dtype,
                   help="KV cache dtype (default: --dtype; bf16 for the weight-only int8/int4)")
    r.add_argument("--compute-dtype", default=None, type=roofline_dtype,
                   help="whose peak the math runs at (default: --dtype; fp32 for bf16 weights "
                        "on CPUs without native bf16)")
    r.add_argument("--prompt-len", type=int, default=512,
                   help="prompt tokens per request")
    r.add_argument("--prefix-len", type=int, default=0, help="cached prefix before the prompt")
    r.add_argument("--output-len", type=int, default=128,
                   help="output tokens per request")
    r.add_argument("--batch", type=int, default=1, help="decode batch")
    r.add_argument("--context", type=int, default=None,
                   help="decode context length (default: prefix + prompt + output/2; 0 = "
                   "weights only)")
    r.add_argument("--mfu", type=float, default=1.0, help="fraction of peak FLOP/s reached")
    r.add_argument("--mbu", type=float, default=1.0, help="fraction of peak bandwidth reached")
    r.add_argument("--link", default=None, help="price a KV transfer over this link")
    r.add_argument("--reserve", type=float, default=0.1,
                   help="fraction of the memory the weights leave that is kept free of K/V, "
                   "for activations and the runtime (the engine's rule on a GPU)")
    r.add_argument("--experts-read", default=None, metavar="T:X[,T:X...]",
                   help="a mixture of experts' routing as measured: X distinct experts a "
                   "layer read in steps of T tokens (StepStats.experts_read, "
                   "phasewise:step_experts_read); the analyser fits the skew to them")
    r.add_argument("--json", action="store_true",
                   help="print the analysis as JSON")
    r.add_argument("--plot", default=None, metavar="FILE.png",
                   help="also draw the roofline chart into this PNG (needs matplotlib)")
    r.add_argument("--list", action="store_true",
                   help="list the catalogs (accelerators, models, links) with each figure's "
                   "source, and exit")

    m = command("measure", "measure this machine's bandwidth and matmul peaks (the "
                "cpu-local / gpu-local accelerators)", cmd_measure)
    m.add_argument("--out", default=None, help="file to write (default: the cache folder)")
    m.add_argument("--quick", action="store_true",
                   help="fewer repetitions; never replaces a full measurement in the file")
    m.add_argument("--replace", action="store_true",
                   help="store every figure of this run, even one measured unstable where "
                   "the file holds a stable one (by default that one is kept)")
    add_threads_arg(m, "CPU threads to measure with (default: torch's, the cores); figures "
                     "for another count than the file's cpu-local are kept as cpu-local@Nt, "
                     "which engines run with --threads N read")

    ca = command("calibrate", "time the real engine over a grid of steps and fit the step "
                 "cost model that simulate and plan use (a profile per model x machine)",
                 cmd_calibrate)
    ca.add_argument("--model", default=None,
                    help="checkpoint folder (default: the bundled stdlib-coder)")
    ca.add_argument("--dtype", default=None, choices=DTYPE_CHOICES,
                    help="as serve will load it (default: serve's, auto)")
    ca.add_argument("--device", default=None,
                    help="as serve will run it (default: serve's, auto)")
    ca.add_argument("--kernels", default=None, choices=KERNEL_CHOICES,
                    help="as serve will run it (default: serve's, auto)")
    ca.add_argument("--block-size", type=int, default=None,
                    help="as serve will run it (default: serve's, 16)")
    ca.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="the largest step the grid holds (default: 544, --quick 160)")
    ca.add_argument("--max-context", type=int, default=4096,
                    help="the longest context the grid reaches (the model's own is the cap)")
    ca.add_argument("--reps", type=int, default=3, help="steps timed per grid point (median)")
    ca.add_argument("--quick", action="store_true", help="a small grid (a smoke test)")
    ca.add_argument("--out", default=None, help="profile file (default: the cache folder's "
                    "profiles/MODEL@MACHINE.json, which simulate and plan read)")
    add_kernel_plan_arg(ca)
    add_threads_arg(ca, "as serve will run it (default: serve's, torch's; a profile is kept "
                     "per thread count)")

    tu = command("tune", "measure the CPU kernel plan for this machine and a model, once, "
                 "and store it for every later start (serve and generate follow it)", cmd_tune)
    tu.add_argument("--model", default=None,
                    help="checkpoint folder (default: the bundled stdlib-coder)")
    tu.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                    help="as the engines will load it (the CPU kernels run bfloat16)")
    tu.add_argument("--quantization", default=None, choices=["int8"],
                    help="as the engines will load it")
    tu.add_argument("--load-format", default="safetensors", choices=LOAD_FORMATS,
                    help="as the engines will load it")
    add_threads_arg(tu, "CPU threads to tune for, 1 to the cores this process may run on "
                     "(default: torch's; the plan is kept per thread count)")
    tu.add_argument("--rounds", type=int, default=3,
                    help="calibrations run; the plan most of them chose is kept (1-20)")
    tu.add_argument("--out", default=None, metavar="FILE",
                    help="plan file (default: the cache folder's kernel-plans/"
                    "MODEL@MACHINE.json, which engines find by themselves)")

    si = command("simulate", "serve a workload in virtual time: the real scheduler, step "
                 "times from the cost model, the bench's summary", cmd_simulate)
    _add_sim_args(si)
    si.add_argument("--mode", default="colocated", choices=["colocated", "pd"],
                    help="colocated: --replicas engines that run both phases; pd: --prefill and "
                         "--decode workers")
    # (None: not given, so that a flag of the other mode is refused rather than ignored)
    si.add_argument("--replicas", type=int, default=None,
                    help="co-located engines behind a router (default 1)")
    si.add_argument("--prefill", type=int, default=None, help="P/D: prefill workers (default 1)")
    si.add_argument("--decode", type=int, default=None, help="P/D: decode workers (default 1)")
    si.add_argument("--disagg-threshold", type=int, default=None,
                    help="P/D: prompts with fewer uncached tokens prefill on the decode worker "
                    "(default 0)")
    si.add_argument("--routing", default="least-load",
                    choices=["least-load", "round-robin", "prefix"],
                    help="how the router picks an engine (prefix weighs cached prompt blocks "
                    "against load: simulated prompts share none, so it picks as least-load)")
    si.add_argument("--fail-at", type=float, default=None, metavar="SECONDS",
                    help="co-located: replica 0 dies at this time; its requests move to the "
                    "others with their outputs so far, as phasewise router's migration does")

    pl = command("plan", "search co-located and P/D deployments for the most goodput per "
                 "accelerator under TTFT and TPOT SLOs; emit Kubernetes manifests", cmd_plan)
    _add_sim_args(pl, results=False)  # its result is the table and the manifests
    next(x for x in pl._actions if "--goodput" in x.option_strings).help = (
        "the SLOs each candidate must meet (required): ttft:MS tpot:MS")
    pl.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024, 2048],
                    help="step budgets to try")
    pl.add_argument("--ratios", nargs="+", default=None,
                    help="P/D prefill:decode ratios to try (default: 1:1 1:2 2:1 1:3 3:1)")
    pl.add_argument("--thresholds", type=int, nargs="+", default=None,
                    help="P/D disaggregation thresholds to try (default: 0 512 1024)")
    pl.add_argument("--no-pd", action="store_true",
                    help="co-located candidates only (the P/D flags are then refused)")
    pl.add_argument("--window", type=_plan_window, default=30.0,
                    help="seconds of traffic simulated per rate (requests = rate x window, "
                    "at least --num-prompts, at most 20000; more than 0, up to "
                    f"{MAX_PLAN_WINDOW:g} s)")
    pl.add_argument("--k8s-out", default=None, metavar="DIR",
                    help="write the winner's Kubernetes manifests here")
    # The manifests' flags default to None so that one given without --k8s-out is refused
    # rather than ignored (perf.commands.check_plan_flags gives them the manifests' defaults).
    pl.add_argument("--name", default=None,
                    help="manifests: prefix of every object (default: phasewise)")
    pl.add_argument("--namespace", default=None,
                    help="the manifests' Kubernetes namespace (default: none, kubectl's current "
                         "one)")
    pl.add_argument("--image", default=None,
                    help="manifests: the container image (phasewise publishes none: build one) "
                    "(default: phasewise:latest)")
    pl.add_argument("--model-pvc", default=None,
                    help="manifests: the PersistentVolumeClaim holding the checkpoints "
                    "(default: phasewise-models)")
    pl.add_argument("--model-path", default=None,
                    help="manifests: the checkpoint folder in the container "
                    "(default: /models/NAME)")
    pl.add_argument("--cpus", type=int, default=None,
                    help="manifests: CPUs per engine pod (default: 2)")
    pl.add_argument("--api-key-secret", default=None, metavar="SECRET",
                    help="manifests: require an API key, from this Secret's api-key (clients "
                    "send it as a bearer token), with the fleet's internal key from its "
                    "internal-key (the manifests' header says how to create it; default: "
                    "no key)")


def cmd_roofline(a: argparse.Namespace) -> int:
    import json

    from phasewise.perf.analysis import analyse, catalog_dict, format_catalog, format_text
    from phasewise.perf.hardware import lookup_accelerator, lookup_link
    from phasewise.perf.models import GenericModel, lookup_model, with_routing

    if a.list:
        if a.json:
            print(json.dumps(catalog_dict(), indent=2))
        else:
            print(format_catalog())
        return 0
    if (a.model is None) == (a.params is None):
        raise ValueError("give exactly one of --model NAME|PATH or --params N (e.g. 7e9)")
    if a.params is not None and a.params > MAX_PARAMS:
        raise ValueError(f"--params must be at most {MAX_PARAMS:.0e} (the largest models have "
                         f"a few 1e12), got {a.params:g}")
    for flag, value, least in (("--prompt-len", a.prompt_len, 1), ("--prefix-len", a.prefix_len, 0),
                               ("--output-len", a.output_len, 1), ("--batch", a.batch, 1),
                               ("--context", a.context, 0)):
        if value is not None and value < least:
            raise ValueError(f"{flag} must be an integer >= {least}, got {value}")
    for flag, value in (("--mfu", a.mfu), ("--mbu", a.mbu)):
        if not 0 < value <= 1:
            raise ValueError(f"{flag} is a fraction of the peak: in (0, 1], got {value}")
    if not 0 <= a.reserve < 1:
        raise ValueError(f"--reserve is a fraction of the memory the weights leave: in [0, 1), "
                         f"got {a.reserve}")
    if a.plot:
        from phasewise.files import check_output

        check_output(a.plot, "--plot")
    model = GenericModel(a.params) if a.params is not None else lookup_model(a.model)
    if a.experts_read is not None:
        model = with_routing(model, a.experts_read)
    result = analyse(model, lookup_accelerator(a.gpu), a.dtype, prompt_len=a.prompt_len,
                     prefix_len=a.prefix_len, output_len=a.output_len, batch=a.batch,
                     context=a.context, kv_dtype=a.kv_dtype, mfu=a.mfu, mbu=a.mbu,
                     link=lookup_link(a.link) if a.link is not None else None,
                     reserve_frac=a.reserve,
                     compute_dtype=a.compute_dtype)
    if a.plot:
        from phasewise.perf.plot import plot_roofline

        print(f"plot written to {plot_roofline(result, a.plot)}", file=sys.stderr)
    print(json.dumps(result, indent=1) if a.json else format_text(result))
    return 0


def cmd_measure(a: argparse.Namespace) -> int:
    from pathlib import Path

    from phasewise.files import check_output
    from phasewise.perf.measure import format_entry, measure

    if a.out is not None:
        check_output(a.out, "--out")
    if a.threads is not None:
        import torch

        torch.set_num_threads(a.threads)
    for key, entry in measure(Path(a.out) if a.out else None, quick=a.quick,
                              replace=a.replace).items():
        print(format_entry(key, entry))
    return 0


def cmd_calibrate(a: argparse.Namespace) -> int:
    from pathlib import Path

    from phasewise.files import check_output
    from phasewise.perf.calibrate import calibrate

    if a.out is not None:
        check_output(a.out, "--out")
    if a.block_size is not None and a.block_size < 1:
        raise ValueError(f"--block-size must be >= 1, got {a.block_size}")
    # (calibrate reads 0 as its default: a size that means nothing is refused, not that)
    if not 16 <= a.max_context <= 1 << 20:
        raise ValueError(f"--max-context must be in 16..1048576 tokens, got {a.max_context}")
    if a.max_num_batched_tokens is not None and not 16 <= a.max_num_batched_tokens <= 65536:
        raise ValueError(f"--max-num-batched-tokens must be in 16..65536, got "
                         f"{a.max_num_batched_tokens}")
    kw = {k: v for k, v in (("dtype", a.dtype), ("device", a.device),
                            ("kernels", a.kernels), ("block_size", a.block_size),
                            ("max_num_batched_tokens", a.max_num_batched_tokens),
                            ("kernel_plan", a.kernel_plan), ("num_threads", a.threads))
          if v is not None}
    cm, path = calibrate(model_arg(a), engine_kwargs=kw, quick=a.quick, reps=a.reps,
                         out=Path(a.out) if a.out else None, max_context=a.max_context)
    print("\n".join(cm.describe()))
    print(f"profile written to {path}")
    return 0


def cmd_tune(a: argparse.Namespace) -> int:
    from pathlib import Path

    from phasewise.files import check_output

    if a.out is not None:
        check_output(a.out, "--out")
    if a.threads is not None:  # (a plan is kept per machine and thread count)
        import torch

        torch.set_num_threads(a.threads)
    from phasewise.model.cpu.plan import KernelPlan, Runtime
    from phasewise.model.cpu.tune import tune

    stored, path = tune(model_arg(a), dtype=a.dtype, quantization=a.quantization,
                        load_format=a.load_format, rounds=a.rounds,
                        out=Path(a.out) if a.out else None)
    plan = KernelPlan(stored.key, stored.panels, stored.linear, stored.stream_prefetch,
                      "stored", str(path), path)
    print(plan.table(Runtime.here()))
    m = stored.measured
    if m.get("rounds"):
        print(f"chosen by {m['agreement']} rounds: {m['chosen']} (the rule: {m['rule']})")
    from phasewise.model.cpu.plan import plans_dir

    if Path(path).resolve().parent == plans_dir().resolve():
        print(f"plan written to {path}; engines with this machine, model, dtype, quantization "
              f"and {stored.key.threads} threads follow it (--kernel-plan {path} pins it "
              "elsewhere)")
    else:  # engines look for stored plans in the cache folder only
        print(f"plan written to {path}; engines follow it when given --kernel-plan {path} "
              f"(without --out it is stored where they find it by themselves)")
    return 0


def cmd_simulate(a: argparse.Namespace) -> int:
    from phasewise.perf.commands import run_simulate
    from phasewise.perf.summary import check_result_flags

    check_result_flags(a)
    return run_simulate(a, _sim_model(a), _served(a))


def cmd_plan(a: argparse.Namespace) -> int:
    from phasewise.files import check_output
    from phasewise.perf.commands import run_plan

    if a.k8s_out is not None:
        check_output(a.k8s_out, "--k8s-out", folder=True)
    return run_plan(a, _sim_model(a), _served(a))


def _served(a: argparse.Namespace):
    """``--served URL``: the cost model as that live, idle server runs it (a probe through
    it: ``phasewise.bench.probe``), or None."""
    if not a.served:
        return None

    def wrap(cm):
        from phasewise.bench.probe import probe
        from phasewise.perf.served import ServedCostModel

        headers = {"Authorization": f"Bearer {a.served_api_key}"} if a.served_api_key else {}
        print(f"probing {a.served} ({a.served_rounds} round(s) of six short phases) ...",
              file=sys.stderr)
        served, _ = probe(a.served, cm, cm.shape.vocab_size, headers=headers,
                          metrics_urls=a.served_metrics or (), repeats=a.served_rounds,
                          idle_s=tuple(a.served_idle))
        return ServedCostModel(cm, served)
    return wrap


def _sim_model(a: argparse.Namespace) -> str:
    """A catalog name as given; else a checkpoint folder (default: the bundled model)."""
    from phasewise.perf.models import CATALOG

    if a.model is not None and a.model.lower() in CATALOG:
        return a.model.lower()
    return model_arg(a)


def _add_sim_args(p: argparse.ArgumentParser, results: bool = True) -> None:
    """What ``simulate`` and ``plan`` model: the model, the machine, one engine's limits."""
    from phasewise.bench.options import add_workload_args
    from phasewise.config import POLICIES

    d = engine_defaults()
    p.add_argument("--model", default=None, help="catalog name (phasewise roofline --list) or "
                   "a checkpoint folder (default: the bundled stdlib-coder)")
    p.add_argument("--gpu", "--accelerator", dest="gpu", default="cpu-local",
                   help="catalog key (phasewise roofline --list), or cpu-local / gpu-local: "
                   "this machine as phasewise measure measured it (default: cpu-local)")
    p.add_argument("--profile", default=None, help="a phasewise calibrate profile (default: "
                   "the stored one for this model on this machine, with --gpu cpu-local)")
    p.add_argument("--dtype", default="bf16", type=roofline_dtype,
                   help="how the weights and K/V are stored")
    p.add_argument("--served", default=None, metavar="URL",
                   help="price steps as this live, idle phasewise server runs them: a short "
                   "probe through it measures its steps' drift from the profile and what "
                   "serving costs beyond the engine's steps (docs/predicting.md)")
    p.add_argument("--served-metrics", nargs="+", default=None, metavar="URL",
                   help="--served under P/D: every worker's URL, whose /metrics hold the "
                   "probe's steps (default: the --served URL)")
    p.add_argument("--served-api-key", default=None, help="--served: the server's API key")
    p.add_argument("--served-rounds", type=int, default=2,
                   help="--served: rounds of the probe; each figure is their median (1-10)")
    p.add_argument("--served-idle", type=float, nargs=2, default=[1.0, 12.0],
                   metavar=("SHORT", "LONG"), help="--served: the idle waits (s) after which "
                   "the probe measures what a request to an idle engine pays (default 1 12)")
    p.add_argument("--link", default=None, help="P/D: the K/V link, 'instant' (K/V arrives "
                   "at once; the default) or a catalog link (roofline --list shows them)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="the simulated engines' context (default: the model's)")
    p.add_argument("--block-size", type=int, default=d["block_size"],
                   help="tokens per KV block, 1..1024 and at most the context (default 16)")
    p.add_argument("--kv-cache-memory", default=None,
                   help="K/V pool per engine (default: 1GiB on a CPU; on an accelerator 90%% "
                   "of its memory less the weights)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="step budget (default: 256 on a CPU, 2048 on an accelerator)")
    p.add_argument("--max-num-seqs", type=int, default=d["max_num_seqs"],
                   help="most sequences one simulated step holds")
    p.add_argument("--policy", default=d["policy"], choices=POLICIES,
                   help="the simulated engines' scheduling, as serve's --policy")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="simulate engines that reuse no cached prompt blocks")
    p.add_argument("--prefill-queue-limit", type=int, default=None,
                   help="P/D: prefill on the decode worker while every prefill queue is this "
                   "long (default 8)")
    p.add_argument("--slo-admission", action="store_true",
                   help="every request carries the --goodput TTFT and TPOT targets and an "
                   "engine refuses one it predicts would miss them, as serve --slo-ttft-ms "
                   "--slo-tpot-ms does (plan: compare the winner with and without it)")
    add_workload_args(p, simulated=True, results=results)

