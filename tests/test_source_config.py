"""The typed source config: parsed once, strictly, with every problem listed; RoPE resolved as transformers does."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from mla_convert.errors import CheckpointError, PreflightError
from mla_convert.io.config_file import read_config_json
from mla_convert.source.config import SourceConfig

SMOLLM2 = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576, "num_attention_heads": 9,
    "num_key_value_heads": 3, "num_hidden_layers": 30, "intermediate_size": 1536, "vocab_size": 49152,
    "rope_theta": 100000.0, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
}


def refusal_of(config: dict) -> list[str]:
    """The problems `from_dict` refuses `config` with (it must refuse it)."""
    with pytest.raises(PreflightError) as refused:
        SourceConfig.from_dict(config)
    return refused.value.problems


def problems_of(**changes) -> list[str]:
    return SourceConfig.problems({**SMOLLM2, **changes})


def test_a_sound_config_parses_into_typed_fields():
    config = SourceConfig.from_dict(SMOLLM2)
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.num_layers) == (9, 3, 64, 30)
    assert config.tied_embeddings is True and config.qkv_bias is False
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 100000.0}
    assert config.first_token_id == 1 and config.eos_token_ids == (2,)
    assert config.head_weight_name == "model.embed_tokens.weight"  # tied: the head reads the embedding rows


@pytest.mark.parametrize("key, value, fragment", [
    ("tie_word_embeddings", "false", "tie_word_embeddings must be true or false (found 'false')"),
    ("attention_bias", 1, "attention_bias must be true or false (found 1)"),
    ("hidden_size", 576.0, "hidden_size must be a positive integer (found 576.0)"),
    ("num_key_value_heads", True, "num_key_value_heads must be a positive integer (found True)"),
    ("num_hidden_layers", 10**9, "num_hidden_layers 1000000000 is beyond any real model"),
    ("rms_norm_eps", "1e-5", "rms_norm_eps must be a positive number (found '1e-5')"),
    ("bos_token_id", 49152, "bos_token_id 49152 is outside the vocabulary (vocab_size 49152)"),
    ("eos_token_id", [2, -1], "eos_token_id [2, -1] is outside the vocabulary"),
    ("pad_token_id", "0", "pad_token_id must be a token id"),
    ("hidden_act", "gelu", "hidden_act 'gelu' is not supported"),
    ("rope_scaling", [1, 2], "rope_scaling must be a JSON object"),
    ("rope_theta", -1, "rope_theta must be a positive number"),
    ("dtype", "int8", "dtype 'int8' is not a dtype mla-convert reads"),
])
def test_wrong_types_and_ranges_are_problems_not_truthiness(key, value, fragment):
    problems = problems_of(**{key: value})
    assert any(fragment in line for line in problems), problems
    with pytest.raises(PreflightError):
        SourceConfig.from_dict({**SMOLLM2, key: value})


def test_every_problem_is_listed_at_once():
    problems = problems_of(hidden_size="big", tie_word_embeddings="yes", bos_token_id=10**6)
    assert len(problems) == 3 and all(line.startswith("config.json: ") for line in problems)


def test_rope_is_resolved_as_transformers_resolves_it():
    """A legacy `rope_scaling` next to `rope_parameters` wins in transformers; it must not be silently dropped."""
    both = {**SMOLLM2, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}}
    assert LlamaConfig(**{k: v for k, v in both.items() if k != "architectures"}).rope_parameters["rope_type"] == "yarn"
    problems = SourceConfig.problems(both)
    assert problems == ["config.json: RoPE type 'yarn' (as transformers resolves this config) is not supported; "
                        "mla-convert reproduces default, linear, llama3"]
    linear = SourceConfig.from_dict({**SMOLLM2, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert linear.rope_parameters == {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0}


def test_read_config_json_errors(tmp_path):
    with pytest.raises(CheckpointError, match=r"config\.json: missing"):
        read_config_json(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json: not valid JSON"):
        read_config_json(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="not a JSON object"):
        read_config_json(tmp_path)
    (tmp_path / "config.json").unlink()
    os.mkfifo(tmp_path / "config.json")  # reading a FIFO would block forever
    with pytest.raises(CheckpointError, match="not a regular file"):
        read_config_json(tmp_path)


def test_only_the_config_module_reads_the_raw_config_dict():
    """One source of truth: no other module indexes a raw config mapping (the target module builds its own)."""
    package = Path(__file__).resolve().parents[1] / "mla_convert"
    pattern = re.compile(r"config\.get|config\[")
    allowed = {package / "source" / "config.py", package / "convert" / "target.py"}
    offenders = [f"{path.relative_to(package)}:{number}" for path in package.rglob("*.py") if path not in allowed
                 for number, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert offenders == []


def test_an_mla_export_given_as_a_source_is_named_as_one(tmp_path):
    """inspect and convert on a converted folder said "unsupported architecture 'DeepseekV3ForCausalLM'"; convert still
    refuses one, and points to inspect, which reports an export's cache (tests/test_inspect_export.py)."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                                                       "kv_lora_rank": 144, "qk_rope_head_dim": 48}))
    with pytest.raises(PreflightError) as refused:
        SourceConfig.from_folder(tmp_path)
    assert refused.value.problems == ["config.json: already an MLA model (DeepseekV3, kv_lora_rank 144 + rope 48); "
                                      "convert and sweep take the Llama / Mistral / Qwen2 / Phi-3 / SmolLM3 / Granite / ERNIE 4.5 / "
                                      "Helium / Ministral / Seed-OSS model it was converted from "
                                      "(`mla-convert inspect` reports what an export caches)"]


