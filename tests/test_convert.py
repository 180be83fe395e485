"""The conversion core: exactness oracle, stock loading, the cached latent, RoPE grids, bad shapes."""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import llama_with_the_weights_of, mapped_files, save_tiny_model, tiny_model
from transformers import AutoModelForCausalLM, DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE, DeepseekV3RotaryEmbedding

from mla_convert.convert import ConvertOptions, convert
from mla_convert.convert.decisions import Progress
from mla_convert.convert.rope import RopeGrid, deepseek_rope_parameters, grid_inv_freq
from mla_convert.errors import MLAConvertError, PreflightError
from mla_convert.eval.kv_cache import measure_kv_cache
from mla_convert.io.hf_loading import load_tokenizer
from mla_convert.options import CalibrationOptions
from mla_convert.source.model import rope_inv_freq

TINY_CALIBRATION = CalibrationOptions(num_samples=4, seq_len=32, error_samples=2)


def fast_options(**kwargs) -> ConvertOptions:
    kwargs.setdefault("calibration", TINY_CALIBRATION)
    kwargs.setdefault("dtype", "fp32")
    return ConvertOptions(**kwargs)


def logits_of(folder, ids):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def relative(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


# small matmuls on a shared 2-core machine are far slower with 2 threads (conftest.py)
pytestmark = pytest.mark.usefixtures("single_torch_thread")


# ----------------------------------------------------------------------------- exactness oracle
@pytest.mark.parametrize(
    "family, bias, head_dim",
    [("llama", False, 16), ("llama", True, 16), ("qwen2", True, 16), ("mistral", False, 16), ("llama", True, 32),
     ("phi3", False, 16), ("smollm3", False, 16), ("smollm3", True, 16), ("granite", False, 16), ("granite", True, 16),
     ("ernie4_5", False, 16), ("helium", False, 16), ("helium", True, 16), ("ministral", False, 16),
     ("seed_oss", False, 16), ("seed_oss", True, 16)],
)
def test_mqa_at_full_rank_with_every_frequency_is_exact(tmp_path, family, bias, head_dim):
    """MQA (1 kv head), full latent rank, rope_dim = head_dim: the MLA model IS the source model.

    head_dim 32: 128 query rows from a 64-wide input, so the query bias lies outside W_q's column space; it used to
    lose ~75 % of the bias without a word (q_lora_rank = hidden), and now rides on one more latent channel.
    smollm3: its second layer attends without RoPE; the export's RoPE rows there are zero and the latent holds the
    whole key.  granite: its four multipliers are folded into the weights (tiny_models.GRANITE_MULTIPLIERS).
    ernie4_5, helium: RoPE over adjacent pairs, read with q/k rows reordered into halves."""
    kwargs = dict(family=family, num_heads=4, num_kv_heads=1, head_dim=head_dim, hidden_size=64, num_layers=2,
                  weight_scale=3.0)
    if family in ("llama", "smollm3", "granite", "helium", "seed_oss"):
        kwargs["attention_bias"] = bias
    source = save_tiny_model(tmp_path / "src", **kwargs)
    out = tmp_path / "mla"
    result = convert(source, out, fast_options(kv_lora_rank=2 * head_dim, rope_dim=head_dim))
    if family == "smollm3":  # layer 1 is NoPE: nothing rotates there
        tensors = load_file(out / "model.safetensors")
        assert not tensors["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"][2 * head_dim:].any()
        assert tensors["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"][2 * head_dim:].any()
        # the converter's own measurement compares each layer with the source's attention, unrotated in layer 1
        assert all(layer["attention_output_relative_error"] < 1e-5 for layer in result.report["layers"])
    if bias:
        assert result.report["options"]["q_lora_rank"] == (64 if head_dim == 16 else 65)
    ids = torch.randint(0, 128, (2, 48))
    converted, expected = logits_of(out, ids), logits_of(source, ids)
    torch.testing.assert_close(converted, expected, rtol=1e-4, atol=1e-4)
    if bias:  # the query bias rides through q_a_proj exactly (W_q is square and invertible here)
        assert all(layer["query_bias_residual"] < 1e-6 for layer in result.report["layers"])


@pytest.mark.parametrize("tie", [False, True])
def test_granite_multipliers_fold_into_the_weights_they_scale(tmp_path, tie):
    """Granite = Llama x four scalars; stock DeepseekV3 has none, so the export holds them in its weights: embeddings
    x e, final norm x 1 / (L e) tied or 1 / L untied (the head reads the scaled table when tied), and (checked through
    the logits, the oracle) query rows x a sqrt(head_dim), o_proj / down_proj x r.  MQA at full rank: exact."""
    from tiny_models import GRANITE_MULTIPLIERS as M

    source = save_tiny_model(tmp_path / "src", family="granite", num_heads=4, num_kv_heads=1, head_dim=16,
                             hidden_size=64, weight_scale=3.0, tie_word_embeddings=tie)
    out = tmp_path / "mla"
    result = convert(source, out, fast_options(kv_lora_rank=32, rope_dim=16))
    assert result.report["source"]["folded_multipliers"] == M
    assert "**Multipliers folded into the weights.**" in (out / "README.md").read_text()  # the card says so
    stored, exported = load_file(source / "model.safetensors"), load_file(out / "model.safetensors")
    torch.testing.assert_close(exported["model.embed_tokens.weight"],
                               stored["model.embed_tokens.weight"] * M["embedding_multiplier"])
    head = M["logits_scaling"] * (M["embedding_multiplier"] if tie else 1.0)
    torch.testing.assert_close(exported["model.norm.weight"], stored["model.norm.weight"] / head)
    torch.testing.assert_close(exported["model.layers.1.mlp.down_proj.weight"],
                               stored["model.layers.1.mlp.down_proj.weight"] * M["residual_multiplier"])
    assert ("lm_head.weight" in exported) == (not tie)
    ids = torch.randint(0, 128, (2, 48))
    torch.testing.assert_close(logits_of(out, ids), logits_of(source, ids), rtol=1e-4, atol=1e-4)


def test_gqa_at_full_rank_loses_only_the_rope_truncation(tmp_path):
    """2 kv heads share one RoPE key: the only loss at full latent rank is the rotation of the second
    head's keys, so the error is well below dropping RoPE entirely and the factorization keeps everything."""
    source = save_tiny_model(tmp_path / "src", num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64, weight_scale=3.0)
    result = convert(source, tmp_path / "full", fast_options(kv_lora_rank=64, rope_dim=16))
    assert all(layer["kept_energy"] > 1 - 1e-9 for layer in result.report["layers"])
    ids = torch.randint(0, 128, (2, 48))
    error = relative(logits_of(tmp_path / "full", ids), logits_of(source, ids))
    assert 1e-4 < error < 0.25, error
    # RoPE estimate: the plan keeps far less logit error than no RoPE at all, in every layer
    for layer in result.report["layers"]:
        assert layer["rope_error_estimate"] < 0.6 * layer["rope_error_if_no_rope"]


def test_mha_full_rank_conversion_keeps_everything(tmp_path):
    source = save_tiny_model(tmp_path / "src", num_heads=4, num_kv_heads=4, head_dim=16, hidden_size=64, weight_scale=3.0)
    result = convert(source, tmp_path / "out", fast_options(kv_lora_rank=64, rope_dim=16))
    assert all(layer["kept_energy"] > 1 - 1e-9 for layer in result.report["layers"])
    ids = torch.randint(0, 128, (1, 40))
    assert relative(logits_of(tmp_path / "out", ids), logits_of(source, ids)) < 0.3


# ----------------------------------------------------------------------------- stock format
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(family="llama", num_kv_heads=2, tie_word_embeddings=True),
        dict(family="llama", num_kv_heads=4, attention_bias=True),
        dict(family="qwen2", num_kv_heads=2),
        dict(family="mistral", num_kv_heads=1),
        dict(family="phi3", num_kv_heads=2),
        dict(family="smollm3", num_kv_heads=2),
        dict(family="granite", num_kv_heads=2, tie_word_embeddings=True),
        dict(family="ernie4_5", num_kv_heads=2, tie_word_embeddings=True),
        dict(family="helium", num_kv_heads=4, attention_bias=True),
        dict(family="ministral", num_kv_heads=2),
        dict(family="seed_oss", num_kv_heads=2, attention_bias=True),
    ],
)
def test_exports_load_in_stock_transformers_and_cache_the_latent(tmp_path, kwargs):
    source = save_tiny_model(tmp_path / "src", num_heads=4, head_dim=16, hidden_size=64, **kwargs)
    out = tmp_path / "mla"
    convert(source, out, fast_options(kv_lora_rank=12, rope_dim=8, dtype="bf16"))
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"] and config["model_type"] == "deepseek_v3"
    assert "auto_map" not in config
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert not any(isinstance(module, DeepseekV3MoE) for module in model.modules())
    ids = torch.randint(3, 128, (1, 6))
    with torch.no_grad():
        cached = model.generate(ids, max_new_tokens=12, do_sample=False, use_cache=True)
        uncached = model.generate(ids, max_new_tokens=12, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)
    measured = measure_kv_cache(model, tokens=20)
    assert measured.bytes_per_token == (12 + 8) * config["num_hidden_layers"] * 2  # bf16 latent + RoPE key


