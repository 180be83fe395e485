"""Fine-tuning checkpoints are data: no code from a checkpoint folder runs on --resume, a damaged checkpoint is
found before anything loads (and `--resume auto` falls back to the last sound one), a full disk is found before
training or named when a write fails, and the checkpoint folder never takes over a folder of the user's.

Bait pickles are real pickles whose loading would create a file: each test asserts the file never appears.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import save_tiny_model

from mla_convert.convert import CalibrationOptions, ConvertOptions, convert
from mla_convert.finetune import checkpoint as checkpoints
from mla_convert.finetune.checkpoint import (
    COMPLETE_MARKER,
    CheckpointError,
    checkpoints_held,
    disk_problems,
    verify_checkpoint,
)
from mla_convert.finetune.config import FinetuneConfig, FinetuneConfigError
from mla_convert.finetune.trainer import LOG_FILE, run_finetune

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ckpt-model")
    source = save_tiny_model(root / "src", family="llama", weight_scale=3.0)
    output = root / "mla"
    convert(source, output, ConvertOptions(compression=2, calibration=CalibrationOptions(num_samples=4, seq_len=32)))
    return output


def _config(model: Path, root: Path, name: str, **overrides) -> FinetuneConfig:
    values = dict(model=str(model), output=str(root / name), checkpoint_dir=str(root / f"{name}.ckpt"),
                  teacher_samples=16, sample_batch_size=8, seq_len=32, micro_batch_size=2, grad_accum=1, max_steps=6,
                  train="attention", warmup_steps=1, lr=3e-3, checkpoint_every=2, keep_checkpoints=3, log_every=1,
                  num_threads=1, seed=3)
    values.update(overrides)
    config = FinetuneConfig(**values)
    config.validate()
    return config


def _quiet(text: str) -> None:
    pass


@pytest.fixture(scope="module")
def runs(converted, tmp_path_factory):
    """A 6-step run done straight, and the same run stopped at step 4 (checkpoints at steps 2 and 4)."""
    root = tmp_path_factory.mktemp("ckpt-runs")
    straight = run_finetune(_config(converted, root, "straight"), log=_quiet)
    stopped = run_finetune(_config(converted, root, "stopped", stop_after=4), log=_quiet)
    return root, straight, stopped


def _copy_checkpoints(runs, tmp_path: Path) -> Path:
    root, _, stopped = runs
    return Path(shutil.copytree(root / "stopped.ckpt", tmp_path / "copy.ckpt"))


def _resume(converted: Path, tmp_path: Path, checkpoint_dir: Path, resume: str = "auto", log=_quiet):
    return run_finetune(_config(converted, tmp_path, "resumed", checkpoint_dir=str(checkpoint_dir), resume=resume), log=log)


def _same_weights(a: Path, b: Path) -> bool:
    first, second = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return first.keys() == second.keys() and all(torch.equal(first[name], second[name]) for name in first)


class _Bait:
    """Unpickling it calls `Path.touch` on the sentinel: what a crafted checkpoint would do with a worse callable."""

    def __init__(self, sentinel: Path):
        self.sentinel = sentinel

    def __reduce__(self):
        return (Path.touch, (self.sentinel,))


def _reseal(folder: Path) -> None:
    """Rewrite the manifest to match the folder's files, as an attacker who edits the checkpoint would."""
    marker = json.loads((folder / COMPLETE_MARKER).read_text())
    marker["files"] = {path.relative_to(folder).as_posix(): {"bytes": path.stat().st_size,
                                                             "sha256": checkpoints._sha256(path)}
                       for path in sorted(folder.rglob("*")) if path.is_file() and path.name != COMPLETE_MARKER}
    (folder / COMPLETE_MARKER).write_text(json.dumps(marker))


# --------------------------------------------------------------------------- the format
def test_a_checkpoint_holds_data_files_only_and_the_resume_is_exact(runs, converted, tmp_path):
    root, straight, stopped = runs
    latest = stopped.checkpoint
    names = sorted(path.name for path in latest.iterdir())
    assert names == ["checkpoint_complete.json", "model.safetensors", "optimizer.bin", "random_states_0.pkl",
                     "trainer_state.json"]
    marker = verify_checkpoint(latest)
    assert marker["step"] == 4 and set(marker["files"]) == set(names) - {COMPLETE_MARKER}
    states = json.loads((latest / "trainer_state.json").read_text())
    assert set(states) == {"scheduler", "cursor", "trainer"} and states["trainer"]["step"] == 4
    resumed = _resume(converted, tmp_path, _copy_checkpoints(runs, tmp_path))
    assert resumed.state.step == 6 and _same_weights(straight.output, resumed.output)
    assert resumed.state.losses == straight.state.losses


