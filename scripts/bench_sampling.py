#!/usr/bin/env python
"""Teacher sampling speed: the growing KV cache against the static one, in one run on one model.

`finetune` draws its training text from the teacher (`data.sampling.sample_from_model`, `static_cache=True`); this
times both caches on the same rows and says whether they drew the same tokens.  Prints a markdown table.

    python scripts/bench_sampling.py MODEL [--rows 64] [--length 256] [--dtype bf16] [--threads 2]
"""

from __future__ import annotations

import argparse
import platform
import time

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a causal LM folder (the teacher)")
    parser.add_argument("--rows", type=int, default=64, help="sequences sampled at once (finetune's sample_batch_size)")
    parser.add_argument("--length", type=int, default=256, help="tokens per sequence (finetune's seq_len)")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)

    from mla_convert.data.sampling import sample_from_model
    from mla_convert.io.hf_loading import load_causal_lm, without_load_progress_bars

    torch.set_num_threads(args.threads)
    with without_load_progress_bars():
        model = load_causal_lm(args.model, dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32).eval()
    rows = {}
    for name, static in (("growing (DynamicCache)", False), ("static (StaticCache)", True)):
        began = time.perf_counter()
        ids = sample_from_model(model, args.rows, args.length, seed=0, batch_size=args.rows, static_cache=static)
        rows[name] = (time.perf_counter() - began, ids)
    tokens = args.rows * (args.length - 1)
    print(f"{args.model}: {args.rows} rows x {args.length} tokens, {args.dtype}, {args.threads} torch threads, "
          f"torch {torch.__version__}, {platform.machine()}")
    print()
    print("| KV cache | seconds | sampled tokens/s |")
    print("|---|---:|---:|")
    for name, (seconds, _) in rows.items():
        print(f"| {name} | {seconds:.1f} | {tokens / seconds:,.0f} |")
    same = torch.equal(rows["growing (DynamicCache)"][1], rows["static (StaticCache)"][1])
    agree = (rows["growing (DynamicCache)"][1] == rows["static (StaticCache)"][1]).float().mean().item()
    print()
    print(f"same tokens: {same} ({100 * agree:.1f} % of positions agree; the caches' logits differ by rounding, and one "
          "different draw changes the rest of its row)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