@pytest.mark.parametrize("num_kv_heads, rank, shard", [(2, 12, "5GB"), (1, 32, "20KB")])
def test_a_fused_phi3_converts_to_the_export_of_the_same_weights_stored_llama_style(tmp_path, num_kv_heads, rank, shard):
    """Phi-3 computes Llama's function with q/k/v in one matrix and gate/up in another.  The oracle: the Llama holding
    the same weights split (transformers gives both the same logits) converts to the same export, byte for byte, at
    a reduced rank (approximate: every decision the converter makes must see the same numbers) and at MQA's full rank
    (exact: the export then reproduces the source's logits), from one file and from 20 KB shards (a layer's tensors
    spread over several)."""
    phi3 = tiny_model(family="phi3", num_heads=4, num_kv_heads=num_kv_heads, head_dim=16, hidden_size=64, weight_scale=3.0)
    llama = llama_with_the_weights_of(phi3)
    ids = torch.randint(0, 128, (1, 24))
    with torch.no_grad():
        torch.testing.assert_close(phi3(ids).logits, llama(ids).logits, rtol=1e-5, atol=1e-5)  # (fused products round their own way)
    phi3.save_pretrained(tmp_path / "phi3", max_shard_size=shard)
    llama.save_pretrained(tmp_path / "llama")
    options = fast_options(kv_lora_rank=rank, rope_dim=16 if rank == 32 else 8)
    exports = {name: convert(tmp_path / name, tmp_path / f"{name}-mla", options) for name in ("phi3", "llama")}
    phi3_tensors, llama_tensors = (load_file(tmp_path / f"{name}-mla" / "model.safetensors") for name in ("phi3", "llama"))
    assert sorted(phi3_tensors) == sorted(llama_tensors)
    assert all(torch.equal(phi3_tensors[name], llama_tensors[name]) for name in phi3_tensors)
    assert (json.loads((tmp_path / "phi3-mla" / "config.json").read_text())
            == json.loads((tmp_path / "llama-mla" / "config.json").read_text()))
    assert exports["phi3"].report["source"]["architecture"] == "Phi3ForCausalLM"
    if rank == 32:  # MQA, full rank, every frequency: exact
        assert all(layer["kept_energy"] > 1 - 1e-9 for layer in exports["phi3"].report["layers"])
        torch.testing.assert_close(logits_of(tmp_path / "phi3-mla", ids), logits_of(tmp_path / "phi3", ids),
                                   rtol=1e-4, atol=1e-4)


def stories260k_stored_as(stories260k: Path, folder: Path, tensors: dict, config) -> Path:
    """stories260K's tokenizer and files beside `tensors` and `config` (another family's layout of the same model)."""
    import shutil

    shutil.copytree(stories260k, folder, ignore=shutil.ignore_patterns("*.bin", "model.safetensors", "config.json"))
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(folder)
    return folder


def assert_converts_like_stories260k(source: Path, stories260k: Path, tmp_path: Path, tolerance: float) -> dict:
    """`source` (stories260K in another family's layout) computes stories260K's logits in transformers (to
    `tolerance`) and converts with default options - calibration text sampled from the source, RoPE grid search, K/V
    balance, refinement - to stories260K's own export, tensor for tensor.  Returns the source's report."""
    ids = torch.randint(0, 512, (1, 48))
    torch.testing.assert_close(logits_of(source, ids), logits_of(stories260k, ids), rtol=tolerance, atol=tolerance)
    options = ConvertOptions(kv_lora_rank=16, rope_dim=8)
    exports = [convert(folder, tmp_path / f"mla-{index}", options) for index, folder in enumerate((source, stories260k))]
    ours, reference = (load_file(result.output / "model.safetensors") for result in exports)
    assert sorted(ours) == sorted(reference)
    assert all(torch.equal(ours[name], reference[name]) for name in ours)
    return exports[0].report


