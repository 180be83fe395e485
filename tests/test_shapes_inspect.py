"""KV-cache arithmetic, MLA shape picking and validation, and the `mla-convert inspect` command.

The configs are those of the two real models the project measures on (SmolLM2-135M and
stories260K), written out here so these checks need no weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from mla_convert.commands.inspect import inspect_shapes
from mla_convert.errors import InvalidShapeError, MLAConvertError, PreflightError
from mla_convert.source.config import SourceConfig
from mla_convert.source.shapes import (
    CacheCost,
    MLAShape,
    cache_costs,
    check_mla_shape,
    default_shape,
    shape_for_compression,
)
from mla_convert.units import human_bytes, parse_dtype

SMOLLM2 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
    "tie_word_embeddings": True,
    "attention_bias": False,
    "dtype": "float32",
}
STORIES260K = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 172,
    "num_hidden_layers": 5,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 8,
    "vocab_size": 512,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "tie_word_embeddings": True,
}
# A Llama-2-7B-like MHA model: caches enough for DeepSeek's own 512+64.
LLAMA7B_MHA = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32000,
    "rope_theta": 10000.0,
}
QWEN2_MQA = {
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "vocab_size": 128,
}


# --------------------------------------------------------------------------- source shapes and cache arithmetic
def test_smollm2_source_shape():
    source = SourceConfig.from_dict(SMOLLM2)
    assert source.attention_kind == "GQA"
    assert (source.num_heads, source.num_kv_heads, source.head_dim, source.num_layers) == (9, 3, 64, 30)
    assert source.kv_values_per_token_layer == 384  # 2 x 3 kv heads x 64
    assert source.max_kv_lora_rank == 384 and source.max_rope_dim == 64
    assert source.tied_embeddings and not source.qkv_bias
    assert source.rope_parameters == {"rope_theta": 100000.0, "rope_type": "default"}
    assert source.torch_dtype == torch.float32


def test_stories260k_source_shape():
    source = SourceConfig.from_dict(STORIES260K)
    assert source.kv_values_per_token_layer == 64  # 2 x 4 x 8
    assert source.max_kv_lora_rank == 64  # min(64, hidden 64)
    assert source.max_rope_dim == 8


def test_attention_kinds_and_derived_head_dim():
    mha = SourceConfig.from_dict(LLAMA7B_MHA)
    assert mha.attention_kind == "MHA" and mha.head_dim == 128  # no head_dim key: hidden / heads
    assert mha.max_kv_lora_rank == 4096  # the hidden size caps it, not 2 x 4096
    mqa = SourceConfig.from_dict(QWEN2_MQA)
    assert mqa.attention_kind == "MQA" and mqa.qkv_bias
    assert mqa.max_kv_lora_rank == 32  # 2 x 1 x 16 < hidden + 1
    assert mqa.rope_parameters["rope_theta"] == 10000.0  # default when absent


def test_cache_arithmetic_smollm2_128_plus_64_halves_the_cache():
    source = SourceConfig.from_dict(SMOLLM2)
    mla = MLAShape(kv_lora_rank=128, rope_dim=64)
    before, after = cache_costs(source, mla, torch.bfloat16)
    assert (before.values_per_token_layer, after.values_per_token_layer) == (384, 192)
    assert (before.bytes_per_token_layer, after.bytes_per_token_layer) == (768, 384)
    assert before.bytes_per_token == 768 * 30 == 23040
    assert before.bytes_for(4096) == 23040 * 4096 == 90 * 2**20
    assert after.bytes_for(4096, batch=8) == 384 * 30 * 4096 * 8
    assert before.max_context(2**30) == 2**30 // 23040 == 46603
    assert after.max_context(2**30, batch=2) == 2**30 // (11520 * 2)
    report = inspect_shapes(SourceConfig.from_dict(SMOLLM2), kv_lora_rank=128, rope_dim=64)
    assert report.ratio == 2.0
    assert CacheCost(192, 30, torch.float32).bytes_per_token_layer == 768


def test_inspect_report_rows_match_the_arithmetic():
    report = inspect_shapes(SourceConfig.from_dict(SMOLLM2), compression=4, dtype=torch.float16, context=1000, batch=3)
    rows = {quantity: (source, mla) for quantity, source, mla in report.rows()}
    assert rows["cached values / token / layer"] == ("384", "96")
    assert rows["bytes / token / layer"] == ("768", "192")
    assert rows["cache for 1000 tokens x batch 3"] == (human_bytes(768 * 30 * 3000), human_bytes(192 * 30 * 3000))
    assert report.ratio == 4.0


def test_inspect_counts_what_a_sliding_window_caches_and_says_what_the_export_declares():
    """A Mistral with a 16-token window was shown caching 4096 tokens, with no word on the export's 16 positions."""
    windowed = SourceConfig.from_dict({**SMOLLM2, "architectures": ["MistralForCausalLM"], "model_type": "mistral",
                                       "sliding_window": 16})
    report = inspect_shapes(windowed, compression=4, dtype=torch.float16, context=4096)
    rows = {quantity: (source, mla) for quantity, source, mla in report.rows()}
    assert rows["cache for 4096 tokens x batch 1"] == (f"{human_bytes(768 * 30 * 16)} (16-token window)",
                                                      human_bytes(192 * 30 * 4096))
    [note] = report.notes()
    assert "caches at most that many per sequence" in note and "declares max_position_embeddings 16" in note
    short = inspect_shapes(SourceConfig.from_dict({**SMOLLM2, "max_position_embeddings": 1024}), compression=4, context=4096)
    # (worded for the default too: --context is not always typed)
    assert short.notes() == ["the cache row's context (4096, --context) is longer than the model's max_position_embeddings "
                             "1024, which the export keeps"]
    assert inspect_shapes(SourceConfig.from_dict(SMOLLM2), compression=4, context=2048).notes() == []


