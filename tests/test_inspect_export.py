"""`mla-convert inspect` on an MLA export: what it caches (config.json), its source and target (mla_convert.json).

Tiny random Llama models are really converted (the Python API, calibration cut to a few windows); the numbers
inspect prints are checked against the arithmetic on the files' own keys (layers x (kv_lora_rank +
qk_rope_head_dim) x bytes) and against the cache transformers really fills.  inspect used to refuse every
DeepseekV3 folder ("already an MLA model"), so each of these tests fails on that code.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import save_tiny_model
from transformers import DeepseekV3Config
from typer.testing import CliRunner

from mla_convert import cli
from mla_convert.convert import ConvertOptions, convert
from mla_convert.errors import PreflightError
from mla_convert.options import CalibrationOptions
from mla_convert.source.architectures import supported_family_names

REPO = Path(__file__).resolve().parents[1]
CALIBRATION = CalibrationOptions(num_samples=4, seq_len=16, error_samples=2)
FAMILIES = ", ".join(supported_family_names())  # as refusals name the source families
# the source: 3 layers, 8 query heads, 4 kv heads of head_dim 8, so 2 * 4 * 8 = 64 cached values per token and layer
LAYERS, KV_HEADS, HEAD_DIM = 3, 4, 8
SOURCE_VALUES = 2 * KV_HEADS * HEAD_DIM


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """A tiny Llama and two real exports of it: 12+4 for transformers (4x), 24+8 for llama.cpp (2x, q_lora_rank set)."""
    root = tmp_path_factory.mktemp("export-inspect")
    source = save_tiny_model(root / "src", num_heads=8, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, hidden_size=64,
                             num_layers=LAYERS, max_position_embeddings=512)
    fast = dict(calibration=CALIBRATION, dtype="fp32", effort="fast")
    plain = convert(source, root / "plain", ConvertOptions(kv_lora_rank=12, rope_dim=4, **fast)).output
    served = convert(source, root / "llamacpp", ConvertOptions(kv_lora_rank=24, rope_dim=8, target="llama.cpp", **fast)).output
    return {"root": root, "source": source, "plain": Path(plain), "llamacpp": Path(served)}


def invoke(*args):
    return CliRunner().invoke(cli.app, ["inspect", *map(str, args)])


def table(output: str) -> dict[str, tuple[str, str]]:
    """The KV-cache table's rows: quantity -> (source cell, MLA cell)."""
    rows = {}
    for line in output.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 3 and cells[0] not in ("quantity", "engine"):
            rows[cells[0]] = (cells[1], cells[2])
    return rows