@pytest.mark.real_model
def test_stories260k_stored_as_phi3_converts_to_the_same_export_with_default_options(stories260k, tmp_path):
    """Real trained weights through the whole default pipeline: stories260K with its q/k/v and gate/up fused as
    Phi3ForCausalLM stores them converts to the export of stories260K itself, tensor for tensor."""
    from transformers import Phi3Config

    llama = load_file(stories260k / "model.safetensors")
    config = json.loads((stories260k / "config.json").read_text())
    phi3 = {}
    for name, tensor in llama.items():
        for fused, parts in (("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                             ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj"))):
            if f".{parts[0]}." in name:  # (rows of [q | k | v] and [gate | up], the order Phi-3 splits them in)
                phi3[name.replace(parts[0], fused)] = torch.cat([llama[name.replace(parts[0], part)] for part in parts])
        if not any(f".{part}." in name for part in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
            phi3[name] = tensor
    phi3_config = Phi3Config(**{key: value for key, value in config.items()
                                if key not in ("architectures", "model_type", "attention_bias", "mlp_bias", "pretraining_tp")})
    phi3_config.architectures = ["Phi3ForCausalLM"]
    source = stories260k_stored_as(stories260k, tmp_path / "stories260k-phi3", phi3, phi3_config)
    # one model, two layouts (a fused product rounds differently: float32 tolerance)
    report = assert_converts_like_stories260k(source, stories260k, tmp_path, tolerance=1e-4)
    assert report["source"]["architecture"] == "Phi3ForCausalLM"


@pytest.mark.real_model
def test_stories260k_stored_as_granite_converts_to_the_same_export_with_default_options(stories260k, tmp_path):
    """stories260K stored as a Granite whose four multipliers (powers of two, so dividing them out and folding them
    back in is exact) undo each other's weight changes: the same logits, and stories260K's own export."""
    from transformers import GraniteConfig

    llama = load_file(stories260k / "model.safetensors")
    config = json.loads((stories260k / "config.json").read_text())
    assert config["tie_word_embeddings"]  # (the head reads the embeddings: the final norm carries 1 / (L e))
    multipliers = dict(embedding_multiplier=4.0, residual_multiplier=0.5, logits_scaling=2.0,
                       attention_multiplier=0.5 / math.sqrt(config["head_dim"]))  # query rows x 0.5
    divisors = {"embed_tokens": 4.0, "q_proj": 0.5, "o_proj": 0.5, "down_proj": 0.5, "model.norm": 1 / 8.0}
    granite = {name: next((tensor / d for part, d in divisors.items() if part in name), tensor) for name, tensor in llama.items()}
    granite_config = GraniteConfig(**{key: value for key, value in config.items()
                                      if key not in ("architectures", "model_type", "pretraining_tp", "head_dim")},
                                   **multipliers)
    granite_config.architectures = ["GraniteForCausalLM"]
    source = stories260k_stored_as(stories260k, tmp_path / "stories260k-granite", granite, granite_config)
    report = assert_converts_like_stories260k(source, stories260k, tmp_path, tolerance=1e-5)
    assert report["source"]["folded_multipliers"] == multipliers


@pytest.mark.real_model
def test_stories260k_stored_with_adjacent_pair_rope_converts_to_the_same_export_with_default_options(stories260k, tmp_path):
    """stories260K stored as a Helium (RoPE over adjacent pairs; its q/k rows within each head put back into that
    order, the layout llama2.c trained it in): the same logits, and stories260K's own export."""
    from transformers import HeliumConfig

    from mla_convert.source.folds import rotate_half_row_order

    llama = load_file(stories260k / "model.safetensors")
    config = json.loads((stories260k / "config.json").read_text())
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    helium = {}
    for name, tensor in llama.items():
        projection = next((p for p in heads if f".{p}." in name), None)
        # stored row r of the interleaved layout is the rotate-half row that the reader's reorder puts it at
        order = None if projection is None else rotate_half_row_order(heads[projection], config["head_dim"])
        helium[name] = tensor if order is None else tensor[torch.argsort(order)]
    helium_config = HeliumConfig(**{key: value for key, value in config.items()
                                    if key not in ("architectures", "model_type", "pretraining_tp")})
    helium_config.architectures = ["HeliumForCausalLM"]
    source = stories260k_stored_as(stories260k, tmp_path / "stories260k-helium", helium, helium_config)
    report = assert_converts_like_stories260k(source, stories260k, tmp_path, tolerance=1e-5)
    assert report["source"]["rope_pairs"] == "adjacent"


def test_a_phi3_fused_matrix_of_the_wrong_size_is_named_as_stored_before_anything_runs(tmp_path):
    """The roles of a fused matrix are rows of it: a qkv_proj with too few rows, or a missing gate_up_proj, is reported
    by the stored name and shape transformers would load, and nothing is written."""
    source = save_tiny_model(tmp_path / "src", family="phi3", num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64)
    tensors = load_file(source / "model.safetensors")
    tensors["model.layers.1.self_attn.qkv_proj.weight"] = tensors["model.layers.1.self_attn.qkv_proj.weight"][:100].clone()
    del tensors["model.layers.0.mlp.gate_up_proj.weight"]
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(PreflightError) as refused:
        convert(source, tmp_path / "out", fast_options(kv_lora_rank=12, rope_dim=8))
    assert refused.value.problems == [
        f"{source}: tensor 'model.layers.0.mlp.gate_up_proj.weight' is missing (expected shape [192, 64])",
        f"{source / 'model.safetensors'}: tensor 'model.layers.1.self_attn.qkv_proj.weight' has shape [100, 64], "
        "expected [128, 64]"]
    assert not (tmp_path / "out").exists()


def test_rope_grid_of_the_export_matches_transformers(tmp_path):
    """The exported rope_parameters reproduce the chosen slot frequencies in DeepseekV3RotaryEmbedding."""
    cases = [
        ({"rope_type": "default", "rope_theta": 100000.0}, RopeGrid(0.0, 2.0, 8)),
        ({"rope_type": "default", "rope_theta": 10000.0}, RopeGrid(1.5, 1.0, 8)),
        ({"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}, RopeGrid(0.5, 2.0, 8)),
        ({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, RopeGrid(0.0, 2.0, 16)),
    ]
    for source_params, grid in cases:
        head_dim = 64
        source_freq = rope_inv_freq(source_params, head_dim)
        expected = grid_inv_freq(grid, source_freq)
        params = deepseek_rope_parameters(source_params, grid, head_dim)
        config = DeepseekV3Config(qk_rope_head_dim=2 * grid.num_slots, rope_parameters=params, num_hidden_layers=1,
                                  max_position_embeddings=131072)
        actual = DeepseekV3RotaryEmbedding(config).inv_freq
        torch.testing.assert_close(actual.double(), expected, rtol=2e-6, atol=0)
        torch.testing.assert_close(rope_inv_freq(params, 2 * grid.num_slots), actual, rtol=0, atol=0)


def test_latent_is_stored_at_a_scale_that_keeps_the_norm_linear(tmp_path):
    source = save_tiny_model(tmp_path / "src", num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64, weight_scale=3.0)
    out = tmp_path / "mla"
    convert(source, out, fast_options(kv_lora_rank=16, rope_dim=8))
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    captured = []
    attn = model.model.layers[0].self_attn
    hook = attn.kv_a_proj_with_mqa.register_forward_hook(lambda m, i, o: captured.append(o[..., :16]))
    with torch.no_grad():
        model(torch.randint(0, 128, (2, 64)) * 0 + torch.randint(0, 128, (2, 64)))
    hook.remove()
    mean_square = captured[0].pow(2).mean(-1).max().item()
    assert mean_square < 1e-5 * 1e-6  # far below the norm's eps: RMSNorm(alpha c) = alpha c / sqrt(eps)


def test_whitening_damping_keeps_directions_calibration_never_saw_in_range():
    """Calibration inputs spanning 6 of 32 dimensions (fewer tokens than hidden dims does this for real).

    Undamped, the whitening sends the 26 unseen directions through inverse roots of floored eigenvalues:
    fresh inputs then make latents ~4000x larger than any calibration latent, and the few digits left for
    the calibrated part are lost to fp32 cancellation. SmolLM2 converted on 2 x 64 tokens that way grew
    its residual stream 30x and its cached and uncached generation disagreed by up to 18 logits.
    """
    from mla_convert.convert.factorize import Whitening, factorize

    torch.manual_seed(0)
    basis = torch.linalg.qr(torch.randn(32, 32, dtype=torch.float64))[0]
    seen, unseen = basis[:, :6], basis[:, 6:]  # (32, 6), (32, 26) orthonormal columns
    calibration = torch.randn(500, 6, dtype=torch.float64) @ seen.T * 3  # (500, 32)
    fresh = torch.randn(500, 26, dtype=torch.float64) @ unseen.T * 3  # same scale, unseen directions
    weight = torch.randn(8, 32, dtype=torch.float64)
    moment = calibration.T @ calibration / calibration.shape[0]

    def latent_growth(damping: float) -> tuple[float, float]:
        f = factorize(weight, 7, Whitening.of(moment, damping=damping))
        fit = ((calibration @ (f.up @ f.down - weight).T).norm() / (calibration @ weight.T).norm()).item()
        growth = ((fresh @ f.down.T).pow(2).mean() / (calibration @ f.down.T).pow(2).mean()).sqrt().item()
        return fit, growth

    exact_fit, undamped_growth = latent_growth(0.0)
    damped_fit, damped_growth = latent_growth(1e-2)
    assert exact_fit < 1e-12 and undamped_growth > 1000  # the failure the damping exists for
    assert damped_fit < 1e-2 and damped_growth < 20


@pytest.mark.parametrize("bias", [False, True])
def test_rope_statistics_equal_the_moments_of_the_rotated_components_on_the_samples(bias):
    """Oracle for the real-arithmetic RoPE statistics: on a finite sample, E[z z^H] of the complex key components
    and E|q|^2 of the query components, computed from the projected samples themselves (bias included)."""
    from mla_convert.convert.rope import rope_stats_from_moments

    torch.manual_seed(0)
    heads, kv_heads, head_dim, d = 4, 2, 8, 24
    x = torch.randn(400, d, dtype=torch.float64) * torch.linspace(0.2, 2.0, d) + 0.5  # uneven scales, nonzero mean
    q_w, k_w = torch.randn(heads * head_dim, d, dtype=torch.float64), torch.randn(kv_heads * head_dim, d, dtype=torch.float64)
    q_b = torch.randn(heads * head_dim, dtype=torch.float64) if bias else None
    k_b = torch.randn(kv_heads * head_dim, dtype=torch.float64) if bias else None
    stats = rope_stats_from_moments(q_w, q_b, k_w, k_b, x.T @ x / len(x), x.mean(0), heads, kv_heads, head_dim,
                                    torch.ones(heads, 5))

    def components(w, b, n):  # (samples, n * h/2) complex: z = row j + i row j + h/2 of each head
        y = (x @ w.T + (b if b is not None else 0)).view(len(x), n, 2, head_dim // 2)
        return torch.complex(y[:, :, 0], y[:, :, 1]).reshape(len(x), -1)

    k = components(k_w, k_b, kv_heads)
    q = components(q_w, q_b, heads)
    assert torch.allclose(stats.key_cov, k.T @ k.conj() / len(x), rtol=1e-10, atol=1e-10)
    assert torch.allclose(stats.query_energy, (q.abs() ** 2).mean(0).view(heads, -1) / head_dim, rtol=1e-10, atol=1e-12)


def test_whitened_factorization_is_the_least_squares_fit_on_the_activations():
    """The eigenbasis form of the whitening: at full rank W is rebuilt exactly; at rank k the subspace is the top-k
    of W C^1/2 (the activation error equals the discarded singular energy) and `up` is least squares on x."""
    from mla_convert.convert.factorize import Whitening, factorize

    torch.manual_seed(1)
    d, rows = 20, 12
    x = torch.randn(300, d, dtype=torch.float64) @ torch.randn(d, d, dtype=torch.float64)  # correlated inputs
    weight = torch.randn(rows, d, dtype=torch.float64)
    whitening = Whitening.of(x.T @ x / len(x), damping=0.0)
    moment = whitening.second_moment
    assert torch.allclose(moment, x.T @ x / len(x), rtol=1e-9, atol=1e-9)
    full = factorize(weight, rows, whitening)
    assert torch.allclose(full.up @ full.down, weight, atol=1e-9)
    low = factorize(weight, 5, whitening)
    error = x @ (low.up @ low.down - weight).T  # (samples, rows)
    assert math.isclose(error.pow(2).mean(0).sum().item(), low.singular_values[5:].pow(2).sum().item(), rel_tol=1e-8)
    latent = x @ low.down.T
    best_up = torch.linalg.lstsq(latent, x @ weight.T).solution.T  # (rows, 5)
    assert torch.allclose(low.up, best_up, atol=1e-8)
    assert torch.allclose(latent.T @ latent / len(x), torch.eye(5, dtype=torch.float64), atol=1e-9)  # unit latent moment


def test_in_place_whitening_is_bitwise_the_out_of_place_one():
    """`Whitening.of` symmetrises in place, block by block, and (consuming) writes the eigenvectors over the moment:
    the result must be exactly what eigh of the damped (M + M^T) / 2 gives, and a moment that is not consumed
    must come back untouched."""
    from mla_convert.convert.factorize import Whitening, symmetrize_

    generator = torch.Generator().manual_seed(2)
    for n in (7, 64, 65, 300):  # below, at and across the block boundaries used below
        square = torch.randn(n, n, dtype=torch.float64, generator=generator)
        assert torch.equal(symmetrize_(square.clone(), block=64), (square + square.T).mul_(0.5))
    x = torch.randn(500, 130, dtype=torch.float64, generator=generator)
    moment = x.T @ x / len(x)  # float rounding: not bitwise symmetric
    damped = moment.clone()
    damped.diagonal().add_(1e-2 * damped.diagonal().mean())
    eigvals, eigvecs = torch.linalg.eigh((damped + damped.T).mul_(0.5))
    kept = moment.clone()
    whitening = Whitening.of(kept, damping=1e-2)
    assert torch.equal(kept, moment)  # not consumed: the caller's moment is unchanged
    assert torch.equal(whitening.eigvals, eigvals) and torch.equal(whitening.eigvecs, eigvecs)
    consumed = moment.clone()
    whitening = Whitening.of(consumed, damping=1e-2, consume=True)
    assert whitening.eigvecs.data_ptr() == consumed.data_ptr()  # no second d x d buffer
    assert torch.equal(whitening.eigvecs, eigvecs)
    narrow = moment.float()
    Whitening.of(narrow, consume=True)  # a float32 moment is widened into a new tensor: the caller's stays as it was
    assert torch.equal(narrow, moment.float())


def test_leading_right_singular_vectors_from_the_gram_matrix_equal_the_svd():
    """Oracle: torch.linalg.svd.  A wide matrix whose kept singular values are above the floor takes the Gram route:
    every singular value and the kept vectors agree with the SVD's to float64 accuracy (each vector up to its sign).
    A kept singular value below the floor, or a tall matrix, takes the SVD route: exactly the SVD's vectors."""
    from mla_convert.convert.factorize import GRAM_SINGULAR_FLOOR, leading_right_singular

    generator = torch.Generator().manual_seed(3)

    def with_spectrum(rows: int, cols: int, singular: torch.Tensor) -> torch.Tensor:
        left, _ = torch.linalg.qr(torch.randn(rows, len(singular), dtype=torch.float64, generator=generator))
        right, _ = torch.linalg.qr(torch.randn(cols, len(singular), dtype=torch.float64, generator=generator))
        return (left * singular) @ right.T  # (rows, cols)

    wide = with_spectrum(40, 90, torch.logspace(0, -3, 40, dtype=torch.float64))  # kept 12: down to ~0.12
    singular, vh = leading_right_singular(wide, 12)
    _, svd_singular, svd_vh = torch.linalg.svd(wide, full_matrices=False)
    torch.testing.assert_close(singular, svd_singular, rtol=1e-8, atol=1e-14)
    assert vh.shape == (12, 90)
    torch.testing.assert_close((vh * svd_vh[:12]).sum(1).abs(), torch.ones(12, dtype=torch.float64), rtol=0, atol=1e-10)
    steep = with_spectrum(40, 90, torch.logspace(0, -8, 40, dtype=torch.float64))
    rank = int((torch.logspace(0, -8, 40) >= GRAM_SINGULAR_FLOOR).sum()) + 1  # one kept value below the floor
    assert torch.equal(leading_right_singular(steep, rank)[1], torch.linalg.svd(steep, full_matrices=False)[2][:rank])
    tall = wide.T.contiguous()
    assert torch.equal(leading_right_singular(tall, 12)[1], torch.linalg.svd(tall, full_matrices=False)[2][:12])


def test_statistics_come_back_as_tensors_of_their_own(tmp_path):
    """The stored statistics are read into memory of their own, not left as views of a mapped file, whose pages would
    stay resident for as long as any one of them (the samples) is in use."""
    from mla_convert.convert.calibration import StatsStore

    store = StatsStore(tmp_path)
    saved = {"second_moment": torch.randn(64, 64, dtype=torch.float64), "samples": torch.randn(2, 8, 64)}
    store.save(3, saved)
    loaded = store.load(3)
    gc.collect()
    assert mapped_files(store.path) == set()
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[name], saved[name]) for name in saved)
    store.cleanup()


@pytest.mark.parametrize("bias", [False, True])
def test_query_moments_per_head_equal_the_moments_of_the_projected_samples(bias):
    """Oracle for E[q q^T] per head (computed a head at a time): the moments of the queries projected from the samples."""
    from mla_convert.convert import layer as layer_module

    torch.manual_seed(3)
    heads, head_dim, d = 5, 8, 24
    x = torch.randn(400, d, dtype=torch.float64) * torch.linspace(0.2, 2.0, d) + 0.5
    q_w = torch.randn(heads * head_dim, d)  # float32, as loaded
    q_b = torch.randn(heads * head_dim, dtype=torch.float64) if bias else None
    moments = layer_module.query_second_moments(q_w, q_b, x.T @ x / len(x), x.mean(0), heads, head_dim)
    q = (x @ q_w.double().T + (q_b if bias else 0)).view(len(x), heads, head_dim)  # (samples, H, h)
    assert torch.allclose(moments, torch.einsum("shi,shj->hij", q, q) / len(x), rtol=1e-10, atol=1e-10)


# ----------------------------------------------------------------------------- options and errors
def test_weight_only_svd_and_sequential_run_and_differ(tmp_path):
    source = save_tiny_model(tmp_path / "src", num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64, weight_scale=3.0)
    svd = convert(source, tmp_path / "svd", fast_options(kv_lora_rank=12, rope_dim=8, method="svd"))
    aware = convert(source, tmp_path / "aware", fast_options(kv_lora_rank=12, rope_dim=8))
    assert svd.report["options"]["method"] == "svd" and aware.report["options"]["method"] == "activation-aware"
    # activation-aware is measured on the calibration inputs, where it must not be worse than plain SVD
    assert aware.report["summary"]["mean_attention_error"] <= svd.report["summary"]["mean_attention_error"] + 1e-9


def test_sequential_and_source_calibration_differ_only_above_the_first_layer(tmp_path):
    """Layer 0 sees the same inputs either way; later layers are fitted on what the converted layers below emit
    (sequential, the default) or on the source's own activations (--no-sequential)."""
    source = save_tiny_model(tmp_path / "src", num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64, num_layers=3,
                             weight_scale=3.0)
    runs = {flag: convert(source, tmp_path / str(flag), fast_options(kv_lora_rank=12, rope_dim=8, sequential=flag))
            for flag in (True, False)}
    weights = {flag: load_file(str(run.output / "model.safetensors")) for flag, run in runs.items()}
    for layer, same in ((0, True), (2, False)):
        name = f"model.layers.{layer}.self_attn.kv_b_proj.weight"
        assert torch.allclose(weights[True][name], weights[False][name], atol=1e-6) is same, layer
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    for run in runs.values():
        assert torch.isfinite(logits_of(run.output, ids)).all()


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(kv_lora_rank=1000, rope_dim=8), "larger than the source allows"),
        (dict(kv_lora_rank=16, rope_dim=7), "must be even"),
        (dict(kv_lora_rank=16, rope_dim=64), "larger than the source head_dim"),
        (dict(compression=4, kv_lora_rank=8), "give either the ratio or the ranks"),
        (dict(kv_lora_rank=16, rope_dim=8, dtype="fp16"), "fp16"),
        # values of the wrong type from the API: were TypeErrors from inside the shape arithmetic
        (dict(compression="4"), "^compression '4': must be float$"),
        (dict(kv_lora_rank="8", rope_dim=4), "^kv_lora_rank '8': must be int$"),
        (dict(compression=2, calibration=CalibrationOptions(seq_len="32")), "^calibration.seq_len '32': must be int$"),
        (dict(compression=2, calibration=None), "calibration None: must be CalibrationOptions"),
        # a misspelled target was a KeyError from `target_of` (found by the API/sweep probe)
        (dict(compression=2, target="vLLM"), "^--target 'vLLM': choose one of transformers, vllm, llama.cpp, all$"),
    ],
)
def test_impossible_requests_fail_before_any_work(tmp_path, options, message):
    source = save_tiny_model(tmp_path / "src", num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64)
    with pytest.raises(PreflightError, match=message):
        convert(source, tmp_path / "out", fast_options(**options))
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob("*.mla-convert-partial"))


