"""Architecture records: each family maps, and its weight-name templates are the names `save_pretrained` writes.

The expected names come from real checkpoints of tiny random models (every family, with and without
bias, tied and untied), read back from disk, so a template typo or a wrong bias rule shows up as a
set difference.  A family that fuses projections (Phi-3) names each role as rows of the stored matrix; those rows
must be the ones transformers' modeling code splits off.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import FAMILIES, tiny_config

from mla_convert.errors import MLAConvertError, UnsupportedArchitectureError
from mla_convert.io.config_file import read_config_json
from mla_convert.io.reader import CheckpointReader, split_row_view
from mla_convert.source.architectures import (
    LLAMA,
    MISTRAL,
    PHI3,
    QWEN2,
    SMOLLM3,
    SUPPORTED_ARCHITECTURES,
    architecture_for_config,
    supported_architecture_names,
)


def save_family(folder, family: str, tie: bool, **overrides) -> None:
    """A real checkpoint of a tiny model; `overrides` set config attributes tiny_config has no argument for."""
    config = tiny_config(family=family, num_layers=3, tie_word_embeddings=tie, **overrides.pop("config_kwargs", {}))
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    FAMILIES[family][1](config).save_pretrained(folder)


def bias_flags(spec, config: dict) -> tuple[bool, bool, bool]:
    """(qkv, o, mlp) bias by the spec's rule: a fixed fact of the family, or the config key it names."""
    return tuple(rule if isinstance(rule, bool) else bool(config.get(rule, False)) for rule in (spec.qkv_bias, spec.o_bias, spec.mlp_bias))


def spec_of(config: dict):
    return architecture_for_config((config.get("architectures") or [None])[0], config.get("model_type"))


def role_rows(config: dict) -> dict[str, int]:
    """Each projection's rows, from the config as written (what a fused family's role names need)."""
    q, kv = (config[key] * config["head_dim"] for key in ("num_attention_heads", "num_key_value_heads"))
    return {"q_weight": q, "k_weight": kv, "v_weight": kv, "gate_weight": config["intermediate_size"],
            "up_weight": config["intermediate_size"]}


def layer_roles(spec, config: dict, layer: int) -> dict[str, str]:
    qkv, o, mlp = bias_flags(spec, config)
    return {**spec.attention_weight_names(layer, qkv, o, role_rows(config)),
            **spec.mlp_weight_names(layer, mlp, role_rows(config)), **spec.norm_weight_names(layer)}


def expected_names(spec, config: dict) -> set[str]:
    """The stored names: a row view counts as the matrix it is rows of."""
    names = {spec.embed, spec.final_norm} | (set() if config.get("tie_word_embeddings") else {spec.lm_head})
    for layer in range(config["num_hidden_layers"]):
        names |= {(split_row_view(name) or (name,))[0] for name in layer_roles(spec, config, layer).values()}
    return names


