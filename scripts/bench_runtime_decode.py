#!/usr/bin/env python
"""End-to-end decode speed on a GPU: source model and MLA model in transformers, MLA model in our runtime.

Why: the kernel benchmark (bench_mla_decode.py) times attention alone; what a user sees is tokens per
second of a whole model, where projections, norms, the MLP and per-step launch overhead also count.
This builds, in the script, randomly initialised models with SmolLM2-135M's dimensions (hidden 576,
30 layers, 9 heads of 64, 3 KV heads, MLP 1536, vocab 49152): the source as a LlamaForCausalLM and the
converted model as a dense DeepseekV3ForCausalLM with the converter's 4x (64+32) and 2x (144+48)
latent shapes.  Random weights decode exactly as fast as trained ones (no early stop: end-of-sequence
is disabled), and nothing has to be downloaded.  Measured per batch size, greedy, fixed prompt and
new-token counts:

  * transformers `generate` for the source and for the MLA model (decode tok/s, prefill excluded: a
    logits processor stamps the time of every step, synchronised);
  * our runtime (`mla_convert.runtime`: Triton kernel, paged latent cache) eager and with CUDA graphs,
    decode tok/s over all steps (graph captures included) and over the second half (steady state).

    TRITON_INTERPRET=0 python scripts/bench_runtime_decode.py --json OUT/runtime.json --markdown OUT/runtime.md
    python scripts/bench_runtime_decode.py --from-json OUT/runtime.json --write-benchmarks BENCHMARKS.md
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
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks_md import recorded_command, write_heading_section  # noqa: E402

SECTION_TITLE = "## MLA runtime decode (GPU)"
SMOLLM2 = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
               intermediate_size=1536, vocab_size=49152)
MLA_SHAPES = {"4x": (64, 32), "2x": (144, 48)}  # kv_lora_rank, qk_rope_head_dim


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--from-json", type=Path)
    parser.add_argument("--write-benchmarks", type=Path)
    parser.add_argument("--batches", type=int, nargs="+", help="batch sizes (default 1 16; --cpu-smoke: 1 2)")
    parser.add_argument("--prompt", type=int, help="prompt tokens per sequence (default 512; --cpu-smoke: 24)")
    parser.add_argument("--new-tokens", type=int, help="default 64; --cpu-smoke: 6")
    parser.add_argument("--shapes", nargs="+", default=list(MLA_SHAPES), choices=list(MLA_SHAPES))
    parser.add_argument("--layers", type=int, help=f"default {SMOLLM2['num_hidden_layers']}; --cpu-smoke: 2")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="2 layers, short prompts, on CPU (plain torch decode attention, no graphs): checks the plumbing only; "
                             "--batches, --prompt, --new-tokens and --layers given explicitly are honoured")
    args = parser.parse_args(argv)
    defaults = (dict(layers=2, prompt=24, new_tokens=6, batches=[1, 2]) if args.cpu_smoke else
                dict(layers=SMOLLM2["num_hidden_layers"], prompt=512, new_tokens=64, batches=[1, 16]))
    for name, value in defaults.items():  # only what was not given (--cpu-smoke used to override it silently)
        if getattr(args, name) is None:
            setattr(args, name, value)
        elif min(getattr(args, name) if name == "batches" else [getattr(args, name)]) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.from_json and not args.from_json.is_file():
        parser.error(f"--from-json {args.from_json}: no such file")
    args.command = recorded_command(__file__, argv, parser)
    return args


def _sync(torch, device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def build_models(torch, shapes, layers, folder: Path):
    """Random source (Llama) and MLA (DeepseekV3) models with SmolLM2-135M's dimensions, bf16 on CUDA."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM

    dims = dict(SMOLLM2, num_hidden_layers=layers)
    torch.manual_seed(0)
    source = LlamaForCausalLM(LlamaConfig(**dims, tie_word_embeddings=True, eos_token_id=None, bos_token_id=None))
    mla = {}
    for name in shapes:
        rank, rope = MLA_SHAPES[name]
        config = DeepseekV3Config(
            vocab_size=dims["vocab_size"], hidden_size=dims["hidden_size"], intermediate_size=dims["intermediate_size"],
            moe_intermediate_size=64, num_hidden_layers=layers, first_k_dense_replace=layers,
            num_attention_heads=dims["num_attention_heads"], num_key_value_heads=dims["num_attention_heads"],
            kv_lora_rank=rank, qk_rope_head_dim=rope, qk_nope_head_dim=dims["head_dim"], v_head_dim=dims["head_dim"],
            q_lora_rank=None, rope_interleave=True, max_position_embeddings=8192, n_routed_experts=1,
            n_shared_experts=0, num_experts_per_tok=1, n_group=1, topk_group=1, num_mtp_layers=0,
            tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
        )
        model = DeepseekV3ForCausalLM(config).to(torch.bfloat16)
        path = folder / f"mla-{name}"
        model.save_pretrained(path)
        mla[name] = (model, path)
    return source.to(torch.bfloat16), mla