@pytest.mark.parametrize(
    "config, compression, rank, rope",
    [
        (SMOLLM2, 2, 144, 48),
        (SMOLLM2, 4, 64, 32),
        (SMOLLM2, 8, 32, 16),
        (STORIES260K, 2, 24, 8),
        (STORIES260K, 4, 10, 6),
        (STORIES260K, 8, 4, 4),
    ],
)
def test_shape_for_compression(config, compression, rank, rope):
    source = SourceConfig.from_dict(config)
    mla = shape_for_compression(source, compression)
    assert (mla.kv_lora_rank, mla.rope_dim) == (rank, rope)
    assert source.kv_values_per_token_layer / mla.kv_values_per_token_layer == compression
    assert inspect_shapes(SourceConfig.from_dict(config), compression=compression).mla == mla


def test_default_shape():
    assert default_shape(SourceConfig.from_dict(LLAMA7B_MHA)) == MLAShape(512, 64)
    assert default_shape(SourceConfig.from_dict(SMOLLM2)) == MLAShape(144, 48)  # too small for 512+64: 2x
    assert default_shape(SourceConfig.from_dict(STORIES260K)) == MLAShape(24, 8)
    # Only one of rank / rope given: the other comes from the default.
    assert inspect_shapes(SourceConfig.from_dict(SMOLLM2), kv_lora_rank=100).mla == MLAShape(100, 48)
    assert inspect_shapes(SourceConfig.from_dict(SMOLLM2), rope_dim=32).mla == MLAShape(144, 32)


# --------------------------------------------------------------------------- impossible shapes
def test_every_problem_is_listed_at_once():
    source = SourceConfig.from_dict(SMOLLM2)
    with pytest.raises(InvalidShapeError) as caught:
        check_mla_shape(source, kv_lora_rank=1000, rope_dim=65, q_lora_rank=0)
    message = str(caught.value)
    assert "--rope-dim 65: must be even" in message
    assert "--kv-lora-rank 1000: larger than the source allows (at most 384" in message
    assert "--q-lora-rank 0: must be positive" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    "rank, rope, expected",
    [
        (128, 63, ["--rope-dim 63: must be even"]),
        (128, 128, ["--rope-dim 128: larger than the source head_dim 64"]),
        (385, 64, ["--kv-lora-rank 385", "at most 384"]),
        (0, 0, ["--kv-lora-rank 0: must be positive", "--rope-dim 0: must be a positive even number"]),
        (-5, -2, ["--kv-lora-rank -5: must be positive", "--rope-dim -2: must be a positive even number"]),
    ],
)
def test_impossible_shapes_are_rejected(rank, rope, expected):
    source = SourceConfig.from_dict(SMOLLM2)
    with pytest.raises(InvalidShapeError) as caught:
        check_mla_shape(source, rank, rope)
    for fragment in expected:
        assert fragment in str(caught.value)
    # The largest legal shape is accepted.
    assert check_mla_shape(source, 384, 64) == MLAShape(384, 64)


def test_rank_limit_needs_no_bias_column():
    """Biases leave the latent: NoPE-key biases cancel in the softmax, value biases move into o_proj."""
    source = SourceConfig.from_dict({**SMOLLM2, "architectures": ["Qwen2ForCausalLM"], "num_key_value_heads": 9})
    assert source.max_kv_lora_rank == 576
    with pytest.raises(InvalidShapeError, match=r"at most 576 = .*hidden size 576\)\)"):
        check_mla_shape(source, 577, 64)


