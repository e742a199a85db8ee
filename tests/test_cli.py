"""The command line: parsing only (choices from the definitions they configure, no torch),
each command's own usage on a bad flag, user errors against internal ones, serve's flags
reaching the server, and what --model says when it is not a checkpoint folder."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from phasewise import cli
from phasewise.cli import build_parser, main
from phasewise.cli.args import engine_kwargs


def _sub(name: str):
    return build_parser()._subparsers._group_actions[0].choices[name]


def _choices(parser, flag: str):
    return next(a for a in parser._actions if flag in a.option_strings).choices


def test_building_the_parser_imports_no_torch_and_no_http_stack():
    code = ("import sys; from phasewise.cli import build_parser, build_report_parser; "
            "build_parser(); build_report_parser(); "
            "heavy = {'torch', 'httpx', 'fastapi', 'uvicorn', 'numpy'} & set(sys.modules); "
            "assert not heavy, heavy")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_choices_and_defaults_come_from_the_definitions():
    from phasewise.config import DTYPE_CHOICES, KERNEL_CHOICES, LOG_LEVELS, EngineConfig
    from phasewise.engine.scheduler import POLICIES
    from phasewise.model.config import SUPPORTED_ARCHITECTURES
    from phasewise.model.loader import DTYPE_CHOICES as LOADER_DTYPES

    assert DTYPE_CHOICES == LOADER_DTYPES  # the torch-free copy the parser offers
    for name in ("generate", "serve"):
        p = _sub(name)
        assert tuple(_choices(p, "--dtype")) == DTYPE_CHOICES
        assert tuple(_choices(p, "--policy")) == POLICIES
        assert tuple(_choices(p, "--kernels")) == KERNEL_CHOICES
        d = p.parse_args(["x"] if name == "generate" else [])
        cfg = EngineConfig(model="m")
        assert (d.block_size, d.max_num_seqs, d.seed, d.policy, d.dtype) == \
            (cfg.block_size, cfg.max_num_seqs, cfg.seed, cfg.policy, cfg.dtype)
    assert tuple(_choices(_sub("serve"), "--log-level")) == LOG_LEVELS
    assert list(_choices(_sub("make-tiny"), "--arch")) == list(SUPPORTED_ARCHITECTURES)


@pytest.mark.parametrize("argv,usage", [
    (["serve", "--bogus"], "usage: phasewise serve"),
    (["generate", "hello", "--bogus", "1"], "usage: phasewise generate"),
    (["roofline", "--params", "7e9", "--nope"], "usage: phasewise roofline"),
    (["bench", "report", "a.json", "--bogus"], "usage: phasewise bench report"),
])
def test_a_bad_flag_shows_that_commands_usage(argv, usage, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage), err
    assert "unrecognized arguments: --bogus" in err or "--nope" in err


def test_user_errors_exit_2_and_internal_errors_exit_1(monkeypatch, capsys):
    from phasewise.perf import analysis

    assert main(["roofline", "--params", "7e9", "--gpu", "h900"]) == 2
    assert capsys.readouterr().err.startswith("phasewise: error: unknown accelerator 'h900'")

    def broken(*args, **kwargs):
        raise RuntimeError("the cost model\nbroke")

    monkeypatch.setattr(analysis, "analyse", broken)
    assert main(["roofline", "--params", "7e9"]) == 1
    err = capsys.readouterr().err
    assert err == ("phasewise: internal error: RuntimeError: the cost model broke "
                   "(--debug shows the traceback)\n")
    for argv in (["roofline", "--params", "7e9", "--debug"],
                 ["--debug", "roofline", "--params", "7e9"]):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert "Traceback (most recent call last)" in err and "in broken" in err
        assert err.rstrip().endswith("phasewise: internal error: RuntimeError: the cost "
                                     "model broke")


def test_bench_against_nothing_says_it_cannot_reach_the_server(capsys):
    assert main(["bench", "--base-url", "http://127.0.0.1:1", "--num-prompts", "1",
                 "--disable-tqdm"]) == 2
    err = capsys.readouterr().err
    assert "phasewise: error: cannot reach http://127.0.0.1:1" in err
    assert "Traceback" not in err


class _FakeServing:
    def __init__(self) -> None:
        self.calls: list = []

    def check_port(self, host, port):
        self.calls.append(("check_port", host, port))

    def build_server(self, config, **kw):
        self.calls.append(("build_server", config.model, kw))
        return "server"

    def run(self, server, **kw):
        self.calls.append(("run", server, kw))


@pytest.fixture
def serving(monkeypatch):
    from phasewise.launch import serve as launch
    from phasewise.server import serve

    fake = _FakeServing()
    for module, name in ((serve, "check_port"), (launch, "build_server"), (serve, "run")):
        monkeypatch.setattr(module, name, getattr(fake, name))
    return fake


def test_a_flag_the_role_does_not_read_is_warned_of(serving, tmp_path, caplog):
    """--kv-bind without --role decode served co-located without a word: the flag is named
    as ignored (a warning, since manifests give every engine role one set of flags)."""
    import logging

    with caplog.at_level(logging.WARNING, logger="phasewise.cli"):
        assert main(["serve", "--model", str(tmp_path), "--kv-bind", "tcp://127.0.0.1:9100",
                     "--disagg-threshold", "64"]) == 0
    said = [r.getMessage() for r in caplog.records if r.name == "phasewise.cli"]
    assert said == ["--kv-bind applies to --role decode only; --role both ignores it",
                    "--disagg-threshold applies to --role decode only; --role both ignores it"]
    caplog.clear()
    (tmp_path / "s").write_text("k" * 32)
    with caplog.at_level(logging.WARNING, logger="phasewise.cli"):
        assert main(["serve", "--model", str(tmp_path), "--role", "decode",
                     "--kv-secret-file", str(tmp_path / "s"), "--kv-bind",
                     "tcp://127.0.0.1:9100"]) == 0
    assert not [r for r in caplog.records if r.name == "phasewise.cli"]


def test_serve_passes_its_flags_and_checks_the_port_first(serving, tmp_path):
    assert main(["serve", "--model", str(tmp_path), "--port", "8123", "--no-access-log",
                 "--log-level", "warning"]) == 0
    (kind0, host, port), (kind1, model, kw), (kind2, server, run_kw) = serving.calls
    assert (kind0, host, port) == ("check_port", "127.0.0.1", 8123)
    assert kind1 == "build_server" and model == str(tmp_path)
    assert kw["max_request_bytes"] == 8 * 2**20 and kw["max_waiting_requests"] == 256
    assert run_kw["access_log"] is False and run_kw["log_level"] == "warning"
    assert run_kw["port"] == 8123
    serving.calls.clear()
    assert main(["serve", "--model", str(tmp_path)]) == 0
    assert serving.calls[-1][2]["access_log"] is True


def test_model_flag_says_what_it_found_and_what_it_takes(serving, tmp_path, capsys):
    cfg = tmp_path / "ckpt" / "config.json"
    cfg.parent.mkdir()
    cfg.write_text("{}")
    assert main(["generate", "--model", str(cfg), "x"]) == 2
    err = capsys.readouterr().err
    assert f"{cfg} is a file; --model takes the checkpoint folder that holds config.json: " \
           f"{cfg.parent}/" in err
    weights = cfg.parent / "model.safetensors"
    weights.write_text("")
    assert main(["generate", "--model", str(weights), "x"]) == 2
    assert f"such as the one it is in: {cfg.parent}/" in capsys.readouterr().err
    stray = tmp_path / "notes.txt"
    stray.write_text("")
    assert main(["generate", "--model", str(stray), "x"]) == 2
    err = capsys.readouterr().err  # its folder is no checkpoint: not offered as one
    assert "is a file; --model takes a checkpoint folder" in err and "such as" not in err
    for name in ("Llama-3.1-8B", "qwen3-8b", "meta-llama/Llama-3.1-8B"):
        assert main(["serve", "--model", name]) == 2
        err = capsys.readouterr().err
        assert "is not a folder here but a roofline catalog name" in err, err
        assert "phasewise roofline --model" in err and "local checkpoint folder" in err
    assert serving.calls == []  # refused before the port check and any loading
    assert main(["generate", "--model", str(tmp_path / "none"), "x"]) == 2
    assert "does not exist" in capsys.readouterr().err  # a missing folder: as before


def test_roofline_list_prints_each_figure_with_its_source(tmp_path, monkeypatch, capsys):
    import json

    from phasewise.perf.hardware import ACCELERATORS, LINKS
    from phasewise.perf.models import CATALOG

    monkeypatch.setenv("PHASEWISE_CACHE_DIR", str(tmp_path))
    (tmp_path / "machine.json").write_text(json.dumps({"cpu-local": {
        "name": "test CPU (measured)", "peak_flops": {"fp32": 105.2e9}, "mem_bytes": 8e9,
        "mem_bandwidth": 16.1e9, "source": "measured by phasewise measure on 2099-01-01"}}))
    assert main(["roofline", "--list"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()

    def block(first: str) -> str:  # an entry's line and the indented lines under it
        i = next(k for k, ln in enumerate(lines) if ln.startswith(first))
        j = i + 1
        while j < len(lines) and lines[j].startswith(" " * 18):
            j += 1
        return "\n".join(lines[i:j])

    h100 = block("  h100-sxm ")
    assert "bf16 989.4 TFLOP/s" in h100 and "fp32 67 TFLOP/s" in h100
    assert "80 GB at 3.35 TB/s" in h100 and ACCELERATORS["h100-sxm"].source in h100
    for acc in ACCELERATORS.values():
        assert acc.source in block(f"  {acc.key} ")
    cpu = block("  cpu-local ")
    assert "fp32 105.2 GFLOP/s" in cpu and "16.1 GB/s" in cpu and "2099-01-01" in cpu
    assert "phasewise measure" in block("  gpu-local ")  # not measured: says how
    for m in CATALOG.values():
        line = block(f"  {m.name} ")
        assert f"{m.total_params / 1e9:.3g}B parameters" in line and m.source in line
    assert "(12.9B active)" in block("  Mixtral-8x7B-v0.1 ")
    for link in LINKS.values():
        assert link.source in block(f"  {link.key} ")
    assert "450 GB/s" in block("  nvlink4 ") and "12.5 GB/s" in block("  100gbe ")


def test_cli_module_holds_no_command_logic():
    """generate's work lives in phasewise.generate (phasewise.cli only parses and calls)."""
    assert not hasattr(cli, "_roofline_lines") and not hasattr(cli, "_compute_dtype")
    from phasewise import generate

    assert callable(generate.run) and callable(generate.roofline_lines)


