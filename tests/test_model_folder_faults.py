"""Every command that reads a model folder, against a catalogue of folder faults: it fails cleanly before doing work.

The catalogue: a tensor missing, a tensor the config has no place for, a weight of a non-float dtype, a truncated
shard, a FIFO where the shard, config.json or tokenizer_config.json should be, and a folder whose name is not valid
UTF-8.  For each (command, fault) the
command must exit 2 with `error:` lines naming the problem, print no traceback, and write nothing.  The commands
run in a subprocess with a time limit (a FIFO read without a check blocks forever).

Also here: the one compatibility rule for two models (a teacher like a baseline) and the one loader's refusal of
weights that do not match their config (eval --update-card wrote the scores of a partly random model into a card).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_journey import plant_bait
from tiny_models import save_tiny_model, save_tiny_tokenizer
from typer.testing import CliRunner

from mla_convert import cli

REPO = Path(__file__).resolve().parents[1]
FAST = ["--calib-samples", "2", "--calib-seq-len", "16", "--refine-steps", "0", "--no-kv-balance-search",
        "--rope-finalists", "1"]
FAULTS = ["missing-tensor", "extra-tensor", "integer-weight", "truncated-shard", "fifo-shard", "fifo-config",
          "fifo-tokenizer-settings", "non-utf8-name"]
# a FIFO in place of one of these files (reading it blocks until something writes into the FIFO)
FIFO_FILES = {"fifo-shard": "model.safetensors", "fifo-config": "config.json",
              "fifo-tokenizer-settings": "tokenizer_config.json"}
# what each command's error says for each fault (a fragment of the message)
SAYS = {"missing-tensor": "model.layers.0.mlp.up_proj.weight", "extra-tensor": "model.layers.9.mlp.up_proj.weight",
        "integer-weight": "model.layers.0.mlp.up_proj.weight", "truncated-shard": "model.safetensors",
        "fifo-shard": "model.safetensors", "fifo-config": "config.json: is a FIFO",
        "fifo-tokenizer-settings": "tokenizer_config.json: is a FIFO", "non-utf8-name": "is not valid UTF-8"}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    source = save_tiny_model(root / "src", vocab_size=128, num_layers=1)
    save_tiny_tokenizer(source, vocab_size=128)
    converted = root / "converted"
    result = CliRunner().invoke(cli.app, ["convert", str(source), str(converted), "-c", "2", *FAST, "-q"])
    assert result.exit_code == 0, result.output
    text = root / "text.txt"
    text.write_text("Once upon a time there was a tiny model that read a tiny text. " * 40)
    return {"source": source, "converted": converted, "text": text, "root": root}


def damaged_copy(folder: Path, fault: str, base: Path) -> Path:
    """A copy of `folder` with one fault of the catalogue (a path whose name is not UTF-8 for `non-utf8-name`)."""
    name = os.fsdecode(b"model-\xff") if fault == "non-utf8-name" else "model"
    copy = Path(shutil.copytree(folder, base / name))
    shard = copy / "model.safetensors"
    if fault in ("missing-tensor", "extra-tensor", "integer-weight"):
        tensors = load_file(str(shard))
        if fault == "missing-tensor":
            del tensors["model.layers.0.mlp.up_proj.weight"]
        elif fault == "extra-tensor":
            tensors["model.layers.9.mlp.up_proj.weight"] = torch.zeros(4, 4)
        else:
            tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"].to(torch.int32)
        save_file(tensors, str(shard), metadata={"format": "pt"})
    elif fault == "truncated-shard":
        data = shard.read_bytes()
        shard.write_bytes(data[: len(data) // 2])
    elif fault in FIFO_FILES:
        (copy / FIFO_FILES[fault]).unlink()
        os.mkfifo(copy / FIFO_FILES[fault])
    return copy


def command_line(command: str, model: Path, world, out: Path) -> list[str]:
    text = str(world["text"])
    return {
        "inspect": ["inspect", str(model)],
        "convert": ["convert", str(model), str(out), "-c", "2", *FAST, "-q"],
        "eval": ["eval", str(model), "--data", text, "--context", "32", "--max-windows", "2", "--json", str(out)],
        "generate": ["generate", str(model), "hello", "--max-new-tokens", "2"],
        "finetune": ["finetune", str(model), str(out), "--max-steps", "2", "--warmup-steps", "0", "--teacher", str(world["source"]),
                     "--teacher-samples", "4", "--sample-batch-size", "4", "--seq-len", "16", "--micro-batch-size", "2",
                     "--num-threads", "1"],
        "push": ["push", str(model), "someone/model", "--dry-run"],
    }[command]


# which folder each command reads: the source (MHA) or the conversion
READS = {"inspect": "source", "convert": "source", "eval": "converted", "generate": "converted", "finetune": "converted",
         "push": "converted"}


# commands that answer from config.json and never read the weights or the tokenizer (their faults are not theirs to find)
CONFIG_ONLY = {"inspect"}
BEYOND_CONFIG_FAULTS = {"missing-tensor", "extra-tensor", "integer-weight", "truncated-shard", "fifo-shard",
                 "fifo-tokenizer-settings"}


def run_cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mla_convert.cli", *args], capture_output=True, cwd=cwd, timeout=300,
                          env=os.environ | {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})


@pytest.mark.slow
@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("command", list(READS))
def test_every_command_refuses_every_folder_fault_before_any_work(world, tmp_path, command, fault):
    model = damaged_copy(world[READS[command]], fault, tmp_path)
    out = tmp_path / "out"
    result = run_cli(command_line(command, model, world, out), tmp_path)
    stderr = result.stderr.decode("utf-8", "replace")
    if command in CONFIG_ONLY and fault in BEYOND_CONFIG_FAULTS:  # documented: inspect answers from config.json alone
        assert result.returncode == 0 and "Traceback" not in stderr, stderr[-2500:]
        assert "KV cache" in result.stdout.decode("utf-8", "replace")
        return
    assert result.returncode == 2, f"{command} / {fault}: exit {result.returncode}\n{stderr[-2500:]}"
    assert "Traceback" not in stderr, stderr[-2500:]
    assert "error:" in stderr and SAYS[fault] in stderr, stderr[-2500:]
    assert not out.exists() and not list(tmp_path.glob("out*"))


def run_in_process(args: list[str]):
    result = CliRunner().invoke(cli.app, [str(arg) for arg in args])
    assert "Traceback" not in result.output
    return result


# --------------------------------------------------------------------------- one loader: weights match the config
def test_eval_update_card_refuses_weights_that_do_not_match_the_config_and_leaves_the_card(world, tmp_path):
    """transformers filled the missing tensor with random values and eval wrote that model's score into the card."""
    model = damaged_copy(world["converted"], "missing-tensor", tmp_path)
    card = (model / "README.md").read_bytes() if (model / "README.md").exists() else None
    result = run_in_process(["eval", model, "--baseline", world["source"], "--data", world["text"], "--context", "32",
                             "--max-windows", "2", "--update-card"])
    assert result.exit_code == 2, result.output
    message = " ".join(result.stderr.split())
    assert "the weights do not match config.json: 1 tensor(s) the model config.json describes needs" in message
    assert "model.layers.0.mlp.up_proj.weight" in message and "LOAD REPORT" not in result.output
    assert ((model / "README.md").read_bytes() if (model / "README.md").exists() else None) == card