def test_a_partial_rotary_factor_is_refused_with_the_reason():
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                         num_hidden_layers=1, vocab_size=128).to_dict()
    config.update(architectures=["LlamaForCausalLM"], partial_rotary_factor=0.5)
    with pytest.raises(PreflightError) as refused:
        SourceConfig.from_dict(config)
    assert any("partial_rotary_factor 0.5 is not supported: only part of each head rotates" in problem
               for problem in refused.value.problems), refused.value.problems


# microsoft/phi-4's config.json as published (Phi3ForCausalLM: fused qkv_proj and gate_up_proj)
PHI4 = {"architectures": ["Phi3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "auto_map": {},
        "bos_token_id": 100257, "embd_pdrop": 0.0, "eos_token_id": 100257, "hidden_act": "silu", "hidden_size": 5120,
        "initializer_range": 0.02, "intermediate_size": 17920, "max_position_embeddings": 16384, "model_type": "phi3",
        "num_attention_heads": 40, "num_hidden_layers": 40, "num_key_value_heads": 10,
        "original_max_position_embeddings": 16384, "pad_token_id": 100257, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05,
        "rope_scaling": None, "rope_theta": 250000, "sliding_window": None, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "transformers_version": "4.47.0", "use_cache": True, "vocab_size": 100352}


def test_phi4_reads_as_a_gqa_source_whose_fused_matrices_are_named_by_rows():
    source = SourceConfig.from_dict(PHI4)
    assert (source.architecture.family, source.num_heads, source.num_kv_heads, source.head_dim) == ("phi3", 40, 10, 128)
    assert source.rope_parameters["rope_theta"] == 250000 and source.sliding_window is None
    assert source.torch_dtype == torch.bfloat16
    assert source.attention_weight_names(3) == {
        "q_weight": "model.layers.3.self_attn.qkv_proj.weight[0:5120]",
        "k_weight": "model.layers.3.self_attn.qkv_proj.weight[5120:6400]",
        "v_weight": "model.layers.3.self_attn.qkv_proj.weight[6400:7680]",
        "o_weight": "model.layers.3.self_attn.o_proj.weight"}
    assert source.mlp_weight_names(3) == {"gate_weight": "model.layers.3.mlp.gate_up_proj.weight[0:17920]",
                                          "up_weight": "model.layers.3.mlp.gate_up_proj.weight[17920:35840]",
                                          "down_weight": "model.layers.3.mlp.down_proj.weight"}


@pytest.mark.parametrize("changes, reason", [
    # Phi-4-mini rotates 96 of its 128 head dimensions
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}},
     "partial_rotary_factor 0.75 is not supported"),
    # the 128k-context Phi-3 variants: two factor lists over the 48 frequencies of a 96-wide head
    ({"hidden_size": 3072, "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 131072,
      "original_max_position_embeddings": 4096, "rope_theta": 10000.0,
      "rope_scaling": {"type": "longrope", "long_factor": [1.5] * 48, "short_factor": [1.0] * 48}},
     "RoPE type 'longrope' (as transformers resolves this config) is not supported"),
])
def test_phi_variants_whose_rope_deepseek_cannot_express_are_refused(changes, reason):
    problems = refusal_of({**PHI4, **changes})
    assert any(reason in problem for problem in problems), problems