def config_of(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def binary(count: int) -> str:
    """Bytes as inspect words them, written out here: B below 1 KiB, else KiB / MiB with two decimals."""
    if count < 1024:
        return f"{count} B"
    return f"{count / 1024:.2f} KiB" if count < 1024 ** 2 else f"{count / 1024 ** 2:.2f} MiB"


def copy_export(folder: Path, where: Path) -> Path:
    shutil.copytree(folder, where)
    return where


# --------------------------------------------------------------------------- the numbers
@pytest.mark.parametrize("dtype, size", [("fp32", 4), ("bf16", 2)])
def test_inspect_on_an_export_prints_its_cache_and_its_sources_from_their_files(exports, dtype, size):
    folder = exports["plain"]
    result = invoke(folder, "--context", 1000, "--batch", 3, "--dtype", dtype)
    assert result.exit_code == 0, result.output
    out = result.stdout
    config = config_of(folder)
    layers, mla_values = config["num_hidden_layers"], config["kv_lora_rank"] + config["qk_rope_head_dim"]
    assert (layers, mla_values) == (LAYERS, 16)
    mla_token, source_token = layers * mla_values * size, LAYERS * SOURCE_VALUES * size
    rows = table(out)
    assert rows["cached values / token / layer"] == (str(SOURCE_VALUES), str(mla_values))
    assert rows["bytes / token / layer"] == (str(SOURCE_VALUES * size), str(mla_values * size))
    assert rows["bytes / token (all layers)"] == (binary(source_token), binary(mla_token))
    assert rows["cache for 1000 tokens x batch 3"] == (binary(source_token * 3000), binary(mla_token * 3000))
    assert rows["tokens cached per GiB"] == (f"{2**30 // source_token:,}", f"{2**30 // mla_token:,}")
    # where each number comes from, the shape and the source as the files state them
    assert f"{folder}: MLA export (DeepseekV3), 3 layers, 8 heads; caches kv_lora_rank 12 + qk_rope_head_dim 4 values " \
           "per token and layer (config.json)" in out
    # (the report's ../src, shown from the working folder: the repository, so absolute)
    assert f"source (mla_convert.json): {exports['source'].resolve()}, LlamaForCausalLM (GQA), 3 layers, 8 query heads, " \
        "4 kv heads, head_dim 8" in out
    assert "| quantity | source (mla_convert.json) | MLA (config.json) |" in out
    assert "compression ratio: 4.00x smaller KV cache (the source's cache from mla_convert.json, the export's from " \
           "config.json)" in out
    assert "made for: --target transformers (mla_convert.json)" in out


def test_without_dtype_the_cache_is_counted_in_the_exports_stored_dtype(exports, tmp_path):
    """inspect used to count an fp32 export's cache in bf16 (the source model's default) unless --dtype was typed."""
    from mla_convert.commands.inspect import inspect_export

    folder = exports["plain"]
    assert config_of(folder)["dtype"] == "float32"
    per_layer = {"fp32": str(16 * 4), "bf16": str(16 * 2)}
    stored = invoke(folder)
    assert stored.exit_code == 0, stored.output
    assert "KV cache (fp32, stored dtype): source vs MLA 12+4" in stored.stdout
    assert table(stored.stdout)["bytes / token / layer"] == (str(SOURCE_VALUES * 4), per_layer["fp32"])
    typed = invoke(folder, "--dtype", "bf16")  # typed, it is used
    assert "KV cache (bf16): source vs MLA 12+4" in typed.stdout
    assert table(typed.stdout)["bytes / token / layer"] == (str(SOURCE_VALUES * 2), per_layer["bf16"])
    assert inspect_export(folder).dtype == torch.float32
    unstated = copy_export(folder, tmp_path / "unstated")  # no dtype in config.json: bf16, and the table says why
    config = config_of(unstated)
    for key in ("dtype", "torch_dtype"):
        config.pop(key, None)
    (unstated / "config.json").write_text(json.dumps(config))
    assert "KV cache (bf16, config.json states no dtype)" in invoke(unstated).stdout
    readme = " ".join((REPO / "README.md").read_text().split())
    assert "without `--dtype`, in the dtype `config.json` stores" in readme


def test_the_default_context_is_not_worded_as_a_typed_flag(exports):
    """The note named "--context 4096" when the user typed no --context (4096 is its default)."""
    result = invoke(exports["plain"])
    assert result.exit_code == 0, result.output
    assert "note: the cache row's context (4096, --context) is longer than the export's max_position_embeddings 512" \
        in result.stdout
    assert "note: --context" not in result.stdout


def test_the_api_gives_the_numbers_and_they_are_what_transformers_caches(exports):
    from transformers import AutoModelForCausalLM

    from mla_convert.commands.inspect import inspect_export
    from mla_convert.eval.kv_cache import measure_kv_cache

    folder = exports["plain"]
    found = inspect_export(folder, dtype=torch.float32, context=20, batch=2)
    config = config_of(folder)
    per_token = config["num_hidden_layers"] * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * 4
    assert found.mla_cost.bytes_per_token == per_token == 3 * 16 * 4
    assert found.source_cost.bytes_per_token == LAYERS * SOURCE_VALUES * 4
    assert found.ratio == pytest.approx(SOURCE_VALUES / 16)
    assert (found.target, found.report_file, found.unknown_because) == ("transformers", "mla_convert.json", None)
    assert (found.mla.kv_lora_rank, found.mla.rope_dim, found.mla.q_lora_rank) == (12, 4, None)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    measured = measure_kv_cache(model, tokens=20, batch_size=2)
    assert measured.total_bytes == found.mla_cost.bytes_for(20, 2)


def test_an_export_without_its_report_has_an_unknown_source_never_a_guessed_one(exports, tmp_path):
    folder = copy_export(exports["plain"], tmp_path / "bare")
    (folder / "mla_convert.json").unlink()
    result = invoke(folder, "--dtype", "fp32")
    assert result.exit_code == 0, result.output
    out = result.stdout
    rows = table(out)
    assert rows and all(source == "unknown" for source, _ in rows.values()), rows
    assert rows["bytes / token (all layers)"][1] == binary(3 * 16 * 4)
    assert "source: unknown" in out and "made for: unknown" in out
    assert f"note: {folder} has no mla_convert.json" in out
    assert "compression ratio: unknown (the source is unknown)" in out and "smaller" not in out
    assert "engine runs: none shown" in out

    from mla_convert.commands.inspect import inspect_export

    found = inspect_export(folder)
    assert (found.source, found.source_cost, found.ratio, found.target, found.runs) == (None, None, None, None, ())


def test_a_deepseek_config_not_made_by_mla_convert_reports_its_cache_from_config(tmp_path):
    """DeepSeek-V3's own shape (query latent, 58 MoE layers): the cache is the latent and the RoPE key per token and
    layer whatever the MLP and the query path; nothing else is known, and inspect says so."""
    folder = tmp_path / "deepseek"
    config = DeepseekV3Config(num_hidden_layers=61, num_attention_heads=128, kv_lora_rank=512, qk_rope_head_dim=64,
                              q_lora_rank=1536, n_routed_experts=256, first_k_dense_replace=3, max_position_embeddings=163840)
    config.architectures = ["DeepseekV3ForCausalLM"]
    config.save_pretrained(folder)
    result = invoke(folder, "--context", 4096)
    assert result.exit_code == 0, result.output
    out = result.stdout
    per_token = 61 * (512 + 64) * 2  # bf16
    rows = table(out)
    assert rows["cached values / token / layer"] == ("unknown", "576")
    assert rows["bytes / token (all layers)"] == ("unknown", binary(per_token)) == ("unknown", "68.62 KiB")
    assert rows["cache for 4096 tokens x batch 1"] == ("unknown", binary(per_token * 4096)) == ("unknown", "274.50 MiB")
    assert "note: q_lora_rank 1536 and mixture-of-experts MLPs in 58 of 61 layers: no change to the KV cache" in out
    assert "source: unknown" in out and "compression ratio: unknown" in out


def test_config_keys_an_export_leaves_out_are_transformers_defaults():
    from mla_convert.source.config import ExportConfig

    for raw in ({"model_type": "deepseek_v3"}, {"model_type": "deepseek_v3", "q_lora_rank": None, "num_hidden_layers": 4}):
        parsed, loaded = ExportConfig.from_dict(raw), DeepseekV3Config.from_dict(raw)
        assert (parsed.kv_lora_rank, parsed.rope_dim, parsed.num_layers, parsed.q_lora_rank) == \
            (loaded.kv_lora_rank, loaded.qk_rope_head_dim, loaded.num_hidden_layers, loaded.q_lora_rank)
        assert parsed.moe_layers == max(0, loaded.num_hidden_layers - loaded.first_k_dense_replace)


def test_a_windowed_sources_cache_is_counted_over_its_window(tmp_path):
    source = save_tiny_model(tmp_path / "src", family="mistral", num_heads=4, num_kv_heads=1, head_dim=16, hidden_size=64,
                             num_layers=2)
    config = config_of(source)
    config["sliding_window"] = 16
    (source / "config.json").write_text(json.dumps(config))
    out = convert(source, tmp_path / "mla", ConvertOptions(kv_lora_rank=16, rope_dim=8, calibration=CALIBRATION,
                                                            dtype="fp32", effort="fast")).output
    result = invoke(out, "--context", 100, "--dtype", "fp32")
    assert result.exit_code == 0, result.output
    # the source caches 2 * 1 * 16 = 32 values per token and layer, of at most 16 tokens; the export 24 of all 100
    assert table(result.stdout)["cache for 100 tokens x batch 1"] == (binary(2 * 32 * 4 * 16) + " (16-token window)",
                                                                       binary(2 * 24 * 4 * 100))
    assert "note: the source slides its attention over 16 tokens" in result.stdout
    assert "note: the cache row's context (100, --context) is longer than the export's max_position_embeddings 16" \
        in result.stdout


@pytest.mark.parametrize("family, note", [
    ("granite", "note: the source scales its activations by embedding_multiplier 3, residual_multiplier 0.5, "
                "attention_multiplier 0.0625, logits_scaling 4; DeepseekV3 has no such settings, so the export folds each "
                "into the weights it multiplies (the same function)"),
    ("helium", "note: the source rotates adjacent dimension pairs of each head; the conversion reads its query and key "
               "rows reordered into DeepseekV3's halves (no attention score changes)"),
    ("smollm3", "note: 2 of the 4 layers attend without RoPE; the export gives them zero RoPE rows, so the latent holds "
                "their whole key"),
])
def test_inspect_and_convert_say_what_the_export_does_about_what_deepseek_lacks(tmp_path, family, note):
    """Granite's multipliers, adjacent-pair RoPE and NoPE layers are converted without a word on the console; the
    report and card recorded them only after the run."""
    from mla_convert.convert.decisions import Progress

    class Notes(Progress):
        def __init__(self):
            self.seen = []

        def message(self, text):
            self.seen.append(text)

    source = save_tiny_model(tmp_path / "src", family=family, num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64,
                             num_layers=4)
    inspected = invoke(source)
    assert inspected.exit_code == 0, inspected.output
    assert note in " ".join(inspected.stdout.split())
    notes = Notes()
    convert(source, tmp_path / "mla", ConvertOptions(kv_lora_rank=16, rope_dim=8, calibration=CALIBRATION, effort="fast"),
            progress=notes)
    assert note in notes.seen
    plain = save_tiny_model(tmp_path / "llama", num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64, num_layers=4)
    assert not [line for line in invoke(plain).stdout.splitlines() if line.startswith("note:") and (
        "DeepseekV3 has no" in line or "RoPE" in line or "adjacent" in line)]


def test_a_source_sliding_some_layers_is_counted_so_in_the_export_inspection(tmp_path):
    """A Qwen2 whose layer 0 attends to every token and layer 1 slides over 16: the export's inspection counted both
    layers of the source at 16 tokens; convert's note, the report and the card said the source slides, as if all did."""
    from mla_convert.convert.decisions import Progress

    class Notes(Progress):
        def __init__(self):
            self.seen = []

        def message(self, text):
            self.seen.append(text)

    source = save_tiny_model(tmp_path / "src", family="qwen2", num_heads=4, num_kv_heads=1, head_dim=16, hidden_size=64,
                             num_layers=2)
    config = config_of(source)
    config.update(use_sliding_window=True, sliding_window=16, max_window_layers=1,
                  layer_types=["full_attention", "sliding_attention"])
    (source / "config.json").write_text(json.dumps(config))
    notes = Notes()
    result = convert(source, tmp_path / "mla", ConvertOptions(kv_lora_rank=16, rope_dim=8, calibration=CALIBRATION,
                                                               dtype="fp32", effort="fast"), progress=notes)
    out = Path(result.output)
    inspected = invoke(out, "--context", 100, "--dtype", "fp32")
    assert inspected.exit_code == 0, inspected.output
    # the source caches 2 * 1 * 16 = 32 values per token and layer: all 100 tokens in layer 0, 16 in layer 1; the
    # export 24 of all 100 in both
    source_bytes, mla_bytes = 32 * 4 * (100 + 16), 2 * 24 * 4 * 100
    assert table(inspected.stdout)["cache for 100 tokens x batch 1"] == \
        (binary(source_bytes) + " (16-token window in 1 of 2 layers)", binary(mla_bytes))
    flowing = " ".join(inspected.stdout.split())
    assert "note: the source slides its attention over 16 tokens in 1 of its 2 layers, so those layers cache at most" \
        in flowing
    assert (f"at 100 tokens x batch 1, where the source's sliding layers keep at most 16 tokens, the cache is "
            f"{mla_bytes / source_bytes:.2f}x larger for the MLA") in flowing
    assert (result.report["source"]["sliding_window"], result.report["source"]["sliding_layers"]) == (16, 1)
    assert any(note.startswith("note: the source slides its attention over 16 tokens in 1 of its 2 layers; DeepseekV3")
               for note in notes.seen), notes.seen
    assert "slides its attention over a window of 16 tokens in 1 of its 2 layers;" in (out / "README.md").read_text()
    # a report written before the count was recorded: every layer slid (the only windowed sources it converted)
    report = json.loads((out / "mla_convert.json").read_text())
    del report["source"]["sliding_layers"]
    (out / "mla_convert.json").write_text(json.dumps(report))
    older = invoke(out, "--context", 100, "--dtype", "fp32")
    assert table(older.stdout)["cache for 100 tokens x batch 1"] == (binary(2 * 32 * 4 * 16) + " (16-token window)",
                                                                      binary(mla_bytes))


# --------------------------------------------------------------------------- the report it reads
def test_a_report_of_another_conversion_is_not_used(exports, tmp_path):
    folder = copy_export(exports["plain"], tmp_path / "mixed")
    report = json.loads((folder / "mla_convert.json").read_text())
    report["options"]["kv_lora_rank"] = 20
    (folder / "mla_convert.json").write_text(json.dumps(report))
    result = invoke(folder)
    assert result.exit_code == 0, result.output
    assert "note: config.json and mla_convert.json describe different models (kv_lora_rank 12 (the report: 20))" in \
        result.stdout
    assert "source: unknown" in result.stdout and "compression ratio: unknown" in result.stdout


def test_a_report_without_a_target_leaves_only_the_target_unknown(exports, tmp_path):
    """(Reports written before --target existed.)  No target, so no engine record is matched to the export."""
    folder = copy_export(exports["llamacpp"], tmp_path / "untargeted")
    report = json.loads((folder / "mla_convert.json").read_text())
    del report["options"]["target"]
    (folder / "mla_convert.json").write_text(json.dumps(report))
    out = invoke(folder).stdout
    assert "made for: unknown" in out and "note: mla_convert.json records no --target" in out
    assert "source (mla_convert.json): ../src" in out and "compression ratio: 2.00x smaller" in out
    assert "engine runs: none shown" in out and "| llama.cpp |" not in out


def test_an_unreadable_report_is_named_and_the_config_still_answers(exports, tmp_path):
    folder = copy_export(exports["plain"], tmp_path / "broken")
    (folder / "mla_convert.json").write_text("{ not json")
    result = invoke(folder)
    assert result.exit_code == 0, result.output
    assert "mla_convert.json: cannot be read as JSON" in result.stdout
    assert table(result.stdout)["cached values / token / layer"] == ("unknown", "16")


def test_a_hub_export_is_read_with_its_report_from_the_hub_cache(exports, tmp_path):
    """A hub id: config.json and the uploaded (public) mla_convert.json, here from an offline hub cache."""
    from mla_convert.hub.card import public_report

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hf" / "hub" / "models--someone--tiny-mla"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    shutil.copy(exports["llamacpp"] / "config.json", snapshot / "config.json")
    report = public_report(json.loads((exports["llamacpp"] / "mla_convert.json").read_text()))
    (snapshot / "mla_convert.json").write_text(json.dumps(report))
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "COLUMNS": "160",
           "PYTHONPATH": f"{REPO}:{REPO / 'kernels'}"}

    def run(*args):
        return subprocess.run([sys.executable, "-m", "mla_convert", "inspect", "someone/tiny-mla", *args],
                              capture_output=True, text=True, env=env, timeout=300)

    done = run("--dtype", "fp32")
    assert done.returncode == 0, done.stderr
    assert "source (mla_convert.json): src, LlamaForCausalLM (GQA), 3 layers" in done.stdout
    assert "made for: --target llama.cpp (mla_convert.json)" in done.stdout
    assert table(done.stdout)["bytes / token (all layers)"] == (binary(LAYERS * SOURCE_VALUES * 4), binary(3 * 32 * 4))
    refused = run("--kv-lora-rank", "8")  # known to be an export only once its config is read
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.startswith("error: --kv-lora-rank: acts only on a source model")
    # the source model's flag checks used to run first: "--calib-samples: only change the cost estimate; add --estimate"
    for args, flags in [(["--calib-samples", "8", "-r", "8"], "--kv-lora-rank, --calib-samples"),
                        (["--device", "cpu"], "--device"), (["--device", "tpu", "--cpu-cores", "0"], "--device, --cpu-cores")]:
        refused = run(*args)
        assert refused.returncode == 2 and refused.stdout == ""
        assert refused.stderr.splitlines() == [
            f"error: {flags}: {'acts' if ',' not in flags else 'act'} only on a source model ({FAMILIES}); "
            "someone/tiny-mla is an MLA export, whose config.json fixes its shape (on an export inspect takes "
            "--context, --batch, --dtype and --revision)"], refused.stderr


