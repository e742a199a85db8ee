"""``phasewise``: one entry point. Argument parsing only; each command's work lives in its room
(``phasewise.generate``, ``phasewise.launch``, ``phasewise.bench``, ``phasewise.perf``).

Each command's flags sit beside its ``cmd_*`` function, one module per kind of command:
``serving`` (generate, serve, router, pd), ``bench`` (bench, bench report), ``perf``
(roofline, measure, calibrate, tune, simulate, plan), ``tiny`` (make-tiny); what several of
them share (the engine's flags, the connection limits, argument types) is in ``args``.

The flags' choices and defaults come from the definitions they configure (``EngineConfig``
and its choice tuples, the scheduler's policies, the model registry's architectures).
Building the parser imports no torch, no HTTP stack: every command builds it.

Exit status and errors:

* a flag the command does not know, or a bad flag value: that command's usage and
  ``phasewise <command>: error: ...``, exit 2;
* an error in what was given (``ValueError`` or ``FileNotFoundError``: a missing model folder,
  a bad length distribution, an unknown accelerator; ``ConnectionError``: a server that
  cannot be reached): ``phasewise: error: ...``, exit 2;
* anything else is an internal error: one line ``phasewise: internal error: <type>: ...``,
  exit 1; ``--debug`` (on any command) prints the traceback before it;
* Ctrl-C: ``phasewise: interrupted``, exit 130 (``serve`` drains first and exits 0).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import traceback
from collections.abc import Callable

from phasewise.cli import bench, perf, serving, tiny
from phasewise.cli.args import HelpFormatter, common_flags
from phasewise.cli.bench import build_report_parser

USER_ERRORS = (ValueError, FileNotFoundError, ConnectionError)


DESCRIPTION = ("phasewise: an LLM inference engine that shows and controls the two phases of "
               "generation, prefill and decode. Serve a checkpoint behind an OpenAI-compatible "
               "API, measure each step against the hardware's roofline, and predict and plan "
               "deployments. 'phasewise COMMAND --help' describes each command.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="phasewise", description=DESCRIPTION,
                                     parents=[common_flags()], formatter_class=HelpFormatter)
    from phasewise import __version__

    parser.add_argument("--version", action="version", version=f"phasewise {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    common = [common_flags(top=False)]

    def command(name: str, help: str, func: Callable[[argparse.Namespace], int]
                ) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help, parents=common,
                           formatter_class=HelpFormatter)
        p.set_defaults(func=func, parser=p)
        return p

    # in the order --help lists them: run, load-test, predict and measure, make a checkpoint
    for group in (serving, bench, perf, tiny):
        group.add_commands(command)
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command's arguments; a flag it does not know gets its own usage (exit 2)."""
    if argv[:2] == ["bench", "report"]:
        parser, argv = build_report_parser(), argv[2:]
    else:
        parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        getattr(args, "parser", parser).error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else list(argv))
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError as e:
        if not _stdout_closed():  # another pipe broke: not the reader leaving
            return _internal_error(e, args)
        # stdout's reader left (| head): stop quietly, as a filter does
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the exit's flush does not fail again
        return 141  # 128 + SIGPIPE, the status a shell gives a program the pipe stopped
    except USER_ERRORS as e:
        print(f"phasewise: error: {by_flag(str(e), getattr(args, 'parser', None))}",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("phasewise: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a bug or a broken environment, not the user's input
        return _internal_error(e, args)


def by_flag(message: str, parser: argparse.ArgumentParser | None) -> str:
    """``message`` with each option it names as the Python API spells it (``max_model_len``,
    as ``EngineConfig`` and the engine report it) spelled as this command's flag
    (``--max-model-len``), where the command has that flag: the user typed the flag."""
    if parser is None:
        return message
    flags = {s for a in parser._actions for s in a.option_strings}

    def flag(m: re.Match[str]) -> str:
        name = "--" + m.group(0).replace("_", "-")
        return name if name in flags else m.group(0)

    # (not inside a path, a file name or a quoted value: only a word standing alone)
    message = re.sub(r"(?<![\w\-/.\\'\"])[a-z][a-z0-9]*(?:_[a-z0-9]+)+(?![\w\-/.\\'\"])",
                     flag, message)
    # a one-word option that opens the message ("seed must be ..."): the subject is the flag
    first = re.match(r"[a-z][a-z0-9]*(?= )", message)
    if first and "--" + first.group(0) in flags:
        message = "--" + message
    return message


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (the kernel flags its write end with
    an error: poll says so without writing)."""
    import select

    try:
        p = select.poll()
        p.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in p.poll(0))
    except (OSError, ValueError, AttributeError):  # no fd, or no poll on this platform
        return False


def _internal_error(e: BaseException, args: argparse.Namespace) -> int:
    if args.debug:
        traceback.print_exception(e)
    text = " ".join(str(e).split()) or "(no message)"
    print(f"phasewise: internal error: {type(e).__name__}: {text}"
          + ("" if args.debug else " (--debug shows the traceback)"), file=sys.stderr)
    return 1

