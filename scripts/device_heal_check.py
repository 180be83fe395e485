#!/usr/bin/env python
"""Healing on a GPU: convert a source at each ratio, heal it with `mla-convert finetune`, score before and after.

The quality issue's GPU target: SmolLM2-135M-Instruct healed to <= 1.05x of its source's perplexity at 2x and
<= 1.20x at 4x within 5 minutes of training on one H100/H200.  For each ratio this script runs, in this process:
  1. the default conversion (`convert`, on the GPU when there is one);
  2. `run_finetune` at the recipe's defaults but for the batch and step settings given here (text sampled from the
     source unless --train-text), scoring the source, the one-shot and the healed model on --eval-text every
     --eval-every steps (the curve);
and records per ratio: the three perplexities, the gap closed, training seconds (sampling and evaluations
included, as the trainer counts them), tokens/s, the GPU's peak allocated memory, and the curve.  Writes a JSON and,
with --write-benchmarks, its BENCHMARKS.md section.  Needs torch, transformers and accelerate only (a stock CUDA
PyTorch image); nothing is downloaded.

    python scripts/device_heal_check.py --source SRC --eval-text WIKITEXT --out OUT [--ratios 2,4] [--max-steps 400]
    python scripts/device_heal_check.py --source STORIES --eval-text TEXT --out OUT --cpu --max-steps 4   (dry run)
    python scripts/device_heal_check.py --from-json OUT/device_heal_check.json --write-benchmarks BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from benchmarks_md import write_marked_section  # noqa: E402

BEGIN, END = "<!-- device_heal_check:begin -->", "<!-- device_heal_check:end -->"
TARGETS = {2: 1.05, 4: 1.20}  # healed perplexity / source's, within TRAINING_BUDGET_S of training
TRAINING_BUDGET_S = 300


def heal_one(source: Path, ratio: int, args, device: str) -> dict:
    import torch

    from mla_convert.convert.pipeline import convert
    from mla_convert.finetune import run_finetune
    from mla_convert.finetune.config import FinetuneConfig
    from mla_convert.options import ConvertOptions

    converted, healed = args.out / f"mla-{ratio}x", args.out / f"mla-{ratio}x-healed"
    began = time.time()
    convert(source, converted, ConvertOptions(compression=ratio, dtype="fp32", device=device, overwrite=True))
    conversion_seconds = time.time() - began
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    config = FinetuneConfig(model=str(converted), output=str(healed), overwrite=True, teacher=str(source),
                            data=str(args.train_text) if args.train_text else None, max_steps=args.max_steps,
                            micro_batch_size=args.micro_batch_size, seq_len=args.seq_len,
                            warmup_steps=args.warmup_steps, teacher_samples=args.teacher_samples, eval_data=str(args.eval_text),
                            eval_context=args.eval_context, eval_windows=args.eval_windows, eval_every=args.eval_every,
                            eval_teacher=True, mixed_precision="bf16" if device == "cuda" else "no",
                            num_threads=args.threads)
    began = time.time()
    section = run_finetune(config, log=print).finetuning
    seconds = time.time() - began
    teacher, before, after = section["perplexity_teacher"], section["perplexity_before"], section["perplexity_after"]
    return {"ratio": ratio, "source_perplexity": teacher, "one_shot_perplexity": before, "healed_perplexity": after,
            "gap_closed": (before - after) / (before - teacher), "tokens": section["tokens"], "steps": section["steps"],
            "training_seconds": round(section.get("seconds", seconds), 1), "run_seconds": round(seconds, 1),
            "conversion_seconds": round(conversion_seconds, 1),
            "tokens_per_second": round(section["tokens"] / max(section.get("seconds", seconds), 1e-9), 1),
            "peak_gpu_memory_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None,
            "curve": section.get("perplexity_curve"), "loss_curve": section.get("loss_curve")}


def environment(device: str) -> dict:
    import platform

    import torch
    import transformers

    return {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if device == "cuda" else platform.machine(),
            "torch": torch.__version__, "transformers": transformers.__version__}


def render(result: dict) -> str:
    env, settings = result["environment"], result["settings"]
    lines = [BEGIN, "## Healing on a GPU (`scripts/device_heal_check.py`)", "",
             f"Run {env['date']} on {env['device']} (torch {env['torch']}, transformers {env['transformers']}): "
             f"`{result['command']}`.  Settings: {json.dumps(settings, sort_keys=True)}.  Perplexity on the --eval-text "
             "windows; training seconds as the trainer counts them (sampling and evaluations included).", "",
             "| ratio | source | one-shot | healed | x source | target | gap closed | tokens | training s | tokens/s | peak GPU memory |",
             "|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for row in result["rows"]:
        ratio = row["healed_perplexity"] / row["source_perplexity"]
        target = TARGETS.get(row["ratio"])
        verdict = (f"<= {target}x in {TRAINING_BUDGET_S // 60} min: "
                   f"{'met' if ratio <= target and row['training_seconds'] <= TRAINING_BUDGET_S else 'missed'}") if target else ""
        memory = f"{row['peak_gpu_memory_bytes'] / 2**30:.1f} GiB" if row["peak_gpu_memory_bytes"] else "-"
        lines.append(f"| {row['ratio']}x | {row['source_perplexity']:.4f} | {row['one_shot_perplexity']:.4f} | "
                     f"{row['healed_perplexity']:.4f} | {ratio:.3f} | {verdict} | {100 * row['gap_closed']:.1f} % | "
                     f"{row['tokens']:,} | {row['training_seconds']:.0f} | {row['tokens_per_second']:,.0f} | {memory} |")
    return "\n".join(lines + ["", END]) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, help="the source model folder (MHA/GQA)")
    parser.add_argument("--eval-text", type=Path, help="text scored before, during and after healing")
    parser.add_argument("--train-text", type=Path, help="train on this text (default: text sampled from the source)")
    parser.add_argument("--out", type=Path, help="work folder (conversions, healed folders, the JSON)")
    parser.add_argument("--ratios", default="2,4", help="KV-cache ratios, comma-separated (default: 2,4)")
    parser.add_argument("--max-steps", type=int, default=400)
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--teacher-samples", type=int, default=4096)
    parser.add_argument("--eval-context", type=int, default=1024)
    parser.add_argument("--eval-windows", type=int, default=40)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (the dry run's compute)")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (a dry run of the same code path)")
    parser.add_argument("--from-json", type=Path, help="render a recorded run instead of running")
    parser.add_argument("--write-benchmarks", type=Path, help="write the section into this BENCHMARKS.md")
    args = parser.parse_args(argv)
    if args.from_json:
        result = json.loads(args.from_json.read_text())
    else:
        missing = [flag for flag, value in (("--source", args.source), ("--eval-text", args.eval_text), ("--out", args.out))
                   if value is None]
        if missing:
            parser.error(f"{', '.join(missing)}: needed to run (or give --from-json)")
        import torch

        device = "cpu" if args.cpu or not torch.cuda.is_available() else "cuda"
        args.out.mkdir(parents=True, exist_ok=True)
        ratios = [int(ratio) for ratio in args.ratios.split(",")]
        settings = {key: getattr(args, key) for key in ("max_steps", "warmup_steps", "micro_batch_size", "seq_len", "teacher_samples",
                                                         "eval_context", "eval_windows", "eval_every")}
        result = {"command": " ".join(["python", "scripts/device_heal_check.py", *(argv if argv is not None else sys.argv[1:])]),
                  "environment": environment(device), "settings": settings,
                  "rows": [heal_one(args.source, ratio, args, device) for ratio in ratios]}
        (args.out / "device_heal_check.json").write_text(json.dumps(result, indent=2) + "\n")
    section = render(result)
    if args.write_benchmarks:
        write_marked_section(args.write_benchmarks, BEGIN, END, section)
    print(section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
