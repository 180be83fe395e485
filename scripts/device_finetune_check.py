"""The fine-tuning recipe under FSDP on a GPU: does the shipped FSDP setup train, save and resume?

The FSDP configs (`recipes/configs/accelerate/fsdp_{4,8}gpu.yaml`) cannot run on a CPU: accelerate turns an FSDP
config into plain multi-process CPU training there (the report then says `distributed: MULTI_CPU`), so the CPU tests
never reach FSDP's wrapping, its sharded checkpoints or its gathered save.  On one GPU, `accelerate launch` with the
shipped FSDP2 config (only `num_processes` set to 1) does run FSDP2.  This script runs there, on stories260K
converted at 8x (real weights, small enough to finish in about a minute), four `accelerate launch` runs of
`recipes/finetune_mla.py` with the same settings:

- single: `recipes/configs/accelerate/1gpu.yaml` (one process, bf16, no FSDP), the reference;
- fsdp: the shipped FSDP2 config on one process, straight through;
- fsdp-stopped + fsdp-resumed: the same FSDP run stopped half way (`--stop-after`, a sharded checkpoint), then
  resumed from it (`--resume auto`) to the end.

Checked: accelerate ran FSDP (the report's `distributed`), the resumed run ends with the straight run's weights and
losses, the FSDP run learns what the single-process run learns (held-out perplexity after training within
PERPLEXITY_TOLERANCE), and every saved folder reloads in stock transformers with the trained model's logits (the
trainer's own check, `save_check_max_logit_difference`, within SAVE_CHECK_TOLERANCE of the largest logit: bf16 mixed
precision computes the trained logits, the reload computes in the saved dtype).

    python scripts/device_finetune_check.py --out OUT [--stories PATH --text PATH --eval-text PATH] [--steps 16]
    python scripts/device_finetune_check.py --out OUT --cpu        (a dry run of the same code path on a CPU)
    python scripts/device_finetune_check.py --from-json OUT/device_finetune_check.json --write-benchmarks BENCHMARKS.md

Defaults read the assets that `scripts/prepare_device_assets.sh` puts in `.device_assets/` (the device has no
network).  With `--cpu` every run is `accelerate launch --cpu` (no FSDP: the dry run checks the plumbing, the
resume, and that two runs of the same settings agree bit for bit).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from benchmarks_md import write_marked_section  # noqa: E402
from device_convert_check import child_env, environment  # noqa: E402

SECTION_BEGIN = "<!-- device_finetune_check:begin -->"
SECTION_END = "<!-- device_finetune_check:end -->"
RECIPE = REPO / "recipes" / "finetune_mla.py"
ACCELERATE_CONFIGS = REPO / "recipes" / "configs" / "accelerate"
ASSETS = REPO / ".device_assets"
# FSDP and one plain process reduce in other orders (and FSDP2 casts parameters to bf16 where autocast casts each
# op's inputs): the two runs learn the same thing, not the same bits
PERPLEXITY_TOLERANCE = 0.03
# the reload computes in the saved dtype (fp32), the trained logits came out of bf16 mixed precision; a save that
# gathered the wrong shards or dropped the latent scale is off by the logits' own size
SAVE_CHECK_TOLERANCE = 0.1
# a GPU may pick other kernels after a restart: then Adam turns rounding differences into weight differences of up
# to the learning rate, so a resume that is not bit for bit is judged by its losses and perplexity (relative)
RESUME_TOLERANCE = 1e-3
RUNS = ("single", "fsdp", "fsdp-stopped", "fsdp-resumed")


def fsdp_one_process_config(folder: Path) -> Path:
    """The shipped FSDP2 accelerate config with `num_processes: 1` (the only change), written into `folder`."""
    import yaml

    config = yaml.safe_load((ACCELERATE_CONFIGS / "fsdp_4gpu.yaml").read_text())
    config["num_processes"] = 1
    path = folder / "fsdp_1gpu.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=True))
    return path


def launch_prefix(run: str, cpu: bool, fsdp_config: Path | None) -> list[str]:
    """`accelerate launch` and its configuration for one run."""
    launch = [sys.executable, "-m", "accelerate.commands.launch"]
    if cpu:
        return launch + ["--cpu", "--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no",
                         "--dynamo_backend", "no"]
    config = ACCELERATE_CONFIGS / "1gpu.yaml" if run == "single" else fsdp_config
    return launch + ["--config_file", str(config)]


def run_settings(args, converted: Path, work: Path, run: str) -> list[str]:
    """The recipe's flags for one run: the same training for all four; the stopped and resumed runs share a
    checkpoint folder."""
    half = max(1, args.steps // 2)
    checkpoints = work / ("fsdp-resume.ckpt" if run.startswith("fsdp-") else f"{run}.ckpt")
    flags = [str(converted), str(work / run), "--checkpoint-dir", str(checkpoints), "--data", str(args.text),
             "--seq-len", str(args.seq_len), "--micro-batch-size", "8", "--grad-accum", "1", "--max-steps", str(args.steps),
             "--warmup-steps", "2", "--lr", "3e-3", "--train", "attention", "--seed", "0", "--log-every", "1",
             "--checkpoint-every", str(half), "--keep-checkpoints", "2", "--mixed-precision", "no" if args.cpu else "bf16",
             "--eval-data", str(args.eval_text), "--eval-context", str(args.seq_len), "--eval-windows", "16",
             "--eval-every", str(args.steps), "--num-threads", str(args.threads)]
    if run == "fsdp-stopped":
        flags += ["--stop-after", str(half)]
    if run == "fsdp-resumed":
        flags += ["--resume", "auto"]
    return flags


def launch(command: list[str], log: Path) -> tuple[int, float]:
    env = child_env(PYTHONUNBUFFERED="1")
    started = time.perf_counter()
    with open(log, "w") as sink:
        done = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    return done.returncode, time.perf_counter() - started


def tail(log: Path, lines: int = 12) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def summarize(folder: Path) -> dict:
    """What one finished run reports about itself (its output folder's mla_convert.json)."""
    section = json.loads((folder / "mla_convert.json").read_text())["finetuning"]
    keys = ("steps", "distributed", "processes", "mixed_precision", "device", "seconds", "loss_first", "loss_last",
            "perplexity_before", "perplexity_after", "resumed", "save_check_max_logit_difference", "save_check_max_logit")
    return {key: section.get(key) for key in keys} | {"losses": [row[1] for row in section.get("loss_curve", [])]}


def weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for shard in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    return tensors


def weight_difference(first: Path, second: Path) -> dict:
    """Largest absolute difference between two saved folders' tensors, and whether they are equal bit for bit."""
    import torch

    a, b = weights(first), weights(second)
    if a.keys() != b.keys():
        return {"same_tensors": False, "bit_identical": False, "max_abs_difference": None}
    largest = max((a[name].float() - b[name].float()).abs().max().item() for name in a)
    return {"same_tensors": True, "bit_identical": all(torch.equal(a[name], b[name]) for name in a),
            "max_abs_difference": largest}


def resumes_exactly(resume: dict, straight: dict, resumed: dict, cpu: bool) -> bool:
    """The resumed run ends where the straight one does: the same weights and losses bit for bit; on a GPU, where a
    restarted process may pick other kernels, the same losses and held-out perplexity to RESUME_TOLERANCE."""
    if not resume["same_tensors"]:
        return False
    if resume["bit_identical"] and straight["losses"] == resumed["losses"]:
        return True
    if cpu or len(straight["losses"]) != len(resumed["losses"]):
        return False
    pairs = list(zip(straight["losses"], resumed["losses"])) + [(straight["perplexity_after"], resumed["perplexity_after"])]
    return all(abs(a - b) <= RESUME_TOLERANCE * abs(a) for a, b in pairs)


def judge(results: dict) -> dict:
    """Each check: True (passed), False (failed) or None (not run: a run it needs failed)."""
    runs, cpu = results["runs"], results["cpu"]
    ok = {name: "error" not in run for name, run in runs.items()}
    checks: dict[str, bool | None] = {}
    checks["fsdp ran"] = (runs["fsdp"].get("distributed") == "FSDP") if ok["fsdp"] and not cpu else None
    resume = results.get("resume")
    checks["resume reproduces the straight run"] = None if resume is None else resumes_exactly(
        resume, runs["fsdp"], runs["fsdp-resumed"], cpu)
    after = [runs[name].get("perplexity_after") for name in ("single", "fsdp")]
    checks["fsdp learns what one process learns"] = (
        None if None in after else abs(after[0] - after[1]) / min(after) <= (0.0 if cpu else PERPLEXITY_TOLERANCE))
    saved = [run for run in runs.values() if run.get("save_check_max_logit")]
    checks["saved folders reload with the trained logits"] = (
        None if not saved else all(run["save_check_max_logit_difference"] <= SAVE_CHECK_TOLERANCE * run["save_check_max_logit"]
                                   for run in saved))
    return checks


def measure(args) -> dict:
    out = Path(args.out)
    work = out / "work"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    import accelerate

    results = {"meta": environment() | {"accelerate": accelerate.__version__}, "cpu": args.cpu, "steps": args.steps, "seq_len": args.seq_len, "runs": {}}
    converted = work / "stories260k-mla-8x"
    command = [sys.executable, "-m", "mla_convert", "convert", str(args.stories), str(converted), "--compression", "8",
               "--calib-data", str(args.text), "--dtype", "fp32", "-q"]
    code, seconds = launch(command, work / "convert.log")
    results["convert"] = {"command": "mla-convert convert stories260k OUT --compression 8 --calib-data TEXT --dtype fp32",
                          "returncode": code, "seconds": round(seconds, 1)}
    if code != 0:
        results["convert"]["error"] = tail(work / "convert.log")
        (out / "device_finetune_check.json").write_text(json.dumps(results, indent=2) + "\n")
        return results
    fsdp_config = None if args.cpu else fsdp_one_process_config(work)
    for run in RUNS:
        command = launch_prefix(run, args.cpu, fsdp_config) + [str(RECIPE)] + run_settings(args, converted, work, run)
        code, seconds = launch(command, work / f"{run}.log")
        entry = {"returncode": code, "wall_seconds": round(seconds, 1)}
        if run == "fsdp-stopped":  # stopped runs save a checkpoint, no folder
            entry["checkpoints"] = sorted(p.name for p in (work / "fsdp-resume.ckpt").glob("step-*"))
            if code != 0:
                entry["error"] = tail(work / f"{run}.log")
        elif code != 0 or not (work / run / "mla_convert.json").is_file():
            entry["error"] = tail(work / f"{run}.log")
        else:
            entry |= summarize(work / run)
        results["runs"][run] = entry
        print(run, json.dumps(entry)[:300], flush=True)
        (out / "device_finetune_check.json").write_text(json.dumps(results, indent=2) + "\n")
    if all("error" not in results["runs"][name] for name in ("fsdp", "fsdp-resumed")):
        results["resume"] = weight_difference(work / "fsdp", work / "fsdp-resumed")
    if all("error" not in results["runs"][name] for name in ("single", "fsdp")):
        results["fsdp_vs_single"] = weight_difference(work / "single", work / "fsdp")
    results["checks"] = judge(results)
    (out / "device_finetune_check.json").write_text(json.dumps(results, indent=2) + "\n")
    return results


def _number(value, spec: str = ".4g") -> str:
    return "-" if value is None else format(value, spec)


def render(results: dict) -> str:
    meta, runs = results["meta"], results["runs"]
    where = meta.get("gpu") or "a CPU-only machine (dry run: `--cpu`, no FSDP)"
    launches = ("every run `accelerate launch --cpu --num_processes 1` (no FSDP on a CPU)" if results["cpu"] else
                "single: `configs/accelerate/1gpu.yaml`; fsdp: the shipped `fsdp_4gpu.yaml` with `num_processes: 1`")
    lines = [SECTION_BEGIN, "## Fine-tuning under FSDP (GPU)", "",
             f"Measured by `python scripts/device_finetune_check.py{' --cpu' if results['cpu'] else ''}` on {where} "
             f"({meta['date']}; torch {meta['torch']}, transformers {meta['transformers']}, "
             f"accelerate {meta.get('accelerate', '?')}): stories260K converted at 8x "
             f"(`{results['convert']['command']}`), then four `accelerate launch` runs of `recipes/finetune_mla.py`, "
             f"{results['steps']} steps of 8 x {results['seq_len']} tokens each, attention trained, held-out perplexity "
             f"on 16 windows before and after; {launches}; fsdp-stopped / fsdp-resumed: the fsdp run's settings, stopped "
             "half way (`--stop-after`) and resumed from its checkpoint (`--resume auto`).", ""]
    if "error" in results["convert"]:
        lines += ["Conversion failed:", "", "```", results["convert"]["error"], "```", SECTION_END]
        return "\n".join(lines) + "\n"
    lines += ["| run | accelerate ran | processes | precision | device | wall s | loss first | loss last | "
              "perplexity before | perplexity after | save check: max logit diff / max logit |",
              "|---|---|---:|---|---|---:|---:|---:|---:|---:|---|"]
    for name, run in runs.items():
        if "error" in run:
            lines.append(f"| {name} | failed (rc {run['returncode']}): {run['error'].splitlines()[-1][:90] if run['error'] else ''} "
                         f"| | | | {run['wall_seconds']} | | | | | |")
            continue
        if name == "fsdp-stopped":
            lines.append(f"| {name} | (checkpoints: {', '.join(run['checkpoints']) or 'none'}) | | | | {run['wall_seconds']} "
                         "| | | | | |")
            continue
        save = (f"{run['save_check_max_logit_difference']:.3g} / {run['save_check_max_logit']:.3g}"
                if run.get("save_check_max_logit") else "-")
        lines.append(f"| {name} | {run['distributed']} | {run['processes']} | {run['mixed_precision']} | {run['device']} | "
                     f"{run['wall_seconds']} | {_number(run['loss_first'])} | {_number(run['loss_last'])} | "
                     f"{_number(run['perplexity_before'])} | {_number(run['perplexity_after'])} | {save} |")
    for key, label in (("resume", "fsdp-resumed against fsdp"), ("fsdp_vs_single", "fsdp against single")):
        if key in results:
            diff = results[key]
            lines += ["", f"Saved weights, {label}: "
                      + ("different tensor names" if not diff["same_tensors"] else
                         f"bit-identical: {'yes' if diff['bit_identical'] else 'no'}, largest |difference| "
                         f"{diff['max_abs_difference']:.3g}.")]
    verdicts = {True: "passed", False: "**failed**", None: "not judged (CPU dry run)" if results["cpu"] else "**not run**"}
    lines += ["", "| check | result |", "|---|---|"]
    lines += [f"| {check} | {verdicts[verdict]} |" for check, verdict in results.get("checks", {}).items()]
    lines += ["", f"Tolerances: held-out perplexity after training, fsdp against single, within {PERPLEXITY_TOLERANCE:.0%} "
              "(bit for bit in the CPU dry run, where both are the same plain run); the resume: the same losses and "
              f"weights bit for bit (on a GPU, if not bit for bit: losses and perplexity within {RESUME_TOLERANCE:.1%}); "
              f"each save check within {SAVE_CHECK_TOLERANCE:.0%} of the largest logit.", SECTION_END]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="device-finetune-check", help="folder for the JSON, logs and runs")
    parser.add_argument("--stories", type=Path, default=ASSETS / "stories260k", help="the stories260K folder")
    parser.add_argument("--text", type=Path, default=ASSETS / "texts" / "calibration.txt",
                        help="calibration and training text")
    parser.add_argument("--eval-text", type=Path, default=ASSETS / "texts" / "held-out.txt", help="held-out text")
    parser.add_argument("--steps", type=int, default=16, help="optimizer steps per run (even: the stop is half way)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=4, help="CPU threads per run")
    parser.add_argument("--cpu", action="store_true", help="dry run on the CPU (no FSDP)")
    parser.add_argument("--from-json", type=Path, help="render an earlier run")
    parser.add_argument("--write-benchmarks", type=Path, help="write the section into this Markdown file")
    args = parser.parse_args(argv)
    if args.from_json:
        if not args.from_json.is_file():
            parser.error(f"--from-json {args.from_json}: no such file")
        results = json.loads(args.from_json.read_text())
    else:
        for flag, path in (("--stories", args.stories / "config.json"), ("--text", args.text), ("--eval-text", args.eval_text)):
            if not path.is_file():
                parser.error(f"{flag}: {path} is not there (scripts/prepare_device_assets.sh makes the defaults)")
        if args.steps < 2 or args.steps % 2:
            parser.error(f"--steps {args.steps}: an even number >= 2 (the stopped run stops half way)")
        if args.threads < 1 or args.seq_len < 8:
            parser.error("--threads must be >= 1 and --seq-len >= 8")
        # the runs start in the repo root: relative paths name the caller's folder, so they are resolved here
        args.out, args.stories, args.text, args.eval_text = (Path(p).resolve() for p in
                                                             (args.out, args.stories, args.text, args.eval_text))
        results = measure(args)
    section = render(results)
    print(section)
    if args.write_benchmarks:
        write_marked_section(args.write_benchmarks, SECTION_BEGIN, SECTION_END, section)
    return 0 if passed(results) else 1


def passed(results: dict) -> bool:
    """Every check passed; in the CPU dry run, every check it can judge (FSDP itself is not run there)."""
    checks = results.get("checks", {})
    judged = [value for value in checks.values() if value is not None or not results["cpu"]]
    return "error" not in results["convert"] and bool(judged) and all(value is True for value in judged)


if __name__ == "__main__":
    sys.exit(main())