def transformers_decode_rate(torch, model, prompts, new_tokens: int, device) -> float:
    """Decode tokens/s of `generate` (greedy, fixed length), prefill excluded."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class Clock(LogitsProcessor):
        def __init__(self):
            self.stamps = []

        def __call__(self, input_ids, scores):
            _sync(torch, device)
            self.stamps.append(time.perf_counter())
            return scores

    model = model.to(device).eval()
    ids = torch.tensor(prompts, device=device)
    settings = dict(do_sample=False, min_new_tokens=new_tokens, max_new_tokens=new_tokens, pad_token_id=0)
    model.generate(ids[:, :16], **dict(settings, min_new_tokens=4, max_new_tokens=4))  # warm-up
    clock = Clock()
    model.generate(ids, logits_processor=LogitsProcessorList([clock]), **settings)
    steps = len(clock.stamps) - 1
    return len(prompts) * steps / (clock.stamps[-1] - clock.stamps[0])


def runtime_decode_rates(torch, model, prompts, new_tokens: int, device) -> dict:
    """Our runtime: decode tok/s over every step and over the second half of the steps."""
    cache = model.new_cache(num_pages=len(prompts) * (-(-(len(prompts[0]) + new_tokens) // 16)), page_size=16,
                            max_sequences=len(prompts))
    seqs = [cache.add_sequence() for _ in prompts]
    logits = model.prefill(cache, seqs, prompts)
    _sync(torch, device)
    stamps = [time.perf_counter()]
    for _ in range(new_tokens - 1):
        logits = model.decode(cache, seqs, logits.float().argmax(-1).tolist())  # .tolist() syncs every step
        stamps.append(time.perf_counter())
    half = len(stamps) // 2
    result = dict(all_steps=len(prompts) * (len(stamps) - 1) / (stamps[-1] - stamps[0]),
                  steady=len(prompts) * (len(stamps) - 1 - half) / (stamps[-1] - stamps[half]))
    graphs = model._graphs.get(cache)
    if graphs is not None:
        result["graph_captures"] = graphs.captures
    return result


def measure(args, argv) -> dict:
    import torch

    if not torch.cuda.is_available() and not args.cpu_smoke:
        raise SystemExit("bench_runtime_decode: needs a CUDA GPU (use --from-json to render a GPU run)")
    import transformers

    from mla_convert.runtime import AbsorbedMLAModel

    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    started = time.perf_counter()
    command = args.command
    device_name = "CPU (smoke test)" if args.cpu_smoke else torch.cuda.get_device_name()
    results = dict(meta=dict(device=device_name, date=datetime.date.today().isoformat(),
                             torch=torch.__version__, transformers=transformers.__version__, command=command,
                             prompt=args.prompt, new_tokens=args.new_tokens, layers=args.layers),
                   rows=[])

    def save():
        results["meta"]["wall_s"] = time.perf_counter() - started
        if args.json:
            args.json.write_text(json.dumps(results, indent=1) + "\n")

    runtimes = {}  # (shape, graphs) -> loaded runtime model, shared by the batch sizes

    def runtime_model(name, path, graphs):
        if (name, graphs) not in runtimes:
            model = AbsorbedMLAModel.from_folder(path, device=device, dtype=torch.bfloat16, cuda_graphs=graphs)
            model.eos_token_ids = ()
            runtimes[(name, graphs)] = model
        return runtimes[(name, graphs)]

    def ours(name, path, graphs, prompts):
        model = runtime_model(name, path, graphs)
        runtime_decode_rates(torch, model, [p[:16] for p in prompts], 4, device)  # warm-up (compiles)
        rates = runtime_decode_rates(torch, model, prompts, args.new_tokens, device)
        rates["absorption"] = ("q fused" if model.absorption.fuse_query else "q separate") + ", " + (
            "o fused" if model.absorption.fuse_output else "o separate")
        return rates

    with tempfile.TemporaryDirectory() as folder:
        source, mla = build_models(torch, args.shapes, args.layers, Path(folder))
        generator = torch.Generator().manual_seed(0)
        for batch in args.batches:
            prompts = torch.randint(0, SMOLLM2["vocab_size"], (batch, args.prompt), generator=generator).tolist()
            kv = 2 * SMOLLM2["num_key_value_heads"] * SMOLLM2["head_dim"] * args.layers * 2
            entries = [("source (Llama, GQA)", "transformers",
                        lambda p=prompts: transformers_decode_rate(torch, source, p, args.new_tokens, device), kv)]
            for name, (hf_model, path) in mla.items():
                rank, rope = MLA_SHAPES[name]
                kv_mla = (rank + rope) * args.layers * 2
                entries.append((f"MLA {name} ({rank}+{rope})", "transformers",
                                lambda m=hf_model, p=prompts: transformers_decode_rate(torch, m, p, args.new_tokens, device),
                                kv_mla))
                for graphs in ((False,) if args.cpu_smoke else (False, True)):
                    entries.append((f"MLA {name} ({rank}+{rope})", "runtime" + (" + CUDA graphs" if graphs else ""),
                                    lambda n=name, p=path, g=graphs, q=prompts: ours(n, p, g, q), kv_mla))
            for model_name, engine, run, kv_bytes in entries:
                row = dict(batch=batch, model=model_name, engine=engine, kv_bytes_per_token=kv_bytes)
                try:
                    rate = run()
                    row.update(rate if isinstance(rate, dict) else dict(all_steps=rate))
                except Exception as error:  # report and go on
                    row["error"] = f"{type(error).__name__}: {error}"[:300]
                print(f"# batch {batch} {model_name} {engine}: {row}", file=sys.stderr)
                results["rows"].append(row)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                save()
    save()
    return results


def render(results: dict) -> str:
    meta = results["meta"]
    lines = [
        f"Produced by `{meta['command']}` on {meta['device']} ({meta['date']}; torch {meta['torch']}, transformers "
        f"{meta['transformers']}): randomly initialised models with SmolLM2-135M's dimensions ({meta['layers']} "
        f"layers), bf16, greedy, {meta['prompt']}-token prompts, {meta['new_tokens']} new tokens, end-of-sequence "
        "disabled.  Decode tok/s = batch x steps / time, prefill excluded; \"steady\" = second half of the steps "
        "(after the runtime's CUDA-graph captures).  KV bytes per token: all layers, bf16 (payload).",
        "",
        "| batch | model | engine | KV B/token | decode tok/s | steady tok/s | notes |",
        "|---:|---|---|---:|---:|---:|---|",
    ]
    for r in results["rows"]:
        if "error" in r:
            lines.append(f"| {r['batch']} | {r['model']} | {r['engine']} | {r['kv_bytes_per_token']} | failed | | "
                         f"{r['error']} |")
            continue
        steady = f"{r['steady']:.0f}" if "steady" in r else "-"
        notes = ", ".join(x for x in (r.get("absorption"), f"{r['graph_captures']} graph captures"
                                      if "graph_captures" in r else None) if x)
        lines.append(f"| {r['batch']} | {r['model']} | {r['engine']} | {r['kv_bytes_per_token']} "
                     f"| {r['all_steps']:.0f} | {steady} | {notes} |")
    lines.append(f"\nWall time: {meta.get('wall_s', 0):.0f} s.")
    return "\n".join(lines) + "\n"


def write_section(path: Path, body: str) -> None:
    """Replace this script's section of BENCHMARKS.md (heading to the next heading or marker), or append it."""
    write_heading_section(path, SECTION_TITLE, f"{SECTION_TITLE}\n\n{body.rstrip()}\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    results = json.loads(args.from_json.read_text()) if args.from_json else measure(args, argv)
    body = render(results)
    print(body)
    if args.markdown:
        args.markdown.write_text(body)
    if args.write_benchmarks:
        write_section(args.write_benchmarks, body)
    return 1 if any("error" in r for r in results["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
