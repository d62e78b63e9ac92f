import json

import pytest
import torch
from omegaconf import OmegaConf

from cfbnn_cli.report.results import write_results
from cfbnn_cli.runtime import ConfigError, atomic_torch_save, atomic_write_json, resolve_device


def test_atomic_write_leaves_no_temp_files(tmp_path):
    target = tmp_path / "sub" / "a.json"
    atomic_write_json(target, {"x": 1})
    atomic_write_json(target, {"x": 2})
    assert json.loads(target.read_text()) == {"x": 2}
    assert [p.name for p in target.parent.iterdir()] == ["a.json"]


def test_atomic_write_keeps_old_file_on_failure(tmp_path):
    target = tmp_path / "a.json"
    atomic_write_json(target, {"x": 1})
    with pytest.raises(TypeError):
        atomic_write_json(target, {"x": object()})
    assert json.loads(target.read_text()) == {"x": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_atomic_torch_save_roundtrip(tmp_path):
    atomic_torch_save({"w": torch.arange(3)}, tmp_path / "c.pt")
    assert torch.equal(torch.load(tmp_path / "c.pt")["w"], torch.arange(3))


def test_write_results_schema_and_done_marker(tmp_path):
    cfg = OmegaConf.create({"seed": 1, "trainer": {"epochs": 2}, "ref": "${seed}"})
    write_results(tmp_path, "train_regression", cfg, {"rmse": 0.5, "bad": float("nan")}, wall_s=1.5, device="cpu")
    record = json.loads((tmp_path / "results.json").read_text())
    assert record["pipeline"] == "train_regression" and record["schema"] == 1 and record["status"] == "complete"
    assert record["config"]["ref"] == 1  # resolved
    assert record["metrics"] == {"rmse": 0.5, "bad": None}
    assert record["environment"]["device"] == "cpu" and record["environment"]["torch"] == torch.__version__
    assert record["timing"]["wall_s"] == 1.5
    assert (tmp_path / "done").exists()


def test_resolve_device():
    assert resolve_device("cpu").type == "cpu"
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ConfigError, match="device"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            resolve_device("cuda")


_DENORMAL_PROBE = """
import sys, torch
from cfbnn_cli.runtime.threads import denormals_flushed, flush_denormals
if sys.argv[1] == "flush":
    flush_denormals(True)  # before any torch work, as the CLI does
torch.set_num_threads(2)
tiny = torch.full((1 << 21,), 1e-20)  # large enough that both OpenMP threads take a share
squares = tiny * tiny  # 1e-40: below float32's normal range
print(int((squares != 0).sum()), denormals_flushed())
"""


@pytest.fixture(scope="module")
def denormal_probes():
    """The probe's output in each mode, both processes started at once."""
    import subprocess
    import sys

    started = {
        mode: subprocess.Popen(
            [sys.executable, "-c", _DENORMAL_PROBE, mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for mode in ("flush", "keep")
    }
    outputs = {}
    for mode, process in started.items():
        stdout, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, stderr[-3000:]
        outputs[mode] = stdout
    return outputs


@pytest.mark.parametrize("mode", ["flush", "keep"])
def test_flushing_denormals_before_any_work_reaches_every_thread(mode, denormal_probes):
    """Set first, the mode is inherited by the OpenMP threads torch creates afterwards:
    no element of a 2-thread product comes back denormal (kept, all of them do)."""
    nonzero, flushed = denormal_probes[mode].split()
    if mode == "flush":
        assert (int(nonzero), flushed) == (0, "True")
    else:
        assert (int(nonzero), flushed) == (1 << 21, "False")


def test_runtime_flush_denormals_must_be_a_bool():
    from cfbnn_cli.runtime.checks import validate_common

    cfg = OmegaConf.create(
        {"seed": 0, "device": "cpu", "resume": False, "runtime": {"threads": "auto", "flush_denormals": "yes"}}
    )
    with pytest.raises(ConfigError, match=r"runtime.flush_denormals='yes' must be true or false"):
        validate_common(cfg)


def test_progress_bars_are_drawn_on_a_terminal_only(monkeypatch):
    """Every bar comes from runtime.progress: drawn when stderr is a terminal, not in a file or pipe;
    CFBNN_PROGRESS=0 turns them off, =1 on (in a file at most one update every 30 s)."""
    import io
    import sys

    from cfbnn_cli.runtime.progress import FILE_INTERVAL_S, progress_bar

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    def drawn(stream):
        monkeypatch.setattr(sys, "stderr", stream)
        with progress_bar(total=3, desc="steps", file=stream) as bar:
            bar.update(3)
        return "steps" in stream.getvalue(), bar

    monkeypatch.delenv("CFBNN_PROGRESS", raising=False)
    assert drawn(Terminal())[0] and not drawn(io.StringIO())[0]
    monkeypatch.setenv("CFBNN_PROGRESS", "0")
    assert not drawn(Terminal())[0]
    monkeypatch.setenv("CFBNN_PROGRESS", "1")
    shown, bar = drawn(io.StringIO())
    assert shown and bar.mininterval == FILE_INTERVAL_S
    monkeypatch.setenv("CFBNN_PROGRESS", "sometimes")
    with pytest.raises(ConfigError, match="CFBNN_PROGRESS='sometimes' is not one of 1, 0, auto"):
        progress_bar(total=1)