# family, tie, extra: what the saved checkpoint must hold beyond the bias-free weights
CASES = {
    "llama": ("llama", False, {}),
    "llama-tied": ("llama", True, {}),
    "llama-attention-bias": ("llama", False, {"config_kwargs": {"attention_bias": True}}),
    "llama-mlp-bias-tied": ("llama", True, {"mlp_bias": True}),
    "mistral": ("mistral", False, {}),
    "mistral-tied": ("mistral", True, {}),
    "qwen2": ("qwen2", False, {}),
    "qwen2-tied": ("qwen2", True, {}),
    "phi3": ("phi3", False, {}),
    "phi3-tied": ("phi3", True, {}),
    "smollm3": ("smollm3", False, {}),
    "smollm3-attention-bias-tied": ("smollm3", True, {"config_kwargs": {"attention_bias": True}}),
    "granite": ("granite", False, {}),
    "granite-attention-bias-tied": ("granite", True, {"config_kwargs": {"attention_bias": True}}),
    "ernie4_5-tied": ("ernie4_5", True, {}),
    "ernie4_5-use-bias": ("ernie4_5", False, {"config_kwargs": {"attention_bias": True}}),  # (use_bias)
    "helium": ("helium", False, {}),
    "helium-attention-bias": ("helium", False, {"config_kwargs": {"attention_bias": True}}),
    "ministral": ("ministral", False, {}),
    "seed_oss-qkv-bias": ("seed_oss", False, {"config_kwargs": {"attention_bias": True}, "attention_out_bias": False}),
    "seed_oss-out-bias-tied": ("seed_oss", True, {"attention_out_bias": True}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_templates_match_the_names_save_pretrained_writes(tmp_path, case):
    family, tie, overrides = CASES[case]
    save_family(tmp_path, family, tie, **overrides)
    config = read_config_json(tmp_path)
    spec = spec_of(config)
    assert spec.family == family
    on_disk = set(CheckpointReader(tmp_path).keys())
    expected = expected_names(spec, config)
    assert expected == on_disk, f"missing from templates: {sorted(on_disk - expected)}; not on disk: {sorted(expected - on_disk)}"
    assert ("lm_head.weight" in on_disk) == (not tie)


@pytest.mark.parametrize(
    "case, qkv_bias, o_bias, mlp_bias",
    [
        ("llama", False, False, False),
        ("llama-attention-bias", True, True, False),
        ("llama-mlp-bias-tied", False, False, True),
        ("mistral", False, False, False),
        ("qwen2", True, False, False),
        ("phi3", False, False, False),
        ("smollm3-attention-bias-tied", True, True, False),
        ("granite-attention-bias-tied", True, True, False),
        ("ernie4_5-use-bias", True, True, True),
        ("helium-attention-bias", True, False, False),
        ("ministral", False, False, False),
        ("seed_oss-qkv-bias", True, False, False),
        ("seed_oss-out-bias-tied", False, True, False),
    ],
)
def test_bias_rules_follow_the_config(tmp_path, case, qkv_bias, o_bias, mlp_bias):
    family, tie, overrides = CASES[case]
    save_family(tmp_path, family, tie, **overrides)
    config = read_config_json(tmp_path)
    spec = spec_of(config)
    assert bias_flags(spec, config) == (qkv_bias, o_bias, mlp_bias)
    roles = spec.attention_weight_names(1, qkv_bias, o_bias, role_rows(config))
    assert ("k_bias" in roles) == qkv_bias and ("o_bias" in roles) == o_bias
    assert roles["k_weight"] == ("model.layers.1.self_attn.qkv_proj.weight[64:96]" if spec is PHI3 else
                                 "model.layers.1.self_attn.k_proj.weight")
    assert ("down_bias" in spec.mlp_weight_names(1, mlp_bias, role_rows(config))) == mlp_bias
    # The role names are what the converter looks tensors up by; their shapes must be the projections'.
    reader = CheckpointReader(tmp_path)
    assert reader.info(roles["q_weight"]).shape == (config["num_attention_heads"] * config["head_dim"], config["hidden_size"])
    assert reader.info(roles["k_weight"]).shape == (config["num_key_value_heads"] * config["head_dim"], config["hidden_size"])
    if qkv_bias:
        assert reader.info(roles["v_bias"]).shape == (config["num_key_value_heads"] * config["head_dim"],)


def test_fused_roles_are_the_rows_transformers_splits_off(tmp_path):
    """Phi-3's qkv_proj is [q | k | v] and its gate_up_proj [gate | up]; the reader's row views must return exactly the
    projections transformers' Phi3Attention / Phi3MLP compute with, and nothing is read twice or left out."""
    save_family(tmp_path, "phi3", False)
    config = read_config_json(tmp_path)
    model = FAMILIES["phi3"][1].from_pretrained(tmp_path)
    layer = model.model.layers[2]
    q_rows = config["num_attention_heads"] * config["head_dim"]
    kv_rows = config["num_key_value_heads"] * config["head_dim"]
    qkv = layer.self_attn.qkv_proj.weight.detach()  # (q_rows + 2 kv_rows, hidden)
    gate, up = layer.mlp.gate_up_proj.weight.detach().chunk(2)  # as Phi3MLP splits it
    expected = {"q_weight": qkv[:q_rows], "k_weight": qkv[q_rows:q_rows + kv_rows], "v_weight": qkv[q_rows + kv_rows:],
                "gate_weight": gate, "up_weight": up, "o_weight": layer.self_attn.o_proj.weight.detach(),
                "down_weight": layer.mlp.down_proj.weight.detach()}
    roles = layer_roles(PHI3, config, 2)
    with CheckpointReader(tmp_path) as reader:
        read = reader.get_many(roles[role] for role in expected)
        for role, weight in expected.items():
            assert torch.equal(read[roles[role]], weight), role
        # a block of a view's rows (how large MLP matrices are streamed) is the same block of the projection
        assert torch.equal(reader.get_rows(roles["up_weight"], 5, 9), up[5:9])
        assert torch.equal(reader.get_rows(roles["up_weight"], 90, 200), up[90:])  # clamped to the view's rows
        # rows past the stored matrix are an error naming it, not a short tensor
        past = roles["v_weight"].replace(f"{q_rows + 2 * kv_rows}]", f"{q_rows + 2 * kv_rows + 1}]")
        with pytest.raises(MLAConvertError, match="qkv_proj.weight' has shape .* too few rows"):
            reader.get(past)


@pytest.mark.parametrize(
    "architecture, spec",
    [("LlamaForCausalLM", LLAMA), ("MistralForCausalLM", MISTRAL), ("Qwen2ForCausalLM", QWEN2),
     ("Phi3ForCausalLM", PHI3), ("SmolLM3ForCausalLM", SMOLLM3)],
)
def test_each_supported_family_maps(architecture, spec):
    assert architecture_for_config(architecture, "whatever") is spec
    # Configs written without `architectures` still say `model_type`.
    assert architecture_for_config(None, spec.model_types[0]) is spec
    assert architecture in supported_architecture_names()


@pytest.mark.parametrize("architectures", [["LLaMAForCausalLM"], ["LlamaModel", "LlamaForCausalLM"], ["LlamaModel"]])
def test_a_config_transformers_loads_by_model_type_maps_by_it(architectures):
    """AutoModelForCausalLM loads these as LlamaForCausalLM (it reads model_type); they were 'unsupported'."""
    assert architecture_for_config(architectures, "llama") is LLAMA


def test_real_configs_map_to_their_family(tmp_path):
    for family in FAMILIES:
        folder = tmp_path / family
        tiny_config(family=family).save_pretrained(folder)
        assert spec_of(read_config_json(folder)).family == family


@pytest.mark.parametrize(
    "config",
    [
        {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"},
        {"architectures": ["LlamaForSequenceClassification"], "model_type": "llama"},
        {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"},
        {"model_type": "gpt_neox"},
        {},
    ],
)
def test_unsupported_architecture_lists_the_supported_ones(config):
    with pytest.raises(UnsupportedArchitectureError) as caught:
        spec_of(config)
    message = str(caught.value)
    assert isinstance(caught.value, MLAConvertError) and "\n" not in message
    named = (config.get("architectures") or [config.get("model_type")])[0]
    assert repr(named) in message
    for spec in SUPPORTED_ARCHITECTURES:
        for name in spec.hf_architectures:
            assert name in message


@pytest.mark.parametrize("model_type, named", [("mistral", "LlamaForCausalLM"), ("llama", "MistralForCausalLM"),
                                               ("qwen2", "LlamaForCausalLM"), ("phi3", "LlamaForCausalLM"),
                                               ("ministral", "MistralForCausalLM")])
def test_model_type_decides_the_family_as_transformers_builds_it(tmp_path, model_type, named):
    """`model_type: mistral` with a 16-token window under `architectures: [LlamaForCausalLM]` converted as a Llama
    without a window (the export diverged past 16 tokens); the reverse claimed a 4096-token window that transformers'
    LlamaConfig does not have.  AutoModelForCausalLM builds the class of model_type: so does the converter."""
    import json

    from transformers import AutoConfig, AutoModelForCausalLM

    from mla_convert.source.config import SourceConfig

    family = model_type
    config = tiny_config(family=family).to_dict()
    config.pop("layer_types", None)  # (derived again from use_sliding_window / max_window_layers)
    config.update(architectures=[named], sliding_window=16 if model_type != "llama" else None,
                  use_sliding_window=model_type == "qwen2", max_window_layers=0)
    (tmp_path / "config.json").write_text(json.dumps(config))
    built = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path))  # the oracle
    source = SourceConfig.from_folder(tmp_path)
    assert built.__class__.__name__ == source.architecture.hf_architectures[0]
    layer_types = getattr(built.config, "layer_types", None)
    window = getattr(built.config, "sliding_window", None) if "sliding_attention" in (layer_types or ["sliding_attention"]) else None
    assert source.sliding_window == window == (None if model_type == "llama" else 16)


def test_a_model_type_transformers_builds_otherwise_is_refused_whatever_architectures_says():
    """model_type gemma under LlamaForCausalLM: transformers builds a Gemma, which mla-convert does not convert; an
    unknown model_type (no transformers class) still maps by architectures."""
    with pytest.raises(UnsupportedArchitectureError, match="^unsupported model_type 'gemma': transformers builds"):
        architecture_for_config(["LlamaForCausalLM"], "gemma")
    assert architecture_for_config(["LlamaForCausalLM"], "my_llama") is LLAMA