# --------------------------------------------------------------------------- engines: recorded runs only
def test_the_engine_runs_shown_are_the_records_of_that_target_and_shape(exports):
    runs = json.loads((REPO / "mla_convert" / "convert" / "engine_runs.json").read_text())["runs"]
    expected = [r for r in runs if r.get("target") == "llama.cpp" and (r["kv_lora_rank"], r["rope_dim"]) == (24, 8)
                and r.get("q_lora_rank") is not None and r.get("rope_type", "default") == "default"]
    assert expected  # the shipped record holds llama.cpp runs of 24+8 --target llama.cpp exports (stories260K)
    result = invoke(exports["llamacpp"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "engine runs on record of --target llama.cpp exports at 24+8 (mla_convert/convert/engine_runs.json; " \
           "runs of the models named, not of this folder)" in out
    shown = [line for line in out.splitlines() if line.startswith(("| llama.cpp | ", "| vllm | "))]
    assert len(shown) == len(expected)
    for run in expected:  # each with its engine version and date
        assert any(run["model"] in line and f"[{run['engine']} {run['version']}, {run['date']}]" in line for line in shown)
    assert "note: q_lora_rank 64: no change to the KV cache" in out


def test_no_engine_is_said_to_run_an_export_nobody_ran(exports):
    result = invoke(exports["plain"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "engine runs: none on record of a --target transformers export at 12+4 (without q_lora_rank, RoPE default) " \
           "in mla_convert/convert/engine_runs.json: no engine is measured to run it" in out
    assert "| engine |" not in out and ": ok" not in out


@pytest.mark.parametrize("trait", ["attention_bias", "tie_word_embeddings"])
def test_no_ok_run_is_shown_for_an_engine_the_exports_own_config_rules_out(tmp_path, trait):
    """A Qwen2 source with q/k/v biases (or tied embeddings), converted at 24+8 with a query latent for the default
    target: its report says llama.cpp cannot run it (no bias slot / latent weights), and inspect used to list the
    recorded "ok" llama.cpp runs of 24+8 exports anyway (stories260K, which has neither)."""
    from mla_convert.convert.engines import recorded_runs
    from mla_convert.source.config import ExportConfig
    from mla_convert.source.shapes import MLAShape

    family = "qwen2" if trait == "attention_bias" else "llama"  # Qwen2 always has q/k/v biases
    source = save_tiny_model(tmp_path / "src", family=family, num_heads=8, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                             hidden_size=64, num_layers=LAYERS, tie_word_embeddings=trait == "tie_word_embeddings")
    out = convert(source, tmp_path / "mla", ConvertOptions(kv_lora_rank=24, rope_dim=8, q_lora_rank=64,
                                                          calibration=CALIBRATION, dtype="fp32", effort="fast")).output
    config, report = config_of(Path(out)), json.loads((Path(out) / "mla_convert.json").read_text())
    assert config[trait] is True
    export = ExportConfig.from_dict(config)
    assert (export.attention_bias, export.tied_embeddings) == (trait == "attention_bias", trait == "tie_word_embeddings")
    llama = report["engines"]["llama.cpp"]
    assert llama["ok"] is False
    assert any(run["engine"] == "llama.cpp" and run["status"] == "ok"
               for run in recorded_runs("transformers", MLAShape(24, 8), 64))  # what used to be shown
    result = invoke(out)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert not [line for line in lines if line.startswith("| llama.cpp |")], result.stdout
    blocked = [line for line in lines if line.startswith("engine llama.cpp: cannot run this export as is")]
    assert len(blocked) == 1
    for problem in (p for p in llama["notes"] if p.startswith(("attention biases", "tied embeddings", "latent weights"))):
        assert problem in blocked[0]  # the report's own reasons, word for word
    if trait == "attention_bias":
        assert "attention biases: the engine's DeepSeek attention has no bias slot" in blocked[0]
    else:  # vLLM never ties its lm_head
        assert report["engines"]["vllm"]["ok"] is False
        assert not [line for line in lines if line.startswith("| vllm |")]
        assert any(line.startswith("engine vllm: cannot run this export as is") and "tied embeddings" in line
                   for line in lines)


# --------------------------------------------------------------------------- flags that cannot act on an export
@pytest.mark.parametrize("args, flag", [
    (["-r", "8"], "--kv-lora-rank"), (["--rope-dim", "4"], "--rope-dim"), (["-c", "2"], "--compression"),
    (["--estimate"], "--estimate"), (["--device", "cpu"], "--device"), (["--cpu-cores", "2"], "--cpu-cores"),
    # typed with its default value it still picks nothing: the export was made for the target its report records
    (["--target", "transformers"], "--target"), (["--calib-samples", "8"], "--calib-samples"),
    (["--no-sequential"], "--no-sequential"), (["--q-lora-rank", "8"], "--q-lora-rank"),
])
def test_flags_that_cannot_act_on_an_export_are_refused_naming_the_flag(exports, args, flag):
    result = invoke(exports["plain"], *args)
    assert result.exit_code == 2 and result.stdout == "", result.output
    assert result.stderr.splitlines() == [
        f"error: {flag}: acts only on a source model ({FAMILIES}); {exports['plain']} is an MLA export, whose "
        "config.json fixes its shape (on an export inspect takes --context, --batch, --dtype and --revision)"]


def test_every_refused_flag_is_named_in_one_line_with_the_other_problems(exports):
    result = invoke(exports["plain"], "-r", "8", "--estimate", "--context", "0")
    assert result.exit_code == 2 and result.stdout == ""
    lines = result.stderr.splitlines()
    assert lines[0].startswith("error: --kv-lora-rank, --estimate: act only on a source model") and \
        lines[1:] == ["error: --context 0: must be at least 1"], lines


def test_the_api_refuses_what_it_cannot_inspect(exports, tmp_path):
    from mla_convert.commands.inspect import inspect_export

    with pytest.raises(PreflightError, match=r"^context 0: must be at least 1\nbatch -1: must be at least 1$"):
        inspect_export(exports["plain"], context=0, batch=-1)
    with pytest.raises(PreflightError, match="model_type 'llama' is not an MLA export's"):
        inspect_export(exports["source"])
    folder = copy_export(exports["plain"], tmp_path / "bad")
    config = config_of(folder)
    config.update(kv_lora_rank="big", qk_rope_head_dim=7)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(PreflightError) as refused:
        inspect_export(folder)
    assert refused.value.problems == ["config.json: kv_lora_rank must be a positive integer (found 'big')",
                                      "config.json: qk_rope_head_dim 7 is odd; RoPE rotates pairs of dimensions"]
    result = invoke(folder)
    assert result.exit_code == 2 and result.stderr.splitlines() == [f"error: {p}" for p in refused.value.problems]


def test_a_local_source_is_shown_where_it_is_not_as_the_report_records_it(exports, tmp_path, monkeypatch):
    """The report names a local source relative to the export folder (`../src`); inspect printed that as it was, which
    read from the working folder names another place.  It shows the source's real place from the working folder
    (absolute when that would climb out of it); a hub id, or a path that no longer exists, stays as recorded."""
    from mla_convert.commands.inspect import inspect_export

    plain, source = exports["plain"], exports["source"]
    assert json.loads((plain / "mla_convert.json").read_text())["source"]["name_or_path"] == "../src"
    deeper = tmp_path / "a" / "b"
    deeper.mkdir(parents=True)
    monkeypatch.chdir(deeper)
    assert inspect_export(plain).source.name == str(source.resolve())
    assert f"source (mla_convert.json): {source.resolve()}, LlamaForCausalLM" in invoke(plain).output
    monkeypatch.chdir(exports["root"])
    assert inspect_export(plain).source.name == "src"
    moved = tmp_path / "moved"
    shutil.copytree(plain, moved)  # its report still says ../src, which is not beside it
    assert inspect_export(moved).source.name == "../src"
    report = json.loads((moved / "mla_convert.json").read_text())
    report["source"]["name_or_path"] = "HuggingFaceTB/SmolLM2-135M-Instruct"
    (moved / "mla_convert.json").write_text(json.dumps(report))
    assert inspect_export(moved).source.name == "HuggingFaceTB/SmolLM2-135M-Instruct"