def test_the_loader_refuses_a_checkpoint_holding_more_layers_than_its_config(world, tmp_path):
    from mla_convert.errors import CheckpointError
    from mla_convert.io.hf_loading import load_causal_lm

    model = damaged_copy(world["source"], "extra-tensor", tmp_path)
    with pytest.raises(CheckpointError, match="1 tensor.* has no place for: model.layers.9.mlp.up_proj.weight"):
        load_causal_lm(model)
    assert load_causal_lm(world["source"]) is not None  # the undamaged folder loads


# --------------------------------------------------------------------------- one rule for two models
def finetune_args(world, tmp_path: Path, teacher: Path) -> list:
    return ["finetune", world["converted"], tmp_path / "out", "--teacher", teacher, "--max-steps", "2",
            "--warmup-steps", "0", "--teacher-samples", "4", "--sample-batch-size", "4", "--seq-len", "16",
            "--micro-batch-size", "2", "--num-threads", "1"]


def test_a_teacher_with_another_tokenizer_is_refused_as_a_baseline_is(world, tmp_path):
    other = Path(shutil.copytree(world["source"], tmp_path / "other-tokenizer"))
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]  # same size, other ids for two letters
    (other / "tokenizer.json").write_text(json.dumps(spec))
    distilled = run_in_process(finetune_args(world, tmp_path, other))
    assert distilled.exit_code == 2, distilled.output
    assert "--teacher" in distilled.stderr and "its tokenizer differs from that of" in " ".join(distilled.stderr.split())
    compared = run_in_process(["eval", world["converted"], "--baseline", other, "--data", world["text"], "--context", "32",
                               "--max-windows", "2"])
    assert compared.exit_code == 2 and "its tokenizer differs from that of" in " ".join(compared.stderr.split())
    assert not (tmp_path / "out").exists()