def test_api_arguments_of_the_wrong_type_are_refused_naming_the_parameter(tmp_path):
    """convert(None, out), convert(src, None) and options passed as a dict were a TypeError from Path(None) and an
    AttributeError deep inside (found by the API/sweep probe)."""
    source = save_tiny_model(tmp_path / "src", num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64)
    for args, message in [((None, tmp_path / "out"), "source None: must be a path (str or os.PathLike)"),
                          ((source, None), "output None: must be a path (str or os.PathLike)"),
                          ((source, tmp_path / "out", {"compression": 2}),
                           "options {'compression': 2}: must be ConvertOptions or None")]:
        with pytest.raises(PreflightError) as refused:
            convert(*args)
        assert refused.value.problems == [message]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["src"]


def test_a_path_for_the_calibration_text_and_a_shard_size_in_bytes_are_taken():
    """CalibrationOptions(data=Path(...)) was refused as "must be str" (run_sweep and run_eval take a Path), and
    max_shard_size=1_000_000 as "must be str" although the error itself offers "bytes" (found by the API/sweep probe)."""
    from pathlib import Path

    from mla_convert.options import option_problems

    options = ConvertOptions(max_shard_size=1_000_000, calibration=CalibrationOptions(data=Path("stories.txt")))
    assert option_problems(options) == [] and options.calibration.data == "stories.txt"  # recorded as the CLI's str
    assert option_problems(ConvertOptions(max_shard_size=True)) == ["max_shard_size True: must be str or int"]


