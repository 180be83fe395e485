"""The folder's `generation_config.json`, applied as transformers' `generate` applies it.

A converted folder carries its source's generation config (Qwen2.5-Instruct sets a repetition penalty, top-k,
top-p and temperature).  `model.generate()` applies those settings by default, so a runtime that ignored them
decoded other tokens than transformers on the same folder.  Here the settings that choose tokens are read with
transformers' own `GenerationConfig`, applied with transformers' own logits processors, and the ones the runtime
does not implement are named, so that nothing is dropped silently.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import GenerationSettingsError

# transformers' values for settings a generation config leaves unset (GenerationConfig._get_default_generation_params
# in transformers 5; a test keeps this table in step with it)
TRANSFORMERS_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0,
                         "no_repeat_ngram_size": 0}
# settings that change which tokens `generate` picks and that this runtime does not implement, with the value that
# means "off" (a config holding that value asks for nothing)
NOT_APPLIED = {"min_length": 0, "min_new_tokens": None, "typical_p": 1.0, "min_p": None, "top_h": None,
               "epsilon_cutoff": None, "eta_cutoff": None, "bad_words_ids": None, "renormalize_logits": False,
               "forced_bos_token_id": None, "forced_eos_token_id": None, "exponential_decay_length_penalty": None,
               "suppress_tokens": None, "begin_suppress_tokens": None, "sequence_bias": None, "guidance_scale": None,
               "watermarking_config": None, "num_beams": 1, "penalty_alpha": None, "dola_layers": None,
               "diversity_penalty": None, "num_beam_groups": None, "constraints": None, "force_words_ids": None,
               "stop_strings": None, "encoder_repetition_penalty": 1.0, "encoder_no_repeat_ngram_size": 0,
               "token_healing": False, "max_time": None, "num_return_sequences": 1}
# new tokens per prompt when neither the caller nor the folder's generation_config.json (max_new_tokens) says
DEFAULT_MAX_NEW_TOKENS = 64


def token_id_tuple(value, path: Path) -> tuple[int, ...]:
    """A config's eos_token_id (one id, a list of them, or none) as a tuple; `path` names the file in the error."""
    values = [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise GenerationSettingsError(f"{path}: eos_token_id {value!r}: must be a token id or a list of them")
    return tuple(values)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# what each applied setting must be (transformers' processors and warpers refuse anything else)
VALID = {
    "do_sample": (lambda v: isinstance(v, bool), "must be true or false"),
    "temperature": (lambda v: _number(v) and v > 0, "must be a number above 0"),
    "top_k": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "must be a whole number, 0 or more"),
    "top_p": (lambda v: _number(v) and 0 < v <= 1, "must be in (0, 1]"),
    "repetition_penalty": (lambda v: _number(v) and v > 0, "must be a number above 0"),
    "no_repeat_ngram_size": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
                             "must be a whole number, 0 or more"),
}


# applied to every run (the sampling settings act only when sampling, and are checked then: `sampling_problems`)
ALWAYS_APPLIED = ("repetition_penalty", "no_repeat_ngram_size")


