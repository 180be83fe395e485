"""The demo's own evaluation text: windows sampled from a real model, scored by that model.

Why: `mla-convert demo` scores source and converted model on text the source samples itself (no dataset
download on a fresh machine), so that text must be seeded and must be the model's kind of text.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from mla_convert.demo import sampled_eval_ids, window_perplexity


@pytest.mark.real_model
def test_sampled_windows_are_seeded_and_far_likelier_than_random_tokens(stories260k):
    model = AutoModelForCausalLM.from_pretrained(stories260k, dtype=torch.float32).eval()
    first = sampled_eval_ids(model, 3, 48, seed=1)
    assert first.shape == (3, 48)
    assert (first[:, 0] == model.config.bos_token_id).all()
    assert torch.equal(first, sampled_eval_ids(model, 3, 48, seed=1))
    assert not torch.equal(first, sampled_eval_ids(model, 3, 48, seed=2))
    random_ids = torch.randint(0, model.config.vocab_size, (3, 48), generator=torch.Generator().manual_seed(0))
    random_ids[:, 0] = model.config.bos_token_id
    own, noise = window_perplexity(model, first), window_perplexity(model, random_ids)
    assert own < 0.1 * noise, (own, noise)
