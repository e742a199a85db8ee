"""The scheduler and the KV manager run without torch and on an injected clock (the simulator
drives them in virtual time)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import phasewise

ROOT = Path(phasewise.__file__).parent

_SCRIPT = r"""
import json, sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
import phasewise.engine.scheduler as sch, phasewise.cache.manager as man
from phasewise.engine.request import Request
from phasewise.engine.sampling_params import SamplingParams

now = [100.0]
def clock():
    return now[0]

kv = man.KVCacheManager(16, 4)
s = sch.Scheduler(sch.SchedulerConfig(max_num_batched_tokens=6, max_model_len=32), kv, clock)
a = Request("a", list(range(10, 20)), SamplingParams(max_tokens=3, ignore_eos=True),
            arrival_time=99.5)
s.add_request(a)
steps = []
while s.has_unfinished():
    now[0] += 1.0
    b = s.schedule()
    sampled = {r.request_id: [7] for r, n in zip(b.requests, b.num_tokens)
               if r.num_computed_tokens + n == r.num_tokens}
    s.update(b, sampled)
    steps.append(b.num_tokens)
m = a.metrics
print(json.dumps({"torch": "torch" in sys.modules and sys.modules["torch"] is not None,
                  "steps": steps, "arrival": m.arrival_time,
                  "scheduled": m.first_scheduled_time, "first": m.first_token_time,
                  "tokens": m.token_times, "finished": m.finished_time,
                  "status": a.status.value, "free": kv.num_free_blocks}))
"""


def test_scheduler_runs_without_torch_on_a_fake_clock():
    out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["torch"] is False
    # 10-token prompt under a 6-token budget: chunks of 6 and 4, then two decodes.
    assert r["steps"] == [[6], [4], [1], [1]]
    assert r["arrival"] == 99.5
    assert r["scheduled"] == 101.0  # the clock as it read at the first schedule()
    assert r["first"] == 102.0
    assert r["tokens"] == [102.0, 103.0, 104.0]
    assert r["finished"] == 104.0
    assert r["status"] == "length" and r["free"] == 16


def _imports_and_calls(path: Path) -> tuple[set[str], set[str]]:
    tree = ast.parse(path.read_text())
    mods: set[str] = set()
    calls: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            mods.add(node.module.split(".")[0])
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            calls.add(f"{node.value.id}.{node.attr}")
    return mods, calls


def test_scheduler_and_cache_import_neither_torch_nor_a_clock():
    files = [ROOT / "engine" / "scheduler.py", ROOT / "engine" / "request.py",
             ROOT / "engine" / "finish.py", ROOT / "engine" / "validation.py",
             *sorted((ROOT / "cache").glob("*.py"))]
    for f in files:
        mods, calls = _imports_and_calls(f)
        assert "torch" not in mods, f
        assert "time" not in mods and not any(c.startswith("time.") for c in calls), f