# HuggingFaceTB/SmolLM3-3B's dimensions: every fourth layer attends without RoPE
SMOLLM3 = {"architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3", "hidden_size": 2048,
           "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16, "num_key_value_heads": 4,
           "vocab_size": 128256, "rope_theta": 5000000.0, "rope_scaling": None, "no_rope_layer_interval": 4,
           "no_rope_layers": [1, 1, 1, 0] * 9, "use_sliding_window": False, "sliding_window": None,
           "tie_word_embeddings": True, "rms_norm_eps": 1e-06, "torch_dtype": "bfloat16"}


def test_smollm3_names_its_nope_layers_as_its_config_class_resolves_them():
    source = SourceConfig.from_dict(SMOLLM3)
    assert (source.architecture.family, source.head_dim, source.num_kv_heads) == ("smollm3", 128, 4)
    assert source.nope_layers == list(range(3, 36, 4)) and source.rotates(0) and not source.rotates(3)
    # without the list, SmolLM3Config derives it from the interval, as transformers does when it loads the model
    derived = SourceConfig.from_dict({**{k: v for k, v in SMOLLM3.items() if k != "no_rope_layers"},
                                      "no_rope_layer_interval": 3})
    assert derived.nope_layers == list(range(2, 36, 3))
    assert SourceConfig.from_dict({**SMOLLM3, "no_rope_layers": [1] * 36}).rotary_layers is None  # all rotate: a Llama


@pytest.mark.parametrize("changes, reason", [
    ({"no_rope_layers": [1, 0]}, "no_rope_layers must list 0 or 1 for each of the 36 layers"),
    ({"no_rope_layers": [2] * 36}, "no_rope_layers must list 0 or 1 for each of the 36 layers"),
    ({"use_sliding_window": True, "sliding_window": 4096}, "use_sliding_window=True is not supported"),
])
def test_smollm3_configs_the_export_cannot_follow_are_refused(changes, reason):
    problems = refusal_of({**SMOLLM3, **changes})
    assert any(reason in problem for problem in problems), problems


# a 2B Granite's sizes and multipliers as public Granite configs state them (GraniteForCausalLM, tied head)
GRANITE = {"architectures": ["GraniteForCausalLM"], "model_type": "granite", "hidden_size": 2048,
           "intermediate_size": 8192, "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 8,
           "vocab_size": 49155, "rope_theta": 5000000.0, "max_position_embeddings": 131072, "attention_bias": False,
           "mlp_bias": False, "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
           "attention_multiplier": 0.015625, "logits_scaling": 8.0, "tie_word_embeddings": True, "rms_norm_eps": 1e-05,
           "torch_dtype": "bfloat16"}


def test_granite_reads_its_four_multipliers_and_folds_each_into_the_weights_it_scales():
    from mla_convert.source.folds import folded_weight_scales

    source = SourceConfig.from_dict(GRANITE)
    assert (source.architecture.family, source.head_dim, source.num_kv_heads) == ("granite", 64, 8)
    assert source.multipliers == {"embedding": 12.0, "residual": 0.22, "attention": 0.015625, "logits_divisor": 8.0}
    scales = folded_weight_scales(source)
    assert scales["model.embed_tokens.weight"] == 12.0
    assert scales["model.norm.weight"] == pytest.approx(1 / (8.0 * 12.0))  # tied: the head reads the scaled table
    assert scales["model.layers.39.self_attn.q_proj.weight"] == pytest.approx(0.015625 * 8)  # x sqrt(head_dim)
    assert scales["model.layers.0.self_attn.o_proj.weight"] == scales["model.layers.0.mlp.down_proj.weight"] == 0.22
    assert len(scales) == 2 + 3 * 40  # nothing else: k, v, gate, up and the layer norms stay as stored
    untied = SourceConfig.from_dict({**GRANITE, "tie_word_embeddings": False})
    assert folded_weight_scales(untied)["model.norm.weight"] == pytest.approx(1 / 8.0)
    # a key left out is GraniteConfig's default (1.0), and a factor of 1 folds nothing
    plain = SourceConfig.from_dict({k: v for k, v in GRANITE.items() if k != "residual_multiplier"})
    assert plain.multipliers["residual"] == 1.0
    assert not any("o_proj" in name or "down_proj" in name for name in folded_weight_scales(plain))
    assert SourceConfig.from_dict(SMOLLM2).multipliers is None and folded_weight_scales(SourceConfig.from_dict(SMOLLM2)) == {}


