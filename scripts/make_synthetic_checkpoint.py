"""Write a synthetic Llama-shaped safetensors checkpoint of any size, one shard at a time.

Benchmarks of checkpoint IO need a checkpoint as large as the real ones, without a hub download: this
writes random bf16 tensors under the names and shapes a `LlamaForCausalLM` of the chosen size has, laid
out in shards exactly as `save_pretrained(max_shard_size=...)` lays them out (shard assignment by
`huggingface_hub.split_torch_state_dict_into_shards`, the same index file), with a `config.json` made by
the installed `LlamaConfig`.  At most one shard's tensors exist in memory at once, and written shards are
dropped from the page cache so that a later reader really reads from disk.

    python scripts/make_synthetic_checkpoint.py outputs/synthetic --min-size-gib 4
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mla_convert.source.architectures import LLAMA  # noqa: E402

DTYPE = torch.bfloat16


def llama_config(hidden: int, heads: int, kv_heads: int, intermediate: int, layers: int, vocab: int):
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        vocab_size=vocab,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = DTYPE
    return config


def tensor_shapes(config) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every stored tensor, in `LlamaForCausalLM.state_dict()` order."""
    hidden, head_dim = config.hidden_size, config.head_dim
    q_rows, kv_rows = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    per_role = {
        "q_weight": (q_rows, hidden),
        "k_weight": (kv_rows, hidden),
        "v_weight": (kv_rows, hidden),
        "o_weight": (hidden, q_rows),
        "gate_weight": (config.intermediate_size, hidden),
        "up_weight": (config.intermediate_size, hidden),
        "down_weight": (hidden, config.intermediate_size),
        "input_norm": (hidden,),
        "post_attn_norm": (hidden,),
    }
    shapes = {LLAMA.embed: (config.vocab_size, hidden)}
    for layer in range(config.num_hidden_layers):
        names = {**LLAMA.attention_weight_names(layer, False, False), **LLAMA.mlp_weight_names(layer, False),
                 **LLAMA.norm_weight_names(layer)}
        for role, name in names.items():
            shapes[name] = per_role[role]
    shapes[LLAMA.final_norm] = (hidden,)
    shapes[LLAMA.lm_head] = (config.vocab_size, hidden)
    return shapes


def checkpoint_bytes(shapes: dict[str, tuple[int, ...]]) -> int:
    element = torch.empty((), dtype=DTYPE).element_size()
    return sum(torch.Size(shape).numel() * element for shape in shapes.values())


