#!/usr/bin/env python
"""What each quality lever buys, one-shot (stories260K, SmolLM2) and healed (stories260K); writes its BENCHMARKS.md section.

One-shot rows (each a `convert` at the default --effort, calibration text sampled from the source, fp32): the shipped
shape at each ratio; the shared-RoPE floor (the latent uncompressed, kv_lora_rank = 2 x kv heads x head_dim, with the
shipped rope_dim: what DeepseekV3's one shared RoPE key costs on its own); the shapes of the same cache size next to
the shipped one (rope_dim a third smaller and larger); calibration on 64 windows instead of 16.  Perplexity: the
project protocol (stories260K: TinyStories excerpt, context 256 x 60 windows; SmolLM2: WikiText-2 test, 1024 x 40;
--max-windows scores fewer, and the section says so), non-overlapping windows, token-weighted NLL.

Healing rows (the 8x conversion, `mla-convert finetune` through `run_finetune`, text sampled from the teacher): the
defaults, then the settings changed one at a time; CPU seconds are the process's user+sys over the whole run
(loading, sampling, both evaluations and the save check included), on one torch thread.

    python scripts/bench_quality.py --model stories260k --json docs/bench/quality-stories260k.json
    python scripts/bench_quality.py --only oneshot --model smollm2 --ratios 2,4 --max-windows 10 --calib-samples 16 \
        --json docs/bench/quality-smollm2.json
    python scripts/bench_quality.py --from-json docs/bench/quality-*.json --write-benchmarks BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmarks_md import recorded_command, write_marked_section  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
BEGIN, END = "<!-- bench_quality:begin -->", "<!-- bench_quality:end -->"
HEAL_RATIO = 8


def _stories() -> Path:
    return SHARED / "assets" / "stories260k"


def _smollm2() -> Path:
    from mla_convert.io.assets import fetch_smollm2

    return fetch_smollm2(quiet=True)


# name -> (source, evaluation text, context, windows of the project protocol)
MODELS = {
    "stories260k": (_stories, "tinystories-valid-excerpt.txt", 256, 60),
    "smollm2": (_smollm2, "wikitext-2-raw-test.txt", 1024, 40),
}
# (label, FinetuneConfig overrides): the first row is the defaults
HEAL = {
    "defaults (train auto: all here; lr 1e-3; 300 steps x 8 windows; 1,024 samples)": {},
    "train attention only": {"train": "attention"},
    "lr 3e-3": {"lr": 3e-3},
    "attention only, 100 steps, 512 samples": {"train": "attention", "max_steps": 100, "teacher_samples": 512},
}


def perplexity(folder: Path, model: str, windows: int) -> float:
    from mla_convert.eval.perplexity import evaluate_perplexity, load_model_for_eval, load_tokenizer_for_eval

    _, text, context, _ = MODELS[model]
    loaded, _ = load_model_for_eval(folder, dtype="fp32")
    return evaluate_perplexity(loaded, load_tokenizer_for_eval(folder), (SHARED / "data" / text).read_text(encoding="utf-8"),
                               context_length=context, max_windows=windows, progress=False).perplexity


def export_row(converter, model: str, windows: int, out: Path, ratio: float | None, kv_lora_rank: int | None = None,
               rope_dim: int | None = None) -> dict:
    """One export of a calibrated Converter, scored; CPU seconds of the export alone (the calibration is shared)."""
    from mla_convert.options import ConvertOptions

    options = ConvertOptions(compression=ratio, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim, dtype="fp32", overwrite=True,
                             calibration=converter.options.calibration)
    began = time.process_time()
    result = converter.export(out, options)
    mla = result.report["options"]
    return {"shape": f"{mla['kv_lora_rank']}+{mla['rope_dim']}", "kv_lora_rank": mla["kv_lora_rank"],
            "rope_dim": mla["rope_dim"], "cpu_seconds": round(time.process_time() - began, 1),
            "perplexity": perplexity(out, model, windows)}


def calibrated(model: str, samples: int):
    from mla_convert.convert.pipeline import Converter
    from mla_convert.options import CalibrationOptions, ConvertOptions

    converter = Converter(MODELS[model][0](), ConvertOptions(dtype="fp32", calibration=CalibrationOptions(num_samples=samples)))
    began = time.process_time()
    converter.calibrate()
    return converter, round(time.process_time() - began, 1)


def neighbour_rope_dims(rope_dim: int, width: int, head_dim: int) -> list[int]:
    """The splits of the same cache width next to the shipped one: rope_dim a third smaller and larger (even, >= 2, at
    most the source's head_dim, which bounds the RoPE key)."""
    step = max(2, rope_dim // 3 // 2 * 2)
    return [rope for rope in (rope_dim - step, rope_dim + step) if 2 <= rope < width and rope <= head_dim]


def one_shot(model: str, windows: int, ratios: list[int], calib_sizes: list[int], work: Path, log) -> list[dict]:
    """Per ratio: the shipped default, the same-width splits beside it, the shared-RoPE floor (one calibration for all
    of them), and the default at each further calibration size."""
    from mla_convert.io.config_file import read_config_json
    from mla_convert.source.config import SourceConfig

    folder = MODELS[model][0]()
    source = SourceConfig.from_dict(read_config_json(folder))
    full_rank = 2 * source.num_kv_heads * source.head_dim  # [NoPE keys; values] of every kv head: nothing compressed
    rows = [{"ratio": 1, "lever": "source", "shape": "GQA K+V", "cpu_seconds": 0.0,
             "perplexity": perplexity(folder, model, windows)}]
    log(rows[-1])

    def add(converter, listed_ratio, lever, **shape):
        rows.append({"ratio": listed_ratio, "lever": lever,
                     **export_row(converter, model, windows, work / f"row-{len(rows)}", **shape)})
        log(rows[-1])
        return rows[-1]

    converter, calibration_cpu = calibrated(model, calib_sizes[0])
    with converter:
        for ratio in ratios:
            shipped = add(converter, ratio, f"default (calibration {calib_sizes[0]} x 256: {calibration_cpu:.0f} CPU s once)",
                          ratio=ratio)
            width = shipped["kv_lora_rank"] + shipped["rope_dim"]
            for rope in neighbour_rope_dims(shipped["rope_dim"], width, source.head_dim):
                add(converter, ratio, "same cache, other split", ratio=None, kv_lora_rank=width - rope, rope_dim=rope)
            add(converter, ratio, "shared-RoPE floor (latent uncompressed)", ratio=None, kv_lora_rank=full_rank,
                rope_dim=shipped["rope_dim"])
    for samples in calib_sizes[1:]:
        converter, calibration_cpu = calibrated(model, samples)
        with converter:
            for ratio in ratios:
                add(converter, ratio, f"calibration {samples} x 256 ({calibration_cpu:.0f} CPU s)", ratio=ratio)
    return rows


def heal(work: Path, log) -> tuple[list[dict], float, float]:
    """The healing rows, the one-shot perplexity they start from and the teacher's."""
    from mla_convert.finetune import run_finetune
    from mla_convert.finetune.config import FinetuneConfig

    converted = work / f"heal-{HEAL_RATIO}x"
    converter, _ = calibrated("stories260k", 16)
    with converter:
        export_row(converter, "stories260k", 1, converted, HEAL_RATIO)
    _, text, context, windows = MODELS["stories260k"]
    rows = []
    for number, (label, overrides) in enumerate(HEAL.items()):
        config = FinetuneConfig(model=str(converted), output=str(work / f"ft-{number}"), eval_data=str(SHARED / "data" / text),
                                eval_context=context, eval_windows=windows, num_threads=1, **overrides)
        began, cpu_began = time.time(), time.process_time()
        section = run_finetune(config, log=lambda line: None).finetuning
        seconds, cpu = time.time() - began, time.process_time() - cpu_began
        before, after, teacher = section["perplexity_before"], section["perplexity_after"], section["perplexity_teacher"]
        rows.append({"lever": label, "overrides": overrides, "tokens": section["tokens"], "steps": section["steps"],
                     "perplexity_after": after, "gap_closed": (before - after) / (before - teacher),
                     "wall_seconds": round(seconds, 1), "cpu_seconds": round(cpu, 1),
                     "tokens_per_second": round(section["tokens"] / seconds, 1)})
        log(rows[-1])
    return rows, before, teacher


def render(results: dict) -> str:
    lines = [BEGIN, "## Quality levers (one-shot and healed)", "",
             "Measured by `scripts/bench_quality.py` (raw rows: the JSON named in each command).  Perplexity: "
             "non-overlapping windows, token-weighted NLL; one torch thread."]
    for name, run in results["one_shot"].items():
        _, text, context, protocol = MODELS[name]
        source = run["rows"][0]["perplexity"]  # the first row is the source itself
        note = "" if run["windows"] == protocol else f" (**not the project protocol**: {run['windows']} windows, it has {protocol})"
        lines += ["", f"### One-shot: {name}, `{text}`, context {context} x {run['windows']} windows{note}", "",
                  f"Command: `{run['command']}` (run {run['date']}, {run['machine']}).  Default `--effort`, calibration "
                  "sampled from the source, one calibration shared by the rows of its size; CPU s: each export's process "
                  "time (the calibration's is in the default row's label).", "",
                  "| ratio | lever | shape R+D | perplexity | x source | CPU s |", "|---:|---|---|---:|---:|---:|"]
        for row in run["rows"]:
            lines.append(f"| {row['ratio']}x | {row['lever']} | {row['shape']} | {row['perplexity']:.4f} | "
                         f"{row['perplexity'] / source:.3f} | {row['cpu_seconds']:.1f} |")
    if results.get("heal"):
        heal = results["heal"]
        lines += ["", f"### Healing: stories260K at {HEAL_RATIO}x ({heal['before']:.4f}; source {heal['teacher']:.4f})", "",
                  f"Command: `{heal['command']}` (run {heal['date']}, {heal['machine']}).  `mla-convert finetune` "
                  "settings, text sampled from the teacher; gap closed = (one-shot - healed) / (one-shot - source); "
                  "CPU s = user+sys of the whole run (loading, sampling, both evaluations, the save check).", "",
                  "| setting | tokens | perplexity | gap closed | wall s | CPU s | tokens/s |", "|---|---:|---:|---:|---:|---:|---:|"]
        for row in heal["rows"]:
            lines.append(f"| {row['lever']} | {row['tokens']:,} | {row['perplexity_after']:.4f} | "
                         f"{100 * row['gap_closed']:.1f} % | {row['wall_seconds']:.0f} | {row['cpu_seconds']:.0f} | "
                         f"{row['tokens_per_second']:,.0f} |")
    lines += ["", END]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("oneshot", "heal"), help="measure one half (default: both)")
    parser.add_argument("--model", choices=sorted(MODELS), default="stories260k", help="the one-shot half's model")
    parser.add_argument("--ratios", default="2,4,8", help="the one-shot half's KV-cache ratios")
    parser.add_argument("--calib-samples", default="16,64", help="calibration sizes: the first for every row, the "
                        "others for the default shape only")
    parser.add_argument("--max-windows", type=int, help="fewer evaluation windows than the project protocol's (said so)")
    parser.add_argument("--json", type=Path, help="merge the rows into this JSON (created when missing)")
    parser.add_argument("--from-json", type=Path, nargs="+", help="measure nothing: render these JSON files together")
    parser.add_argument("--write-benchmarks", type=Path, help="replace this script's section of this file")
    args = parser.parse_args(argv)
    try:
        ratios = [int(r) for r in args.ratios.split(",")]
    except ValueError:
        ratios = []
    if not ratios or min(ratios) < 2:
        parser.error(f"--ratios: whole KV-cache ratios of at least 2, comma-separated (got {args.ratios!r})")
    try:
        calib_sizes = [int(n) for n in args.calib_samples.split(",")]
    except ValueError:
        calib_sizes = []
    if not calib_sizes or min(calib_sizes) < 2:
        parser.error(f"--calib-samples: whole window counts of at least 2, comma-separated (got {args.calib_samples!r})")
    if args.max_windows is not None and args.max_windows < 1:
        parser.error(f"--max-windows: at least 1 (got {args.max_windows})")
    missing = [str(path) for path in args.from_json or [] if not path.is_file()]
    if missing:
        parser.error(f"--from-json: {', '.join(missing)} is not a file")
    results = {"one_shot": {}}
    for path in args.from_json or ([args.json] if args.json and args.json.is_file() else []):
        found = json.loads(path.read_text())
        results["one_shot"].update(found.get("one_shot", {}))
        results.update({key: value for key, value in found.items() if key != "one_shot"})
    if not args.from_json:
        import platform

        import torch

        torch.set_num_threads(1)
        stamp = {"command": recorded_command(__file__, argv, parser), "date": datetime.date.today().isoformat(),
                 "machine": f"{platform.machine()}, torch {torch.__version__}"}
        with tempfile.TemporaryDirectory() as work:
            if args.only in (None, "oneshot"):
                windows = args.max_windows or MODELS[args.model][3]
                rows = one_shot(args.model, windows, ratios, calib_sizes, Path(work), print)
                results["one_shot"][args.model] = {**stamp, "windows": windows, "rows": rows}
            if args.only in (None, "heal"):
                rows, before, teacher = heal(Path(work), print)
                results["heal"] = {**stamp, "rows": rows, "before": before, "teacher": teacher}
        if args.json:
            args.json.write_text(json.dumps(results, indent=2) + "\n")
    section = render(results)
    if args.write_benchmarks:
        write_marked_section(args.write_benchmarks, BEGIN, END, section)
    else:
        print(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