def test_existing_output_is_refused_without_overwrite(tmp_path):
    source = save_tiny_model(tmp_path / "src", num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(MLAConvertError, match="already exists"):
        convert(source, tmp_path / "out", fast_options(kv_lora_rank=16, rope_dim=8))
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
    with pytest.raises(MLAConvertError, match="not an earlier mla-convert output"):  # --overwrite alone: not someone's files
        convert(source, tmp_path / "out", fast_options(kv_lora_rank=16, rope_dim=8, overwrite=True))
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
    convert(source, tmp_path / "out", fast_options(kv_lora_rank=16, rope_dim=8, overwrite=True, force=True))
    assert (tmp_path / "out" / "mla_convert.json").exists() and not (tmp_path / "out" / "keep.txt").exists()
    # an earlier mla-convert output is replaced by --overwrite alone
    convert(source, tmp_path / "out", fast_options(kv_lora_rank=12, rope_dim=8, overwrite=True))
    assert json.loads((tmp_path / "out" / "mla_convert.json").read_text())["options"]["kv_lora_rank"] == 12


def test_an_export_cannot_ask_for_calibration_its_converter_did_not_run(tmp_path):
    """`Converter.export` with other calibration settings used to record them while using the Converter's own."""
    from mla_convert.convert.pipeline import Converter

    source = save_tiny_model(tmp_path / "src", num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64)
    options = fast_options(kv_lora_rank=16, rope_dim=8)
    other = dataclasses.replace(options, calibration=CalibrationOptions(num_samples=3, seq_len=48))
    with Converter(source, options) as converter:
        with pytest.raises(PreflightError, match="calibration differs from the Converter's"):
            converter.export(tmp_path / "b", other)
        assert not (tmp_path / "b").exists()
        result = converter.export(tmp_path / "a", dataclasses.replace(options, kv_lora_rank=12))  # shape may differ
    assert result.report["options"]["calibration"]["num_samples"] == 4


def test_an_export_after_close_is_refused(tmp_path):
    """`Converter.export` after `close()` silently calibrated all over again, into a statistics folder nothing would
    remove (found by the API/sweep probe)."""
    from mla_convert.convert.pipeline import Converter

    source = save_tiny_model(tmp_path / "src", num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64)
    converter = Converter(source, fast_options(kv_lora_rank=16, rope_dim=8))
    converter.close()
    with pytest.raises(PreflightError) as refused:
        converter.export(tmp_path / "out")
    assert refused.value.problems == ["the Converter is closed (its calibration statistics are removed and its source "
                                      "closed); make a new Converter to convert again"]
    assert not (tmp_path / "out").exists()
    with pytest.raises(PreflightError) as refused_preflight:  # (pre-flight alone read the closed source's headers)
        converter.preflight(tmp_path / "out")
    assert refused_preflight.value.problems == refused.value.problems


# ----------------------------------------------------------------------------- real model
@pytest.mark.real_model
def test_stories260k_two_x_conversion_quality(stories260k, tinystories_text, tmp_path):
    """One-shot 2x conversion of a real model stays close to it (full protocol lives in the benchmark)."""
    from transformers import AutoTokenizer

    from mla_convert.eval.perplexity import evaluate_perplexity

    out = tmp_path / "mla"
    result = convert(stories260k, out, ConvertOptions(compression=2, dtype="fp32",
                                                      calibration=CalibrationOptions(num_samples=8, seq_len=128)))
    assert result.report["cache"]["ratio"] == 2.0
    tokenizer = AutoTokenizer.from_pretrained(stories260k)
    text = tinystories_text.read_text()
    scores = {}
    for name, folder in (("source", stories260k), ("converted", out)):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        scores[name] = evaluate_perplexity(model, tokenizer, text, context_length=256, max_windows=10, progress=False).perplexity
    assert math.isfinite(scores["converted"])
    assert scores["converted"] < 1.35 * scores["source"], scores
    # small layers: refinement is on by default (a fixed number of cheap steps), and no layer leaves it worse on its
    # held-out window
    assert re.match(r"\d+ steps per layer of \d+ window \(", result.report["refinement"]), result.report["refinement"]
    for layer in result.report["layers"]:
        before, after = layer["refine_held_out_error"]
        assert after <= before


@pytest.mark.real_model
@pytest.mark.slow
def test_stories260k_eight_x_default_refinement_beats_the_former_budget(stories260k, tinystories_text, tmp_path):
    """The default refinement (40 one-window steps per layer) is a measured lever: stories260K 8x scored 54.4518 on the
    project protocol (60 windows of 256 tokens) with the former default (16 two-window steps) and 51.8375 with this one
    (BENCHMARKS.md, 'Quality levers'); a default that loses the lever goes back above the bound."""
    from mla_convert.eval.perplexity import evaluate_perplexity

    out = tmp_path / "mla-8x"
    result = convert(stories260k, out, ConvertOptions(compression=8, dtype="fp32"))
    assert result.report["refinement"].startswith("40 steps per layer of 1 window"), result.report["refinement"]
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(stories260k)
    score = evaluate_perplexity(model, tokenizer, tinystories_text.read_text(), context_length=256, max_windows=60,
                                progress=False).perplexity
    assert score < 53.0, score


def test_refinement_follows_the_effort_and_the_cost_of_a_layer():
    """Default: a fixed number of one-window steps on layers up to SmolLM2's size, none (saying how to get it) on
    Llama-3-8B-sized ones; fast: none; thorough: every layer; explicit settings win over the effort."""
    from mla_convert.convert.decisions import (
        AUTO_REFINE_STEPS,
        DEFAULT_REFINE_CHECK_EVERY,
        DEFAULT_REFINE_STEPS,
        DEFAULT_REFINE_WINDOWS,
        REFINE_BATCH_WINDOWS,
        RefinePolicy,
        effort_of,
    )
    from mla_convert.source.config import SourceConfig

    def shape(hidden, heads, kv_heads):
        return SourceConfig.from_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
                                        "num_attention_heads": heads, "num_key_value_heads": kv_heads,
                                        "num_hidden_layers": 2, "intermediate_size": 4 * hidden, "vocab_size": 512})

    for small in (RefinePolicy.of(ConvertOptions(), shape(64, 8, 4)), RefinePolicy.of(ConvertOptions(), shape(576, 9, 3))):
        assert (small.steps, small.patience, small.batch_windows, small.check_every) == (
            DEFAULT_REFINE_STEPS, None, DEFAULT_REFINE_WINDOWS, DEFAULT_REFINE_CHECK_EVERY)
        assert "GFLOP" in small.decision
    large = RefinePolicy.of(ConvertOptions(), shape(4096, 32, 8))
    assert large.steps == 0 and "--effort thorough" in large.decision
    assert RefinePolicy.of(ConvertOptions(effort="fast"), shape(64, 8, 4)).steps == 0
    thorough = RefinePolicy.of(ConvertOptions(effort="thorough"), shape(576, 9, 3))
    assert (thorough.steps, thorough.patience, thorough.batch_windows) == (AUTO_REFINE_STEPS, 2, REFINE_BATCH_WINDOWS)
    assert RefinePolicy.of(ConvertOptions(method="svd", effort="thorough"), shape(64, 8, 4)).steps == 0  # data-free baseline
    given = RefinePolicy.of(ConvertOptions(refine_steps=7, effort="fast"), shape(576, 9, 3))
    assert (given.steps, given.patience) == (7, None)
    assert (effort_of(ConvertOptions(effort="fast")).kv_balance_search, effort_of(ConvertOptions()).rope_finalists) == (False, 2)
    explicit = effort_of(ConvertOptions(effort="fast", kv_balance_search=True, rope_finalists=3))
    assert (explicit.kv_balance_search, explicit.rope_finalists) == (True, 3)


