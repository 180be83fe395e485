"""Fine-tuning under real FSDP2 sharding on two CPU processes (gloo): sharded training agrees with one plain process.

accelerate runs an FSDP config as DDP on a CPU, so the recipe's tests never split a parameter across processes;
`scripts/fsdp_sharding_check.py` shards the recipe's student with torch's `fully_shard` (the units the shipped FSDP2
config asks for, activation checkpointing included; fp32, or bf16 parameter copies as accelerate's bf16 policy),
trains it with the recipe's loss, checkpoints and resumes through torch.distributed.checkpoint, evaluates it with
the recipe's distributed evaluation, gathers and saves it with the recipe's save, and compares with a one-process
unsharded fp32 run of the same steps.
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

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "fsdp_sharding_check.py"

pytestmark = [pytest.mark.slow, pytest.mark.real_model]


def run(args: list[str], processes: int | None = None) -> subprocess.CompletedProcess:
    launcher = [sys.executable]
    env = dict(os.environ)
    if processes:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
        if sys.platform == "linux":  # gloo otherwise binds the address the host name resolves to, which a sandbox may lack
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return subprocess.run(launcher + [str(SCRIPT)] + args, capture_output=True, text=True, timeout=600, cwd=REPO,
                          env=env)


@pytest.fixture(scope="module")
def inputs(stories_mla, stories260k, tinystories_text) -> list[str]:
    return ["--model", str(stories_mla), "--teacher", str(stories260k), "--text", str(tinystories_text)]


@pytest.fixture(scope="module")
def references(tmp_path_factory, inputs) -> dict[str, Path]:
    """The one-process unsharded fp32 run of each parameter selection (default steps and learning rate)."""
    folders = {}
    for train in ("attention", "all"):
        folders[train] = tmp_path_factory.mktemp("reference") / train
        done = run(inputs + ["--train", train, "--out", str(folders[train]), "--no-shard"])
        assert done.returncode == 0, done.stderr[-3000:]
    return folders


@pytest.mark.parametrize(("train", "precision"), [("attention", "no"), ("all", "no"), ("attention", "bf16")])
def test_two_sharded_processes_train_like_one_plain_process(tmp_path, inputs, references, stories_mla, train, precision):
    sharded = tmp_path / "sharded"
    done = run(inputs + ["--train", train, "--mixed-precision", precision, "--out", str(sharded), "--resume-at", "4"],
               processes=2)
    assert done.returncode == 0, done.stderr[-3000:]

    result = json.loads((sharded / "result.json").read_text())
    layers = json.loads((stories_mla / "config.json").read_text())["num_hidden_layers"]
    assert (result["world_size"], result["sharded"], result["backend"]) == (2, True, "gloo")
    assert result["mixed_precision"] == precision
    assert len(result["units"]) == layers + 2  # a unit per decoder layer, the embedding/norm/head unit, the root
    assert result["resume_at"] == 4 and len(list((sharded / "checkpoint").glob("*.distcp"))) == 2  # a shard per rank
    assert result["perplexity_windows"] == 3  # odd: one process ran the evaluation's padding forward (else: a hang)
    if train == "attention":  # frozen MLPs and trained attention share each layer's unit
        assert result["frozen_parameters"] > 0 and result["trainable_parameters"] > 0
    else:
        assert result["frozen_parameters"] == 0

    judged = run(["--compare", str(references[train]), str(sharded)])
    assert judged.returncode == 0, judged.stdout + judged.stderr
    assert "sharded training agrees with the reference" in judged.stdout
    assert f"{precision} mixed precision): max relative difference" in judged.stdout


def test_the_comparison_catches_a_weight_that_sharding_got_wrong(tmp_path, inputs, references):
    """The check must be able to fail: one attention tensor of the sharded run off by 1e-3 of its size."""
    sharded = tmp_path / "sharded"
    assert run(inputs + ["--out", str(sharded)], processes=2).returncode == 0
    assert run(["--compare", str(references["attention"]), str(sharded)]).returncode == 0

    broken = tmp_path / "broken"
    shutil.copytree(sharded, broken)
    files = sorted((broken / "model").glob("*.safetensors"))
    for path in files:
        tensors = load_file(path)
        name = next((key for key in tensors if key.endswith("layers.1.self_attn.kv_b_proj.weight")), None)
        if name is not None:
            tensors[name] = tensors[name] + 1e-3 * tensors[name].abs().max() * torch.sign(torch.randn_like(tensors[name]))
            save_file(tensors, path, metadata={"format": "pt"})
            break
    else:
        pytest.fail(f"no kv_b_proj of layer 1 in {files}")
    judged = run(["--compare", str(references["attention"]), str(broken)])
    assert judged.returncode == 1
    assert "trained weights differ" in judged.stdout


def test_a_bf16_run_that_did_not_train_fails_the_comparison(tmp_path, inputs, references):
    """bf16 is judged by what the runs learn: a run with no training steps' worth of learning rate must fail it."""
    sharded = tmp_path / "sharded"
    assert run(inputs + ["--mixed-precision", "bf16", "--lr", "1e-9", "--out", str(sharded)], processes=2).returncode == 0
    judged = run(["--compare", str(references["attention"]), str(sharded)])
    assert judged.returncode == 1
    assert "perplexities differ" in judged.stdout and "it did not learn" in judged.stdout


def test_batch_settings_shape_the_steps_and_are_checked(tmp_path, inputs):
    out = tmp_path / "small"
    done = run(inputs + ["--steps", "2", "--seq-len", "32", "--windows-per-step", "2", "--out", str(out), "--no-shard"])
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "result.json").read_text())
    assert result["tokens_per_step"] == 2 * 32 and len(result["losses"]) == 2
    refused = run(inputs + ["--windows-per-step", "3", "--out", str(tmp_path / "odd")], processes=2)
    assert refused.returncode != 0 and "is not a multiple of the 2 processes" in refused.stderr
    assert not (tmp_path / "odd").exists()
