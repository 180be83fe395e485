#!/usr/bin/env python
"""Greedy decode speed and KV-cache size of a source model and its MLA conversion, side by side.

Why: the point of MLA is a smaller cache, which should make long-context decoding cheaper in memory
and (where decoding is memory-bound) faster.  This times plain `model.generate` (greedy, `use_cache=True`,
a fixed number of new tokens after a prompt of N tokens) for both models in the same run, on the same
prompts, and counts the bytes of the cache `generate` hands back (`mla_convert.eval.kv_cache`).  The
converted model is also decoded by mla-convert's absorbed runtime (`mla_convert.runtime`, what
`mla-convert generate` runs: kv_b_proj folded into the query and output instead of expanding every cached
latent at every step), on the same prompt, with end-of-sequence ignored as `min_new_tokens` makes
`generate` ignore it; its greedy tokens are compared with transformers' for the converted model.

Prefill and decode are timed separately within one `generate` call: a logits processor stamps the
clock each time the model has produced next-token logits, so the first stamp ends the prefill and the
rest are decode steps (decode tok/s = (new_tokens - 1) / (last stamp - first stamp)).  The runtime's
own clock splits its call the same way (`GenerationOutput`: prefill, then the decode steps).

    python scripts/bench_decode.py --source SRC --converted OUT --contexts 512,2048 --new-tokens 32 \
        --write-benchmarks BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmarks_md import recorded_command, repo_path, write_marked_section  # noqa: E402

from mla_convert.devices import device_problems  # noqa: E402
from mla_convert.io.paths import absolute_path, output_file_problems  # noqa: E402
from mla_convert.io.resolve import looks_like_hub_id  # noqa: E402
from mla_convert.units import DTYPE_NAMES  # noqa: E402

SECTION_BEGIN = "<!-- bench_decode:begin -->"
SECTION_END = "<!-- bench_decode:end -->"
CPU_DEFAULT_CONTEXTS = "512,2048"  # SmolLM2 source + converted finish in a few minutes on 2 cores
GPU_DEFAULT_CONTEXTS = "512,2048,8192"


@dataclass
class DecodeTiming:
    model: str
    context: int  # prompt tokens actually used
    new_tokens: int
    prefill_s: float
    decode_s: float
    decode_tokens_per_s: float
    kv_cache_bytes: int
    kv_bytes_per_token: float
    same_tokens_as_converted: bool | None = None  # runtime only: its greedy ids equal transformers' for the converted model


class StepClock:
    """A logits processor that only records when each next-token distribution is ready.

    It returns the scores untouched; on CUDA it synchronizes first so the stamp is the real finish time.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.stamps: list[float] = []

    def __call__(self, input_ids, scores):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stamps.append(time.perf_counter())
        return scores


