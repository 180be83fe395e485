"""Fine-tuning a converted MLA model back towards its source (distillation), used by `recipes/finetune_mla.py`.

Modules, one job each:
- `latent`: the stored latents brought to a trainable scale (exact reparametrisation) and back;
- `config`: `FinetuneConfig`, read from YAML and overridden by flags;
- `data`: packed text windows, text sampled from the teacher, the resumable data cursor;
- `loss`: KL(teacher || student) with temperature, plus optional next-token cross-entropy;
- `evaluate`: perplexity on the project protocol, across processes;
- `saving`: the stock DeepseekV3 folder, with the updated report and model card;
- `trainer`: the accelerate loop with exact checkpoint/resume.
"""

from .config import FinetuneConfig, FinetuneConfigError, parse_config
from .latent import UnfoldedLatentNorm, fold_latent_scales, unfold_latent_scales
from .trainer import Finetuner, FinetuneResult, run_finetune

__all__ = [
    "FinetuneConfig",
    "FinetuneConfigError",
    "FinetuneResult",
    "Finetuner",
    "UnfoldedLatentNorm",
    "fold_latent_scales",
    "parse_config",
    "run_finetune",
    "unfold_latent_scales",
]