# --------------------------------------------------------------------------- class 1: no code runs
def test_a_pickle_planted_in_a_checkpoint_is_refused_and_never_unpickled(runs, converted, tmp_path):
    """accelerate loads `custom_checkpoint_*.pkl` with weights_only=False; this version never writes or reads one."""
    ckpt = _copy_checkpoints(runs, tmp_path)
    sentinel = tmp_path / "ran"
    latest = ckpt / "step-0000004"
    (latest / "custom_checkpoint_0.pkl").write_bytes(pickle.dumps(_Bait(sentinel)))
    with pytest.raises(CheckpointError, match="custom_checkpoint_0.pkl, which its manifest does not list"):
        _resume(converted, tmp_path, ckpt, resume=str(latest))
    assert not sentinel.exists()


@pytest.mark.parametrize("name", ["optimizer.bin", "random_states_0.pkl"])
def test_a_torch_file_replaced_by_code_is_refused_even_with_a_matching_manifest(runs, converted, tmp_path, name):
    ckpt = _copy_checkpoints(runs, tmp_path)
    sentinel = tmp_path / "ran"
    latest = ckpt / "step-0000004"
    torch.save({"state": _Bait(sentinel)}, latest / name)  # a real torch zip file, as accelerate writes them
    _reseal(latest)
    with pytest.raises(CheckpointError, match=f"{name} is not plain tensor data"):
        _resume(converted, tmp_path, ckpt, resume=str(latest))
    assert not sentinel.exists()


def test_checkpoint_metadata_builds_only_record_classes(tmp_path):
    """FSDP's sharded checkpoints carry a plain-pickle `.metadata`: real metadata passes, a bait is refused."""
    import torch.distributed.checkpoint as dcp

    real = tmp_path / "real"
    with pytest.warns(UserWarning):  # (torch says it saves in one process)
        dcp.save({"w": torch.ones(3, 2), "step": 3, "lr": 1e-3}, checkpoint_id=str(real), no_dist=True)
    assert checkpoints._check_data_file(real / ".metadata") is None
    sentinel = tmp_path / "ran"
    bait = tmp_path / "bait" / ".metadata"
    bait.parent.mkdir()
    bait.write_bytes(pickle.dumps(_Bait(sentinel)))
    assert "not plain records" in checkpoints._check_data_file(bait)
    assert not sentinel.exists()
    plain_pickle = tmp_path / "state.pkl"  # a raw pickle (not torch's zip format): never part of a checkpoint
    plain_pickle.write_bytes(pickle.dumps({"step": 1}))
    assert checkpoints._check_data_file(plain_pickle) == "a kind of file a checkpoint never holds"
    assert checkpoints._check_data_file(real / "__0_0.distcp") is None


# --------------------------------------------------------------------------- class 4: damaged checkpoints
def test_resume_auto_falls_back_from_a_truncated_checkpoint_and_says_so(runs, converted, tmp_path):
    _, straight, _ = runs
    ckpt = _copy_checkpoints(runs, tmp_path)
    optimizer = ckpt / "step-0000004" / "optimizer.bin"
    optimizer.write_bytes(optimizer.read_bytes()[: optimizer.stat().st_size // 2])
    lines = []
    resumed = _resume(converted, tmp_path, ckpt, log=lines.append)
    assert resumed.state.resumed_from == [str(ckpt / "step-0000002")]
    assert any("optimizer.bin holds" in line and "truncated" in line and "resuming from the earlier step-0000002"
               in line for line in lines), lines
    assert _same_weights(straight.output, resumed.output)  # the steps after step 2 were trained again


def test_an_explicit_damaged_checkpoint_and_no_sound_checkpoint_stop_with_a_clear_error(runs, converted, tmp_path):
    ckpt = _copy_checkpoints(runs, tmp_path)
    for step in ("step-0000002", "step-0000004"):
        model = ckpt / step / "model.safetensors"
        data = bytearray(model.read_bytes())
        data[-1] ^= 0xFF  # same size, other content
        model.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="step-0000004: model.safetensors changed since it was written"):
        _resume(converted, tmp_path, ckpt, resume=str(ckpt / "step-0000004"))
    with pytest.raises(CheckpointError, match="no checkpoint in .* can be resumed"):
        _resume(converted, tmp_path, ckpt)
    assert not (tmp_path / "resumed").exists()


def test_a_marker_that_is_not_json_and_a_checkpoint_of_the_old_format_are_named(runs, tmp_path):
    ckpt = _copy_checkpoints(runs, tmp_path)
    (ckpt / "step-0000004" / COMPLETE_MARKER).write_text('{"step": 4, "fil')
    with pytest.raises(CheckpointError, match="its checkpoint_complete.json cannot be read"):
        verify_checkpoint(ckpt / "step-0000004")
    (ckpt / "step-0000002" / COMPLETE_MARKER).write_text(json.dumps({"step": 2, "settings": {}}))
    with pytest.raises(CheckpointError, match="no file list .* start a new run"):
        verify_checkpoint(ckpt / "step-0000002")


def test_a_torn_last_log_line_and_a_leftover_partial_checkpoint_do_not_stop_the_resume(runs, converted, tmp_path):
    _, straight, _ = runs
    ckpt = _copy_checkpoints(runs, tmp_path)
    with open(ckpt / LOG_FILE, "a") as log:
        log.write('{"step": 5, "tokens": 3')  # the process died mid-line
    partial = ckpt / "step-0000006.partial"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"\0" * 64)
    lines = []
    resumed = _resume(converted, tmp_path, ckpt, log=lines.append)
    assert not partial.exists() and any("step-0000006.partial, left behind" in line for line in lines)
    steps = [json.loads(line)["step"] for line in (ckpt / LOG_FILE).read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6] and _same_weights(straight.output, resumed.output)