def test_the_student_or_a_copy_of_it_as_its_own_teacher_is_refused(world, tmp_path):
    itself = run_in_process(finetune_args(world, tmp_path, world["converted"]))
    assert itself.exit_code == 2 and "is the model being trained" in " ".join(itself.stderr.split())
    copy = Path(shutil.copytree(world["converted"], tmp_path / "copy"))
    copied = run_in_process(finetune_args(world, tmp_path, copy))
    assert copied.exit_code == 2, copied.output
    assert "computes the same next-token distribution as the model being trained" in " ".join(copied.stderr.split())
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- smaller ones
def test_generate_refuses_an_end_of_text_id_outside_the_vocabulary(world, tmp_path):
    model = Path(shutil.copytree(world["converted"], tmp_path / "model"))
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": 128}))
    result = run_in_process(["generate", model, "hello", "--max-new-tokens", "2"])
    assert result.exit_code == 2, result.output
    assert "eos_token_id 128 is outside the vocabulary (ids 0..127)" in " ".join(result.stderr.split())


def test_sweep_refuses_an_out_dir_inside_the_source_folder(world, tmp_path):
    source = Path(shutil.copytree(world["source"], tmp_path / "src"))
    before = sorted(path.name for path in source.iterdir())
    for out_dir in (source, source / "results"):
        result = run_in_process(["sweep", source, "--data", world["text"], "--ratios", "2", "--out-dir", out_dir])
        assert result.exit_code == 2, result.output
        assert "is the source folder" in " ".join(result.stderr.split())
    assert sorted(path.name for path in source.iterdir()) == before


# --------------------------------------------------------------------------- no code from a model folder
def test_finetune_and_push_never_run_code_from_a_model_folder(world, tmp_path):
    """The bait test of eval and generate (test_journey) for the other two commands that load a model folder: the
    student and the teacher of finetune, and the folder push checks and lists."""
    marker = tmp_path / "IMPORTED"
    student = plant_bait(Path(shutil.copytree(world["converted"], tmp_path / "student")), marker)
    teacher = plant_bait(Path(shutil.copytree(world["source"], tmp_path / "teacher")), marker)
    trained = run_in_process(["finetune", student, tmp_path / "out", "--teacher", teacher, "--max-steps", "2",
                              "--warmup-steps", "0", "--teacher-samples", "4", "--sample-batch-size", "4", "--seq-len", "16",
                              "--micro-batch-size", "2", "--num-threads", "1"])
    assert trained.exit_code == 0, trained.output
    assert "auto_map" not in json.loads((tmp_path / "out" / "config.json").read_text())
    listed = run_in_process(["push", student, "someone/model", "--dry-run"])
    assert listed.exit_code == 0, listed.output
    assert not marker.exists(), marker.read_text()
