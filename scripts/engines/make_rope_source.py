"""A copy of a model folder with only its RoPE declaration edited, for the engines' RoPE runs (docs/engines.md).

  make_rope_source.py SRC OUT --rope llama3 --original-context 2048
  make_rope_source.py SRC OUT --rope linear --factor 4

Trained weights with a RoPE they were not trained with are a worse model, but a perfectly good probe: every engine
must rotate them exactly as transformers does, and an engine that ignores or rewrites the declaration shows up as a
perplexity gap on the same token ids.  The files are copied, not linked (`convert` refuses weights that resolve outside
the model folder).  llama3 uses Llama-3's low/high frequency factors 1 and 4; `--original-context` decides how many
frequencies the scaling changes (stories260K, head_dim 8: 64 changes 3 of its 4).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path


def edited_rope(config: dict, rope: str, factor: float, original_context: int | None) -> dict:
    """`config`'s `rope_parameters` replaced by the requested scaling, keeping its `rope_theta`."""
    theta = (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta", 10000.0))
    parameters = {"rope_type": rope, "rope_theta": theta, "factor": factor}
    if rope == "llama3":
        parameters.update(low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=original_context or config["max_position_embeddings"])
    edited = {key: value for key, value in config.items() if key not in ("rope_scaling", "rope_theta")}
    edited["rope_parameters"] = parameters
    return edited


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("source", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--rope", choices=("llama3", "linear"), required=True)
    ap.add_argument("--factor", type=float, default=8.0, help="scaling factor (default 8)")
    ap.add_argument("--original-context", type=int, help="llama3: original_max_position_embeddings "
                    "(default: the source's max_position_embeddings)")
    a = ap.parse_args(argv)
    if a.out.exists():
        ap.error(f"{a.out} exists")
    if a.original_context is not None and a.rope != "llama3":
        ap.error(f"--original-context: only llama3 scaling has one (--rope {a.rope})")
    if not (a.source / "config.json").is_file():
        ap.error(f"{a.source}: no config.json (a model folder is needed)")
    config = json.loads((a.source / "config.json").read_text())
    partial = a.out.with_name(a.out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(a.source, partial, symlinks=False, ignore=shutil.ignore_patterns(".*"))
    (partial / "config.json").write_text(json.dumps(edited_rope(config, a.rope, a.factor, a.original_context), indent=2))
    partial.rename(a.out)
    print(a.out, json.dumps(json.loads((a.out / "config.json").read_text())["rope_parameters"]))


if __name__ == "__main__":
    main()