def test_a_bad_or_busy_kv_address_is_refused_before_loading(tmp_path, capsys):
    import socket

    secret = tmp_path / "kv.secret"
    secret.write_text("0123456789abcdef0123")
    with socket.socket() as s:  # a free port for the HTTP side
        s.bind(("127.0.0.1", 0))
        http_port = str(s.getsockname()[1])
    base = ["serve", "--role", "decode", "--port", http_port, "--kv-secret-file", str(secret)]
    assert main([*base, "--kv-bind", "127.0.0.1:8100"]) == 2
    assert "must be tcp://HOST:PORT" in capsys.readouterr().err
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main([*base, "--kv-bind", f"tcp://127.0.0.1:{port}"]) == 2
        err = capsys.readouterr().err
        assert "--kv-bind" in err and "already in use" in err and "loading" not in err


@pytest.mark.parametrize("flag", ["--port", "--decode-port", "--prefill-port", "--kv-port"])
def test_pd_names_the_flag_of_the_port_that_is_in_use(flag, capsys, tmp_path):
    free = []
    for _ in range(4):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            free.append(s.getsockname()[1])
    ports = dict(zip(["--port", "--decode-port", "--prefill-port", "--kv-port"], free))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", ports[flag]))
        busy.listen()
        args = [a for f, p in ports.items() for a in (f, str(p))]
        assert main(["pd", "--model", str(tmp_path / "none"), *args]) == 2
    err = capsys.readouterr().err
    assert "already in use" in err and f"with {flag} " in err, err


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_every_engine_option_is_a_flag_and_reaches_the_config(command):
    """docs/python-api.md: generate and serve take EngineConfig's fields as flags (the
    prefix cache's as --no-prefix-caching, num_threads as --threads); each one's value
    arrives in the config."""
    import dataclasses

    from phasewise.config import EngineConfig

    parser = build_parser()
    flags = {o for a in parser._subparsers._group_actions[0].choices[command]._actions
             for o in a.option_strings}
    for f in dataclasses.fields(EngineConfig):
        if f.name != "model":
            flag = {"enable_prefix_caching": "--no-prefix-caching",
                    "num_threads": "--threads"}.get(f.name, "--" + f.name.replace("_", "-"))
            assert flag in flags, f.name
    a = parser.parse_args([command, "--num-kv-blocks", "7", "--block-size", "8",
                           "--no-prefix-caching"] + (["x"] if command == "generate" else []))
    config = EngineConfig(model="m", **engine_kwargs(a))
    assert (config.num_kv_blocks, config.block_size, config.enable_prefix_caching) == (
        7, 8, False)