# --------------------------------------------------------------------------- class 4: the user's folder, the disk
def test_a_checkpoint_dir_holding_the_users_files_is_refused_and_left_alone(converted, tmp_path):
    mine = tmp_path / "my-notes"
    mine.mkdir()
    (mine / "train_log.jsonl").write_text("my own log\n")
    (mine / "step-0000002").mkdir()
    with pytest.raises(FinetuneConfigError, match="holds files mla-convert did not write .*step-0000002, train_log"):
        run_finetune(_config(converted, tmp_path, "run", checkpoint_dir=str(mine)), log=_quiet)
    assert (mine / "train_log.jsonl").read_text() == "my own log\n"
    assert sorted(path.name for path in mine.iterdir()) == ["step-0000002", "train_log.jsonl"]


def test_disk_space_is_summed_per_file_system_and_checkpoints_held_are_counted(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    (tmp_path / "a").mkdir()
    assert disk_problems([(tmp_path, free // 4, "checkpoints"), (tmp_path / "a", free // 4, "the output")]) == []
    problems = disk_problems([(tmp_path, free // 2 + 1, "checkpoints"), (tmp_path / "a", free // 2, "the output")])
    assert len(problems) == 1 and "checkpoints" in problems[0] and "the output" in problems[0]
    assert checkpoints_held(max_steps=300, checkpoint_every=0, keep=2) == 1  # a stop still writes one
    assert checkpoints_held(max_steps=300, checkpoint_every=100, keep=2) == 3
    assert checkpoints_held(max_steps=300, checkpoint_every=200, keep=5) == 2


def test_a_run_the_disk_cannot_hold_is_refused_before_training(converted, tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoints, "DISK_MARGIN", 1e15)  # every size this many times: more than any disk holds
    with pytest.raises(FinetuneConfigError, match="not enough disk space .*checkpoint.* the output"):
        run_finetune(_config(converted, tmp_path, "run"), log=_quiet)
    assert not (tmp_path / "run").exists() and not (tmp_path / "run.ckpt").exists()


FILE_SIZE_LIMITED_RUN = textwrap.dedent("""
    import resource, signal, sys
    from mla_convert.cli import app
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
    limit = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    sys.argv = ["mla-convert", "finetune"] + sys.argv[2:]
    app()
""")


def test_a_checkpoint_that_cannot_be_written_removes_its_pieces_and_names_the_last_good_one(converted, tmp_path):
    """Files may grow to 4 KiB less than the student's weights: the teacher samples and the log fit, the
    checkpoint's model.safetensors does not (the real write fails, as on a full disk)."""
    weights = (converted / "model.safetensors").stat().st_size  # the checkpoint holds the student in fp32, no smaller
    args = ["--model", str(converted), "--output", str(tmp_path / "run"), "--checkpoint-dir", str(tmp_path / "run.ckpt"),
            "--teacher-samples", "16", "--sample-batch-size", "8", "--seq-len", "32", "--micro-batch-size", "2",
            "--max-steps", "4", "--train", "attention", "--warmup-steps", "1", "--checkpoint-every", "2",
            "--num-threads", "1"]
    result = subprocess.run([sys.executable, "-c", FILE_SIZE_LIMITED_RUN, str(weights - 4096), *args],
                            capture_output=True, text=True, cwd=tmp_path, timeout=600,
                            env=os.environ | {"PYTHONPATH": str(REPO)})
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert "error: checkpoint step-0000002: could not be written" in result.stderr, result.stderr[-2000:]
    assert "no earlier checkpoint exists" in result.stderr
    assert not list((tmp_path / "run.ckpt").glob("step-*")) and not (tmp_path / "run").exists()
