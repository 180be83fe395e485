"""Fine-tuning under real FSDP2 sharding on two CPU processes (gloo): sharded training equals one plain process.

accelerate runs an FSDP config as DDP on a CPU, so the recipe's tests never split a parameter across processes;
`scripts/fsdp_sharding_check.py` shards the recipe's student with torch's `fully_shard` (the units the shipped FSDP2
config asks for, activation checkpointing included), trains it with the recipe's loss, checkpoints and resumes
through torch.distributed.checkpoint, evaluates it with the recipe's distributed evaluation, gathers and saves it
with the recipe's save, and compares with a one-process unsharded run of the same steps.
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


@pytest.mark.parametrize("train", ["attention", "all"])
def test_two_sharded_processes_train_like_one_plain_process(tmp_path, stories_mla, stories260k, tinystories_text, train):
    common = ["--model", str(stories_mla), "--teacher", str(stories260k), "--text", str(tinystories_text),
              "--steps", "3", "--train", train]
    reference, sharded = tmp_path / "reference", tmp_path / "sharded"
    done = run(common + ["--out", str(reference), "--no-shard"])
    assert done.returncode == 0, done.stderr[-3000:]
    done = run(common + ["--out", str(sharded), "--resume-at", "2"], processes=2)
    assert done.returncode == 0, done.stderr[-3000:]

    result = json.loads((sharded / "result.json").read_text())
    layers = json.loads((stories_mla / "config.json").read_text())["num_hidden_layers"]
    assert (result["world_size"], result["sharded"], result["backend"]) == (2, True, "gloo")
    assert len(result["units"]) == layers + 2  # a unit per decoder layer, the embedding/norm/head unit, the root
    assert result["resume_at"] == 2 and (sharded / "checkpoint").is_dir()  # every rank wrote its shard
    assert result["perplexity_windows"] == 3  # odd: one process ran the evaluation's padding forward (else: a hang)
    assert len(list((sharded / "checkpoint").glob("*.distcp"))) == 2
    if train == "attention":  # frozen MLPs and trained attention share each layer's unit
        assert result["frozen_parameters"] > 0 and result["trainable_parameters"] > 0
    else:
        assert result["frozen_parameters"] == 0

    judged = run(["--compare", str(reference), str(sharded)])
    assert judged.returncode == 0, judged.stdout + judged.stderr
    assert "sharded training equals the reference" in judged.stdout
    assert "perplexity after training (3 windows, spread over the processes)" in judged.stdout


def test_the_comparison_catches_a_weight_that_sharding_got_wrong(tmp_path, stories_mla, stories260k, tinystories_text):
    """The check must be able to fail: one attention tensor of the sharded run off by 1e-3 of its size."""
    common = ["--model", str(stories_mla), "--teacher", str(stories260k), "--text", str(tinystories_text),
              "--steps", "1"]
    reference, sharded = tmp_path / "reference", tmp_path / "sharded"
    assert run(common + ["--out", str(reference), "--no-shard"]).returncode == 0
    assert run(common + ["--out", str(sharded)], processes=2).returncode == 0
    assert run(["--compare", str(reference), str(sharded)]).returncode == 0

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
    judged = run(["--compare", str(reference), str(broken)])
    assert judged.returncode == 1
    assert "trained weights differ" in judged.stdout
