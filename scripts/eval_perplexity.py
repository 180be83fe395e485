#!/usr/bin/env python
"""Perplexity of a model (and optionally its source) on the project's protocol, as a markdown table.

A thin wrapper around `mla_convert.eval.perplexity.run_eval`, the same function `mla-convert eval` calls,
so the script and the CLI can never disagree.  Defaults are the project protocol: non-overlapping
windows, token-weighted NLL.

    python scripts/eval_perplexity.py OUT_DIR --baseline SRC --data ../shared/data/wikitext-2-raw-test.txt \
        --context 1024 --max-windows 40 --json eval.json
"""

from __future__ import annotations

import argparse
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="model folder or hub id (any causal LM, e.g. a converted DeepseekV3 folder)")
    parser.add_argument("--baseline", help="source model to compare against on identical windows")
    parser.add_argument("--data", required=True, help="text file, folder of text files, or datasets spec name:config:split")
    parser.add_argument("--text-column", default="text", help="text column of a jsonl file or dataset")
    parser.add_argument("--split", help="dataset split when --data does not name one")
    parser.add_argument("--max-chars", type=int, help="read only the first N characters of the text")
    parser.add_argument("--context", type=int, help="window length in tokens (default: 1024, or the models' "
                        "max_position_embeddings when shorter)")
    parser.add_argument("--allow-long-context", action="store_true", help="allow a context beyond max_position_embeddings")
    parser.add_argument("--stride", type=int, help="tokens between window starts (default: --context, no overlap)")
    parser.add_argument("--max-windows", type=int, help="evaluate at most N windows")
    parser.add_argument("--max-tokens", type=int, help="evaluate only the first N tokens")
    parser.add_argument("--batch-size", type=int, default=1, help="windows per forward")
    parser.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: where the model loads)")
    parser.add_argument("--dtype", default="auto", help="auto (checkpoint dtype), fp32 or bf16 (fp16 is refused for "
                        "converted models)")
    parser.add_argument("--json", dest="json_path", help="also write the results as JSON here")
    parser.add_argument("--threads", type=int, help="CPU threads for torch (fewer than cores helps on a shared machine)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads {args.threads}: must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from mla_convert.errors import MLAConvertError
    from mla_convert.eval.perplexity import run_eval

    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)

    try:
        report = run_eval(
            args.model,
            args.data,
            baseline=args.baseline,
            context_length=args.context,
            allow_long_context=args.allow_long_context,
            stride=args.stride,
            max_windows=args.max_windows,
            max_tokens=args.max_tokens,
            batch_size=args.batch_size,
            device=args.device,
            dtype=args.dtype,
            text_column=args.text_column,
            split=args.split,
            max_chars=args.max_chars,
            json_path=args.json_path,
            progress=not args.no_progress,
        )
    except MLAConvertError as error:
        for line in str(error).splitlines():
            print(f"error: {line}", file=sys.stderr)
        return 2
    for note in report.notes:
        print(f"note: {note}", file=sys.stderr)
    s = report.settings
    print(f"data: {s['data']}  ({s['total_tokens']} tokens; context {s['context_length']}, stride {s['stride']}, {s['dtype']} on {s['device']})")
    print(report.markdown())
    if report.ratio is not None:
        print(f"\nperplexity ratio model / baseline: {report.ratio:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