def context_list(text: str) -> list[int]:
    try:
        contexts = [int(c) for c in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of whole numbers (e.g. 512,2048)") from None
    if any(c < 1 for c in contexts):
        raise argparse.ArgumentTypeError(f"{text!r}: each context must be at least 1 token")
    return contexts


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", required=True, help="source model folder or hub id")
    parser.add_argument("--converted", required=True, help="converted (MLA) model folder or hub id")
    parser.add_argument("--contexts", type=context_list,
                        help=f"prompt lengths, comma separated (default: {CPU_DEFAULT_CONTEXTS} on CPU, {GPU_DEFAULT_CONTEXTS} on GPU)")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated after each prompt")
    parser.add_argument("--data", help="text for the prompts (file, folder or dataset spec); default: random token ids")
    parser.add_argument("--device", help="cpu or cuda[:i] (default: cuda if available)")
    parser.add_argument("--dtype", choices=sorted(DTYPE_NAMES), metavar="DTYPE",
                        help="fp32, bf16 or fp16 (default: bf16 on GPU, fp32 on CPU)")
    parser.add_argument(
        "--threads",
        type=int,
        help="CPU threads for torch (default: all cores but one; on a shared 2-core machine a second busy "
        "thread made decode 5-20x slower and erratic, one thread gave steady numbers)",
    )
    parser.add_argument("--repeats", type=int, default=1, help="runs per (model, context); the fastest counts")
    parser.add_argument("--no-runtime", dest="runtime", action="store_false",
                        help="skip decoding the converted model with mla-convert's absorbed runtime")
    parser.add_argument("--write-benchmarks", type=absolute_path, metavar="BENCHMARKS.md",
                        help="replace (or append) this script's section there")
    parser.add_argument("--json", type=absolute_path, dest="json_path", help="also write the raw timings as JSON")
    return parser


MODEL_FLAGS = ("--source", "--converted", "--data")  # a local path or a hub id / dataset spec


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Everything is checked here, before the models load and the timing starts."""
    from mla_convert.data.textdata import looks_like_path

    parser = build_parser()
    args = parser.parse_args(argv)
    for flag, value in (("--repeats", args.repeats), ("--threads", args.threads)):
        if value is not None and value < 1:
            parser.error(f"{flag} must be at least 1")
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2 (one prefill step plus decode steps)")
    for problem in device_problems(args.device):
        parser.error(problem)
    for flag, value in (("--source", args.source), ("--converted", args.converted)):
        path = Path(value).expanduser()
        if path.exists() and not path.is_dir():
            parser.error(f"{flag} {value}: is a file; pass the model folder")
        if not path.exists() and not looks_like_hub_id(value):
            parser.error(f"{flag} {value}: no such folder, and not a Hugging Face hub id (owner/name)")
    if args.data is not None and looks_like_path(args.data) and not Path(args.data).expanduser().exists():
        parser.error(f"--data {args.data}: no such file or folder")
    for flag, path in (("--json", args.json_path), ("--write-benchmarks", args.write_benchmarks)):
        for problem in output_file_problems(path, flag):
            parser.error(problem)
    args.command = recorded_command(__file__, argv, parser, local_or_not=MODEL_FLAGS)
    return args


def shown(value: str) -> str:
    """A local path as the repo root sees it; a hub id or dataset spec as given."""
    return repo_path(value) if Path(value).expanduser().exists() else value


def load(model: str, device: torch.device, dtype: torch.dtype):
    from mla_convert.eval.perplexity import load_model_for_eval

    loaded, path = load_model_for_eval(model, device=device, dtype=str(dtype).replace("torch.", ""))
    return loaded, path


def prompt_ids(args, tokenizer_folder: Path, length: int, vocab_size: int) -> torch.Tensor:
    """(1, length) prompt: the start of --data if given, else seeded random ids (speed ignores content)."""
    if args.data is None:
        generator = torch.Generator().manual_seed(length)
        return torch.randint(0, vocab_size, (1, length), generator=generator)
    from mla_convert.data.textdata import load_text, tokenize_text
    from mla_convert.eval.perplexity import load_tokenizer_for_eval

    tokenizer = load_tokenizer_for_eval(tokenizer_folder)
    chars = length * 8
    while True:
        ids = tokenize_text(tokenizer, load_text(args.data, max_chars=chars))
        if ids.numel() >= length:
            return ids[:length][None]  # (length,) -> (1, length)
        full_text_tokens = ids.numel()
        chars *= 2
        if chars > 64 * length * 8:
            raise SystemExit(f"error: {args.data} has only {full_text_tokens} tokens, fewer than a {length}-token prompt")


def time_generate(model, ids: torch.Tensor, new_tokens: int, device: torch.device) -> tuple[float, float, int, list[int]]:
    """(prefill seconds, decode seconds, cache bytes, new token ids) of one greedy `generate`."""
    from transformers import LogitsProcessorList

    from mla_convert.eval.kv_cache import cache_bytes

    clock = StepClock(device)
    ids = ids.to(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        use_cache=True,
        logits_processor=LogitsProcessorList([clock]),
        return_dict_in_generate=True,
        pad_token_id=model.generation_config.pad_token_id or model.generation_config.eos_token_id or 0,
    )
    generated = out.sequences.shape[1] - ids.shape[1]
    if generated != new_tokens or len(clock.stamps) != new_tokens:
        raise RuntimeError(f"generate produced {generated} tokens ({len(clock.stamps)} steps), expected {new_tokens}")
    cache = getattr(out, "cache", None)  # transformers 5.x name; `past_key_values` is deprecated
    if cache is None:
        cache = getattr(out, "past_key_values", None)
    per_layer, _, _ = cache_bytes(cache)
    prefill = clock.stamps[0] - start
    decode = clock.stamps[-1] - clock.stamps[0]
    tokens = out.sequences[0, ids.shape[1]:].tolist()
    del out, cache
    return prefill, decode, sum(per_layer), tokens


def time_runtime(model, ids: torch.Tensor, new_tokens: int) -> tuple[float, float, int, list[int]]:
    """The same four numbers for mla-convert's absorbed runtime (`model`: an AbsorbedMLAModel with no stop tokens).

    Its decode time is the call after the prefill's logits (the first decode step and the steady steps:
    new_tokens - 1 steps, as `time_generate` counts; on CUDA the first step may capture a CUDA graph for a length
    the warm-up did not reach, and that is counted too); cache bytes are the latent cache's payload holding the
    prompt and all but the last new token, as `generate`'s cache does.
    """
    from mla_convert.runtime.generate import run_generation

    prompt = ids[0].tolist()
    output = run_generation(model, [prompt], new_tokens)
    tokens = output.sequences[0]
    if len(tokens) != new_tokens:
        raise RuntimeError(f"the runtime produced {len(tokens)} tokens, expected {new_tokens}")
    decode = output.first_decode_step_seconds + output.steady_decode_seconds
    held = (len(prompt) + new_tokens - 1) * output.cache.bytes_per_token
    return output.prefill_seconds, decode, held, tokens


def load_runtime(spec: str, device: torch.device, dtype: torch.dtype):
    """The converted model in mla-convert's absorbed runtime, stop tokens off (every run decodes new_tokens)."""
    from mla_convert.io.resolve import resolve_model_path
    from mla_convert.runtime import AbsorbedMLAModel

    model = AbsorbedMLAModel.from_folder(resolve_model_path(spec), device=device, dtype=dtype)
    model.eos_token_ids = ()
    return model


