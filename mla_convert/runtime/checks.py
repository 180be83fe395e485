"""Pre-flight of `generate`: every problem listed before the model is loaded.

The folder must be an export (a DeepseekV3 folder, safe to load), the prompts plus the new tokens must fit
the model's positions (beyond them it decodes garbage for minutes), the sampling settings must mean
something, and the latent cache the run allocates must fit in the memory of the device it runs on.
"""

from __future__ import annotations

import math
import os

import torch

from ..convert import target as T
from ..devices import device_problems, resolve_device
from ..errors import MLAConvertError
from ..eval.checks import ModelFacts, dtype_problems, model_facts, positive_problems
from ..io.hf_loading import load_config, load_tokenizer
from .generate import chat_template_problems, prompt_token_ids, system_turn_problems
from .generation_settings import GenerationSettings
from .loading import RUNTIME_DTYPES, config_eos_ids
from .paged_cache import PagedLatentCache

SEED_MAX = 2**63 - 1  # as `convert --seed`; torch generators take 64-bit seeds


def available_memory(device: torch.device) -> int | None:
    """Bytes free for new allocations on `device` (host: MemAvailable), None when unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _is_fp16(dtype: str | None) -> bool:
    """Any spelling `--dtype` accepts for float16 (FP16, float16, torch.float16)."""
    from ..units import parse_dtype

    try:
        return dtype not in (None, "auto") and parse_dtype(dtype) == torch.float16
    except MLAConvertError:
        return False



def weights_config_problems(folder) -> list[str]:
    """The rule `push` and the loader of the other commands apply: the stored tensors are exactly those config.json's
    model has (the runtime reads the tensors it knows by name and ignored a layer config.json does not have)."""
    from ..convert.target import config_tensor_problems
    from ..io.reader import CheckpointReader

    try:
        with CheckpointReader(folder) as reader:
            shapes = {name: info.shape for name, info in reader.tensor_infos().items()}
    except MLAConvertError as error:
        return [str(error)]
    return [f"{folder}: {problem}" for problem in config_tensor_problems(folder, shapes)]


def eos_problems(eos_ids: tuple[int, ...], vocab_size: int | None, folder) -> list[str]:
    """An end-of-sequence id the model cannot emit: generation would never stop on it (a negative one is refused where
    the ids are read; one past the vocabulary passed)."""
    outside = [token for token in eos_ids if vocab_size is not None and token >= vocab_size]
    if not outside:
        return []
    return [f"{folder}: eos_token_id {', '.join(map(str, outside))} is outside the vocabulary (ids 0..{vocab_size - 1}): "
            "the model can never produce it, so generation would never stop at an end of text; fix eos_token_id in "
            "generation_config.json / config.json"]

def generation_problems(model: str | os.PathLike, prompts: list[str], max_new_tokens: int | None, temperature: float | None,
                        top_p: float | None, device: str | None, dtype: str, page_size: int,
                        allow_long_context: bool, seed: int = 0, chat: bool = False,
                        system: str | None = None) -> tuple[list[str], ModelFacts | None]:
    problems: list[str] = []
    facts = model_facts(model, None, False, problems, pickle_flag=False)  # generate has no --allow-pickle
    problems += positive_problems({"--max-new-tokens": max_new_tokens, "--page-size": page_size})
    if temperature is not None and not 0 < temperature < math.inf:
        problems.append(f"--temperature {temperature}: must be a finite number > 0 when sampling")
    if not 0 <= seed <= SEED_MAX - len(prompts):  # prompt i is seeded with seed + i (torch.Generator: 64 bits)
        problems.append(f"--seed {seed}: must be between 0 and {SEED_MAX - len(prompts)}")
    if top_p is not None and not 0 < top_p <= 1:
        problems.append(f"--top-p {top_p}: must be in (0, 1]")
    if not prompts or any(not p.strip() for p in prompts):
        problems.append("every prompt needs some text")
    problems += system_turn_problems(chat, system)
    problems += device_problems(device)
    if facts is None:
        return problems, None
    if _is_fp16(dtype):  # whatever the export: the runtime has no fp16 path
        problems.append(f"--dtype {dtype}: {RUNTIME_DTYPES}")
    else:
        problems += dtype_problems(dtype, [facts])
    if not facts.converted:
        problems.append(f"{facts.path}: is not a model written by `mla-convert convert` (config.json is not {T.MODEL_TYPE}); "
                        "generate decodes exported MLA models")
        return problems, facts
    if problems:
        return problems, facts
    problems += weights_config_problems(facts.path)
    if problems:
        return problems, facts
    try:
        tokenizer = load_tokenizer(facts.path)
        config = load_config(facts.path)
        settings = GenerationSettings.from_folder(facts.path)  # its generation_config.json, read as the run applies it
        eos_ids = settings.eos_token_ids if settings.eos_token_ids is not None else config_eos_ids(config)
    except MLAConvertError as error:
        return problems + [str(error)], facts
    problems += chat_template_problems(tokenizer, facts.path, chat, system)
    problems += eos_problems(eos_ids, facts.vocab_size, facts.path)
    if problems:
        return problems, facts
    # None: the file's max_new_tokens (named as such in a refusal), else the default
    length_flag = "--max-new-tokens" if max_new_tokens is not None or settings.max_new_tokens is None else \
        "generation_config.json max_new_tokens"
    max_new_tokens = settings.new_tokens(max_new_tokens)
    lengths = [len(ids) for ids in prompt_token_ids(tokenizer, prompts, chat, system)]  # (the template's tokens too)
    # positions the longest sequence takes: its prompt and every new token but the last (that one is never fed back)
    longest = max(lengths) + max_new_tokens - 1
    if facts.max_positions and max(lengths) > facts.max_positions and not allow_long_context:
        problems.append(f"the longest prompt ({max(lengths)} tokens) is longer than the model's max_position_embeddings "
                        f"({facts.max_positions}); shorten it or pass --allow-long-context")
    elif facts.max_positions and longest > facts.max_positions and not allow_long_context:
        problems.append(f"{length_flag} {max_new_tokens}: the longest prompt ({max(lengths)} tokens) and the new tokens "
                        f"fed back after it take {longest} positions, more than the model's max_position_embeddings "
                        f"({facts.max_positions}); generate fewer tokens (--max-new-tokens) or pass --allow-long-context")
    # a page no sequence of this run can fill (with --allow-long-context, the longest sequence is the limit)
    limit = max(facts.max_positions or 0, longest if allow_long_context else 0)
    if limit and page_size > limit:
        problems.append(f"--page-size {page_size}: more than the longest sequence this run can hold ({limit} tokens); "
                        "every page is allocated whole, so most of it would stay empty")
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)  # auto computes in the stored dtype
    element = 2 if dtype in ("bf16", "bfloat16") or (dtype == "auto" and str(stored).endswith("bfloat16")) else 4
    per_token = config.num_hidden_layers * (config.kv_lora_rank + config.qk_rope_head_dim) * element
    pages = PagedLatentCache.pages_needed([n + max_new_tokens - 1 for n in lengths], page_size)
    needed = pages * page_size * per_token
    free = available_memory(resolve_device(device))
    if free is not None and needed > free:
        problems.append(f"the latent cache for {len(prompts)} prompts of up to {longest} tokens needs {needed / 2**30:.1f} GiB, "
                        f"more than the {free / 2**30:.1f} GiB free on {resolve_device(device)}")
    return problems, facts