def test_generate_with_no_output_token_reports_the_prefill_alone(llama_dir, capsys):
    """--max-tokens 0 (allowed: a prompt's K/V alone) has no first token: generate says so
    instead of failing on the missing TTFT."""
    rc = main(["generate", "--model", str(llama_dir), "--max-tokens", "0", "--no-roofline",
               "def f"])
    err = capsys.readouterr().err
    assert rc == 0
    assert "[prefill]" in err and "TTFT" not in err
    assert "[decode]   none: no output token was asked for" in err


@pytest.mark.parametrize("flag, value", [("--max-tokens", "-3"), ("--temperature", "-1"),
                                         ("--temperature", "nan")])
def test_generate_refuses_a_sampling_value_by_its_flag_before_loading(flag, value, llama_dir,
                                                                    capsys):
    assert main(["generate", "--model", str(llama_dir), flag, value, "def f"]) == 2
    err = capsys.readouterr().err
    assert f"error: {flag} must be" in err and "loaded" not in err and "None" not in err


def test_generate_says_when_the_context_ended_the_output_first(llama_dir, capsys):
    rc = main(["generate", "--model", str(llama_dir), "--max-model-len", "24",
               "--max-tokens", "100", "--no-roofline", "def f"])
    err = capsys.readouterr().err
    assert rc == 0
    assert ("finish: length (the model's context of 24 tokens, prompt included, ended it "
            "before --max-tokens 100)") in err