def bench_models(args, contexts: list[int], device: torch.device, dtype: torch.dtype) -> dict[str, list[DecodeTiming]]:
    """Time every model at every context, alternating them run by run.

    All models stay loaded and take turns, so load from other users of a shared machine (or clock
    changes) hits them alike instead of whichever happened to run last.  The runtime decodes the converted
    model's folder, with its prompt (the same ids: both read the converted folder's tokenizer).
    """
    models = {}  # label -> (timer, tokenizer folder, text config)
    for label, spec in (("source", args.source), ("converted", args.converted)):
        model, path = load(spec, device, dtype)
        config = model.config.get_text_config()
        models[label] = (lambda ids, n, m=model: time_generate(m, ids, n, device), path, config)
    if args.runtime:
        runtime = load_runtime(args.converted, device, dtype)
        models["runtime"] = (lambda ids, n, m=runtime: time_runtime(m, ids, n), *models["converted"][1:])
    for timer, path, config in models.values():
        timer(prompt_ids(args, path, 16, config.vocab_size), 2)  # warm-up: first-call setup
    timings: dict[str, list[DecodeTiming]] = {label: [] for label in models}
    limits = [getattr(config, "max_position_embeddings", None) for _, _, config in models.values()]
    max_positions = min((limit for limit in limits if limit), default=None)
    for context in contexts:
        best: dict[str, tuple[float, float, int, list[int]]] = {}
        length = context
        if max_positions is not None and context + args.new_tokens > max_positions:
            # Stay inside the trained positions; every model gets the same (shorter) prompt.
            length = max_positions - args.new_tokens
            print(f"note: context {context}: prompt cut to {length} tokens (max_position_embeddings={max_positions})", file=sys.stderr)
        prompts = {label: prompt_ids(args, path, length, config.vocab_size) for label, (_, path, config) in models.items()}
        for _ in range(args.repeats):
            for label, (timer, _, _) in models.items():
                result = timer(prompts[label], args.new_tokens)
                if label not in best or result[1] < best[label][1]:
                    best[label] = result
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        held_tokens = length + args.new_tokens - 1  # the last generated token is never fed back
        for label, (prefill, decode, held, tokens) in best.items():
            same = tokens == best["converted"][3] if label == "runtime" else None
            timing = DecodeTiming(label, length, args.new_tokens, prefill, decode, (args.new_tokens - 1) / decode, held,
                                  held / held_tokens, same)
            timings[label].append(timing)
            print(
                f"{label:>9} ctx {length:>6}: prefill {prefill:7.2f}s  decode {timing.decode_tokens_per_s:8.2f} tok/s  "
                f"KV {held / 2**20:9.2f} MiB" + ("" if same is None else f"  same tokens as transformers: {same}"),
                flush=True,
            )
    return timings


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    processor = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                processor = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU {processor}, {torch.get_num_threads()} threads"


