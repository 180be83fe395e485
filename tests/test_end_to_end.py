"""stories260K through the real CLI: the summary, the card, the cache the model really holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from mla_convert.commands.inspect import inspect_shapes
from mla_convert.eval.kv_cache import measure_kv_cache
from mla_convert.hub.card import validate_card
from mla_convert.source.config import SourceConfig

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def converted(stories260k, tmp_path_factory):
    """`mla-convert convert stories260k OUT --compression 4` run as a user runs it."""
    out = tmp_path_factory.mktemp("e2e") / "stories-mla"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-m", "mla_convert", "convert", str(stories260k), str(out), "--compression", "4",
         "--calib-samples", "8", "--calib-seq-len", "128", "--dtype", "fp32"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return out, result.stdout


def test_cli_prints_the_summary_and_the_engine_report(converted):
    out, stdout = converted
    assert "compression ratio" in stdout and "4.00x" in stdout
    assert "64 -> 16" in stdout  # cached values per token and layer, source -> MLA
    assert "vllm" in stdout and "transformers" in stdout
    assert stdout.strip().endswith(str(out))


def test_card_of_a_real_conversion_validates_offline_and_shows_its_numbers(converted):
    out, _ = converted
    report = json.loads((out / "mla_convert.json").read_text())
    card_text = (out / "README.md").read_text()
    metadata = validate_card(card_text)
    assert metadata["library_name"] == "transformers"
    assert "mla" in metadata["tags"] and "deepseek_v3" in metadata["tags"]
    cache = report["cache"]
    # bytes per token before/after (fp32, 5 layers) and the ratio appear in the card
    assert str(cache["source_bytes_per_token"]) in card_text.replace(",", "")
    assert str(cache["mla_bytes_per_token"]) in card_text.replace(",", "")
    # the measured ratio of this export, in the sentence and in the table row the card prints it in
    ratio = f"{cache['ratio']:.3g}x"
    assert cache["ratio"] == pytest.approx(64 / 16) and ratio == "4x"
    assert f"Its KV cache is **{ratio} smaller**" in card_text
    assert f"| compression ratio | 1x | {ratio} |" in card_text
    assert report["options"]["kv_lora_rank"] + report["options"]["rope_dim"] == 16
    assert f"{report['options']['kv_lora_rank']}" in card_text and str(out) not in card_text


def test_measured_cache_ratio_matches_inspect(converted, stories260k):
    out, _ = converted
    predicted = inspect_shapes(SourceConfig.from_folder(stories260k), compression=4, dtype=torch.float32)
    source = AutoModelForCausalLM.from_pretrained(stories260k, dtype=torch.float32)
    mla = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tokens = 64
    measured_source = measure_kv_cache(source, tokens=tokens)
    measured_mla = measure_kv_cache(mla, tokens=tokens)
    expected_mla = (predicted.mla.kv_lora_rank + predicted.mla.rope_dim) * 5 * 4 * tokens
    assert abs(measured_mla.total_bytes - expected_mla) <= 0.01 * expected_mla
    assert measured_source.total_bytes / measured_mla.total_bytes == pytest.approx(predicted.ratio, rel=0.01)