@pytest.mark.parametrize("argv", [
    ["simulate", "--burstiness", "nan"],  # a gamma gap of nan: the simulation never ended
    ["simulate", "--trace-time-scale", "-1"],
    ["plan", "--window", "0"],  # every rate got the minimum of requests: goodput unbounded
    ["plan", "--window", "inf"],
    ["roofline", "--params", "inf"],
])
def test_numbers_that_mean_nothing_are_refused_by_their_flag(argv, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2
    assert f"argument {argv[1]}: must be a finite number > 0" in capsys.readouterr().err


@pytest.mark.parametrize("flags,match", [
    (["--prompt-len", "0"], "--prompt-len must be an integer >= 1, got 0"),
    (["--prefix-len", "-1"], "--prefix-len must be an integer >= 0"),
    (["--batch", "0"], "--batch must be an integer >= 1"),
    (["--context", "-1"], "--context must be an integer >= 0"),
    (["--mbu", "nan"], "--mbu is a fraction of the peak"),
    (["--reserve", "1"], "--reserve is a fraction of the memory"),
])
def test_roofline_names_the_flag_whose_number_means_nothing(flags, match, capsys):
    assert main(["roofline", "--model", "llama-3.1-8b", *flags]) != 0
    assert match in capsys.readouterr().err


@pytest.mark.parametrize("flags,match", [
    (["--input-len", "0"], "--input-len: lengths must be >= 1"),
    (["--intruder-len", "uniform:5-2"], "--intruder-len: uniform range"),
    (["--intruder-fraction", "nan"], "--intruder-fraction is a share of the requests"),
    (["--num-prompts", "100000000"], "--num-prompts must be in 1..1000000"),
])
def test_simulate_and_bench_name_the_workload_flag_they_refuse(flags, match, capsys):
    assert main(["simulate", "--model", "llama-3.1-8b", "--num-prompts", "4", *flags]) != 0
    assert match in capsys.readouterr().err
    assert main(["bench", "--base-url", "http://127.0.0.1:9", "--num-prompts", "4",
                 *flags]) == 2  # refused before any connection is tried
    assert match in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--dtype", "--kv-dtype", "--compute-dtype"])
def test_a_dtype_the_roofline_does_not_know_is_refused_by_its_flag(flag, capsys):
    """Three dtype flags once gave one message ("dtype must be ..."): which was wrong?"""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["roofline", "--model", "llama-3.1-8b", flag, "fp7"])
    err = capsys.readouterr().err
    assert f"argument {flag}: dtype must be one of fp32, bf16" in err and "'fp7'" in err
    a = build_parser().parse_args(["roofline", "--model", "x", flag, "BFloat16"])
    assert getattr(a, flag[2:].replace("-", "_")) == "bf16"  # aliases kept


def test_a_decode_batch_of_one_length_is_priced_without_a_row_per_sequence():
    """batch x one context is arithmetic, not a list of batch contexts (a batch of 1e12 took
    the memory of a list that long); it prices as the list would."""
    from phasewise.perf.hardware import lookup_accelerator
    from phasewise.perf.models import lookup_model
    from phasewise.perf.roofline import Roofline

    r = Roofline(lookup_model("llama-3.1-8b"), lookup_accelerator("h100-sxm"), "bf16")
    one, listed = r.decode(5, 700), r.decode(5, [700] * 5)
    assert (one.flops, one.bytes, one.kv_read_bytes) == (
        listed.flops, listed.bytes, listed.kv_read_bytes)
    huge = r.decode(10**12, 700)
    assert huge.kv_read_bytes == pytest.approx(one.kv_read_bytes * 2 * 10**11)


def test_an_slo_must_be_a_finite_number_given_once():
    from phasewise.perf.summary import parse_slo

    for bad, match in ((["ttft:nan"], "finite"), (["ttft:inf"], "finite"),
                       (["ttft:50", "ttft:10"], "given twice")):
        with pytest.raises(ValueError, match=match):
            parse_slo(bad)
    assert parse_slo(["ttft:50", "tpot:5"]) == {"ttft": 50.0, "tpot": 5.0}