def test_mlp_matrices_streamed_from_their_shard_are_copied_to_the_export_unchanged(tmp_path, monkeypatch):
    """With MLP matrices larger than one widened block (forced small here) the layer holds them as `StreamedRows` and the
    export copies them block by block: every MLP tensor of the output must equal the source's, byte for byte."""
    from mla_convert.source import model as model_module

    source = tmp_path / "src"
    save_tiny_model(source, num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64, weight_scale=3.0)
    monkeypatch.setattr(model_module, "WIDENED_BLOCK_BYTES", 5 * 96 * 4)  # a few rows per block: every MLP matrix streams
    result = convert(source, tmp_path / "out", fast_options(kv_lora_rank=12, rope_dim=8))
    exported = load_file(str(result.output / "model.safetensors"))
    original = load_file(str(source / "model.safetensors"))
    mlp_names = [name for name in original if ".mlp." in name]
    assert len(mlp_names) == 6
    for name in mlp_names:
        assert torch.equal(exported[name], original[name]), name


@pytest.mark.parametrize("compression", [float("nan"), float("inf")])
def test_a_non_finite_ratio_is_one_problem(tmp_path, compression):
    """It used to be two contradicting lines: "must be a finite number", then "must be at least 1" or "leaves 0"."""
    source = save_tiny_model(tmp_path / "src", num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64)
    with pytest.raises(PreflightError) as refused:
        convert(source, tmp_path / "out", fast_options(compression=compression))
    assert refused.value.problems == [f"--compression {compression}: must be a finite number"]


class RecordedMessages(Progress):
    """A progress sink that keeps the messages (notes) a conversion prints."""

    def __init__(self):
        self.seen = []

    def message(self, text):
        self.seen.append(text)


def test_a_shape_that_grows_the_cache_is_said_so_before_converting(tmp_path):
    """-r 64 -d 8 on a source caching 64 values is allowed (a full-rank conversion may be wanted), but it only
    showed up as "compression ratio 0.89x" in the closing summary."""
    source = save_tiny_model(tmp_path / "src", num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64, num_layers=1)
    grown, smaller = RecordedMessages(), RecordedMessages()
    convert(source, tmp_path / "grown", fast_options(kv_lora_rank=64, rope_dim=8), progress=grown)
    convert(source, tmp_path / "smaller", fast_options(kv_lora_rank=48, rope_dim=8), progress=smaller)
    assert ("note: 64+8 caches 72 values per token and layer, more than the source's 64: the KV cache grows 1.12x "
            "(compression 0.89x)") in grown.seen
    assert not any("the KV cache grows" in text for text in smaller.seen)