def markdown_table(timings: dict[str, list[DecodeTiming]]) -> str:
    """One row per context: both models in transformers, and the runtime's columns when it ran."""
    source, converted, runtime = timings["source"], timings["converted"], timings.get("runtime")
    header = ("| context | source tok/s | converted tok/s | speed ratio | source KV MiB | converted KV MiB | KV ratio "
              "| source prefill s | converted prefill s |")
    if runtime:
        header += " runtime tok/s | runtime / source | runtime prefill s | runtime tokens = converted's |"
    lines = [header, "|" + "---:|" * (header.count("|") - 1)]
    for index, (s, c) in enumerate(zip(source, converted)):
        line = (
            f"| {s.context} | {s.decode_tokens_per_s:.2f} | {c.decode_tokens_per_s:.2f} | "
            f"{c.decode_tokens_per_s / s.decode_tokens_per_s:.2f}x | {s.kv_cache_bytes / 2**20:.2f} | "
            f"{c.kv_cache_bytes / 2**20:.2f} | {s.kv_cache_bytes / c.kv_cache_bytes:.2f}x | {s.prefill_s:.2f} | {c.prefill_s:.2f} |"
        )
        if runtime:
            r = runtime[index]
            line += (f" {r.decode_tokens_per_s:.2f} | {r.decode_tokens_per_s / s.decode_tokens_per_s:.2f}x | "
                     f"{r.prefill_s:.2f} | {'yes' if r.same_tokens_as_converted else 'no'} |")
        lines.append(line)
    return "\n".join(lines)


def write_section(path: Path, body: str) -> None:
    """Replace this script's marked section of BENCHMARKS.md, or append it; other sections stay."""
    write_marked_section(path, SECTION_BEGIN, SECTION_END, f"{SECTION_BEGIN}\n{body.rstrip()}\n{SECTION_END}\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import transformers

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    from mla_convert.units import parse_dtype

    dtype = parse_dtype(args.dtype, default=torch.bfloat16 if device.type == "cuda" else torch.float32)
    if device.type == "cpu":
        torch.set_num_threads(args.threads or max(1, min(torch.get_num_threads(), (os.cpu_count() or 2) - 1)))
    elif args.threads:
        torch.set_num_threads(args.threads)
    contexts = args.contexts or context_list(GPU_DEFAULT_CONTEXTS if device.type == "cuda" else CPU_DEFAULT_CONTEXTS)
    started = time.perf_counter()
    with torch.inference_mode():
        timings = bench_models(args, contexts, device, dtype)
    table = markdown_table(timings)
    command = args.command
    body = "\n".join(
        [
            "## Greedy decode: source vs converted (`scripts/bench_decode.py`)",
            "",
            f"`{command}`",
            "",
            f"{datetime.date.today().isoformat()}; {device_name(device)}; {str(dtype).replace('torch.', '')}; "
            f"torch {torch.__version__}, transformers {transformers.__version__}; greedy `generate`, "
            f"{args.new_tokens} new tokens after a prompt of `context` tokens "
            f"({'text from ' + shown(args.data) if args.data else 'random token ids'}); best of {args.repeats}.",
            f"source: `{shown(args.source)}`; converted: `{shown(args.converted)}`. Decode tok/s excludes the prefill; "
            "KV MiB is what the returned `DynamicCache` holds (context + new tokens - 1 positions)."
            + (" runtime: the converted folder decoded by `mla_convert.runtime` (as `mla-convert generate`; "
               "plain torch attention on CPU; the Triton kernel and CUDA graphs on CUDA), stop tokens off; "
               "\"runtime tokens = converted's\": its greedy ids equal transformers' for the converted model."
               if "runtime" in timings else ""),
            "",
            table,
        ]
    )
    print()
    print(table)
    print(f"\n(total {time.perf_counter() - started:.0f}s)")
    if args.write_benchmarks:
        write_section(args.write_benchmarks, body)
        print(f"wrote section to {args.write_benchmarks}")
    if args.json_path:
        args.json_path.write_text(json.dumps({label: [asdict(t) for t in rows] for label, rows in timings.items()}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
