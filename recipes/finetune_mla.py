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

Every YAML key is also a flag (`max_steps` <-> `--max-steps`) and flags win; paths in a YAML file are
relative to that file.  `--resume auto` continues from the newest checkpoint in `checkpoint_dir` exactly
where it stopped (Ctrl-C saves one first).  The same program is `mla-convert finetune`; see recipes/README.md.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from mla_convert.finetune.command import main as finetune

    return finetune(argv, prog="finetune_mla.py")


if __name__ == "__main__":
    sys.exit(main())
