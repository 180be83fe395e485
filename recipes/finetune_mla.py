#!/usr/bin/env python
"""Fine-tune a converted MLA model so that it recovers its source model's quality.

The converted folder (stock `DeepseekV3ForCausalLM`, written by `mla-convert convert`) is the student;
the source model named in its `mla_convert.json` is the teacher.  The loss is KL(teacher || student)
on the logits (temperature `temperature`, plus `ce_weight` x next-token cross-entropy); by default only
the attention parameters train (`--train all` for everything).  Text comes from `data` (file, folder
or `datasets` spec, packed into `seq_len` windows), or, when no text is given, is sampled from the
teacher itself.  The result is written to `output` as the same stock DeepseekV3 folder `convert`
writes, with a `finetuning` section in `mla_convert.json` and a regenerated model card.

    python recipes/finetune_mla.py --config recipes/configs/stories260k_cpu.yaml
    accelerate launch recipes/finetune_mla.py --config recipes/configs/smollm2_1gpu.yaml
    accelerate launch --config_file recipes/configs/accelerate/fsdp_4gpu.yaml \\
        recipes/finetune_mla.py --config recipes/configs/smollm2_fsdp.yaml

Every YAML key is also a flag (`max_steps` <-> `--max-steps`) and flags win; `--resume auto` continues
from the newest checkpoint in `checkpoint_dir` exactly where it stopped.  See recipes/README.md.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from mla_convert.errors import MLAConvertError
    from mla_convert.finetune import parse_config, run_finetune

    try:
        config = parse_config(argv)
        result = run_finetune(config)
    except MLAConvertError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if result.output is not None:
        section = result.finetuning
        before, after = section.get("perplexity_before"), section.get("perplexity_after")
        summary = f"saved {result.output}: {section['steps']} steps, {section['tokens']:,} tokens"
        if before is not None and after is not None:
            summary += f"; perplexity {before:.4f} -> {after:.4f}"
        print(summary)
    elif result.checkpoint is not None:
        print(f"stopped at step {result.state.step}; resume with --resume auto (checkpoint {result.checkpoint})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
