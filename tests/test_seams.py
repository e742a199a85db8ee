"""The seams between rooms: the HTTP server reaches the engine only through the
``ServingBackend`` protocol, and engine commands are plain data that could cross a process
boundary."""

from __future__ import annotations

import ast
import json
import pickle
import subprocess
import sys
from pathlib import Path

import phasewise
from phasewise.engine.backend import PromptSpec, ServingBackend
from phasewise.engine.commands import AbortAll, AbortRequests, AddRequests, Stop, Verdict
from phasewise.engine.sampling_params import SamplingParams

ROOT = Path(phasewise.__file__).parent
FORBIDDEN = ("phasewise.engine.engine", "phasewise.engine.scheduler", "phasewise.cache")


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-level imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_no_server_module_imports_the_engine_internals():
    files = sorted((ROOT / "server").glob("*.py"))
    assert len(files) >= 8  # app, guard, errors, protocol, routes, openai_format, sse, ...
    for path in files:
        bad = sorted(n for n in _imports(path) if n.startswith(FORBIDDEN))
        assert not bad, f"{path.name} imports {bad}"


def test_importing_the_server_loads_no_engine_internals():
    script = ("import json, sys\n"
              "import phasewise.server.app, phasewise.server.serve\n"
              f"print(json.dumps(sorted(m for m in sys.modules if m.startswith({FORBIDDEN!r}))))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True)
    assert json.loads(out.stdout) == []


def test_the_async_engine_is_a_serving_backend():
    from phasewise.engine.async_engine import AsyncEngine

    members = [n for n in dir(ServingBackend) if not n.startswith("_")]
    members += list(ServingBackend.__annotations__)
    assert {"add", "abort", "abort_all", "snapshot", "add_observer", "info",
            "tokenizer", "default_sampling_params"} <= set(members)
    for name in ServingBackend.__dict__:
        if not name.startswith("_"):
            assert hasattr(AsyncEngine, name), name


def test_engine_commands_survive_a_process_boundary():
    spec = PromptSpec([1, 2, 3], SamplingParams(temperature=0.5, seed=7, stop=("\n",)), "x")
    commands = [AddRequests(4, (("r-0", spec),), 12.5, 256), AbortRequests(("r-0",)),
                AbortAll("grace period over"), Stop(), Verdict(4, ("overloaded", "full", None))]
    for cmd in commands:
        assert pickle.loads(pickle.dumps(cmd)) == cmd