@pytest.mark.parametrize("compression, fragment", [(30, "must be below 25.6"), (0, "at least 1"), (-2, "at least 1"), (0.5, "at least 1")])
def test_impossible_compressions(compression, fragment):
    source = SourceConfig.from_dict(STORIES260K)
    with pytest.raises(InvalidShapeError, match=fragment):
        shape_for_compression(source, compression)


def test_the_stated_largest_ratio_is_the_largest_accepted_and_a_rounded_ratio_says_so():
    """stories260K caches 64 values: 26 was refused with "the ratio can be at most 21.3" while 22 and 25 were accepted
    and silently gave 1+2 = 21.33x."""
    import re

    from mla_convert.source.shapes import shape_choice_note

    source = SourceConfig.from_dict(STORIES260K)
    with pytest.raises(InvalidShapeError) as refused:
        shape_for_compression(source, 26)
    limit = float(re.search(r"must be below ([0-9.]+)", str(refused.value)).group(1))
    assert "21.33x" in str(refused.value)  # the smallest cache it can reach
    for ratio in (21.3, 22, 25, 25.59, limit, limit + 0.01, 26):
        accepted = True
        try:
            mla = shape_for_compression(source, ratio)
        except InvalidShapeError:
            accepted = False
        assert accepted == (ratio < limit), ratio
        if accepted:
            note = shape_choice_note(source, "transformers", mla, ratio)
            assert note == f"asked {ratio:g}x, got 1+2 = 21.33x (the cache holds whole values: 3 per token and layer " \
                           "of the source's 64)"
    assert shape_choice_note(source, "transformers", shape_for_compression(source, 4), 4) is None  # exact: no note
    assert shape_choice_note(source, "transformers", shape_for_compression(source, 4.001), 4.001) is None  # prints 4.00x
    assert shape_choice_note(source, "transformers", MLAShape(16, 16), None) is None  # no ratio asked


def test_config_errors_are_user_errors():
    broken = {key: value for key, value in SMOLLM2.items() if key != "num_attention_heads"}
    with pytest.raises(PreflightError, match=r"num_attention_heads must be a positive integer \(found None\)"):
        SourceConfig.from_dict(broken)
    with pytest.raises(PreflightError, match="hidden_size must be a positive integer \\(found 'big'\\)"):
        SourceConfig.from_dict({**SMOLLM2, "hidden_size": "big"})
    with pytest.raises(InvalidShapeError, match="unknown dtype 'int4'"):
        parse_dtype("int4")
    assert parse_dtype("bf16") == torch.bfloat16 and parse_dtype("torch.float16") == torch.float16


def test_rope_parameters_from_older_config_keys():
    params = SourceConfig.from_dict({**SMOLLM2, "rope_theta": 500000.0, "rope_scaling": {"type": "linear", "factor": 4.0}}).rope_parameters
    assert params == {"rope_type": "linear", "factor": 4.0, "rope_theta": 500000.0}


# --------------------------------------------------------------------------- the command line
def run_cli(*args, cwd=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "160", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "mla_convert", *map(str, args)], capture_output=True, text=True, env=env, timeout=120, cwd=cwd
    )


