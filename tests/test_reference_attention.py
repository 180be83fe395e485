"""The conversion's own MLA forward (`convert.reference.mla_attention`) against transformers' DeepseekV3Attention.

Every measured decision of a conversion (K/V balance, RoPE grid, refinement, the report's attention-error
column) runs on `mla_attention`; if it drifted from the stock attention, those decisions would optimise the
wrong function.  The oracle is transformers itself, on random weights with the latent norms active.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_mla_config
from transformers import DeepseekV3ForCausalLM

from mla_convert.convert.reference import mla_attention


@pytest.mark.parametrize("variant", [
    dict(q_lora_rank=None, attention_bias=False),
    dict(q_lora_rank=24, attention_bias=False),
    dict(q_lora_rank=24, attention_bias=True),
], ids=["q_proj", "q_lora", "q_lora-bias"])
def test_mla_attention_equals_deepseek_v3_attention(variant):
    torch.manual_seed(0)
    config = tiny_mla_config(kv_lora_rank=12, rope_dim=8, **variant)
    config._attn_implementation = "sdpa"
    model = DeepseekV3ForCausalLM(config).eval()
    attention = model.model.layers[0].self_attn
    with torch.no_grad():
        for name, parameter in attention.named_parameters():  # non-trivial norms and biases
            if "layernorm" in name:
                parameter.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                parameter.normal_(0, 0.1)
        x = torch.randn(2, 11, config.hidden_size)
        positions = torch.arange(11)[None].expand(2, -1)
        cos, sin = model.model.rotary_emb(x, positions)
        expected, _ = attention(hidden_states=x, position_embeddings=(cos, sin), attention_mask=None)
        weights = {name: tensor for name, tensor in attention.state_dict().items()}
        ours = mla_attention(x, weights, config.num_attention_heads, config.qk_nope_head_dim, config.qk_rope_head_dim,
                             config.v_head_dim, model.model.rotary_emb.inv_freq)
    assert ours.shape == expected.shape
    assert torch.allclose(ours, expected, atol=1e-5, rtol=1e-4), (ours - expected).abs().max()
