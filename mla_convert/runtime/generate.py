"""Batched generation with the absorbed MLA model: prefill every prompt, then one token per sequence per step.

Semantics follow transformers' `generate` for a single unpadded prompt, so each prompt's output can be
compared with it token for token: the folder's generation_config.json applies as it does there (repetition
penalty, no-repeat n-grams, and when sampling its temperature, top-k and top-p unless given; settings the
runtime does not implement are listed by `GenerationSettings.notes`); greedy picks the argmax of the logits;
sampling uses temperature, top-k and nucleus (top-p) filtering; a sequence stops after `max_new_tokens`
tokens (the caller's: a max_length in the folder's generation_config.json, or generate()'s default of 20, is not
applied, so compare with generate() given the same max_new_tokens) or right after it emits an
end-of-sequence id (which is kept in its output, as `generate` keeps it), and finished sequences leave
the batch and give their cache pages back.

Sampling is seeded per prompt (`seed + index`), each prompt with its own generator: a prompt's sample
never depends on how many other prompts share the batch or when they finish.
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..data.sampling import greedy_tokens, top_p_sample
from ..errors import NonFiniteError
from .errors import GenerationSettingsError
from .generation_settings import GenerationSettings
from .model import AbsorbedMLAModel
from .paged_cache import PagedLatentCache

DEFAULT_PAGE_SIZE = 16
# wall-clock bound on rendering one prompt with a model folder's chat template (real templates take milliseconds)
CHAT_TEMPLATE_SECONDS = 5.0


@dataclass
class GenerationOutput:
    """Generated ids per prompt (prompt not included) and the cache they were decoded with.

    The call's time in three consecutive parts: the prefill, the first decode step, the steady decode.  The first
    decode step is timed apart because it carries one-off costs (on CUDA the kernel's compilation and the first
    allocations), which would otherwise read as slow decoding.  Each
    sequence's first new token comes from the prefill's logits, its second from the first decode step's, the rest
    from the steady steps (`first_decode_step_tokens`, `steady_decode_tokens` count them).
    """

    sequences: list[list[int]]
    cache: PagedLatentCache
    prefill_seconds: float = 0.0  # from the call to the prefill's logits
    # from there to the first decode step's tokens chosen: the prompts' first tokens chosen, then one decode step
    first_decode_step_seconds: float = 0.0
    steady_decode_seconds: float = 0.0  # the rest of the call: every later decode step and its tokens chosen

    @property
    def first_decode_step_tokens(self) -> int:
        """Tokens chosen from the first decode step's logits: one per sequence still running after its first token."""
        return sum(1 for sequence in self.sequences if len(sequence) >= 2)

    @property
    def steady_decode_tokens(self) -> int:
        """Tokens chosen from the later decode steps' logits (each sequence's third token on)."""
        return sum(max(len(sequence) - 2, 0) for sequence in self.sequences)


def _whole_number(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _token_ids(prompts) -> list[list[int]]:
    """Prompts as lists of ints: each a list / tuple / 1-D integer tensor of token ids (a flat list of ids, a text
    or float ids are refused in one line rather than by a TypeError deep in the loop)."""
    if isinstance(prompts, (str, bytes, torch.Tensor)) or not isinstance(prompts, Sequence):
        raise GenerationSettingsError(f"prompts: a list of prompts, each a list of token ids (got {type(prompts).__name__})")
    converted = []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, torch.Tensor) and prompt.dim() == 1 and not prompt.is_floating_point():
            prompt = prompt.tolist()
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence) or not all(map(_whole_number, prompt)):
            raise GenerationSettingsError(f"prompt {index}: a list of token ids (whole numbers), got {prompt!r:.80}; "
                                          "tokenize text first, or use generate_text")
        converted.append([int(token) for token in prompt])
    return converted


def _check_settings(prompts: list[list[int]], vocab_size: int, max_new_tokens: int, do_sample: bool,
                    temperature: float, top_p: float, page_size: int = DEFAULT_PAGE_SIZE) -> None:
    if not prompts:
        raise GenerationSettingsError("no prompts given")
    for index, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise GenerationSettingsError(f"prompt {index} is empty; every prompt needs at least one token")
        if min(prompt) < 0 or max(prompt) >= vocab_size:
            raise GenerationSettingsError(f"prompt {index} holds token ids outside the vocabulary (0..{vocab_size - 1})")
    if not _whole_number(max_new_tokens) or max_new_tokens < 1:
        raise GenerationSettingsError(f"max_new_tokens must be a whole number of at least 1, got {max_new_tokens!r}")
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
        raise GenerationSettingsError(f"page_size must be a whole number of at least 1, got {page_size!r}")
    if do_sample and not temperature > 0:
        raise GenerationSettingsError(f"temperature must be > 0 when sampling, got {temperature}")
    if do_sample and not 0 < top_p <= 1:
        raise GenerationSettingsError(f"top_p must be in (0, 1], got {top_p}")