@pytest.mark.parametrize("changes, reason", [
    ({"logits_scaling": 0}, "logits_scaling must be a number > 0 (found 0)"),
    ({"embedding_multiplier": -12.0}, "embedding_multiplier must be a number > 0 (found -12.0)"),
    ({"attention_multiplier": None}, "attention_multiplier must be a number > 0 (found None)"),
    ({"mlp_bias": True}, "mlp_bias=true is not supported"),
])
def test_granite_multipliers_that_cannot_be_folded_are_refused(changes, reason):
    problems = refusal_of({**GRANITE, **changes})
    assert any(reason in problem for problem in problems), problems


@pytest.mark.parametrize("family, config_class", [("ernie4_5", "Ernie4_5Config"), ("helium", "HeliumConfig")])
def test_adjacent_pair_rope_families_read_their_q_k_rows_reordered_into_halves(family, config_class):
    """Per head the even rows, then the odd ones: pair (2i, 2i + 1) lands on (i, i + d/2), Llama's layout."""
    import transformers

    from mla_convert.source.folds import rotate_half_row_order, source_folds

    raw = getattr(transformers, config_class)().to_dict()  # the class's defaults: a 1B-3B-sized config
    source = SourceConfig.from_dict(raw)
    assert source.architecture.family == family and source.architecture.interleaved_rope
    assert rotate_half_row_order(2, 4).tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    folds = source_folds(source)
    q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    assert folds[q].row_order.tolist() == rotate_half_row_order(source.num_heads, source.head_dim).tolist()
    assert len(folds[k].row_order) == source.num_kv_heads * source.head_dim and folds[k].scale == 1.0
    assert len(folds) == 2 * source.num_layers  # q and k of each layer; v, o and the MLP are read as stored
    assert source_folds(SourceConfig.from_dict(SMOLLM2)) == {}


def test_ernie_use_bias_is_refused_by_its_own_key_for_its_mlp_biases():
    import transformers

    with pytest.raises(PreflightError) as refused:
        SourceConfig.from_dict({**transformers.Ernie4_5Config().to_dict(), "use_bias": True})
    assert refused.value.problems == ["config.json: use_bias=true is not supported (DeepseekV3's MLP has no biases)"]


def test_a_pad_token_id_of_minus_one_is_no_pad_token(tmp_path):
    """transformers-4.2x-era Llama configs carry `pad_token_id: -1` ("no pad token"); transformers loads them, and
    mla-convert refused them as "outside the vocabulary".  The export states no pad id, and loads."""
    import json

    from tiny_models import save_tiny_model

    from mla_convert.convert import ConvertOptions, convert
    from mla_convert.options import CalibrationOptions

    LlamaConfig(**{k: v for k, v in SMOLLM2.items() if k != "architectures"}, pad_token_id=-1)  # transformers takes it
    assert SourceConfig.from_dict({**SMOLLM2, "pad_token_id": -1}).pad_token_id is None
    assert "bos_token_id -1 is outside the vocabulary" in " ".join(problems_of(bos_token_id=-1))  # only pad means none
    source = save_tiny_model(tmp_path / "src", num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "pad_token_id": -1}))
    convert(source, tmp_path / "mla", ConvertOptions(kv_lora_rank=12, rope_dim=8, dtype="fp32", calibration=CalibrationOptions(
        num_samples=4, seq_len=32, error_samples=2)))
    exported = json.loads((tmp_path / "mla" / "config.json").read_text())
    assert exported.get("pad_token_id") is None
