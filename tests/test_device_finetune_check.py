"""scripts/device_finetune_check.py: the FSDP fine-tuning check prepared for a GPU session.

FSDP itself cannot run here (accelerate runs an FSDP config as plain CPU processes), so these tests check what can
be checked on a CPU: the FSDP config it launches is the shipped one with one process, its verdicts on recorded
results (a run that did not get FSDP, a resume that drifted, a save that lost the model all fail it), and the CPU dry
run end to end on stories260K (four real `accelerate launch` runs; the resume and the repeated run bit for bit)."""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


def load_check():
    spec = importlib.util.spec_from_file_location("device_finetune_check", REPO / "scripts" / "device_finetune_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["device_finetune_check"] = module
    spec.loader.exec_module(module)
    return module


check = load_check()


def test_the_fsdp_run_uses_the_shipped_config_with_one_process(tmp_path, monkeypatch):
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    path = check.fsdp_one_process_config(tmp_path)
    shipped = yaml.safe_load((REPO / "recipes" / "configs" / "accelerate" / "fsdp_4gpu.yaml").read_text())
    written = yaml.safe_load(path.read_text())
    assert shipped["num_processes"] == 4 and written == shipped | {"num_processes": 1}
    # what accelerate makes of it: an FSDP2 launch of one process (a GPU launch, so the env is built, not run)
    prefix = check.launch_prefix("fsdp", cpu=False, fsdp_config=path)
    assert prefix[1:4] == ["-m", "accelerate.commands.launch", "--config_file"]
    args = launch_command_parser().parse_args(prefix[3:] + [str(check.RECIPE)])
    args, _, _ = _validate_launch_command(args)
    env = prepare_multi_gpu_env(args)
    assert args.use_fsdp and args.num_processes == 1
    assert env["FSDP_VERSION"] == "2" and env["FSDP_STATE_DICT_TYPE"] == "SHARDED_STATE_DICT"
    assert check.launch_prefix("single", cpu=False, fsdp_config=path)[-1].endswith("accelerate/1gpu.yaml")
    assert "--cpu" in check.launch_prefix("fsdp", cpu=True, fsdp_config=None)


def test_the_stopped_and_resumed_runs_share_their_checkpoints_and_differ_only_in_stop_and_resume(tmp_path):
    args = type("Args", (), dict(steps=8, seq_len=64, text=tmp_path / "t.txt", eval_text=tmp_path / "e.txt", cpu=False,
                                 threads=2))
    flags = {run: check.run_settings(args, tmp_path / "model", tmp_path, run) for run in check.RUNS}

    def without(run, *names):  # the flags minus the output, the checkpoint folder and the named flags (with values)
        items, kept = flags[run], []
        skip = {"--checkpoint-dir", *names}
        index = 2
        while index < len(items):
            if items[index] in skip:
                index += 2
                continue
            kept.append(items[index])
            index += 1
        return kept

    assert without("single") == without("fsdp") == without("fsdp-stopped", "--stop-after") == \
        without("fsdp-resumed", "--resume")
    stopped, resumed = flags["fsdp-stopped"], flags["fsdp-resumed"]
    assert stopped[stopped.index("--stop-after") + 1] == "4" and resumed[resumed.index("--resume") + 1] == "auto"
    assert stopped[stopped.index("--checkpoint-dir") + 1] == resumed[resumed.index("--checkpoint-dir") + 1]
    assert flags["fsdp"][flags["fsdp"].index("--checkpoint-dir") + 1] != stopped[stopped.index("--checkpoint-dir") + 1]
    assert flags["fsdp"][flags["fsdp"].index("--mixed-precision") + 1] == "bf16"


def _run(distributed: str, perplexity_after: float, losses: list[float], save=(0.02, 12.0)) -> dict:
    return {"returncode": 0, "wall_seconds": 30.0, "steps": 16, "distributed": distributed, "processes": 1,
            "mixed_precision": "bf16", "device": "cuda:0", "seconds": 20.0, "loss_first": losses[0], "loss_last": losses[-1],
            "perplexity_before": 40.0, "perplexity_after": perplexity_after, "resumed": 0,
            "save_check_max_logit_difference": save[0], "save_check_max_logit": save[1], "losses": losses}


def _gpu_results() -> dict:
    losses = [2.2, 2.0, 1.9, 1.8]
    results = {"meta": {"date": "2026-12-05", "torch": "2.11.0+cu130", "transformers": "5.17.0", "gpu": "NVIDIA H200",
                        "accelerate": "1.15.0"},
               "cpu": False, "steps": 16, "seq_len": 128, "convert": {"command": "mla-convert convert ...", "returncode": 0},
               "runs": {"single": _run("NO", 20.0, [2.2, 2.01, 1.9, 1.81]), "fsdp": _run("FSDP", 20.3, losses),
                        "fsdp-stopped": {"returncode": 0, "wall_seconds": 20.0, "checkpoints": ["step-0000008"]},
                        "fsdp-resumed": _run("FSDP", 20.3, list(losses)) | {"resumed": 1}},
               "resume": {"same_tensors": True, "bit_identical": True, "max_abs_difference": 0.0},
               "fsdp_vs_single": {"same_tensors": True, "bit_identical": False, "max_abs_difference": 3e-3}}
    results["checks"] = check.judge(results)
    return results


def test_a_gpu_run_that_did_what_the_recipe_promises_passes():
    results = _gpu_results()
    assert results["checks"] == {"fsdp ran": True, "resume reproduces the straight run": True,
                                 "fsdp learns what one process learns": True,
                                 "saved folders reload with the trained logits": True}
    assert check.passed(results)
    section = check.render(results)
    assert "accelerate 1.15.0" in section and "| fsdp | FSDP | 1 | bf16 | cuda:0 |" in section and "fsdp_4gpu.yaml` with `num_processes: 1`" in section
    assert "Saved weights, fsdp-resumed against fsdp: bit-identical: yes" in section and "| fsdp ran | passed |" in section


@pytest.mark.parametrize("spoil, failed", [
    (lambda r: r["runs"]["fsdp"].update(distributed="MULTI_GPU"), "fsdp ran"),  # the config did not give FSDP
    (lambda r: r["runs"]["fsdp"].update(perplexity_after=21.0), "fsdp learns what one process learns"),  # 5 % apart
    (lambda r: r["runs"]["fsdp-resumed"].update(losses=[2.2, 2.0, 1.9, 1.81]),  # a resume that drifted by 0.5 %
     "resume reproduces the straight run"),
    (lambda r: r["resume"].update(same_tensors=False), "resume reproduces the straight run"),
    (lambda r: r["runs"]["fsdp"].update(save_check_max_logit_difference=5.0),  # the reload lost the model
     "saved folders reload with the trained logits"),
])
def test_a_gpu_run_fails_the_check_it_breaks(spoil, failed):
    results = copy.deepcopy(_gpu_results())
    spoil(results)
    results["checks"] = check.judge(results)
    assert [name for name, verdict in results["checks"].items() if verdict is not True] == [failed]
    assert not check.passed(results)
    assert f"| {failed} | **failed** |" in check.render(results)


def test_a_gpu_resume_that_is_not_bit_for_bit_passes_within_its_tolerance_and_a_failed_run_is_not_a_pass():
    results = copy.deepcopy(_gpu_results())
    results["resume"].update(bit_identical=False, max_abs_difference=2e-3)
    results["runs"]["fsdp-resumed"]["losses"] = [2.2, 2.0, 1.9, 1.8005]  # 0.03 % apart
    assert check.judge(results)["resume reproduces the straight run"] is True
    results["runs"]["fsdp-resumed"] = {"returncode": 1, "wall_seconds": 9.0, "error": "RuntimeError: boom"}
    del results["resume"]
    results["checks"] = check.judge(results)
    assert results["checks"]["resume reproduces the straight run"] is None and not check.passed(results)
    section = check.render(results)
    assert "| fsdp-resumed | failed (rc 1): RuntimeError: boom |" in section
    assert "| resume reproduces the straight run | **not run** |" in section


def test_the_runs_keep_the_callers_python_path_behind_the_repos(tmp_path, monkeypatch):
    """A device run carries packages the image lacks as wheels unpacked on PYTHONPATH: the runs must see them."""
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    code, _ = check.launch([sys.executable, "-c", "import os; print(os.environ['PYTHONPATH'])"], tmp_path / "log")
    assert code == 0
    assert (tmp_path / "log").read_text().split() == [f"{check.REPO}:{check.REPO / 'kernels'}:{tmp_path / 'site'}"]


def test_bad_arguments_are_refused_before_anything_runs(tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        check.main(["--out", str(tmp_path / "out"), "--stories", str(tmp_path / "nothing")])
    assert stopped.value.code == 2 and "scripts/prepare_device_assets.sh makes the defaults" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_conversion_that_fails_is_recorded_and_fails_the_check(tmp_path, capsys):
    """Nothing is trained from a source that does not convert; the JSON that comes back from the device says why."""
    source = tmp_path / "broken"
    source.mkdir()
    (source / "config.json").write_text('{"model_type": "llama", "hidden_size": "wide"}')
    for name in ("train.txt", "held-out.txt"):
        (tmp_path / name).write_text("Once upon a time there was a cat.\n" * 50)
    code = check.main(["--cpu", "--out", str(tmp_path / "out"), "--stories", str(source), "--text", str(tmp_path / "train.txt"),
                       "--eval-text", str(tmp_path / "held-out.txt")])
    results = json.loads((tmp_path / "out" / "device_finetune_check.json").read_text())
    assert code == 1 and results["runs"] == {} and results["convert"]["returncode"] == 2
    assert "hidden_size" in results["convert"]["error"]
    assert "Conversion failed:" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.real_model
def test_the_cpu_dry_run_trains_stops_resumes_and_renders(stories260k, tinystories_text, tmp_path, monkeypatch):
    """Four real accelerate launches on stories260K converted at 8x (a relative --out, from another folder)."""
    text = tinystories_text.read_text(encoding="utf-8")
    cut = text.index("\n", len(text) // 2)
    (tmp_path / "train.txt").write_text(text[:cut], encoding="utf-8")
    (tmp_path / "held-out.txt").write_text(text[cut + 1:], encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    code = check.main(["--cpu", "--out", "out", "--stories", str(stories260k), "--text", "train.txt", "--eval-text",
                       "held-out.txt", "--steps", "4", "--seq-len", "64", "--threads", "1",
                       "--write-benchmarks", "BENCH.md"])
    results = json.loads((tmp_path / "out" / "device_finetune_check.json").read_text())
    assert code == 0, json.dumps(results, indent=1)[-3000:]
    runs = results["runs"]
    assert runs["fsdp-stopped"]["checkpoints"] == ["step-0000002"]
    assert runs["fsdp-resumed"]["resumed"] == 1 and runs["fsdp"]["resumed"] == 0
    assert all(runs[name]["distributed"] == "NO" and runs[name]["steps"] == 4 for name in ("single", "fsdp", "fsdp-resumed"))
    # the distillation learned something, and the resume is the straight run exactly
    assert runs["fsdp"]["perplexity_after"] < 0.9 * runs["fsdp"]["perplexity_before"]
    assert results["resume"] == {"same_tensors": True, "bit_identical": True, "max_abs_difference": 0.0}
    assert runs["fsdp-resumed"]["losses"] == runs["fsdp"]["losses"] and len(runs["fsdp"]["losses"]) == 4
    assert results["checks"]["fsdp ran"] is None
    section = (tmp_path / "BENCH.md").read_text()
    assert "a CPU-only machine (dry run: `--cpu`, no FSDP)" in section and "| fsdp ran | not judged (CPU dry run) |" in section
    assert check.main(["--from-json", str(tmp_path / "out" / "device_finetune_check.json")]) == 0
