"""``phasewise measure``: a quick measurement never replaces a full one, and every figure is
printed with its band over the runs. The measurement itself is faked: nothing is timed."""

from __future__ import annotations

import json

import pytest

from phasewise.cli import main
from phasewise.perf import measure as measure_mod


def _entry(quick: bool, bw: float, fp32: float) -> dict:
    return {"name": f"{'quick' if quick else 'full'} CPU (measured)",
            "peak_flops": {"fp32": fp32, "bf16": fp32 / 4}, "mem_bytes": 8e9,
            "mem_bandwidth": bw, "source": f"measured {'quickly' if quick else 'fully'}",
            "measured": {"quick": quick, "runs": {"mem_bandwidth": 3 if quick else 10,
                                                  "fp32": 3 if quick else 10, "bf16": 2},
                         "spread": {"mem_bandwidth": [bw * 0.8, bw], "fp32": [fp32 * 0.9, fp32],
                                    "bf16": [fp32 / 4, fp32 / 4]}}}


@pytest.fixture
def fake_device(monkeypatch):
    calls = []

    def fake_measure_device(device, progress, quick=False, dtypes=(), read_bandwidth=True):
        calls.append((device, quick))
        return _entry(quick, 12e9 if quick else 16e9, 90e9 if quick else 105e9)

    monkeypatch.setattr(measure_mod, "measure_device", fake_measure_device)
    return calls


def test_quick_never_replaces_a_full_measurement(fake_device, tmp_path, capsys):
    path = tmp_path / "machine.json"
    assert main(["measure", "--out", str(path)]) == 0  # full: written
    assert fake_device[-1] == ("cpu", False)
    full = json.loads(path.read_text())["cpu-local"]
    assert full["mem_bandwidth"] == 16e9 and full["measured"]["quick"] is False
    capsys.readouterr()

    assert main(["measure", "--quick", "--out", str(path)]) == 0
    out, err = capsys.readouterr()
    assert json.loads(path.read_text())["cpu-local"] == full  # the full one stays
    assert "kept the full measurement" in err and "a quick one never replaces it" in err
    assert "read 12.0 GB/s" in out and "(quick)" in out  # the quick reading is still shown

    assert main(["measure", "--out", str(path)]) == 0  # a full one replaces a full one
    assert json.loads(path.read_text())["cpu-local"]["measured"]["quick"] is False


def test_an_unstable_full_figure_keeps_the_stable_one_unless_replace(monkeypatch, tmp_path,
                                                                     capsys):
    """docs/predicting.md: an unstable figure never replaces a stable one; a full run on a busy
    machine keeps the stable figures it measured unstable (and stores the stable ones it
    measured), and ``--replace`` stores every figure of the run."""
    runs = [_entry(False, 16e9, 105e9)]
    busy = _entry(False, 9e9, 40e9)
    busy["measured"]["unstable"] = {"mem_bandwidth": "other processes took 45% of the CPU",
                                    "fp32": "other processes took 45% of the CPU"}
    busy["measured"]["conditions"] = {"load": 3.0}
    busy["peak_flops"]["bf16"] = 30e9  # measured stable: stored
    runs.append(busy)
    runs.append(busy)
    monkeypatch.setattr(measure_mod, "measure_device", lambda *a, **k: runs.pop(0))
    path = tmp_path / "machine.json"
    assert main(["measure", "--out", str(path)]) == 0
    capsys.readouterr()
    assert main(["measure", "--out", str(path)]) == 0
    out, err = capsys.readouterr()
    entry = json.loads(path.read_text())["cpu-local"]
    assert entry["mem_bandwidth"] == 16e9 and entry["peak_flops"]["fp32"] == 105e9  # kept
    assert entry["peak_flops"]["bf16"] == 30e9  # a stable figure of the new run is taken
    assert entry["measured"]["unstable"] == {}
    assert entry["measured"]["spread"]["fp32"] == [105e9 * 0.9, 105e9]  # the kept one's band
    assert "kept the stable read bandwidth" in err and "9.0 GB/s, other processes" in err
    assert "kept the stable fp32 matmul" in err and "--replace" in err
    assert "read 16.0 GB/s" in out and "UNSTABLE" not in out  # as stored
    assert "kept from an earlier full run" in entry["source"]

    assert main(["measure", "--replace", "--out", str(path)]) == 0
    entry = json.loads(path.read_text())["cpu-local"]
    assert entry["mem_bandwidth"] == 9e9 and "fp32" in entry["measured"]["unstable"]


