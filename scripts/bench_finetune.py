#!/usr/bin/env python
"""Quality recovered by the fine-tuning recipe, measured end to end on CPU; writes its BENCHMARKS.md section.

For each model: convert (once; the folder is reused when its options match), fine-tune with the settings
of its recipe config (`recipes/configs/*_cpu.yaml`, through the same library call the recipe makes),
then reload the SAVED folder with stock transformers and score it again on the project protocol.

  stories260K at 8x: distilled on text sampled from the source model (never the evaluation excerpt);
      perplexity on ../shared/data/tinystories-valid-excerpt.txt, context 256, 60 windows.
      Target: the fine-tuned model closes at least half of the gap between the one-shot conversion and the source.
  SmolLM2-135M-Instruct at 4x: distilled on ../shared/data/sotu.txt; perplexity on WikiText-2 test,
      context 1024, the first 40 windows (the conversion protocol).
  Both perplexity-vs-tokens curves go to docs/finetune_curves.png (with --no-markdown: WORK/finetune_curves.png,
  so that a trial run leaves the shipped plot alone).

    python scripts/bench_finetune.py                 # both models, writes BENCHMARKS.md and the plot
    python scripts/bench_finetune.py --only stories260k --no-markdown
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmarks_md import write_heading_section  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
SECTION = "## Fine-tuning recipe (distillation)"
PLOT = REPO / "docs" / "finetune_curves.png"
BUDGET_SECONDS = 600  # each fine-tuning run must fit in 10 minutes on this machine


def _stories_source() -> Path:
    return SHARED / "assets" / "stories260k"


def _smollm2_source() -> Path:
    from mla_convert.io.assets import fetch_smollm2

    return fetch_smollm2(quiet=True)


# name -> how to convert and which recipe config heals it
MODELS = {
    "stories260k": dict(
        source=_stories_source,
        label="stories260K",
        compression=8,
        calibration=dict(num_samples=16, seq_len=256),  # sampled from the source model: no text
        config="stories260k_cpu.yaml",
    ),
    "smollm2": dict(
        source=_smollm2_source,
        label="SmolLM2-135M-Instruct",
        compression=4,
        calibration=dict(num_samples=16, seq_len=256),  # the converter's default: sampled from the source model
        config="smollm2_cpu.yaml",
    ),
}


# --------------------------------------------------------------------------- steps
def converted_folder(name: str, spec: dict, work: Path, log) -> tuple[Path, float | None]:
    """Convert (or reuse a conversion with the same options); returns (folder, seconds or None if reused)."""
    from mla_convert.convert import ConvertOptions, convert
    from mla_convert.options import CalibrationOptions

    folder = work / f"{name}-mla-{spec['compression']}x"
    wanted = {"compression": float(spec["compression"]), **spec["calibration"]}
    report_path = folder / "mla_convert.json"
    if report_path.is_file():
        report = json.loads(report_path.read_text())
        options = report["options"]
        recorded = {"compression": options.get("compression"), **{k: options["calibration"].get(k) for k in spec["calibration"]}}
        if _same_options(recorded, wanted):
            log(f"{name}: reusing the conversion in {folder}")
            return folder, None
    source = spec["source"]()
    log(f"{name}: converting {source} at {spec['compression']}x ...")
    began = time.time()
    convert(source, folder, ConvertOptions(compression=spec["compression"], overwrite=True,
                                           calibration=CalibrationOptions(**spec["calibration"])))
    return folder, time.time() - began


def _same_options(recorded: dict, wanted: dict) -> bool:
    """Equal options; a calibration file may be named by different paths to the same file."""
    def normal(value):
        return str(Path(value).resolve()) if isinstance(value, str) and Path(value).exists() else value

    return {k: normal(v) for k, v in recorded.items()} == {k: normal(v) for k, v in wanted.items()}


def recipe_config(name: str, spec: dict, converted: Path, work: Path):
    """The model's recipe config with this run's folders (relative paths in it are relative to the repo)."""
    from mla_convert.finetune.config import config_from_mapping, load_yaml_config

    path = REPO / "recipes" / "configs" / spec["config"]
    values = load_yaml_config(path)  # its relative paths are relative to the repository root, the working folder
    values.update(model=str(converted), output=str(work / f"{name}-ft"), checkpoint_dir=str(work / f"{name}-ft.checkpoints"),
                  overwrite=True, resume=None)
    config = config_from_mapping(values)
    config.validate()
    return config, path


def saved_perplexity(folder: Path, config) -> float:
    """The saved folder, loaded by stock transformers, on the same windows as the run's evaluations."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mla_convert.data.textdata import load_text
    from mla_convert.eval.perplexity import evaluate_perplexity

    model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    text = load_text(config.eval_data)
    return evaluate_perplexity(model, tokenizer, text, context_length=config.eval_context, max_windows=config.eval_windows,
                               progress=False).perplexity