def test_a_ratio_met_by_another_says_so_under_the_default_target(tmp_path):
    """-c 25 on a source caching 64 values converts to 1+2 = 21.33x; under --target transformers nothing said so
    (a serving target's summary did), and the refusal of 26 named 21.3 as the largest ratio."""
    source = save_tiny_model(tmp_path / "src", num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64, num_layers=1)
    rounded, exact = RecordedMessages(), RecordedMessages()
    result = convert(source, tmp_path / "rounded", fast_options(compression=25), progress=rounded)
    convert(source, tmp_path / "exact", fast_options(compression=4), progress=exact)
    assert result.report["cache"]["ratio"] == pytest.approx(64 / 3)
    assert ("note: asked 25x, got 1+2 = 21.33x (the cache holds whole values: 3 per token and layer of the source's "
            "64)") in rounded.seen
    assert not any(text.startswith("note: asked") for text in exact.seen)
    with pytest.raises(PreflightError, match=r"must be below 25\.6"):
        convert(source, tmp_path / "refused", fast_options(compression=26))


def _edit_config(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


WINDOW_CALIBRATION = CalibrationOptions(num_samples=4, seq_len=16, error_samples=2)  # within a 16-token window


def test_a_sliding_window_source_exports_the_context_where_both_attentions_agree(tmp_path):
    """Mistral with sliding_window 16 was exported as full attention over 512 positions, and called exact: past 16
    tokens the source reads a window and the export everything (logits 89 % apart).  The export now declares the
    window as its positions, where it is exact, and the report and card say why."""
    source = save_tiny_model(tmp_path / "src", family="mistral", num_heads=4, num_kv_heads=1, head_dim=16,
                             hidden_size=64, num_layers=2, weight_scale=3.0)
    _edit_config(source, sliding_window=16)
    # calibration windows longer than the source's window are refused: the streamed source would attend to every position
    with pytest.raises(PreflightError, match="--calib-seq-len 32: longer than the 16 tokens the source's sliding window"):
        convert(source, tmp_path / "mla", fast_options(kv_lora_rank=32, rope_dim=16))
    result = convert(source, tmp_path / "mla", fast_options(kv_lora_rank=32, rope_dim=16, calibration=WINDOW_CALIBRATION))
    config = json.loads((tmp_path / "mla" / "config.json").read_text())
    assert config["max_position_embeddings"] == 16
    assert (result.report["source"]["sliding_window"], result.report["source"]["max_position_embeddings"]) == (16, 512)
    card = (tmp_path / "mla" / "README.md").read_text()
    assert "declares `max_position_embeddings` = 16 (the source: 512)" in card
    assert "| one sequence of 16 tokens (max_position_embeddings) |" in card  # the KV table said 4,096 tokens
    ids = torch.randint(0, 128, (2, 16))
    torch.testing.assert_close(logits_of(tmp_path / "mla", ids), logits_of(source, ids), rtol=1e-4, atol=1e-4)


def test_qwen2_window_settings_that_slide_no_layer_change_nothing(tmp_path):
    """use_sliding_window with max_window_layers = every layer slides none (transformers: all full attention); it
    used to be refused.  Where one layer slides, the window caps the positions as for Mistral."""
    source = save_tiny_model(tmp_path / "src", family="qwen2", num_heads=4, num_kv_heads=2, head_dim=16,
                             hidden_size=64, num_layers=2)
    _edit_config(source, use_sliding_window=True, sliding_window=16, max_window_layers=2, layer_types=None)
    convert(source, tmp_path / "none", fast_options(compression=2))
    assert json.loads((tmp_path / "none" / "config.json").read_text())["max_position_embeddings"] == 512
    _edit_config(source, max_window_layers=1)
    convert(source, tmp_path / "one", fast_options(compression=2, calibration=WINDOW_CALIBRATION))
    assert json.loads((tmp_path / "one" / "config.json").read_text())["max_position_embeddings"] == 16


@pytest.mark.parametrize("family, changes, window", [
    # transformers 5 saves layer_types, and its Qwen2 model follows them over max_window_layers
    ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=2, layer_types=["sliding_attention"] * 2), 16),
    ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=0, layer_types=["full_attention"] * 2), None),
    ("qwen2", dict(use_sliding_window=True, sliding_window=16, layer_types=["full_attention", "sliding_attention"]), 16),
    ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1, layer_types=None), 16),
    ("qwen2", dict(use_sliding_window=True, sliding_window=100, max_window_layers=None, layer_types=None), None),  # default 28
    ("mistral", dict(sliding_window=None, max_position_embeddings=8192), 4096),  # a missing key: MistralConfig's 4096
    # Ministral: layer_types choose the sliding layers; without them every layer slides when a window is set
    ("ministral", dict(sliding_window=16, layer_types=["full_attention", "sliding_attention"]), 16),
    ("ministral", dict(sliding_window=16, layer_types=["full_attention"] * 2), None),
    ("ministral", dict(sliding_window=16, layer_types=None), 16),
])
def test_which_layers_slide_is_what_transformers_builds(family, changes, window):
    """The converter read the sliding keys itself and disagreed with transformers on layer_types, on a missing
    sliding_window and on a missing max_window_layers (an export cut for nothing, or not cut where it must be)."""
    from transformers import AutoConfig

    from mla_convert.source.config import SourceConfig

    config = tiny_model(family=family, num_layers=2).config.to_dict()
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    assert SourceConfig.from_dict(config).sliding_window == window
    built = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    slides = "sliding_attention" in (getattr(built, "layer_types", None) or ["sliding_attention"])
    assert (window is not None) == (slides and (built.sliding_window or 1 << 30) < built.max_position_embeddings)
    # and how many layers slide: those transformers builds as sliding (every layer of a family without layer_types)
    sliding = sum(kind == "sliding_attention" for kind in getattr(built, "layer_types", None) or ["sliding_attention"] * 2)
    assert SourceConfig.from_dict(config).sliding_layers == (sliding if window is not None else None)


def test_missing_positions_are_the_familys_transformers_default(tmp_path):
    """A config without max_position_embeddings was exported with 4096 positions; transformers reads Llama's as 2048."""
    from transformers import AutoConfig

    source = save_tiny_model(tmp_path / "src", num_layers=1)
    _edit_config(source, max_position_embeddings=None)
    result = convert(source, tmp_path / "mla", fast_options(compression=2))
    # (no tokenizer in this source: the report says what was copied and the card does not claim one)
    assert result.report["copied_from_source"] == ["generation_config.json"] and "had no tokenizer files" in (tmp_path / "mla" / "README.md").read_text()
    exported = json.loads((tmp_path / "mla" / "config.json").read_text())["max_position_embeddings"]
    assert exported == AutoConfig.from_pretrained(source).max_position_embeddings == 2048


def test_a_tokenizer_with_ids_beyond_the_vocabulary_is_named(tmp_path):
    """A 512-id tokenizer on a 64-row model: the embedding left those rows as uninitialised memory and the run
    failed on 'second_moment holds NaN/Inf' (or, with finite garbage, would have converted on it)."""
    from tiny_models import save_tiny_tokenizer

    source = save_tiny_tokenizer(save_tiny_model(tmp_path / "src", num_layers=1, vocab_size=64), vocab_size=512)
    text = tmp_path / "text.txt"
    text.write_text("zebra quartz jukebox " * 40)  # lower-case letters are ids 68..93 in the character tokenizer
    with pytest.raises(MLAConvertError, match="gives token id .* but the model's vocab_size is 64; the tokenizer does "
                                              "not belong to this model"):
        convert(source, tmp_path / "mla", fast_options(compression=2, calibration=CalibrationOptions(
            data=str(text), num_samples=2, seq_len=16)))
    assert not (tmp_path / "mla").exists()