def test_quick_is_stored_where_there_is_no_full_one(fake_device, tmp_path, capsys):
    path = tmp_path / "machine.json"
    path.write_text(json.dumps({"gpu-local": {"keep": "me"}}))
    assert main(["measure", "--quick", "--out", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["cpu-local"]["measured"]["quick"] is True and data["gpu-local"] == {"keep": "me"}
    assert main(["measure", "--quick", "--out", str(path)]) == 0  # quick over quick: fine
    assert "kept the full" not in capsys.readouterr().err
    assert main(["measure", "--out", str(path)]) == 0  # and a full one replaces it
    assert json.loads(path.read_text())["cpu-local"]["mem_bandwidth"] == 16e9


def test_each_figure_is_printed_with_its_band(fake_device, tmp_path, capsys):
    assert main(["measure", "--out", str(tmp_path / "m.json")]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("cpu-local: full CPU (measured) (full): ")
    assert "read 16.0 GB/s [12.8-16.0 over 10 runs, 20% spread]" in line
    assert "fp32 matmul 105.0 GFLOP/s [94.5-105.0 over 10 runs, 10% spread]" in line
    assert "bf16 matmul 26.2 GFLOP/s [26.2-26.2 over 2 runs, 0% spread]" in line


def test_rates_give_the_best_figure_and_the_band():
    best, band = measure_mod._rates(100.0, [2.0, 1.0, 4.0])
    assert best == 100.0 and band == [25.0, 100.0]
    assert measure_mod.band([25.0, 100.0], 3, 1.0) == "[25.0-100.0 over 3 runs, 75% spread]"
    assert measure_mod.band(None, None, 1.0) == "[no spread recorded]"  # older files
    old = {"name": "old", "peak_flops": {"fp32": 1e9}, "mem_bytes": 1, "mem_bandwidth": 2e9}
    assert measure_mod.is_full(old)  # files from before quick was recorded count as full
    assert "read 2.0 GB/s [no spread recorded]" in measure_mod.format_entry("cpu-local", old)


def test_generate_s_quick_figures_are_marked_in_a_full_entry(fake_device, tmp_path):
    path = tmp_path / "machine.json"
    full = _entry(False, 16e9, 105e9)
    del full["peak_flops"]["bf16"]
    path.write_text(json.dumps({"cpu-local": full}))
    acc = measure_mod.ensure_local("cpu", ("fp32", "bf16"), path)
    assert acc.mem_bandwidth == 16e9 and acc.peak_flops_for("fp32") == 105e9  # kept
    entry = json.loads(path.read_text())["cpu-local"]
    assert entry["measured"]["quick"] is False and entry["measured"]["quick_figures"] == ["bf16"]
    text = measure_mod.format_entry("cpu-local", entry)
    assert "bf16 matmul 22.5 GFLOP/s [22.5-22.5 over 2 runs, 0% spread] (quick)" in text
    assert "fp32 matmul 105.0 GFLOP/s [94.5-105.0 over 10 runs, 10% spread];" in text


def test_the_cpu_probe_reads_twice_the_largest_cache(tmp_path):
    from phasewise.perf.measure import cpu_read_bytes, largest_cache_bytes

    assert largest_cache_bytes(tmp_path) is None
    assert cpu_read_bytes(tmp_path) == 1 << 30  # caches not reported: 1 GiB
    for i, size in enumerate(["48K", "2048K", "491520K", "garbage"]):
        (tmp_path / f"index{i}").mkdir()
        (tmp_path / f"index{i}" / "size").write_text(size + "\n")
    assert largest_cache_bytes(tmp_path) == 491520 << 10
    assert cpu_read_bytes(tmp_path) == 960 << 20  # twice a 480 MiB L3
    (tmp_path / "index3" / "size").write_text("4G\n")
    assert cpu_read_bytes(tmp_path) == 2 << 30  # at most 2 GiB
    for i in range(4):
        (tmp_path / f"index{i}" / "size").write_text("8M\n")
    assert cpu_read_bytes(tmp_path) == 256 << 20  # at least 256 MiB
