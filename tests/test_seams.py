"""The seams between rooms: every import runs down the order of rooms, the HTTP server reaches
the engine only through the ``ServingBackend`` protocol, and engine commands are plain data
that could cross a process boundary.

The order of rooms (``docs/architecture.md``), lowest first; a room imports only from rooms
below it and from itself, never from a room above it or from a peer (rooms on one level):

1. ``config``: ``phasewise/config.py``, the package's ``__init__.py`` and any other module at
   the package's top level that is not one of the ``cli`` room's;
2. ``model``, ``cache`` (peers);
3. ``engine``;
4. ``perf``;
5. ``bench``, ``server``, ``disagg`` (peers);
6. ``launch``;
7. ``cli``: ``phasewise/cli/``, ``generate.py``, ``llm.py`` and ``__main__.py``.

Every import statement counts, wherever it is: at module level, inside a function (a lazy
import runs all the same), and under ``if TYPE_CHECKING:`` (a type from a room above still ties
this room's code to it; none is exempt). ``from phasewise import NAME`` counts as importing
the module the package's lazy name (``phasewise.__getattr__``) loads it from. The package's
own lazy table is data, not an import statement, and is not read.
"""

from __future__ import annotations

import ast
import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

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


# -- the order of rooms ------------------------------------------------------------------------
LEVELS = (("config",), ("model", "cache"), ("engine",), ("perf",), ("bench", "server", "disagg"),
          ("launch",), ("cli",))
LEVEL = {room: i for i, rooms in enumerate(LEVELS) for room in rooms}
CLI_MODULES = {"cli", "generate", "llm", "__main__"}  # top-level modules of the cli room


def room_of_module(name: str) -> str | None:
    """The room of a module named ``phasewise...``; None for a module outside the package."""
    parts = name.split(".")
    if parts[0] != "phasewise":
        return None
    if len(parts) == 1:
        return "config"  # the package itself: its version and its lazy names' table
    if parts[1] in LEVEL and parts[1] not in ("config", "cli"):
        return parts[1]
    return "cli" if parts[1] in CLI_MODULES else "config"


def room_of_file(path: Path) -> str:
    """The room of a file under ``phasewise/``."""
    rel = path.relative_to(ROOT)
    if len(rel.parts) == 1:
        return "cli" if rel.stem in CLI_MODULES else "config"
    return rel.parts[0]


def _imported(path: Path, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The ``phasewise`` modules one import statement loads."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:  # relative: from the file's own package upward
        package = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if path.name != "__init__.py":
            package = package[:-1]
        base = package[:len(package) - node.level + 1]
        module = ".".join(base + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    if module != "phasewise":
        return [module]
    names = []
    for a in node.names:  # from phasewise import x: a submodule, or one of the lazy names
        if (ROOT / a.name).is_dir() or (ROOT / f"{a.name}.py").is_file():
            names.append(f"phasewise.{a.name}")
        else:
            names.append(getattr(phasewise, "_LAZY", {}).get(a.name, "phasewise"))
    return names


def order_violations(path: Path, source: str | None = None) -> list[str]:
    """Each import in ``path`` (or in ``source``, read as that file) that reaches a room above
    the file's own, or a peer of it: ``file:line: imports module (room -> room)``."""
    room = room_of_file(path)
    tree = ast.parse(path.read_text() if source is None else source)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        for module in _imported(path, node):
            target = room_of_module(module)
            if target is None or target == room or LEVEL[target] < LEVEL[room]:
                continue
            how = "a peer" if LEVEL[target] == LEVEL[room] else "a room above"
            found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: imports {module} "
                         f"({room} -> {target}, {how})")
    return found


def test_every_import_runs_down_the_order_of_rooms():
    files = sorted(ROOT.rglob("*.py"))
    rooms = {room_of_file(f) for f in files}
    assert rooms == set(LEVEL), rooms ^ set(LEVEL)  # a new folder needs its place in LEVELS
    bad = [v for f in files for v in order_violations(f)]
    assert not bad, "imports against the order of rooms:\n" + "\n".join(bad)


@pytest.mark.parametrize(("file", "source", "why"), [
    ("engine/engine.py", "from phasewise.perf.attribution import StepCostModel\n",
     "engine -> perf, a room above"),
    ("engine/engine.py", "def f():\n    import phasewise.disagg.worker\n",
     "engine -> disagg, a room above"),
    ("engine/engine.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
     "    from phasewise.server.app import OpenAIServer\n", "engine -> server, a room above"),
    ("disagg/router.py", "from phasewise.server import relay\n", "disagg -> server, a peer"),
    ("model/config.py", "from phasewise.cache.manager import KVCacheManager\n",
     "model -> cache, a peer"),
    ("config.py", "from phasewise import LLM\n", "config -> cli, a room above"),
    ("perf/simulate.py", "from ..bench import client\n", "perf -> bench, a room above"),
    ("server/serve.py", "from phasewise.launch.serve import build_server\n",
     "server -> launch, a room above"),
])
def test_the_order_check_catches_an_upward_import(file, source, why):
    found = order_violations(ROOT / file, source)
    assert len(found) == 1 and why in found[0], found
    assert found[0].startswith(f"phasewise/{file}:"), found


def test_the_order_check_lets_imports_run_down_and_within_a_room():
    source = ("from phasewise.config import EngineConfig\n"
              "from phasewise.engine.backend import ServingBackend\n"
              "from phasewise.perf.attribution import StepCostModel\n"
              "from phasewise.server.app import OpenAIServer\n"
              "from . import serve\n"
              "import phasewise\n"
              "import json\n")
    assert order_violations(ROOT / "launch" / "serve.py", source) == []


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
