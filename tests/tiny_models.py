"""Tiny randomly initialised source models, built inside the tests (shape and plumbing checks).

Real trained weights are used where quality matters (stories260K, SmolLM2); these exist to cover every
family and attention layout (MHA/GQA/MQA, bias, tied/untied embeddings, sharded checkpoints) in
seconds.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    Ernie4_5Config,
    Ernie4_5ForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    HeliumConfig,
    HeliumForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MinistralConfig,
    MinistralForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    SeedOssConfig,
    SeedOssForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "phi3": (Phi3Config, Phi3ForCausalLM),  # q/k/v stored in one matrix, gate/up in another
    "smollm3": (SmolLM3Config, SmolLM3ForCausalLM),  # some layers without RoPE (here every second)
    "granite": (GraniteConfig, GraniteForCausalLM),  # Llama with four activation multipliers (GRANITE_MULTIPLIERS)
    "ernie4_5": (Ernie4_5Config, Ernie4_5ForCausalLM),  # RoPE over adjacent pairs; `use_bias` for every projection
    "helium": (HeliumConfig, HeliumForCausalLM),  # RoPE over adjacent pairs; attention_bias on q/k/v only
    "ministral": (MinistralConfig, MinistralForCausalLM),  # Mistral whose layer_types choose the sliding layers
    "seed_oss": (SeedOssConfig, SeedOssForCausalLM),  # attention_bias on q/k/v, attention_out_bias on o_proj
}

# Granite's scalars, none of them 1, so each fold shows (public 2B Granite configs: 12, 0.22, 0.015625, 8)
GRANITE_MULTIPLIERS = dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.0625, logits_scaling=4.0)


def tiny_config(
    family: str = "llama",
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    hidden_size: int = 64,
    num_layers: int = 2,
    vocab_size: int = 128,
    intermediate_size: int = 96,
    attention_bias: bool = False,
    tie_word_embeddings: bool = False,
    rope_theta: float = 10000.0,
    rope_parameters: dict | None = None,
    max_position_embeddings: int = 512,
    rms_norm_eps: float = 1e-6,
):
    config_cls, _ = FAMILIES[family]
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        rms_norm_eps=rms_norm_eps,
        rope_parameters=rope_parameters or {"rope_type": "default", "rope_theta": rope_theta},
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if family in ("llama", "smollm3", "granite", "helium", "seed_oss"):
        kwargs["attention_bias"] = attention_bias
    if family == "seed_oss":
        kwargs["attention_out_bias"] = attention_bias
    if family == "ernie4_5":
        kwargs["use_bias"] = attention_bias  # (the MLP's too: a source pre-flight refuses)
    if family == "granite":
        kwargs.update(GRANITE_MULTIPLIERS)
    if family == "smollm3":
        kwargs["no_rope_layer_interval"] = 2  # layers 1, 3, ... attend without RoPE
    if family in ("mistral", "phi3"):
        kwargs["sliding_window"] = None
    if family == "ministral":  # (transformers 5.25 cannot run a Ministral without a window: one past every position)
        kwargs["sliding_window"] = 2 * max_position_embeddings
    config = config_cls(**kwargs)
    config.architectures = [FAMILIES[family][1].__name__]
    return config


def tiny_model(seed: int = 0, weight_scale: float = 1.0, **config_kwargs):
    """A randomly initialised model; `weight_scale` > 1 makes attention sharper than the 0.02 init."""
    config = tiny_config(**config_kwargs)
    torch.manual_seed(seed)
    model = FAMILIES[config_kwargs.get("family", "llama")][1](config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.02 * weight_scale)
            elif param.dim() == 2:
                param.mul_(weight_scale)
    return model


def llama_with_the_weights_of(phi3: Phi3ForCausalLM) -> LlamaForCausalLM:
    """The Llama that computes what `phi3` computes: its fused qkv_proj split into q/k/v_proj and its gate_up_proj
    into gate/up_proj, as Phi3Attention and Phi3MLP split them (the oracle of the fused-family conversion)."""
    c = phi3.config
    llama = LlamaForCausalLM(tiny_config(
        family="llama", num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
        hidden_size=c.hidden_size, num_layers=c.num_hidden_layers, vocab_size=c.vocab_size,
        intermediate_size=c.intermediate_size, tie_word_embeddings=c.tie_word_embeddings,
        rope_parameters={k: v for k, v in c.rope_parameters.items() if k != "partial_rotary_factor"},
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps)).eval()
    q_rows, kv_rows = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    state = {}
    for name, tensor in phi3.state_dict().items():
        if "qkv_proj" in name:
            for part, rows in zip(("q_proj", "k_proj", "v_proj"), tensor.split([q_rows, kv_rows, kv_rows])):
                state[name.replace("qkv_proj", part)] = rows
        elif "gate_up_proj" in name:
            for part, rows in zip(("gate_proj", "up_proj"), tensor.chunk(2)):
                state[name.replace("gate_up_proj", part)] = rows
        else:
            state[name] = tensor
    llama.load_state_dict(state, strict=True)
    return llama


def mapped_files(folder: Path) -> set[str]:
    """Files of `folder` that this process has memory-mapped right now (Linux)."""
    root = str(Path(folder).resolve())
    with open("/proc/self/maps") as maps:
        return {line.split()[-1] for line in maps if root in line}


def save_tiny_model(path: Path, max_shard_size: str | int = "5GB", seed: int = 0, weight_scale: float = 1.0, **config_kwargs) -> Path:
    model = tiny_model(seed=seed, weight_scale=weight_scale, **config_kwargs)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    return Path(path)


def tiny_mla_config(vocab_size: int = 128, hidden_size: int = 64, num_heads: int = 4, head_dim: int = 16,
                    num_layers: int = 2, intermediate_size: int = 96, kv_lora_rank: int = 12, rope_dim: int = 8,
                    q_lora_rank: int | None = None, max_position_embeddings: int = 256, tie_word_embeddings: bool = False,
                    **overrides):
    """A tiny DeepseekV3Config exactly as the exporter builds one (`convert.target.build_config`).

    `overrides` replace config values before the config is built (e.g. `first_k_dense_replace=1` for an MoE
    layer, `rope_parameters` of another type, `attention_bias=True`), so transformers validates them as usual.
    """
    from mla_convert.convert import target
    from mla_convert.source.config import SourceConfig
    from mla_convert.source.shapes import MLAShape

    source = SourceConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": vocab_size, "hidden_size": hidden_size,
        "num_attention_heads": num_heads, "num_key_value_heads": num_heads, "head_dim": head_dim,
        "num_hidden_layers": num_layers, "intermediate_size": intermediate_size, "bos_token_id": 1, "eos_token_id": 2,
        "max_position_embeddings": max_position_embeddings, "tie_word_embeddings": tie_word_embeddings,
    })
    config = target.build_config(source, MLAShape(kv_lora_rank, rope_dim, q_lora_rank), {"rope_type": "default", "rope_theta": 10000.0},
                                 torch.float32, q_lora_rank, attention_bias=False)
    return type(config).from_dict({**config.to_dict(), **overrides})


def save_tiny_tokenizer(folder: Path, vocab_size: int = 512) -> Path:
    """A character-level fast tokenizer (tokenizer.json + tokenizer_config.json) of `vocab_size` ids.

    Ids 0-2 are <unk>, <s>, </s>; then printable ASCII; the rest are unused filler tokens, so a tiny
    random model of that vocabulary can generate any id.  Built here so tests that need a tokenizer,
    not real weights, run without ../shared.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    chars = [chr(code) for code in range(32, 127)]
    vocab = {token: index for index, token in enumerate(specials + chars)}
    for index in range(len(vocab), vocab_size):
        vocab[f"<extra_{index}>"] = index
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)
    return Path(folder)


def pickled_copy(folder: Path, to: Path) -> Path:
    """`folder` copied to `to` with its safetensors weights replaced by `torch.save(state_dict)` (pytorch_model.bin): a
    pickled-only checkpoint, which every command refuses unless it can opt in."""
    import shutil

    from safetensors.torch import load_file

    copy = Path(shutil.copytree(folder, to))
    state = {}
    for file in sorted(copy.glob("*.safetensors")):
        state.update(load_file(file))
        file.unlink()
    for index in copy.glob("*.safetensors.index.json"):
        index.unlink()
    torch.save(state, copy / "pytorch_model.bin")
    return copy
