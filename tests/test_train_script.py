"""scripts/train_default_model.py on a small corpus: seeded, standard layout, loads in the engine.

The full run takes ~1.5 hours; here a one-layer model trains for a few steps on a few files.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from phasewise import LLM, SamplingParams

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train_default_model.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("train_default_model", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, script):
    """A few stdlib files, plus two the script must leave out (a test suite and a codec)."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    out = tmp_path_factory.mktemp("corpus")
    for name in ("textwrap.py", "bisect.py", "heapq.py", "fnmatch.py", "colorsys.py"):
        (out / name).write_text((root / name).read_text())
    for sub in ("test", "encodings"):
        (out / sub).mkdir()
        (out / sub / "skipped.py").write_text("SKIPPED = 'never trained on'\n" * 50)
    return out


ARGS = ["--vocab-size", "320", "--hidden-size", "32", "--intermediate-size", "64",
        "--layers", "1", "--heads", "2", "--kv-heads", "1", "--seq-len", "64",
        "--batch-size", "4", "--tokens", "1024", "--eval-windows", "4", "--threads", "1",
        "--log-every", "0", "--no-compile", "--repetition-steps", "3",
        "--repetition-batch", "2", "--repetition-tokens", "24"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, script, corpus):
    outs = []
    for _ in range(2):
        out = tmp_path_factory.mktemp("model")
        assert script.main(["--out", str(out), "--corpus", str(corpus), *ARGS]) == 0
        outs.append(out)
    return outs


def test_files_are_the_standard_layout_and_skip_tests_and_codecs(script, corpus, runs):
    out = runs[0]
    for name in ("config.json", "model.safetensors", "generation_config.json",
                 "tokenizer.json", "tokenizer_config.json", "README.md", "training.json"):
        assert (out / name).is_file(), name
    files = script.corpus_files(corpus)
    assert sorted(f.name for f in files) == sorted(
        ["textwrap.py", "bisect.py", "heapq.py", "fnmatch.py", "colorsys.py"])
    info = json.loads((out / "training.json").read_text())
    assert info["corpus_files"] + info["held_out_files"] == 5
    assert info["steps"] == 1024 // (4 * 64)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["max_position_embeddings"] == 64
    assert cfg["tie_word_embeddings"] is True
    tok = json.loads((out / "tokenizer_config.json").read_text())
    assert tok["chat_template"] == script.CODE_CHAT_TEMPLATE
    card = (out / "README.md").read_text()
    assert f"{info['parameters']:,} parameters" in card and info["sample"] in card


def test_two_runs_write_identical_weights_and_tokenizer(runs):
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (runs[0] / name).read_bytes() == (runs[1] / name).read_bytes(), name