@pytest.mark.parametrize("flags,match", [
    (["--hidden-size", "7"], "--hidden-size must be in 8..4096, a multiple of 8"),
    (["--layers", "0"], "--layers must be in 1..64"),
    (["--vocab-size", "0"], "--vocab-size must be in 300..65536"),
])
def test_make_tiny_refuses_a_checkpoint_it_would_write_broken(tmp_path, capsys, flags, match):
    assert main(["make-tiny", str(tmp_path / "m"), *flags]) == 2
    assert match in capsys.readouterr().err
    assert not (tmp_path / "m").exists()  # nothing half-written


def test_roofline_list_as_json_holds_the_catalog(capsys):
    import json

    from phasewise.perf.models import CATALOG

    assert main(["roofline", "--list", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    names = {m["name"] for m in got["models"]}
    assert names == {m.name for m in CATALOG.values()}
    mixtral = next(m for m in got["models"] if m["name"] == "Mixtral-8x7B-v0.1")
    assert mixtral["active_params"] < mixtral["total_params"] and mixtral["source"]
    assert {"h100-sxm", "h200"} <= {a["key"] for a in got["accelerators"]}
    assert got["links"] and all(link["bandwidth_Bps"] > 0 for link in got["links"])


def test_output_into_a_pipe_that_closes_ends_quietly():
    """``phasewise roofline --list | head``: the reader leaving is not an error to print."""
    p = subprocess.Popen([sys.executable, "-m", "phasewise", "roofline", "--list"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # the reader is gone before the first line
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 141, err
    assert "error" not in err.lower(), err


def test_every_flag_says_what_it_does_and_its_default():
    """--help is a newcomer's first reference: each flag and argument of each command has
    help text, and a flag with a default shows it."""
    import argparse

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    silent = [f"{name} {a.option_strings or a.dest}" for name, p in sub.choices.items()
              for a in p._actions if not a.help]
    assert not silent, silent
    text = sub.choices["serve"].format_help()
    assert "(default: 8000)" in " ".join(text.split())  # --port: no default in its help
    text = " ".join(sub.choices["make-tiny"].format_help().split())
    assert "seed of the random weights (default: 0)" in text  # a zero is a default too


def test_a_broken_pipe_that_is_not_stdout_is_an_error(monkeypatch, capsys):
    """Only stdout's reader leaving ends quietly; another pipe breaking (a child process, a
    socket) is reported."""
    def broken(_a):
        raise BrokenPipeError(32, "Broken pipe")

    args = build_parser().parse_args(["roofline", "--list"])
    args.func = broken
    monkeypatch.setattr(cli, "parse_args", lambda argv: args)
    assert main(["roofline", "--list"]) == 1
    assert "internal error: BrokenPipeError" in capsys.readouterr().err


@pytest.mark.parametrize("argv,match", [
    (["simulate", "--model", "llama-3.1-8b", "--result-file", "{dir}"],
     "--result-file {dir}: is a folder"),
    (["simulate", "--model", "llama-3.1-8b", "--result-dir", "{file}", "--save-result"],
     "--result-dir {file}: is a file"),
    (["measure", "--quick", "--out", "{dir}"], "--out {dir}: is a folder"),
    (["calibrate", "--quick", "--out", "{file}/x.json"], "{file} is a file, not a folder"),
    (["calibrate", "--quick", "--block-size", "0"], "--block-size must be >= 1"),
    (["tune", "--out", "{dir}"], "--out {dir}: is a folder"),
    (["roofline", "--model", "llama-3.1-8b", "--plot", "{dir}"], "--plot {dir}: is a folder"),
    (["plan", "--model", "llama-3.1-8b", "--goodput", "ttft:1", "tpot:1", "--k8s-out",
      "{file}"], "--k8s-out {file}: is a file"),
    (["bench", "report", "x.json", "-o", "{dir}"], "-o/--output {dir}: is a folder"),
    (["bench", "--base-url", "http://127.0.0.1:9", "--result-file", "{dir}"],
     "--result-file {dir}: is a folder"),
    (["bench", "--base-url", "http://127.0.0.1:9", "--temperature", "nan"],
     "--temperature must be a number in [0, 100], got nan"),
    (["bench", "--base-url", "http://127.0.0.1:9", "--max-concurrency", "-1"],
     "--max-concurrency must be >= 1"),
    (["bench", "--base-url", "http://127.0.0.1:9", "--header", "a b=c"],
     "not a valid HTTP header"),
    (["pd", "--pin", "--threads", "2"], "--pin runs each worker on a core of its own"),
    (["bench", "report", "x.json", "--stall-factor", "nan"],
     "--stall-factor must be a finite number > 1, got nan"),
    # found by a hostile pass: each was taken (or failed as an internal error)
    (["measure", "--quick", "--out", "/proc/phasewise-x.json"], "cannot write in /proc"),
    (["bench", "report", "x.json", "-o", os.devnull], "not a regular file"),
    (["make-tiny", "{file}/x"], "{file} is a file, not a folder"),
    (["make-tiny", "{dir}/m", "--seed", "1" + "0" * 20], "--seed must be an integer in [0"),
    (["roofline", "--params", "1e308"], "--params must be at most 1e+15"),
    (["serve", "--shutdown-grace", "nan"], "--shutdown-grace must be a number of seconds in"),
    (["serve", "--shutdown-grace", "-1"], "--shutdown-grace must be a number of seconds in"),
    (["serve", "--log-interval", "-5"], "--log-interval must be a number of seconds in "
     "[0.1, 86400] (0: off), got -5.0"),
    (["router", "--decode", "http://127.0.0.1:9", "--wait", "nan"],
     "--wait must be a number of seconds in [1, 86400], got nan"),
    (["generate", "x", "--seed", "1" + "0" * 29], "--seed must be an integer in"),
    (["generate", "x", "--max-model-len", "1"], "--max-model-len must be at least 2"),
    (["calibrate", "--max-context", "0"], "--max-context must be"),
    (["calibrate", "--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be"),
    # pd: before any worker starts (they had printed their command lines, then failed)
    (["pd", "--kv-secret-file", "{dir}/missing"], "--kv-secret-file {dir}/missing: No such"),
    (["pd", "--disagg-threshold", "-1"], "--disagg-threshold must be >= 0, got -1"),
    (["router", "--decode", "http://127.0.0.1:9", "--routing", "least-load",
      "--prefix-weight", "5"], "--prefix-weight weigh --routing prefix's score; with "
     "--routing least-load they would be ignored"),
])
def test_an_output_or_value_that_cannot_work_is_refused_before_the_work(tmp_path, argv, match,
                                                                       capsys):
    """Each in well under a second: the check comes before any measurement, model, search
    or connection (a folder given for a file once failed after minutes, as an internal
    error)."""
    (tmp_path / "f").write_text("")
    fill = {"dir": str(tmp_path), "file": str(tmp_path / "f")}
    assert main([a.format(**fill) for a in argv]) == 2
    assert match.format(**fill) in capsys.readouterr().err


@pytest.mark.parametrize("argv,given", [
    (["tune", "--threads", "100000"], "100000"), (["generate", "x", "--threads", "0"], "0"),
    (["serve", "--threads", "1.5"], "'1.5'"), (["measure", "--threads", "100000"], "100000"),
    (["calibrate", "--threads", "-1"], "-1"), (["pd", "--threads", "x"], "'x'"),
])
def test_a_thread_count_is_checked_against_the_cores(argv, given, capsys):
    from phasewise.config import usable_cores

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert (f"--threads must be an integer from 1 to {usable_cores()} (the cores this process "
            f"may run on), got {given}") in capsys.readouterr().err


def test_plan_offers_no_result_file_it_would_not_write(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--result-file", "x.json"])
    assert "unrecognized arguments: --result-file" in capsys.readouterr().err


def test_a_result_with_no_finite_figure_is_strict_json(tmp_path, capsys):
    """A run where no request gave a figure (every one failed): its means are null, not
    NaN, which strict JSON readers refuse."""
    import argparse
    import json

    from phasewise.perf.summary import save_result

    out = tmp_path / "r.json"
    a = argparse.Namespace(result_file=str(out), result_dir=None, save_result=False)
    save_result(a, {"mean_ttft_ms": float("nan"), "p99": [1.0, float("inf")], "n": 3}, "x",
                1.0, False)

    def no_constants(name):
        raise ValueError(f"{name} in the result")

    data = json.loads(out.read_text(), parse_constant=no_constants)
    assert data == {"mean_ttft_ms": None, "p99": [1.0, None], "n": 3}


def test_simulate_refuses_requests_its_engine_would_refuse_as_bench_does(capsys):
    """A prompt and its output past the context: the server answers 400, so neither bench
    nor simulate runs them (simulate cut such outputs short and counted them served)."""
    assert main(["simulate", "--model", "llama-3.1-8b", "--num-prompts", "3",
                 "--max-model-len", "128", "--input-len", "64", "--output-len", "100"]) == 2
    err = capsys.readouterr().err
    assert "3 of the 3 requests would not fit the engine's context of 128 tokens" in err
    assert "--input-len or --output-len" in err


def test_make_tiny_refuses_to_overwrite_a_folder_that_holds_files(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"mine": true}')
    assert main(["make-tiny", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "is not empty (config.json)" in err and "--force" in err
    assert (tmp_path / "config.json").read_text() == '{"mine": true}'
    assert main(["make-tiny", ""]) == 2
    assert "an empty path" in capsys.readouterr().err
    assert main(["make-tiny", str(tmp_path), "--force", "--vocab-size", "300"]) == 0
    assert "mine" not in (tmp_path / "config.json").read_text()


def test_make_tiny_refuses_a_size_this_machine_cannot_write(tmp_path, capsys, monkeypatch):
    """The largest flags make ~12 GiB of float32 weights: refused before any is made where
    the memory to write them is not there, with the size and what is available."""
    from phasewise.engine import kv_sizing

    monkeypatch.setattr(kv_sizing, "host_memory_available", lambda: 2**30)
    out = tmp_path / "big"
    assert main(["make-tiny", str(out), "--hidden-size", "2048", "--layers", "16"]) == 2
    err = capsys.readouterr().err
    assert "--hidden-size 2048 and --layers 16 make" in err and "1.0 GiB available" in err
    assert not out.exists()
    assert main(["make-tiny", str(out)]) == 0  # a small one still fits
    assert "MiB" in capsys.readouterr().err


def test_input_files_that_are_not_what_they_should_be_are_named(tmp_path, capsys):
    """A folder, bytes that are not UTF-8, a file with no line break: each refused with the
    file's name, quickly (a trace of /dev/zero was read whole into memory)."""
    from phasewise.perf.workload import MAX_TRACE_LINE

    binary = tmp_path / "b.json"
    binary.write_bytes(b"\xff\xfe{}")
    long = tmp_path / "long.jsonl"
    long.write_bytes(b" " * (MAX_TRACE_LINE + 10))
    sim = ["simulate", "--model", "llama-3.1-8b"]
    for argv, match in (
            ([*sim, "--trace", str(tmp_path)], f"--trace {tmp_path}: a folder"),
            ([*sim, "--trace", str(binary)], f"{binary}:1: not UTF-8 text"),
            ([*sim, "--trace", str(long)], f"{long}:1: a line longer than"),
            (["bench", "report", str(binary)], f"{binary}: not UTF-8 text"),
            (["bench", "report", str(tmp_path)], f"{tmp_path}: a folder, not a JSON file"),
            (["roofline", "--model", str(binary)], "not UTF-8 text")):
        assert main(argv) == 2, argv
        assert match in capsys.readouterr().err, argv


def test_an_option_the_engine_names_is_reported_as_the_flag_typed(capsys):
    """EngineConfig and the engine name options as the Python API spells them; on the
    command line the error names the flag (a name the command has no flag for stays)."""
    assert main(["simulate", "--model", "llama-3.1-8b", "--max-model-len", "0"]) == 2
    assert "--max-model-len must be an integer >= 1" in capsys.readouterr().err
    text = cli.by_flag("raise kv_cache_memory or lower max_model_len (max_position_embeddings "
                       "4096; --max-model-len stays)", _sub("simulate"))
    assert text == ("raise --kv-cache-memory or lower --max-model-len (max_position_embeddings "
                    "4096; --max-model-len stays)")
    # a path or a quoted value that holds such a name is the user's own text: left alone
    for text in ("no such trace file: runs/request_rate.jsonl",
                 "no config.json at /m/max_model_len/config.json", "got 'max_model_len'"):
        assert cli.by_flag(text, _sub("simulate")) == text


@pytest.mark.parametrize("flags,match", [
    (["--prefill", "2"], "--prefill: for --mode pd, not --mode colocated"),
    (["--link", "pcie4", "--disagg-threshold", "100"],
     "--disagg-threshold, --link: for --mode pd, not --mode colocated"),
    (["--mode", "pd", "--replicas", "3"], "--replicas: for --mode colocated, not --mode pd"),
    (["--trace-time-scale", "2"], "--trace-time-scale scales a trace's arrivals"),
    (["--prefill-queue-limit", "3"], "--prefill-queue-limit: for --mode pd"),
])
def test_simulate_refuses_a_flag_its_mode_would_ignore(flags, match, capsys):
    assert main(["simulate", "--model", "llama-3.1-8b", "--num-prompts", "2", *flags]) == 2
    assert match in capsys.readouterr().err


def test_version_prints_the_package_version(capsys):
    from phasewise import __version__

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"phasewise {__version__}"


def test_pd_workers_start_from_a_folder_that_holds_a_phasewise_folder(tmp_path):
    """A clone's parent holds a folder named phasewise: ``python -m`` put the current folder
    first on the path, and the workers imported that folder instead of the package."""
    from phasewise.launch.pd import Launcher, PDConfig

    (tmp_path / "phasewise").mkdir()
    cmd = Launcher(PDConfig(model="m")).commands("secret")["decode"]
    base = cmd[:cmd.index("serve")]
    out = subprocess.run([*base, "--version"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("phasewise ")


def test_server_urls_take_host_port_alone_and_refuse_other_schemes(capsys):
    """bench --base-url and router --decode/--prefill: HOST:PORT (as curl takes it) means
    http://HOST:PORT; another scheme, or no host, is refused by name before anything runs."""
    parser = build_parser()
    a = parser.parse_args(["bench", "--base-url", "localhost:8000"])
    assert a.base_url == "http://localhost:8000"
    a = parser.parse_args(["router", "--decode", "127.0.0.1:8001", "HTTPS://w:1",
                           "--prefill", "p:2"])
    assert a.decode == ["http://127.0.0.1:8001", "https://w:1"] and a.prefill == ["http://p:2"]
    for argv in (["bench", "--base-url", "ftp://x:1"], ["router", "--decode", ":8001"]):
        with pytest.raises(SystemExit) as e:
            parser.parse_args(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "http://127.0.0.1:8000" in err and ("ftp://x:1" in err or "':8001'" in err)


def test_pd_pin_places_the_workers_on_the_cores_this_process_may_use(monkeypatch):
    """Under ``taskset -c 4,6 phasewise pd --pin`` the workers took cores 0 and 1, outside
    the set the user gave."""
    from phasewise.launch import pd as pd_launch

    monkeypatch.setattr(pd_launch.os, "sched_getaffinity", lambda pid: {6, 4})
    cmds = pd_launch.Launcher(pd_launch.PDConfig(model="m", pin=True)).commands("secret")
    assert cmds["decode"][:3] == ["taskset", "-c", "4"]
    assert cmds["prefill"][:3] == ["taskset", "-c", "6"]
    monkeypatch.setattr(pd_launch.os, "sched_getaffinity", lambda pid: {3})
    cmds = pd_launch.Launcher(pd_launch.PDConfig(model="m", pin=True)).commands("secret")
    assert cmds["decode"][:3] == cmds["prefill"][:3] == ["taskset", "-c", "3"]


def test_pd_hands_its_api_key_to_the_workers_in_the_environment_not_argv(monkeypatch):
    """pd put --api-key KEY on its children's command lines, which any user of the machine
    can list (ps); they now read it from PHASEWISE_API_KEY, as serve and router can."""
    from phasewise.config import API_KEY_ENV
    from phasewise.launch import pd as pd_launch

    launcher = pd_launch.Launcher(pd_launch.PDConfig(model="m", api_key="k-secret"))
    cmds = launcher.commands("secret", "internal.key")
    assert not any("k-secret" in " ".join(c) or "--api-key" in c for c in cmds.values())
    assert all(c[c.index("--internal-key-file") + 1] == "internal.key" for c in cmds.values())
    started = []
    monkeypatch.setattr(pd_launch.subprocess, "Popen",
                        lambda cmd, env, **kw: started.append(env) or object())
    monkeypatch.setenv(API_KEY_ENV, "someone-elses")
    launcher._start("router", cmds["router"])
    assert started[0][API_KEY_ENV] == "k-secret"
    pd_launch.Launcher(pd_launch.PDConfig(model="m"))._start("router", cmds["router"])
    assert API_KEY_ENV not in started[1]  # no key given: none passed on
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert build_parser().parse_args(["serve"]).api_key == "from-env"
    assert build_parser().parse_args(["serve", "--api-key", "flag"]).api_key == "flag"


def test_an_api_key_is_stripped_and_one_with_a_control_character_refused(monkeypatch, capsys):
    """A key mounted from a file ends in a line break: serve took it as it was and refused
    every client with the right key, and the router's error quoted the whole key."""
    from phasewise.config import API_KEY_ENV

    monkeypatch.setenv(API_KEY_ENV, "sekret-key-123\n")
    assert build_parser().parse_args(["router", "--decode", "http://a:1"]).api_key == \
        "sekret-key-123"
    for bad in ("sek\tret", "sek\nret", "  "):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--api-key", bad])
        err = capsys.readouterr().err
        assert "argument --api-key: the API key" in err and "sek" not in err


@pytest.mark.parametrize("value,want", [("0", 0), ("0KiB", 0), ("00", 0), ("0B", 0),
                                        ("64KiB", 64 << 10), ("lots", None)])
def test_send_buffer_takes_zero_in_any_unit(value, want):
    """--send-buffer 0KiB was refused as 'must be > 0', though 0 is the system's own."""
    from phasewise.cli.args import connection_limits

    a = build_parser().parse_args(["serve", "--send-buffer", value])
    if want is None:
        with pytest.raises(ValueError, match="--send-buffer"):
            connection_limits(a)
    else:
        assert connection_limits(a).send_buffer == want