def run_one(name: str, work: Path, log) -> dict:
    from mla_convert.finetune import run_finetune

    spec = MODELS[name]
    converted, convert_seconds = converted_folder(name, spec, work, log)
    config, config_path = recipe_config(name, spec, converted, work)
    shutil.rmtree(config.checkpoint_path, ignore_errors=True)  # a fresh run, not a resume
    command = (f"python recipes/finetune_mla.py --config {config_path.relative_to(REPO)} --model {converted} "
               f"--output {config.output}")
    log(f"{name}: fine-tuning ({config.max_steps} steps) ...")
    began, cpu_began = time.time(), time.process_time()
    result = run_finetune(config, log=lambda text: log(f"  {text}"), command=command)
    seconds, cpu_seconds = time.time() - began, time.process_time() - cpu_began
    began = time.time()
    after_saved = saved_perplexity(result.output, config)
    eval_seconds = time.time() - began
    section = result.finetuning
    before, after, teacher = section["perplexity_before"], section["perplexity_after"], section["perplexity_teacher"]
    return {
        "name": name,
        "date": datetime.date.today().isoformat(),
        "label": spec["label"],
        "compression": spec["compression"],
        "converted": str(converted),
        "convert_seconds": convert_seconds,
        "convert_seconds_recorded": json.loads((converted / "mla_convert.json").read_text())["summary"].get("seconds"),
        "config": str(config_path.relative_to(REPO)),
        "command": command,
        "finetune_seconds": seconds,
        "finetune_cpu_seconds": cpu_seconds,
        "teacher_perplexity": teacher,
        "before": before,
        "after": after,
        "after_saved_folder": after_saved,
        "gap_closed": (before - after_saved) / (before - teacher) if teacher is not None else None,
        "finetuning": section,
        "eval_context": config.eval_context,
        "eval_windows": config.eval_windows,
        "eval_seconds": eval_seconds,
        "threads": config.num_threads,
    }


# --------------------------------------------------------------------------- outputs
def plot_curves(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in results.values() if r["finetuning"]["perplexity_curve"]]
    figure, axes = plt.subplots(1, len(shown), figsize=(5.2 * len(shown), 3.8), squeeze=False)
    for axis, result in zip(axes[0], shown):
        curve = result["finetuning"]["perplexity_curve"]
        tokens = [row[0] for row in curve]
        axis.plot(tokens, [row[1] for row in curve], "o-", label=f"MLA {result['compression']}x, fine-tuned")
        if result["teacher_perplexity"]:
            axis.axhline(result["teacher_perplexity"], color="gray", linestyle="--", label="source model")
        axis.set_yscale("log")
        axis.set_xlabel("training tokens")
        axis.set_ylabel("perplexity")
        axis.set_title(f"{result['label']} ({result['eval_windows']} x {result['eval_context']}-token windows)", fontsize=9)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _row(result: dict) -> str:
    s = result["finetuning"]
    closed = result["gap_closed"]
    return (f"| {result['label']} | {result['compression']}x | {result['teacher_perplexity']:.4f} | {result['before']:.4f} | "
            f"{result['after_saved_folder']:.4f} | {'n/a' if closed is None else f'{100 * closed:.1f} %'} | "
            f"{s['tokens']:,} | {s['steps']} | {result['finetune_seconds'] / 60:.1f} min |")