def layers_for_size(min_bytes: int, hidden: int, heads: int, kv_heads: int, intermediate: int, vocab: int) -> int:
    """Fewest layers (at least 1) that make the checkpoint at least `min_bytes` large.

    The size is linear in the layer count, so two sizes give the answer (counting up one layer at a time
    took hours for a narrow model and a large target).
    """
    one, two = (checkpoint_bytes(tensor_shapes(llama_config(hidden, heads, kv_heads, intermediate, n, vocab))) for n in (1, 2))
    per_layer = two - one
    return max(1, -(-(min_bytes - (one - per_layer)) // per_layer))


def shape_problems(hidden: int, heads: int, kv_heads: int, intermediate: int, layers: int, vocab: int,
                   max_shard_size: str | int) -> list[str]:
    """What would make the checkpoint impossible, found before anything is written."""
    from mla_convert.io.writer import parse_shard_size

    values = dict(hidden=hidden, heads=heads, kv_heads=kv_heads, intermediate=intermediate, layers=layers, vocab=vocab)
    problems = [f"--{name.replace('_', '-')} {value}: must be at least 1" for name, value in values.items() if value < 1]
    if not problems:
        if hidden % heads:
            problems.append(f"--hidden {hidden} is not a multiple of --heads {heads}")
        if heads % kv_heads:
            problems.append(f"--heads {heads} is not a multiple of --kv-heads {kv_heads}")
    try:
        if parse_shard_size(max_shard_size) < 1:
            problems.append(f"--max-shard-size {max_shard_size!r}: must be positive")
    except ValueError:
        problems.append(f"--max-shard-size {max_shard_size!r}: expected a size like 1GB or 500MB")
    return problems


def evict_from_page_cache(paths) -> None:
    """Flush and drop these files' cached pages (only theirs), so the next read comes from disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def make_synthetic_checkpoint(
    folder: str | os.PathLike,
    *,
    hidden: int = 4096,
    heads: int = 32,
    kv_heads: int = 8,
    intermediate: int = 14336,
    layers: int = 9,
    vocab: int = 32000,
    max_shard_size: str | int = "1GB",
    seed: int = 0,
    quiet: bool = False,
) -> dict:
    """Write the checkpoint into `folder` (which must not exist); a bad shape is a ValueError before any file."""
    folder = Path(folder)
    problems = shape_problems(hidden, heads, kv_heads, intermediate, layers, vocab, max_shard_size)
    if folder.exists():
        problems.append(f"{folder}: already exists")
    if problems:
        raise ValueError("; ".join(problems))
    folder.mkdir(parents=True)
    try:
        return _write_checkpoint(folder, hidden, heads, kv_heads, intermediate, layers, vocab, max_shard_size, seed, quiet)
    except BaseException:  # a half-written folder would pass for a checkpoint (and block the next run)
        shutil.rmtree(folder, ignore_errors=True)
        raise


def _write_checkpoint(folder: Path, hidden: int, heads: int, kv_heads: int, intermediate: int, layers: int, vocab: int,
                      max_shard_size: str | int, seed: int, quiet: bool) -> dict:
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    config = llama_config(hidden, heads, kv_heads, intermediate, layers, vocab)
    config.save_pretrained(folder)
    shapes = tensor_shapes(config)
    # Shapes only (meta tensors): the shard plan of save_pretrained without allocating anything.
    plan = split_torch_state_dict_into_shards(
        {name: torch.empty(shape, dtype=DTYPE, device="meta") for name, shape in shapes.items()},
        max_shard_size=max_shard_size,
    )
    generator = torch.Generator().manual_seed(seed)
    started = time.perf_counter()
    for number, (file, names) in enumerate(plan.filename_to_tensors.items(), start=1):
        shard = {}
        for name in names:
            tensor = torch.empty(shapes[name], dtype=DTYPE)
            tensor.normal_(0.0, 0.02, generator=generator)
            shard[name] = tensor
        save_file(shard, str(folder / file), metadata={"format": "pt"})
        del shard
        evict_from_page_cache([folder / file])
        if not quiet:
            print(f"  wrote {file} ({number}/{len(plan.filename_to_tensors)})", flush=True)
    if plan.is_sharded:
        index = {
            "metadata": {"total_parameters": sum(torch.Size(s).numel() for s in shapes.values()), **plan.metadata},
            "weight_map": plan.tensor_to_filename,
        }
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return {
        "folder": str(folder),
        "bytes": checkpoint_bytes(shapes),
        "on_disk_bytes": sum(path.stat().st_size for path in folder.iterdir()),
        "shards": len(plan.filename_to_tensors),
        "tensors": len(shapes),
        "layers": layers,
        "seconds": time.perf_counter() - started,
        "shape": dict(hidden=hidden, heads=heads, kv_heads=kv_heads, intermediate=intermediate, layers=layers, vocab=vocab),
        "max_shard_size": max_shard_size,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help="output folder (must not exist)")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--vocab", type=int, default=32000)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--layers", type=int, help="number of decoder layers")
    size.add_argument("--min-size-gib", type=float, default=4.0, help="fewest layers that reach this size (default 4 GiB)")
    parser.add_argument("--max-shard-size", default="1GB")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.layers is None and not args.min_size_gib > 0:
        parser.error(f"--min-size-gib {args.min_size_gib}: must be positive")
    dims = (args.hidden, args.heads, args.kv_heads, args.intermediate)
    problems = shape_problems(*dims, args.layers if args.layers is not None else 1, args.vocab, args.max_shard_size)
    if problems:
        parser.error("; ".join(problems))
    layers = args.layers if args.layers is not None else layers_for_size(int(args.min_size_gib * 2**30), *dims, args.vocab)
    try:
        summary = make_synthetic_checkpoint(args.folder, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                                            intermediate=args.intermediate, layers=layers, vocab=args.vocab,
                                            max_shard_size=args.max_shard_size, seed=args.seed)
    except ValueError as error:
        parser.error(str(error))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