def test_the_result_loads_and_generates_in_the_engine(runs):
    llm = LLM(str(runs[0]), dtype="float32")
    assert llm.engine.max_model_len <= 64
    out = llm.generate("def f(", SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert len(out.token_ids) == 5


def test_a_corpus_without_files_is_refused(script, tmp_path, capsys):
    assert script.main(["--out", str(tmp_path / "m"), "--corpus", str(tmp_path), *ARGS]) == 2
    assert "need at least 2 .py files" in capsys.readouterr().err


def test_a_stopped_run_resumes_to_the_same_weights(script, corpus, runs, tmp_path, capsys):
    """Stopped after one step (its state saved), then run again: the same files as one go."""
    out, work = tmp_path / "m", tmp_path / "state"
    argv = ["--out", str(out), "--corpus", str(corpus), "--work-dir", str(work), *ARGS]
    assert script.main([*argv, "--stop-after", "1"]) == 3
    assert (work / "state.pt").is_file()
    assert "step 1/4" in capsys.readouterr().err
    assert script.main(argv) == 0
    assert "resuming from" in capsys.readouterr().err
    assert not (work / "state.pt").exists()  # removed once the model is saved
    for name in ("model.safetensors", "tokenizer.json"):
        assert (out / name).read_bytes() == (runs[0] / name).read_bytes(), name
    info = json.loads((out / "training.json").read_text())
    assert info["steps"] == 4 and info["sources"][0]["group"] == "core"


def test_the_compiled_step_trains_as_the_eager_one_does(script, corpus, runs, tmp_path, capsys):
    """torch.compile'd training (the default) reaches the eager run's loss, up to rounding."""
    out = tmp_path / "m"
    args = [a for a in ARGS if a != "--no-compile"]
    assert script.main(["--out", str(out), "--corpus", str(corpus), *args]) == 0
    err = capsys.readouterr().err
    assert "compiling the training step for 4 x 64-token windows" in err
    if "compiling failed" in err:
        pytest.skip("torch.compile cannot compile here (see the fallback test)")
    eager = json.loads((runs[0] / "training.json").read_text())
    compiled = json.loads((out / "training.json").read_text())
    # the same steps, fused differently: the same loss up to rounding, and it went down
    assert compiled["held_out_loss"] == pytest.approx(eager["held_out_loss"], abs=2e-3)
    assert compiled["held_out_loss"] < compiled["loss_history"][0]["loss"] - 0.02
    assert compiled["compiled"] is True and eager["compiled"] is False


def test_a_compiled_run_stopped_after_the_window_switch_resumes_to_the_same_weights(
        script, corpus, tmp_path, capsys):
    """Compiled, with short windows first: stopped in the long-window steps and resumed, it
    writes the files of an uninterrupted run (the resumed run compiles the short shape
    again first, so the long one compiles as the uninterrupted run compiled it)."""
    args = [a for a in ARGS if a != "--no-compile"] + ["--short-seq", "32",
                                                      "--short-frac", "0.5"]
    one = tmp_path / "one"
    assert script.main(["--out", str(one), "--corpus", str(corpus), *args]) == 0
    if "compiling failed" in capsys.readouterr().err:
        pytest.skip("torch.compile cannot compile here")
    out, work = tmp_path / "m", tmp_path / "state"
    argv = ["--out", str(out), "--corpus", str(corpus), "--work-dir", str(work), *args]
    assert script.main([*argv, "--stop-after", "3"]) == 3
    assert "step 3/4" in capsys.readouterr().err
    assert script.main(argv) == 0
    err = capsys.readouterr().err
    assert "resuming from" in err and "8 x 32-token windows" in err
    assert (out / "model.safetensors").read_bytes() == (one / "model.safetensors").read_bytes()

def test_a_failed_compile_falls_back_to_eager_training(script, corpus, runs, tmp_path,
                                                          monkeypatch, capsys):
    import torch

    def broken(fn):
        def call(*args, **kwargs):
            raise RuntimeError("no C++ compiler")
        return call

    monkeypatch.setattr(torch, "compile", broken)
    out = tmp_path / "m"
    args = [a for a in ARGS if a != "--no-compile"]
    assert script.main(["--out", str(out), "--corpus", str(corpus), *args]) == 0
    err = capsys.readouterr().err
    assert "compiling failed (RuntimeError: no C++ compiler); training eagerly" in err
    # from then on it is the eager run, step for step
    assert (out / "model.safetensors").read_bytes() == (runs[0] / "model.safetensors").read_bytes()


def test_repeated_lines_marks_where_a_line_that_repeats_the_one_before_starts(script):
    NL, SP, EOS, PAD = 10, 11, 1, 2  # 10 holds a newline, 11 is blank
    rows = [
        [5, 6, NL, 5, 6, NL, 5, 6, NL, 7, NL],  # a line twice more, then another
        [SP, 5, NL, SP, 5, NL],  # the first token that is not blank
        [5, 6, NL, 7, NL, 5, 6, NL],  # the same line again, but not right after itself
        [SP, SP, NL, SP, SP, NL, 8, NL, 8, NL],  # blank lines do not count; others do
        [5, 6, NL, 5, 6, NL, EOS, 5, 6, NL, PAD],  # nothing after the end of text
    ]
    got = script.repeated_lines(rows, {NL}, {SP, NL}, {EOS, PAD})
    assert got == [
        [0, 0, 0, 1, 0, 0, 1, 0, 0, 0, 0],  # each repeat's first token
        [0, 0, 0, 0, 1, 0],
        [0] * 8,
        [0, 0, 0, 0, 0, 0, 0, 0, 1, 0],
        [0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0],
    ]


def test_the_repetition_phase_runs_and_resumes_to_the_same_weights(script, corpus, runs,
                                                                   tmp_path, capsys):
    info = json.loads((runs[0] / "training.json").read_text())
    rep = info["repetition"]
    assert rep["steps"] == 3 and rep["heads"] > 0 and rep["batch"] == 2
    assert "repetition phase" in (runs[0] / "README.md").read_text()
    # stopped inside the phase (after the main training), then run again: the same files
    out, work = tmp_path / "m", tmp_path / "state"
    argv = ["--out", str(out), "--corpus", str(corpus), "--work-dir", str(work), *ARGS,
            "--stop-after", "2"]
    assert script.main(argv) == 3  # in the main training (4 steps)
    assert script.main(argv) == 3  # its last 2 steps, then 2 of the phase's 3
    err = capsys.readouterr().err
    assert "stopped at repetition step 2/3" in err and (work / "repetition.pt").is_file()
    assert script.main(argv) == 0
    assert "resuming the repetition phase" in capsys.readouterr().err
    assert not (work / "repetition.pt").exists() and not (work / "state.pt").exists()
    assert (out / "model.safetensors").read_bytes() == (runs[0] / "model.safetensors").read_bytes()


def test_main_from_runs_the_phase_on_a_saved_main_training(script, corpus, runs, tmp_path,
                                                           capsys):
    """The main training alone, saved, then --main-from it: the files of one run."""
    main_only, final = tmp_path / "main", tmp_path / "final"
    args = [a for a in ARGS]
    args[args.index("--repetition-steps") + 1] = "0"
    assert script.main(["--out", str(main_only), "--corpus", str(corpus), *args]) == 0
    assert "repetition" not in json.loads((main_only / "training.json").read_text())
    assert script.main(["--out", str(final), "--corpus", str(corpus), *ARGS,
                        "--main-from", str(main_only)]) == 0
    assert "taken from" in capsys.readouterr().err
    for name in ("model.safetensors", "tokenizer.json"):
        assert (final / name).read_bytes() == (runs[0] / name).read_bytes(), name
    info = json.loads((final / "training.json").read_text())
    assert info["steps"] == 4 and info["repetition"]["steps"] == 3
    # a folder that is not such a checkpoint is refused
    assert script.main(["--out", str(tmp_path / "x"), "--corpus", str(corpus), *ARGS,
                        "--main-from", str(tmp_path)]) == 2
    assert "not a checkpoint this script saved" in capsys.readouterr().err
