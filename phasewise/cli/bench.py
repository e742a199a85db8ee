"""``bench`` and ``bench report``: the load-testing client (``phasewise.bench``)."""

from __future__ import annotations

import argparse
import sys

from phasewise.cli.args import Command, HelpFormatter, common_flags


def add_commands(command: Command) -> None:
    from phasewise.bench.options import add_args as add_bench_args

    b = command("bench", "load-test any OpenAI-compatible server "
                "('phasewise bench report FILES' renders an HTML report)", cmd_bench)
    add_bench_args(b)


def build_report_parser() -> argparse.ArgumentParser:
    r = argparse.ArgumentParser(prog="phasewise bench report", parents=[common_flags()],
                                description="HTML report from benchmark result files",
                                formatter_class=HelpFormatter)
    r.add_argument("results", nargs="+", help="result JSON files (phasewise bench, or "
                   "vllm bench serve --save-detailed)")
    r.add_argument("-o", "--output", default="bench-report.html", help="the HTML file to write")
    r.add_argument("--stall-factor", type=float, default=5.0,
                   help="mark a stall where a gap exceeds this x the median ITL")
    r.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLO lines to draw (default: the results' own)")
    r.set_defaults(func=cmd_bench_report, parser=r)
    return r


def cmd_bench(a: argparse.Namespace) -> int:
    from phasewise.bench.run import main as run_bench

    return run_bench(a)


def cmd_bench_report(a: argparse.Namespace) -> int:
    from phasewise.bench.report import render
    from phasewise.files import check_output
    from phasewise.perf.summary import parse_slo

    check_output(a.output, "-o/--output")
    out = render(a.results, a.output, stall_factor=a.stall_factor,
                 slo=parse_slo(a.goodput) or None)
    print(f"report written to {out}", file=sys.stderr)
    return 0