@dataclass(frozen=True)
class GenerationSettings:
    """What the folder's generation config asks `generate` for (transformers' defaults where it says nothing)."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    not_applied: dict = field(default_factory=dict)  # setting -> value the runtime cannot apply
    # the file's end-of-sequence ids (empty: it names none, and generate() then stops at none); None: there is no
    # file, and generate() takes config.json's ids
    eos_token_ids: tuple[int, ...] | None = None
    max_new_tokens: int | None = None  # the file's, when it sets one
    max_length: int | None = None  # the file's, when it sets one (prompt and new tokens together)

    @classmethod
    def from_folder(cls, folder: str | Path) -> GenerationSettings:
        from transformers import GenerationConfig

        path = Path(folder) / "generation_config.json"
        if not path.is_file():
            return cls()
        from transformers.utils import logging as hf_logging

        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # its warning about sampling flags in a greedy config is ours to explain
        try:
            config = GenerationConfig.from_pretrained(str(folder))
        except (OSError, ValueError, TypeError) as error:  # transformers' own words, on one line
            raise GenerationSettingsError(f"{path}: {str(error).strip().splitlines()[0]}") from error
        finally:
            hf_logging.set_verbosity(verbosity)
        values = {name: getattr(config, name, None) for name in TRANSFORMERS_DEFAULTS}
        values = {name: default if values[name] is None else values[name] for name, default in TRANSFORMERS_DEFAULTS.items()}
        problems = [f"{name} {values[name]!r}: {rule}" for name, (valid, rule) in VALID.items()
                    if name in ALWAYS_APPLIED and not valid(values[name])]
        if problems:  # transformers' processors would refuse them with a traceback at the first token
            raise GenerationSettingsError("\n".join(f"{path}: {problem}" for problem in problems))  # a line each
        ignored = {name: getattr(config, name, None) for name in NOT_APPLIED}
        ignored = {name: value for name, value in ignored.items() if value is not None and value != NOT_APPLIED[name]}
        lengths = {name: getattr(config, name, None) for name in ("max_new_tokens", "max_length")}
        problems = [f"{name} {value!r}: must be a whole number, 1 or more" for name, value in lengths.items()
                    if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1)]
        if problems:
            raise GenerationSettingsError("\n".join(f"{path}: {problem}" for problem in problems))  # a line each
        return cls(**values, not_applied=ignored, eos_token_ids=token_id_tuple(config.eos_token_id, path), **lengths)

    def new_tokens(self, given: int | None) -> int:
        """New tokens per prompt: `given`, else the file's max_new_tokens (as generate() takes it), else 64."""
        if given is not None:
            return given
        return self.max_new_tokens if self.max_new_tokens is not None else DEFAULT_MAX_NEW_TOKENS

    def sampling_problems(self, temperature: float | None = None, top_p: float | None = None) -> list[str]:
        """The config's sampling values a sampled run would use (those not replaced by `temperature` / `top_p`) that
        transformers' warpers refuse; a greedy run never reads them (transformers' generate ignores them too)."""
        used = {"top_k": self.top_k, "temperature": self.temperature if temperature is None else None,
                "top_p": self.top_p if top_p is None else None}
        return [f"generation_config.json {name} {value!r}: {VALID[name][1]}" for name, value in used.items()
                if value is not None and not VALID[name][0](value)]

    def processors(self, sampling: bool):
        """transformers' logits processors for these settings, in `generate`'s order (penalties, then top-k when
        sampling; temperature and top-p are applied by the sampler)."""
        from transformers.generation.logits_process import (
            LogitsProcessorList,
            NoRepeatNGramLogitsProcessor,
            RepetitionPenaltyLogitsProcessor,
            TopKLogitsWarper,
        )

        chain = LogitsProcessorList()
        if self.repetition_penalty != 1.0:
            chain.append(RepetitionPenaltyLogitsProcessor(self.repetition_penalty))
        if self.no_repeat_ngram_size > 0:
            chain.append(NoRepeatNGramLogitsProcessor(self.no_repeat_ngram_size))
        if sampling and self.top_k:  # (a bad top-k is refused before: `sampling_problems`)
            chain.append(TopKLogitsWarper(self.top_k))
        return chain

    def apply(self, chain, sequence: list[int], logits: torch.Tensor) -> torch.Tensor:
        """`logits` (1, vocab) of a sequence whose tokens so far (prompt and new ones) are `sequence`."""
        if not chain:
            return logits
        ids = torch.tensor([sequence], dtype=torch.long, device=logits.device)  # (1, tokens so far)
        return chain(ids, logits.float())

    def notes(self, sampling: bool, max_new_tokens: int | None = None) -> list[str]:
        """What a reader of the folder's generation config must know about this run (`max_new_tokens`: the new tokens
        per prompt this run generates by default, when the caller gave no length; None: the caller gave one)."""
        lines = []
        if max_new_tokens is not None and self.max_new_tokens is None and self.max_length is not None:
            lines.append(f"generation_config.json sets max_length {self.max_length} (prompt and new tokens), which "
                         f"mla-convert generate does not apply: this run generates up to {max_new_tokens} new tokens "
                         "per prompt, the default of --max-new-tokens")
        if self.do_sample and not sampling:
            lines.append(f"generation_config.json samples (do_sample true, temperature {self.temperature:g}, top-p "
                         f"{self.top_p:g}, top-k {self.top_k}); this run decodes greedily: add --sample to sample as "
                         "transformers' generate() would")
        if self.not_applied:
            listed = ", ".join(f"{name} {value!r}" for name, value in self.not_applied.items())
            lines.append(f"generation_config.json sets {listed}; mla-convert generate does not apply "
                         f"{'it' if len(self.not_applied) == 1 else 'them'}, so its tokens can differ from "
                         "transformers' generate()")
        return lines
