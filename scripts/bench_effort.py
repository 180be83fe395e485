"""What `--effort` costs and buys: stories260K at 2x/4x/8x, each effort level, CPU time per phase and perplexity.

Each conversion is its own `mla-convert convert` process with OMP_NUM_THREADS=1 (process CPU seconds, all
phases, from its report: less sensitive to a busy machine than wall time); each export is scored on the
project protocol (TinyStories excerpt, context 256, 60 non-overlapping windows, token-weighted NLL).

    python scripts/bench_effort.py --json docs/bench/effort-stories260k.json --write-benchmarks BENCHMARKS.md
    python scripts/bench_effort.py --from-json docs/bench/effort-stories260k.json --write-benchmarks BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
from benchmarks_md import recorded_command, write_marked_section  # noqa: E402

from mla_convert.io.paths import absolute_path, output_file_problems  # noqa: E402

SHARED = Path(os.environ.get("MLA_CONVERT_SHARED", REPO.parent / "shared"))
SECTION_BEGIN = "<!-- bench_effort:begin -->"
SECTION_END = "<!-- bench_effort:end -->"
EFFORTS = ("fast", "default", "thorough")
RATIOS = (2, 4, 8)


def run_one(work: Path, effort: str, ratio: int) -> dict:
    source = SHARED / "assets" / "stories260k"
    output = work / f"{effort}-{ratio}x"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}:{REPO / 'kernels'}", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "mla_convert", "convert", str(source), str(output), "-c", str(ratio), "--effort", effort,
               "--dtype", "fp32", "-q"]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=work)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    wall = time.perf_counter() - started
    report = json.loads((output / "mla_convert.json").read_text())
    scores = work / f"{effort}-{ratio}x.json"
    evaluation = subprocess.run([sys.executable, "-m", "mla_convert", "eval", str(output), "--data",
                                 str(SHARED / "data" / "tinystories-valid-excerpt.txt"), "--context", "256", "--max-windows", "60",
                                 "--device", "cpu", "--json", str(scores)], capture_output=True, text=True, env=env, cwd=work)
    if evaluation.returncode != 0:
        raise RuntimeError(evaluation.stderr[-2000:])
    perplexity = next(iter(json.loads(scores.read_text())["results"].values()))["perplexity"]
    summary = report["summary"]
    return {"effort": effort, "ratio": ratio, "shape": f"{report['options']['kv_lora_rank']}+{report['options']['rope_dim']}",
            "cpu_seconds": summary["cpu_seconds"], "wall_seconds": round(wall, 1), "perplexity": perplexity,
            "refinement": report["refinement"], "phase_cpu_seconds": summary["phase_cpu_seconds"]}


def render(results: dict) -> str:
    rows = results["rows"]
    lines = [SECTION_BEGIN, "## `--effort`: conversion time and quality (stories260K)", "",
             f"Measured {results['date']} on this 2-core machine (shared with other work; CPU time of each "
             "`mla-convert convert ... --effort E --dtype fp32` process with OMP_NUM_THREADS=1, all phases, imports "
             "included); perplexity on the TinyStories excerpt, context 256, 60 windows (source 5.74).  Before this "
             "option the default was what `thorough` is now (200 refinement steps with early stopping where cheap): "
             "2x took 33.5 s of CPU (6.44).", "",
             "| effort | ratio | shape | CPU s | perplexity | refinement | CPU s by phase |", "|---|---|---|---:|---:|---|---|"]
    for row in rows:
        phases = ", ".join(f"{name} {seconds:.1f}" for name, seconds in
                           sorted(row["phase_cpu_seconds"].items(), key=lambda item: -item[1]) if seconds >= 0.05)
        lines.append(f"| {row['effort']} | {row['ratio']}x | {row['shape']} | {row['cpu_seconds']:.1f} | {row['perplexity']:.4f} | "
                     f"{row['refinement']} | {phases} |")
    lines += ["", *tradeoff_lines(rows), f"Command: `{results['command']}`", SECTION_END]
    return "\n".join(lines) + "\n"


def tradeoff_lines(rows: list[dict]) -> list[str]:
    """One sentence per ratio: what `default` gives up against `thorough`, and for how much less CPU time."""
    by = {(row["effort"], row["ratio"]): row for row in rows}
    parts = []
    for ratio in sorted({row["ratio"] for row in rows}):
        default, thorough = by.get(("default", ratio)), by.get(("thorough", ratio))
        if default and thorough:
            loss = 100 * (default["perplexity"] / thorough["perplexity"] - 1)
            parts.append(f"{ratio}x {loss:+.1f} % perplexity for {default['cpu_seconds'] / thorough['cpu_seconds']:.0%} "
                         "of the CPU time")
    if not parts:
        return []
    return ["`default` against `thorough`: " + "; ".join(parts) + ".  Convert with `--effort thorough` for the final "
            "model at 4x and beyond.", ""]


def write_section(path: Path, section: str) -> None:
    write_marked_section(path, SECTION_BEGIN, SECTION_END, section)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=absolute_path, help="write the raw results here")
    parser.add_argument("--from-json", type=absolute_path, help="render an earlier run")
    parser.add_argument("--write-benchmarks", type=absolute_path, help="write the section into this Markdown file")
    parser.add_argument("--efforts", nargs="+", choices=EFFORTS, default=list(EFFORTS))
    parser.add_argument("--ratios", nargs="+", type=int, default=list(RATIOS))
    args = parser.parse_args(argv)
    if any(ratio < 2 for ratio in args.ratios):
        parser.error("--ratios: each ratio must be at least 2")
    for flag, path in (("--json", args.json), ("--write-benchmarks", args.write_benchmarks)):
        problems = output_file_problems(path, flag)
        if problems:
            parser.error(problems[0])
    if args.from_json:
        try:
            results = json.loads(args.from_json.read_text())
        except FileNotFoundError:
            parser.error(f"--from-json {args.from_json}: no such file")
        except (OSError, ValueError) as error:
            parser.error(f"--from-json {args.from_json}: not a bench_effort JSON file ({error})")
    else:
        results = {"date": time.strftime("%Y-%m-%d"), "command": recorded_command(__file__, argv, parser), "rows": []}
        with tempfile.TemporaryDirectory(prefix="mla-convert-effort-") as work:
            for ratio in args.ratios:
                for effort in args.efforts:
                    results["rows"].append(run_one(Path(work), effort, ratio))
                    print(json.dumps(results["rows"][-1]), flush=True)
                    if args.json:
                        args.json.write_text(json.dumps(results, indent=2) + "\n")
    section = render(results)
    print(section)
    if args.write_benchmarks:
        write_section(args.write_benchmarks, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
