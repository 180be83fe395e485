#!/usr/bin/env python
"""The runtime's two CPU decode paths side by side: the per-sequence loop and the kernel's batched oracle.

Why: `mla_convert.runtime.torch_decode` hands a call to the oracle (`mla_decode_triton.reference`) when the
sequences' caches are short on average (`LOOP_FROM_VALUES`), and runs its own loop otherwise.  That threshold is
a measured crossover; this script measures it again.  One converted folder is loaded twice (backend "reference",
and backend "torch" with the loop forced for every call), and for each batch x prompt length both decode the same
random prompts, alternating, `--repeats` times each; the better steady decode rate of each counts.  Their greedy
tokens must be equal (both compute in float32); the table says so.

    python scripts/bench_cpu_decode_paths.py --model SmolLM2-mla-2x --cases 16x128,8x256,8x512,16x1024,4x2048,1x4096 \\
        --write-benchmarks BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmarks_md import recorded_command, write_marked_section  # noqa: E402

from mla_convert.io.paths import absolute_path, output_file_problems  # noqa: E402

SECTION_BEGIN = "<!-- bench_cpu_decode_paths:begin -->"
SECTION_END = "<!-- bench_cpu_decode_paths:end -->"


def case_list(text: str) -> list[tuple[int, int]]:
    try:
        cases = [tuple(int(part) for part in case.split("x")) for case in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: cases are BATCHxLENGTH, comma separated (e.g. 16x128,1x4096)") from None
    if any(len(case) != 2 or min(case) < 1 for case in cases):
        raise argparse.ArgumentTypeError(f"{text!r}: each case is BATCHxLENGTH with both at least 1")
    return cases


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, type=absolute_path, help="converted (DeepseekV3) model folder")
    parser.add_argument("--cases", type=case_list, default=case_list("16x128,8x256,8x512,16x1024,4x2048,1x4096"),
                        help="batch x prompt length, comma separated")
    parser.add_argument("--new-tokens", type=int, default=10, help="tokens generated per prompt (at least 3)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per path and case; the fastest counts")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--json", type=absolute_path, dest="json_path", help="also write the rates as JSON")
    parser.add_argument("--write-benchmarks", type=absolute_path, metavar="BENCHMARKS.md",
                        help="replace (or append) this script's section there")
    args = parser.parse_args(argv)
    if args.new_tokens < 3:
        parser.error("--new-tokens must be at least 3 (steady decode starts at the third token)")
    for flag, value in (("--repeats", args.repeats), ("--threads", args.threads)):
        if value < 1:
            parser.error(f"{flag} must be at least 1")
    if not (args.model / "config.json").is_file():
        parser.error(f"--model {args.model}: no config.json there")
    for flag, path in (("--json", args.json_path), ("--write-benchmarks", args.write_benchmarks)):
        for problem in output_file_problems(path, flag):
            parser.error(problem)
    args.command = recorded_command(__file__, argv, parser)
    return args


def measure(args) -> list[dict]:
    from mla_convert.runtime import AbsorbedMLAModel, torch_decode

    models = {backend: AbsorbedMLAModel.from_folder(args.model, device="cpu", dtype=torch.float32, decode_backend=backend)
              for backend in ("reference", "torch")}
    for model in models.values():
        model.eos_token_ids = ()  # every prompt decodes --new-tokens
    vocab = models["torch"].embed_tokens.shape[0]
    generator = torch.Generator().manual_seed(0)
    args.loop_from_values = torch_decode.LOOP_FROM_VALUES  # the runtime's threshold, for the table's note
    torch_decode.LOOP_FROM_VALUES = 0  # "torch" runs its loop for every call (restored below)
    try:
        rows = [measure_case(args, models, batch, length, vocab, generator) for batch, length in args.cases]
    finally:
        torch_decode.LOOP_FROM_VALUES = args.loop_from_values
    return rows


def measure_case(args, models: dict, batch: int, length: int, vocab: int, generator: torch.Generator) -> dict:
    """Both paths on one batch of random prompts: their best steady rates and whether their tokens agree."""
    from mla_convert.runtime.generate import run_generation

    prompts = [torch.randint(0, vocab, (length,), generator=generator).tolist() for _ in range(batch)]
    rates, tokens = {"reference": [], "torch": []}, {}
    for _ in range(args.repeats):
        for backend, model in models.items():
            output = run_generation(model, prompts, args.new_tokens)
            rates[backend].append(output.steady_decode_tokens / output.steady_decode_seconds)
            tokens[backend] = output.sequences
    width = models["torch"].kv_lora_rank + models["torch"].rope_dim  # R + D cached values per token
    row = dict(batch=batch, length=length, values_per_sequence=length * width, reference_tok_s=max(rates["reference"]),
               loop_tok_s=max(rates["torch"]), same_tokens=tokens["reference"] == tokens["torch"])
    print(f"{batch} x {length}: reference {row['reference_tok_s']:.1f} tok/s, loop {row['loop_tok_s']:.1f} tok/s, "
          f"same tokens: {row['same_tokens']}", flush=True)
    return row


def markdown(args, rows: list[dict]) -> str:
    lines = [
        "## CPU decode: the runtime's loop against the batched oracle (`scripts/bench_cpu_decode_paths.py`)", "",
        f"`{args.command}`", "",
        f"{datetime.date.today().isoformat()}; torch {torch.__version__}, {torch.get_num_threads()} thread(s), fp32; "
        f"random prompts, {args.new_tokens} new tokens, steady decode (from the third token), the better of "
        f"{args.repeats} alternating runs.  The runtime takes the loop from {args.loop_from_values} cached values per "
        "sequence on average (length x (R + D)), the oracle below.", "",
        "| batch x prompt | cached values per sequence | oracle tok/s | loop tok/s | loop / oracle | same tokens |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        lines.append(f"| {row['batch']} x {row['length']} | {row['values_per_sequence']} | {row['reference_tok_s']:.1f} | "
                     f"{row['loop_tok_s']:.1f} | {row['loop_tok_s'] / row['reference_tok_s']:.2f} | "
                     f"{'yes' if row['same_tokens'] else 'no'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    with torch.inference_mode():
        rows = measure(args)
    body = markdown(args, rows)
    print("\n" + body + f"\n\n(total {time.perf_counter() - started:.0f}s)")
    if args.json_path:
        args.json_path.write_text(json.dumps(rows, indent=2) + "\n")
    if args.write_benchmarks:
        write_marked_section(args.write_benchmarks, SECTION_BEGIN, SECTION_END, f"{SECTION_BEGIN}\n{body}\n{SECTION_END}\n")
        print(f"wrote section to {args.write_benchmarks}")
    return 0 if all(row["same_tokens"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
