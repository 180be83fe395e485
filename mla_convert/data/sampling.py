"""Seeded sampling from a causal LM: nucleus sampling with an explicit generator (never the global RNG).

Used for calibration text (from the layer-streamed source), fine-tuning data (from the teacher), the
demo's evaluation text and the runtime's sampled generation, so all of them draw tokens the same way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import NonFiniteError

NUCLEUS_CANDIDATES = 1024
NON_FINITE_LOGITS = ("the model's next-token logits are not finite (NaN, +Inf, or -Inf for every token: its activations "
                     "overflow its dtype)")


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """The most likely token of each (batch, vocab) row.  argmax over NaN logits returns a token all the same (an
    export computing NaN printed text and no error), so a row whose largest logit is not finite is refused: NaN
    propagates through the max, and +Inf, or -Inf everywhere, is no distribution (one reduction, not a softmax, on
    the decode loop)."""
    scores = logits.float()
    if not bool(torch.isfinite(scores.amax(dim=-1)).all()):
        raise NonFiniteError(NON_FINITE_LOGITS + ", so no token can be chosen")
    return scores.argmax(dim=-1).tolist()


def top_p_sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator,
                 candidates: int | None = None) -> torch.Tensor:
    """One token per row from (batch, vocab) logits with temperature and nucleus filtering.

    `candidates` limits the nucleus to that many most likely tokens: calibration sampling uses
    `NUCLEUS_CANDIDATES`, because a full sort of a 50K vocabulary per step costs more than the
    model's own step there; the tail it drops is less likely than every kept token.  None is exact.
    """
    probs = torch.softmax(logits.float() / max(temperature, 1e-5), dim=-1)
    if not bool(torch.isfinite(probs).all()):  # (torch.multinomial's own error was a traceback naming no model)
        raise NonFiniteError(NON_FINITE_LOGITS + ", so no token can be sampled")
    top_probs, order = probs.topk(min(candidates or probs.shape[-1], probs.shape[-1]), dim=-1)  # sorted, descending
    keep = top_probs.cumsum(-1) - top_probs < top_p  # (batch, candidates)
    keep[..., 0] = True  # the top token always (a top_p below float32's smallest number compared as 0 kept none)
    choice = torch.multinomial(top_probs * keep, 1, generator=generator)  # (batch, 1)
    return order.gather(-1, choice).squeeze(-1)


def start_token(model) -> int:
    """The token every sampled sequence starts from: BOS, else EOS (GPT-style), else 0."""
    config = model.config
    for candidate in (getattr(config, "bos_token_id", None), getattr(config, "eos_token_id", None)):
        if isinstance(candidate, (list, tuple)):
            candidate = candidate[0] if candidate else None
        if candidate is not None:
            return int(candidate)
    return 0


@torch.no_grad()
def sample_from_model(
    model,
    num: int,
    seq_len: int,
    seed: int,
    temperature: float = 1.0,
    top_p: float = 0.95,
    batch_size: int = 64,
    device: torch.device | str | None = None,
    progress: Callable[[int, int], None] | None = None,
    candidates: int | None = NUCLEUS_CANDIDATES,
    static_cache: bool = False,
) -> torch.Tensor:
    """`num` sequences of `seq_len` tokens sampled from a transformers causal LM (KV-cached, seeded): (num, seq_len).

    Sampling does not stop at end-of-sequence: the model goes on with whatever it predicts next
    (for TinyStories-style models: the next story), so every row is a full window of the teacher's
    own distribution.  The seeded generator makes the samples independent of the global RNG; they
    depend on (seed, batch_size), which is why both are part of the cached samples' description.
    `candidates`: the nucleus is drawn from that many most likely tokens (`top_p_sample`); None sorts the whole
    vocabulary, which on SmolLM2 (49K tokens, 64 rows) took 0.23 s a step beside the model's 0.8 s.
    `static_cache`: a cache allocated once for `seq_len` tokens instead of one that grows by concatenation.  The
    growing cache made each step cost more the longer the rows got: SmolLM2 in bf16 on one CPU thread, 64 rows, a step
    at position 230 took 1.04 s against 0.38 s with the static cache (transformers' SDPA path on a grown cache
    dominates); the logits agree to float rounding, so the samples can differ from the growing cache's.
    """
    device = torch.device(device) if device is not None else next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    begin = start_token(model)
    was_training = model.training
    model.eval()
    rows = []
    try:
        for first in range(0, num, batch_size):
            count = min(batch_size, num - first)
            ids = torch.full((count, seq_len), begin, dtype=torch.long)
            cache = _static_cache(model, seq_len) if static_cache else None
            out = model(input_ids=ids[:, :1].to(device), cache=cache, use_cache=True)
            for position in range(1, seq_len):
                logits = out.logits[:, -1].float().cpu()  # (count, vocab)
                ids[:, position] = top_p_sample(logits, temperature, top_p, generator, candidates)
                if position < seq_len - 1:
                    out = model(input_ids=ids[:, position : position + 1].to(device), cache=out.cache, use_cache=True)
            rows.append(ids)
            if progress:
                progress(first + count, num)
    finally:
        model.train(was_training)
    return torch.cat(rows)  # (num, seq_len)


def _static_cache(model, seq_len: int):
    """transformers' fixed-size KV cache for `seq_len` tokens (its tensors are made on the first forward, on the
    model's device and dtype)."""
    from transformers import StaticCache

    return StaticCache(config=model.config, max_cache_len=seq_len)
