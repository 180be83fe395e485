"""The measured KV cache equals the bytes the attention layout implies: full K/V per kv head for Llama,
the latent plus one shared RoPE key for stock DeepseekV3 (transformers caches the compressed form)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_mla_config, tiny_model

from mla_convert.errors import MLAConvertError
from mla_convert.eval.kv_cache import cache_bytes, max_context_for_budget, measure_kv_cache


def tiny_deepseek_v3(kv_lora_rank: int, rope_dim: int, num_layers: int = 3, seed: int = 0):
    """Dense (no MoE layer), no query LoRA: the shape our exporter writes."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    return DeepseekV3ForCausalLM(tiny_mla_config(kv_lora_rank=kv_lora_rank, rope_dim=rope_dim, num_layers=num_layers)).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads, tokens, batch", [(2, 37, 1), (1, 64, 3), (4, 5, 2)])
def test_llama_cache_is_full_keys_and_values(dtype, num_kv_heads, tokens, batch):
    layers, head_dim = 3, 16
    model = tiny_model(num_heads=4, num_kv_heads=num_kv_heads, head_dim=head_dim, num_layers=layers).to(dtype)
    measured = measure_kv_cache(model, tokens=tokens, batch_size=batch)
    dtype_size = torch.empty((), dtype=dtype).element_size()
    per_layer = 2 * num_kv_heads * head_dim * dtype_size * tokens * batch
    assert measured.per_layer_bytes == (per_layer,) * layers
    assert measured.total_bytes == 2 * num_kv_heads * head_dim * layers * dtype_size * tokens * batch
    assert measured.bytes_per_token == 2 * num_kv_heads * head_dim * layers * dtype_size
    assert measured.bytes_by_attribute == {"keys": layers * per_layer // 2, "values": layers * per_layer // 2}
    assert measured.dtypes == (str(dtype).replace("torch.", ""),)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_lora_rank, rope_dim", [(12, 8), (32, 16)])
def test_deepseek_v3_caches_only_latent_and_rope_key(dtype, kv_lora_rank, rope_dim):
    layers, tokens, batch = 3, 41, 2
    model = tiny_deepseek_v3(kv_lora_rank, rope_dim, layers).to(dtype)
    measured = measure_kv_cache(model, tokens=tokens, batch_size=batch)
    dtype_size = torch.empty((), dtype=dtype).element_size()
    assert measured.total_bytes == (kv_lora_rank + rope_dim) * layers * dtype_size * tokens * batch
    assert measured.bytes_per_token == (kv_lora_rank + rope_dim) * layers * dtype_size
    # the latent kv_nope sits in the "keys" slot, the shared rotary key k_rot in "values"
    assert measured.bytes_by_attribute["keys"] == kv_lora_rank * layers * dtype_size * tokens * batch
    assert measured.bytes_by_attribute["values"] == rope_dim * layers * dtype_size * tokens * batch
    # and far less than the per-head keys and values it stands for
    heads = model.config.num_attention_heads
    expanded = heads * (16 + rope_dim + 16) * layers * dtype_size
    assert measured.bytes_per_token < expanded


def test_given_input_ids_set_tokens_and_batch():
    model = tiny_model(num_kv_heads=2, head_dim=16, num_layers=2)
    ids = torch.arange(20) % 128
    measured = measure_kv_cache(model, input_ids=ids)
    assert (measured.tokens, measured.batch_size) == (20, 1)
    assert measured.total_bytes == 2 * 2 * 16 * 2 * 4 * 20


def test_cache_after_generate_is_counted_too():
    """`cache_bytes` works on the cache `generate` returns (used by the decode benchmark)."""
    model = tiny_model(num_kv_heads=2, head_dim=16, num_layers=2)
    prompt = torch.arange(10)[None] % 128  # (1, 10)
    out = model.generate(prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False, use_cache=True, return_dict_in_generate=True, pad_token_id=0)
    cache = getattr(out, "past_key_values", None) or getattr(out, "cache", None)
    per_layer, by_attribute, dtypes = cache_bytes(cache)
    held_tokens = 10 + 6 - 1  # the last generated token is never fed back
    assert per_layer == [2 * 2 * 16 * 4 * held_tokens] * 2
    assert dtypes == {"float32"}


def test_max_context_for_budget():
    assert max_context_for_budget(1000, 1_000_000, batch=1) == 1000
    assert max_context_for_budget(1000, 1_000_999, batch=1) == 1000
    assert max_context_for_budget(1000, 1_000_000, batch=4) == 250
    assert max_context_for_budget(46080, 16 * 2**30, batch=2) == 186413
    with pytest.raises(MLAConvertError):
        max_context_for_budget(0, 100)
    with pytest.raises(MLAConvertError):
        max_context_for_budget(10, 100, batch=0)