def run_generation(model: AbsorbedMLAModel, prompts: list[list[int]], max_new_tokens: int, do_sample: bool = False,
                   temperature: float | None = None, top_p: float | None = None, seed: int = 0,
                   page_size: int = DEFAULT_PAGE_SIZE, num_pages: int | None = None,
                   generation_config: bool = True) -> GenerationOutput:
    """Generate for token-id prompts of any lengths; `num_pages=None` sizes the cache for the worst case.

    The worst case is every prompt running to max_new_tokens: the cache then holds prompt + max_new_tokens
    - 1 tokens per sequence (the last generated token is returned, never fed back).  `temperature` and `top_p`
    None: the folder's generation config's (else 1.0); `generation_config=False` ignores that file entirely.
    """
    started = time.perf_counter()  # the prefill's time runs from the call: the cache's allocation is part of it
    settings = model.generation_settings if generation_config else GenerationSettings()
    problems = settings.sampling_problems(temperature, top_p) if do_sample else []
    if problems:
        raise GenerationSettingsError("\n".join(problems))  # one line each
    temperature = settings.temperature if temperature is None else temperature
    top_p = settings.top_p if top_p is None else top_p
    chain = settings.processors(do_sample)
    prompts = _token_ids(prompts)
    _check_settings(prompts, model.embed_tokens.shape[0], max_new_tokens, do_sample, temperature, top_p, page_size)
    if num_pages is None:
        num_pages = PagedLatentCache.pages_needed([len(p) + max_new_tokens - 1 for p in prompts], page_size)
    longest = max(len(p) for p in prompts) + max_new_tokens - 1
    cache = model.new_cache(num_pages, page_size, max_sequences=len(prompts),
                            max_pages_per_sequence=-(-longest // page_size))
    seq_ids = [cache.add_sequence() for _ in prompts]
    generators = ([torch.Generator(device=model.device).manual_seed(seed + index) for index in range(len(prompts))]
                  if do_sample else None)
    eos = set(model.eos_token_ids if generation_config else model.config_eos_token_ids)
    outputs: list[list[int]] = [[] for _ in prompts]
    active = list(range(len(prompts)))
    logits = model.prefill(cache, seq_ids, prompts)  # (B, vocab)
    if logits.device.type == "cuda":
        torch.cuda.synchronize(logits.device)
    prefilled = time.perf_counter()
    prefill_seconds = prefilled - started
    first_step_done = None  # when the first decode step's tokens were chosen (None: no decode step yet)
    step = 0  # 0: choosing from the prefill's logits, n: from the n-th decode step's
    while True:
        if chain:  # each sequence's penalties see its own tokens so far, prompt included, as in generate()
            logits = torch.cat([settings.apply(chain, prompts[index] + outputs[index], logits[row : row + 1])
                                for row, index in enumerate(active)])
        try:
            if do_sample:
                chosen = [int(top_p_sample(logits[row : row + 1].float(), temperature, top_p, generators[index])[0])
                          for row, index in enumerate(active)]
            else:
                chosen = greedy_tokens(logits)
        except NonFiniteError as error:  # which step: a model that overflows only past some length shows it here
            raise NonFiniteError(f"new token {step + 1}: {error}") from None
        still_active = []
        for index, token in zip(active, chosen):
            outputs[index].append(token)
            if token in eos or len(outputs[index]) >= max_new_tokens:
                cache.release(seq_ids[index])
            else:
                still_active.append(index)
        active = still_active
        if step == 1:  # (the tokens were read back to the host above: the step's device work is done)
            first_step_done = time.perf_counter()
        if not active:
            finished = time.perf_counter()
            first_step_done = finished if first_step_done is None else first_step_done
            return GenerationOutput(outputs, cache, prefill_seconds, first_decode_step_seconds=first_step_done - prefilled,
                                    steady_decode_seconds=finished - first_step_done)
        logits = model.decode(cache, [seq_ids[i] for i in active], [outputs[i][-1] for i in active])
        step += 1


def _model(model_or_dir: AbsorbedMLAModel | str | Path, device, decode_backend: str) -> AbsorbedMLAModel:
    if isinstance(model_or_dir, AbsorbedMLAModel):
        return model_or_dir
    return AbsorbedMLAModel.from_folder(model_or_dir, device=device, decode_backend=decode_backend)


def generate_ids(model_or_dir: AbsorbedMLAModel | str | Path, prompt_ids: list[list[int]], max_new_tokens: int,
                 do_sample: bool = False, temperature: float | None = None, top_p: float | None = None, seed: int = 0,
                 device: str | torch.device | None = None, page_size: int = DEFAULT_PAGE_SIZE,
                 decode_backend: str = "auto", generation_config: bool = True) -> list[list[int]]:
    """Generated token ids per prompt (prompt excluded, a final eos included).

    `generation_config`: apply the folder's generation_config.json as transformers' generate() does (what it sets
    that the runtime cannot apply: `model.generation_settings.notes(do_sample)`).

    `model_or_dir`: an exported folder (loaded on `device`, default CUDA when available) or an already
    loaded `AbsorbedMLAModel` (then `device` / `decode_backend` are the model's own).
    """
    model = _model(model_or_dir, device, decode_backend)
    return run_generation(model, prompt_ids, max_new_tokens, do_sample, temperature, top_p, seed, page_size,
                          generation_config=generation_config).sequences


@dataclass
class TextGeneration:
    """What `generate_text` produced and what it cost."""

    texts: list[str]  # each prompt's continuation, spaced as the tokenizer decodes the whole sequence
    new_tokens: int
    seconds: float  # prefill + decode
    cache_bytes_in_use: int  # the latent cache's payload: every sequence's tokens at its end
    cache_bytes_allocated: int  # payload of every slot of every page
    cache_storage_bytes: int = 0  # what was allocated, the rows' 16-byte alignment padding included
    prompt_tokens: int = 0  # every prompt's tokens together
    prefill_seconds: float = 0.0  # part of `seconds`: the prompts' prefill
    # the rest of `seconds`, in two parts (`GenerationOutput`): the first decode step, warm-up included (CUDA kernel
    # compilation, first allocations), and the steady decode after it; the three parts add up to `seconds`
    first_decode_step_seconds: float = 0.0
    steady_decode_seconds: float = 0.0
    first_decode_step_tokens: int = 0  # new tokens from the first decode step's logits (one per sequence still running)
    steady_decode_tokens: int = 0  # new tokens from the later steps' (the other new tokens come from the prefill's)

    @property
    def tokens_per_second(self) -> float:
        """New tokens over the whole run, prefill included (not decode throughput: `steady_decode_tokens_per_second`)."""
        return self.new_tokens / max(self.seconds, 1e-9)

    @property
    def decode_seconds(self) -> float:
        """Everything after the prefill: the first decode step (warm-up included) and the steady decode."""
        return max(self.seconds - self.prefill_seconds, 0.0)

    @property
    def decode_tokens_per_second(self) -> float:
        """All new tokens over `decode_seconds`: the first decode step's warm-up included, and the tokens the prefill's
        logits gave counted too; what decoding sustains is `steady_decode_tokens_per_second`."""
        return self.new_tokens / max(self.decode_seconds, 1e-9)

    @property
    def steady_decode_tokens_per_second(self) -> float | None:
        """Tokens per second of the decode steps after the first (None: no such step ran, e.g. --max-new-tokens 2)."""
        if not self.steady_decode_tokens:
            return None
        return self.steady_decode_tokens / max(self.steady_decode_seconds, 1e-9)


def prompt_token_ids(tokenizer, prompts: Sequence[str], chat: bool = False, system: str | None = None) -> list[list[int]]:
    """Each prompt's ids: the text as it is, or (`chat`) a user turn rendered by the folder's chat template, after a
    `system` turn when one is given (else whatever the template adds on its own), ending in the assistant's turn.

    An instruct model answers its template's turns; a bare question is text for it to continue, often not an answer.
    """
    if not chat:
        return [tokenizer(prompt)["input_ids"] for prompt in prompts]
    from ..io.signals import time_limit

    head = [] if system is None else [{"role": "system", "content": system}]
    # transformers renders the folder's template in jinja2's sandbox, which bounds what it may call, not how long it
    # loops (two nested range(100000) hung `generate`): each rendering gets CHAT_TEMPLATE_SECONDS
    ids = []
    for prompt in prompts:
        with time_limit(CHAT_TEMPLATE_SECONDS):
            ids.append(list(tokenizer.apply_chat_template(head + [{"role": "user", "content": prompt}],
                                                          add_generation_prompt=True, tokenize=True,
                                                          return_dict=True)["input_ids"]))
    return ids


def system_turn_problems(chat: bool, system: str | None) -> list[str]:
    """A system turn without a chat: it would be ignored."""
    return ["--system: sets the chat's system turn; only with --chat"] if system is not None and not chat else []


def chat_template_problems(tokenizer, folder, chat: bool, system: str | None) -> list[str]:
    """What keeps `--chat` from acting on this folder's tokenizer (nothing without `chat`)."""
    if not chat:
        return []
    if not getattr(tokenizer, "chat_template", None):
        return [f"--chat: {folder} has no chat template (tokenizer_config.json chat_template, chat_template.jinja); "
                "give the prompts as plain text without --chat"]
    from ..io.signals import TimeLimitExceeded

    try:
        prompt_token_ids(tokenizer, ["test"], chat, system)
    except TimeLimitExceeded as error:
        return [f"--chat: the folder's chat template {error} rendering a one-word message (a template loops that long "
                "only by mistake or by design); fix the template, or give the prompts as plain text without --chat"]
    except Exception as error:  # jinja2's TemplateError (e.g. a template that raises on a system turn), or a bad render
        return [f"--chat: the folder's chat template refused the messages ({type(error).__name__}: {error})"]
    return []


def continuation(tokenizer, prompt_ids: list[int], new_ids: list[int]) -> str:
    """The new text as it reads after the prompt: the whole sequence decoded, minus the decoded prompt.

    Decoding the new ids alone drops the space a SentencePiece/BPE tokenizer puts at the boundary ("The
    dog" + "named" instead of "The dog named").
    """
    whole = tokenizer.decode(prompt_ids + new_ids, skip_special_tokens=True)
    prompt = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    return whole[len(prompt):] if whole.startswith(prompt) else tokenizer.decode(new_ids, skip_special_tokens=True)


def generate_text(model_dir: str | Path, prompts: list[str], max_new_tokens: int, do_sample: bool = False,
                  temperature: float | None = None, top_p: float | None = None, seed: int = 0, device: str | torch.device | None = None,
                  page_size: int = DEFAULT_PAGE_SIZE, decode_backend: str = "auto",
                  dtype: torch.dtype | None = None, chat: bool = False, system: str | None = None) -> TextGeneration:
    """Continuations of text prompts, tokenised and detokenised with the folder's own tokenizer.

    `chat`: each prompt is a user turn of the folder's chat template (`prompt_token_ids`), and each text is the reply
    alone (the template's own text is not part of any prompt the user typed).
    """
    from ..io.hf_loading import load_tokenizer

    if isinstance(prompts, str):  # a string is a sequence too: each character would become a prompt
        raise GenerationSettingsError("prompts: a list of strings (got one string; wrap it in a list)")
    if not all(isinstance(prompt, str) for prompt in prompts):
        raise GenerationSettingsError("prompts: a list of strings (token ids go to generate_ids)")
    tokenizer = load_tokenizer(model_dir)
    problems = system_turn_problems(chat, system) + chat_template_problems(tokenizer, model_dir, chat, system)
    if problems:
        raise GenerationSettingsError("; ".join(problems))
    prompt_ids = prompt_token_ids(tokenizer, prompts, chat, system)
    model = AbsorbedMLAModel.from_folder(model_dir, device=device, dtype=dtype, decode_backend=decode_backend)
    started = time.perf_counter()
    output = run_generation(model, prompt_ids, max_new_tokens, do_sample, temperature, top_p, seed, page_size)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    seconds = time.perf_counter() - started
    # every sequence's cached tokens: its prompt and all but its last new token (that one is never fed back)
    cached_tokens = sum(len(p) + len(s) - 1 for p, s in zip(prompt_ids, output.sequences))
    return TextGeneration(
        texts=[tokenizer.decode(s, skip_special_tokens=True) if chat else continuation(tokenizer, p, s)
               for p, s in zip(prompt_ids, output.sequences)],
        new_tokens=sum(len(s) for s in output.sequences), seconds=seconds,
        cache_bytes_in_use=cached_tokens * output.cache.bytes_per_token, cache_bytes_allocated=output.cache.bytes_allocated,
        cache_storage_bytes=output.cache.storage_bytes, prompt_tokens=sum(map(len, prompt_ids)),
        prefill_seconds=output.prefill_seconds, first_decode_step_seconds=output.first_decode_step_seconds,
        steady_decode_seconds=output.steady_decode_seconds, first_decode_step_tokens=output.first_decode_step_tokens,
        steady_decode_tokens=output.steady_decode_tokens)