def render_section(results: dict, command: str) -> str:
    import torch
    import transformers

    lines = [SECTION, ""]
    lines.append(
        "`scripts/bench_finetune.py` converts each model, heals it with the recipe's settings "
        "(`recipes/configs/*_cpu.yaml`, through `mla_convert.finetune.run_finetune`, the call `recipes/finetune_mla.py` "
        "makes), then reloads the saved folder with stock `transformers` and scores it again. Loss: "
        "KL(source || converted) on the logits, T = 1; only the attention parameters train. "
        f"Runs on {platform.machine()} {platform.system()}, 2 CPU cores (shared with other "
        f"work), torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{next(iter(results.values()))['threads']} torch thread(s)."
    )
    lines += ["", "| model | KV compression | source ppl | one-shot ppl | fine-tuned ppl (saved folder) | gap closed | "
                  "training tokens | steps | fine-tune wall time |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [_row(r) for r in results.values()]
    lines.append("")
    lines.append("gap closed = (one-shot - fine-tuned) / (one-shot - source).")
    for result in results.values():
        s = result["finetuning"]
        lines += ["", f"### {result['label']} at {result['compression']}x (run {result['date']})", ""]
        if result["name"] == "stories260k":
            closed = result["gap_closed"]
            verdict = "met" if closed is not None and closed >= 0.5 else "MISSED"
            lines.append(f"- target: close at least half of the gap to the source: **{100 * closed:.1f} % closed ({verdict})**.")
        else:
            verdict = "met" if result["after_saved_folder"] < result["before"] else "MISSED"
            lines.append(f"- target: perplexity below the one-shot conversion's: **{result['before']:.2f} -> "
                         f"{result['after_saved_folder']:.2f} ({verdict})**.")
        lines.append(f"- evaluation: {s['eval_data']}; one evaluation takes {result['eval_seconds']:.1f} s here "
                     f"({result['eval_seconds'] / result['eval_windows']:.2f} s per window)"
                     + ".")
        lines.append(f"- training text: {s['data']}.")
        lines.append(f"- budget: {s['steps']} steps x {s['batch_windows_per_step']} windows x {s['seq_len']} tokens = "
                     f"{s['tokens']:,} tokens; lr {s['lr']:g}, {s['schedule']}; {s['optimizer']}.")
        lines.append(f"- wall time: fine-tuning {result['finetune_seconds']:.0f} s (budget {BUDGET_SECONDS} s: "
                     f"{'met' if result['finetune_seconds'] <= BUDGET_SECONDS else 'MISSED'}; process CPU time "
                     f"{result['finetune_cpu_seconds']:.0f} s, the rest is waiting for the shared cores), including "
                     f"loading, sampling, every evaluation and the save check; conversion "
                     + (f"{result['convert_seconds']:.0f} s." if result["convert_seconds"] else
                        f"reused from an earlier run (it took {result['convert_seconds_recorded']:.0f} s then, by its report)."))
        lines.append(f"- saved folder vs the in-training model: max |logit difference| "
                     f"{s.get('save_check_max_logit_difference', float('nan')):.2g} (max |logit| {s.get('save_check_max_logit', float('nan')):.3g}); "
                     f"the run's own final evaluation {result['after']:.4f} vs the saved folder's {result['after_saved_folder']:.4f}.")
        lines.append(f"- recipe: `{result['command']}` (config `{result['config']}`).")
        lines += ["", "| training tokens | perplexity |", "|---:|---:|"]
        lines += [f"| {tokens:,} | {value:.4f} |" for tokens, value in s["perplexity_curve"]]
    lines += ["", f"Perplexity vs training tokens (both runs): `{PLOT.relative_to(REPO)}`.", "",
              f"![fine-tuning curves]({PLOT.relative_to(REPO)})"]
    commands = sorted({r.get("bench_command", command) for r in results.values()})  # the runs that made the numbers
    lines += ["", "Command: " + ", ".join(f"`{c}`" for c in commands), ""]
    return "\n".join(lines)


def write_section(markdown: Path, section: str) -> None:
    """Replace this script's section of BENCHMARKS.md (heading to the next heading or marker), or append it."""
    write_heading_section(markdown, SECTION, section)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=sorted(MODELS), action="append", help="run only this model (repeatable)")
    parser.add_argument("--work", type=Path, default=Path("outputs") / "bench_finetune",
                        help="where conversions, runs and results.json go (relative: to the repository root)")
    parser.add_argument("--no-markdown", action="store_true",
                        help="print the section instead of writing BENCHMARKS.md, and draw the plot in --work "
                             f"instead of {PLOT.relative_to(REPO)}")
    parser.add_argument("--render-only", action="store_true", help="run nothing: rewrite the section and plot from results.json")
    args = parser.parse_args(argv)
    os.chdir(REPO)  # the recipe configs name their files relative to the repository root
    if args.render_only:
        found = json.loads((args.work / "results.json").read_text()) if (args.work / "results.json").is_file() else {}
        if not found:
            parser.error(f"--render-only: no results in {args.work / 'results.json'} (relative --work: to the repository root)")
    command = " ".join(shlex.quote(a) for a in ["python", "scripts/bench_finetune.py", *(argv if argv is not None else sys.argv[1:])])
    args.work.mkdir(parents=True, exist_ok=True)
    store = args.work / "results.json"
    results = json.loads(store.read_text()) if store.is_file() else {}

    def log(text: str) -> None:
        print(text, flush=True)

    for name in [] if args.render_only else (args.only or list(MODELS)):
        results[name] = run_one(name, args.work, log)
        results[name]["bench_command"] = command
        store.write_text(json.dumps(results, indent=2) + "\n")
        r = results[name]
        log(f"{name}: source {r['teacher_perplexity']:.4f}, one-shot {r['before']:.4f}, fine-tuned {r['after_saved_folder']:.4f} "
            f"({r['finetuning']['tokens']:,} tokens, {r['finetune_seconds']:.0f} s)")
    ordered = {name: results[name] for name in MODELS if name in results}
    plot = args.work / PLOT.name if args.no_markdown else PLOT
    plot_curves(ordered, plot)
    section = render_section(ordered, command)
    if args.no_markdown:
        print(section)
        log(f"drew the curves in {plot}")
    else:
        write_section(REPO / "BENCHMARKS.md", section)
        log(f"wrote the '{SECTION}' section of {REPO / 'BENCHMARKS.md'} and {PLOT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