def test_a_tied_config_with_a_different_stored_head_converts_untied_as_transformers_loads_it(tmp_path):
    """tie_word_embeddings true, but the checkpoint stores its own lm_head: transformers keeps both (untied); the
    export tied them and dropped the stored head (logits 2x their scale apart)."""
    source = save_tiny_model(tmp_path / "src", num_heads=4, num_kv_heads=1, head_dim=16, hidden_size=64, num_layers=2,
                             weight_scale=3.0)
    _edit_config(source, tie_word_embeddings=True)
    convert(source, tmp_path / "mla", fast_options(kv_lora_rank=32, rope_dim=16))
    assert json.loads((tmp_path / "mla" / "config.json").read_text())["tie_word_embeddings"] is False
    ids = torch.randint(0, 128, (2, 24))
    torch.testing.assert_close(logits_of(tmp_path / "mla", ids), logits_of(source, ids), rtol=1e-4, atol=1e-4)


def test_an_explicit_q_lora_rank_of_hidden_keeps_the_bias_at_least_as_well_as_a_smaller_one(tmp_path):
    """--q-lora-rank 64 (= hidden) on heads wider than the input took the least-squares path and kept the query bias
    worse (residual 0.64-0.72) than rank 32 (0.03-0.05); it now takes the bias-aware factorization like any rank."""
    source = save_tiny_model(tmp_path / "src", num_heads=8, num_kv_heads=1, head_dim=16, hidden_size=64, num_layers=1,
                             attention_bias=True, weight_scale=4.0)
    residual = {rank: max(layer["query_bias_residual"] for layer in convert(
        source, tmp_path / f"q{rank}", fast_options(kv_lora_rank=32, rope_dim=16, q_lora_rank=rank)).report["layers"])
        for rank in (32, 64)}
    assert residual[64] <= residual[32] + 1e-9, residual


def test_phase_timer_passes_the_end_of_a_phase_on_and_stops_its_clock():
    """`PhaseTimer` swallowed `end()`: a log under a conversion showed a phase's time only once the next one started,
    and the timer kept counting the gap as part of the phase that had ended."""
    import time

    from mla_convert.convert.decisions import PhaseTimer, Progress

    class Recorder(Progress):
        def __init__(self):
            self.calls = []

        def phase(self, name, total=None):
            self.calls.append(("phase", name))

        def end(self):
            self.calls.append(("end",))

    inner, seconds = Recorder(), {}
    timer = PhaseTimer(inner, seconds)
    timer.phase("calibration")
    timer.end()
    measured = seconds["calibration"]
    time.sleep(0.05)  # between phases: not calibration's time
    timer.phase("factorization")
    timer.stop()
    assert inner.calls == [("phase", "calibration"), ("end",), ("phase", "factorization")]
    assert seconds["calibration"] == measured and measured < 0.05


# ----------------------------------------------------------------------------- a config.json without a dtype
def _without_stated_dtype(folder):
    config = json.loads((folder / "config.json").read_text())
    config.pop("dtype", None), config.pop("torch_dtype", None)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("stored, exported", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.bfloat16)])
def test_auto_dtype_of_a_config_without_one_is_the_dtype_transformers_loads(tmp_path, stored, exported):
    """transformers 5 loads a checkpoint whose config.json states no dtype in its weights' dtype; `--dtype auto` is
    "the source's", so it exports that (fp16 as bf16), and says where it came from.  It used to read float32: a bf16
    checkpoint was exported at twice its size."""
    source = tmp_path / "src"
    tiny_model(num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64).to(stored).save_pretrained(source)
    _without_stated_dtype(source)
    loaded = AutoModelForCausalLM.from_pretrained(source, dtype="auto")  # the oracle: what transformers itself picks
    assert loaded.dtype == stored
    progress = RecordedMessages()
    convert(source, tmp_path / "mla", fast_options(kv_lora_rank=12, rope_dim=8, dtype="auto"), progress=progress)
    lines = progress.seen
    config = json.loads((tmp_path / "mla" / "config.json").read_text())
    assert config["dtype"] == str(exported).removeprefix("torch.")
    assert {t.dtype for t in load_file(tmp_path / "mla" / "model.safetensors").values()} == {exported}
    note = next(line for line in lines if "states no dtype" in line)
    assert str(stored).removeprefix("torch.") in note and ("fp16 cannot hold" in note) == (stored == torch.float16)


def test_the_weights_dtype_is_the_first_floating_tensor_of_the_first_shard_as_transformers_reads_it(tmp_path):
    """Mixed dtypes (fp32 norms beside bf16 matrices): transformers takes the first floating-point tensor by name in
    the first shard; so does the converter, and an explicit --dtype prints no note."""
    from safetensors.torch import save_file

    from mla_convert.convert.pipeline import with_the_weights_dtype
    from mla_convert.io.reader import CheckpointReader
    from mla_convert.source.config import SourceConfig

    source = save_tiny_model(tmp_path / "src", num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64)
    tensors = load_file(source / "model.safetensors")
    save_file({name: (t if "norm" in name else t.to(torch.bfloat16)) for name, t in tensors.items()},
              source / "model.safetensors", metadata={"format": "pt"})
    _without_stated_dtype(source)
    config = SourceConfig.from_folder(source)
    assert not config.dtype_stated
    first = sorted(tensors)[0]  # lm_head.weight: bf16 here
    assert "norm" not in first
    assert AutoModelForCausalLM.from_pretrained(source, dtype="auto").dtype == torch.bfloat16
    lines = []
    with CheckpointReader(source) as reader:
        assert with_the_weights_dtype(config, reader, lines.append, "fp32").torch_dtype == torch.bfloat16
    assert lines == []
    stated = SourceConfig.from_folder(save_tiny_model(tmp_path / "stated", num_heads=4, head_dim=16, hidden_size=64))
    with CheckpointReader(source) as reader:  # a stated dtype is the source's, whatever the weights hold
        assert with_the_weights_dtype(stated, reader, lines.append) is stated


@pytest.mark.parametrize("stated", [True, False])
def test_a_damaged_shard_of_a_config_without_a_dtype_is_reported_with_the_other_problems(tmp_path, stated):
    """Reading the weights' dtype (config.json states none) read every shard's header and raised on a truncated one
    from the constructor, so `-r 0` went unreported until the shard was fixed; with a stated dtype both came in one
    run.  Now both do."""
    import os

    source = tmp_path / "src"
    tiny_model(num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64).save_pretrained(source, max_shard_size="100KB")
    if not stated:
        _without_stated_dtype(source)
    last = sorted(source.glob("*.safetensors"))[-1]
    assert last.name != sorted(source.glob("*.safetensors"))[0].name  # the dtype is read from the first, intact one
    os.truncate(last, last.stat().st_size // 2)
    with pytest.raises(PreflightError) as raised:
        convert(source, tmp_path / "mla", fast_options(kv_lora_rank=0, rope_dim=8))
    message = str(raised.value)
    assert "--kv-lora-rank 0" in message or "kv_lora_rank 0" in message, message
    assert f"{last.name}: truncated or corrupt" in message
    assert not (tmp_path / "mla").exists()


def test_the_summary_says_its_attention_error_is_the_float32_fits_when_the_export_is_rounded(tmp_path):
    """A full-rank MQA conversion to bf16 printed "attention output error 0.000" while the bf16 export's logits differ
    by ~2e-2: the error is measured on the float32 fit, before the weights are rounded, and now says so."""
    from mla_convert.console import summary_rows

    source = save_tiny_model(tmp_path / "src", num_heads=4, num_kv_heads=1, head_dim=16, hidden_size=64)
    labels = {}
    for dtype in ("bf16", "fp32"):
        result = convert(source, tmp_path / dtype, fast_options(kv_lora_rank=16, rope_dim=16, dtype=dtype))
        labels[dtype] = next(label for label, _ in summary_rows(result.report) if label.startswith("attention output error"))
    assert labels == {"bf16": "attention output error (mean, relative; of the float32 fit, before the bfloat16 export)",
                      "fp32": "attention output error (mean, relative)"}