def test_inspect_names_weights_convert_will_refuse(tmp_path):
    """inspect read config.json alone and exited 0 without a word on a folder missing a shard; convert refused it."""
    from tiny_models import save_tiny_model

    folder = save_tiny_model(tmp_path / "sharded", max_shard_size="20KB")
    shards = sorted(folder.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2
    result = run_cli("inspect", folder)
    assert result.returncode == 0 and "convert will refuse" not in result.stdout, result.stdout + result.stderr
    shards[-1].unlink()
    result = run_cli("inspect", folder)
    flowing = " ".join(result.stdout.split())
    assert result.returncode == 0 and f"note: convert will refuse these weights: {folder}" in flowing, flowing
    assert f"names shard '{shards[-1].name}'" in flowing and "which is missing from the folder" in flowing


def test_inspect_cli_prints_the_table_and_ratio(smollm2_config_folder):
    result = run_cli("inspect", smollm2_config_folder, "--compression", "4", "--context", "4096")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    flowing = " ".join(out.split())  # the summary line may wrap at the terminal width
    assert "llama (GQA), 30 layers, hidden 576, 9 query heads, 3 kv heads, head_dim 64, RoPE default theta=100000.0" in flowing
    assert "source vs MLA 64+32" in out
    table_row = next(line for line in out.splitlines() if "cached values / token / layer" in line)
    assert "384" in table_row and "96" in table_row
    cache_row = next(line for line in out.splitlines() if "cache for 4096 tokens x batch 1" in line)
    assert "90.00 MiB" in cache_row and "22.50 MiB" in cache_row
    assert "compression ratio: 4.00x" in out


def test_inspect_cli_impossible_shape_is_one_error_line_per_problem(smollm2_config_folder):
    """(Both problems were joined on one line by "; ", where convert prints one `error:` line each.)"""
    result = run_cli("inspect", smollm2_config_folder, "--kv-lora-rank", "1000", "--rope-dim", "65")
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 2 and all(line.startswith("error: ") for line in lines), result.stderr
    assert lines[0].startswith("error: --rope-dim 65") and lines[1].startswith("error: --kv-lora-rank 1000"), lines
    assert "Traceback" not in result.stderr + result.stdout


def test_inspect_cli_user_errors_exit_2(tmp_path):
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    (tmp_path / "empty").mkdir()
    for folder, fragment in [(tmp_path / "gpt2", "LlamaForCausalLM"), (tmp_path / "empty", "config.json: missing")]:
        result = run_cli("inspect", folder)
        assert result.returncode == 2, result.stdout + result.stderr
        assert result.stderr.startswith("error: ") and fragment in result.stderr
        assert "Traceback" not in result.stderr
    assert isinstance(InvalidShapeError("x"), MLAConvertError)


@pytest.mark.parametrize("args, messages", [
    (["--context", "-1", "--batch", "0"], ["--context -1: must be at least 1", "--batch 0: must be at least 1"]),
    # --estimate predicts a conversion; one that `convert` refuses for this source gets the same refusal
    (["--estimate", "--q-lora-rank", "577"], ["--q-lora-rank 577: larger than the source allows"]),
    (["--estimate", "--calib-seq-len", "100000"], ["--calib-seq-len 100000: longer than the source's max_position_embeddings"]),
    (["--estimate", "--calib-data", "no-such-text.txt"], ["--calib-data: no-such-text.txt: no such file or folder"]),
    # a misspelled target: the one line convert and sweep print too (they raised a KeyError)
    (["--target", "vLLM"], ["--target 'vLLM': choose one of transformers, vllm, llama.cpp, all"]),
    (["--estimate", "--target", "ALL"], ["--target 'ALL': choose one of transformers, vllm, llama.cpp, all"]),
])
def test_inspect_refuses_what_would_print_nonsense(smollm2_config_folder, tmp_path, args, messages):
    """Negative cache sizes, or a cost prediction (21.6 h for 100K-token windows) for a conversion that cannot run."""
    result = run_cli("inspect", smollm2_config_folder, *args, cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == "", result.stdout + result.stderr
    assert result.stderr.splitlines() == [f"error: {message}" for message in messages] or \
        all(message in " ".join(result.stderr.split()) for message in messages), result.stderr


def test_inspect_says_when_the_mla_cache_is_larger(smollm2_config_folder):
    """Full rank plus a RoPE key caches more than the source (the exactness case): the ratio line says so, and the
    piped tables are Markdown blocks of their own (a blank line before each title)."""
    result = run_cli("inspect", smollm2_config_folder, "-r", "384", "-d", "32")
    assert result.returncode == 0, result.stderr
    assert "compression ratio: 0.92x: the MLA cache is 1.08x larger than the source's" in result.stdout
    assert "smaller" not in result.stdout
    assert "\n\n**shapes each --target allows for this model**\n\n" in result.stdout


def test_the_transformers_target_row_spans_the_ratios_of_the_shapes_it_allows():
    """It said "1x to 10.7x" for an MQA model whose full-rank shape (allowed) caches more than the source: 0.67x."""
    from mla_convert.commands.inspect import target_rows

    mqa = SourceConfig.from_dict({**SMOLLM2, "num_key_value_heads": 1})
    [(_, shapes, ratios)] = [row for row in target_rows(mqa) if row[0] == "transformers"]
    widest = mqa.max_kv_lora_rank + mqa.max_rope_dim
    assert ratios.startswith(f"{mqa.kv_values_per_token_layer / widest:.2f}x to ") and widest > mqa.kv_values_per_token_layer
    assert f"kv_lora_rank <= {mqa.max_kv_lora_rank}" in shapes


def _tokens_each_layer_attends(model, context: int) -> list[int]:
    """Tokens each layer's attention reads from transformers' own DynamicCache when it decodes token `context`, after
    a forward of the `context - 1` before it: every one in a full layer, the window in a sliding one (the
    DynamicSlidingWindowLayer keeps window - 1 between steps and adds the token being decoded)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    read = {}
    for index, layer in enumerate(cache.layers):
        def update(*args, _update=layer.update, _index=index, **kwargs):
            keys, values = _update(*args, **kwargs)
            read[_index] = keys.shape[-2]
            return keys, values
        layer.update = update
    torch.manual_seed(0)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 128, (1, context - 1)), cache=cache, use_cache=True)
        model(input_ids=torch.randint(0, 128, (1, 1)), cache=cache, use_cache=True)
    return [read[index] for index in range(len(cache.layers))]


def test_only_the_sliding_layers_of_a_mixed_source_are_counted_at_their_window(tmp_path):
    """Qwen2 with layer 0 full and layer 1 sliding over 16 tokens: inspect counted both layers' caches at 16 tokens
    ("2.00 KiB (16-token window)" for 4096 tokens), while transformers' cache holds every token in layer 0."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, max_position_embeddings=512, use_sliding_window=True,
                         sliding_window=16, max_window_layers=1)
    assert config.layer_types == ["full_attention", "sliding_attention"]
    folder = tmp_path / "mixed"
    config.save_pretrained(folder)
    source = SourceConfig.from_folder(folder)
    context = 64
    read = _tokens_each_layer_attends(Qwen2ForCausalLM(config).eval(), context)
    assert read == [context, 16]
    per_token_layer = 2 * 2 * 16 * 4  # keys and values of 2 kv heads of head_dim 16, float32
    report = inspect_shapes(source, kv_lora_rank=16, rope_dim=16, dtype=torch.float32, context=context)
    assert report.source_cost.bytes_for(context) == per_token_layer * sum(read) == per_token_layer * (64 + 16)
    rows = {quantity: (source, mla) for quantity, source, mla in report.rows()}
    assert rows[f"cache for {context} tokens x batch 1"] == (f"{human_bytes(per_token_layer * 80)} (16-token window in 1 of 2 layers)",
                                                             human_bytes(32 * 4 * 2 * context))
    assert (source.sliding_window, source.sliding_layers, source.num_layers) == (16, 1, 2)
    [note] = report.notes()
    assert note.startswith("the source slides its attention over 16 tokens in 1 of its 2 layers, so those layers cache at "
                           "most that many per sequence and the others every token")
    # the command: the table, and the ratio line beside the per-token ratio (64 values / 32) the cache at the context
    result = run_cli("inspect", folder, "-r", "16", "-d", "16", "--dtype", "fp32", "--context", "4096")
    assert result.returncode == 0, result.stderr
    flowing = " ".join(result.stdout.split())
    source_bytes, mla_bytes = per_token_layer * (4096 + 16), 32 * 4 * 2 * 4096
    assert f"| {human_bytes(source_bytes)} (16-token window in 1 of 2 layers) | {human_bytes(mla_bytes)} |" in flowing
    assert (f"compression ratio: 2.00x smaller KV cache per cached token; at 4096 tokens x batch 1, where the source's "
            f"sliding layers keep at most 16 tokens, the cache is {source_bytes / mla_bytes:.2f}x smaller "
            f"({human_bytes(source_bytes)} vs {human_bytes(mla_bytes)})") in flowing
    # an explicit layer_types list is read the same way
    config.layer_types = ["sliding_attention", "full_attention"]
    config.save_pretrained(folder)
    assert SourceConfig.from_folder(folder).sliding_layers == 1


def test_a_source_that_slides_every_layer_keeps_its_numbers():
    """Mistral (no layer_types) slides every layer: all are counted at the window, as before."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, max_position_embeddings=512, sliding_window=16)
    source = SourceConfig.from_dict({**config.to_dict(), "architectures": ["MistralForCausalLM"]})
    assert (source.sliding_window, source.sliding_layers) == (16, 2)
    read = _tokens_each_layer_attends(MistralForCausalLM(config).eval(), 64)
    assert read == [16, 16]
    report = inspect_shapes(source, kv_lora_rank=16, rope_dim=16, dtype=torch.float32, context=64)
    rows = {quantity: (source, mla) for quantity, source, mla in report.rows()}
    assert rows["cache for 64 tokens x batch 1"] == (f"{human_bytes(256 * 32)} (16-token window)", human_bytes(128 * 2 * 64))
    assert report.ratio == 2.0
    [note] = report.notes()
    assert note.startswith("the source slides its attention over 16 tokens, so it caches at most that many per sequence")
