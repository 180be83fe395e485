"""The stock DeepseekV3 target: its config and the names of the weights that carry over unchanged."""

from __future__ import annotations

import torch

from ..source.shapes import MLAShape, SourceShape

# Every engine must compute the same latent norm: transformers hard-codes eps 1e-6 for kv_a_layernorm,
# vLLM and SGLang use config.rms_norm_eps, so the export sets rms_norm_eps to that same 1e-6.
EXPORT_RMS_NORM_EPS = 1e-6

DEEPSEEK_ATTENTION_PREFIX = "model.layers.{i}.self_attn."


def build_deepseek_config(
    source_config: dict,
    shape: SourceShape,
    mla: MLAShape,
    rope_parameters: dict,
    dtype: torch.dtype,
    q_lora_rank: int | None,
    attention_bias: bool,
):
    """A `DeepseekV3Config` for a dense MLA model equivalent to the source (built by transformers itself)."""
    from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config

    config = DeepseekV3Config(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_heads,
        kv_lora_rank=mla.kv_lora_rank,
        q_lora_rank=q_lora_rank,
        qk_rope_head_dim=mla.rope_dim,
        qk_nope_head_dim=shape.head_dim,
        v_head_dim=shape.head_dim,
        # dense model: every layer keeps the source MLP, so no MoE block is ever built
        first_k_dense_replace=shape.num_layers,
        n_routed_experts=1,
        n_shared_experts=0,
        num_experts_per_tok=1,
        n_group=1,
        topk_group=1,
        moe_intermediate_size=shape.intermediate_size,
        num_mtp_layers=0,
        hidden_act=source_config.get("hidden_act", "silu"),
        max_position_embeddings=shape.max_position_embeddings,
        rms_norm_eps=EXPORT_RMS_NORM_EPS,
        rope_parameters=dict(rope_parameters),
        rope_interleave=True,
        attention_bias=attention_bias,
        attention_dropout=0.0,
        tie_word_embeddings=shape.tied_embeddings,
        bos_token_id=source_config.get("bos_token_id"),
        eos_token_id=source_config.get("eos_token_id"),
        pad_token_id=source_config.get("pad_token_id"),
        initializer_range=float(source_config.get("initializer_range", 0.02)),
    )
    config.architectures = ["DeepseekV3ForCausalLM"]
    config.dtype = dtype
    return config


def carried_over_names(shape: SourceShape, config: dict, layer: int) -> dict[str, str]:
    """Source tensor name -> target name for a layer's MLP and norms (identical math in DeepseekV3)."""
    arch = shape.architecture
    mlp = arch.mlp_weight_names(layer, config)
    norms = arch.norm_weight_names(layer)
    prefix = f"model.layers.{layer}."
    return {
        norms["input_norm"]: prefix + "input_layernorm.weight",
        mlp["gate_weight"]: prefix + "mlp.gate_proj.weight",
        mlp["up_weight"]: prefix + "mlp.up_proj.weight",
        mlp["down_weight"]: prefix + "mlp.down_proj.weight",
        norms["post_attn_norm"]: prefix + "post_attention_layernorm.weight",
    }


def global_names(shape: SourceShape, config: dict) -> tuple[dict[str, str], dict[str, str]]:
    """(before the layers, after the layers): source name -> target name for embeddings, norm and head."""
    arch = shape.architecture
    head = {arch.final_norm: "model.norm.weight"}
    if not shape.tied_embeddings:
        head[arch.lm_head] = "lm_head.weight"
    return {arch.embed: "model.embed_tokens.weight"}, head
