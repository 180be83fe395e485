"""The user's journey with the real CLI: convert -> eval --update-card -> push, and what eval refuses.

Each step is run as a user runs it (the typer app in-process, the real hub client against the local
fake Hub), on stories260K (real weights: the numbers in the card must be the measured ones).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
from fake_hub import FakeHub
from typer.testing import CliRunner

from mla_convert import cli
from mla_convert.convert import target as T
from mla_convert.hub.push import push_to_hub

TOKEN = "hf_testTOKENmlaConvertJourney0123456789XYZ"
FAST = ["--calib-samples", "4", "--calib-seq-len", "64", "--refine-steps", "0", "--no-kv-balance-search", "--rope-finalists", "1",
        "--dtype", "fp32"]


def run(*args: str, check: bool = True):
    result = CliRunner().invoke(cli.app, [str(a) for a in args])
    if check:
        assert result.exit_code == 0, result.output + repr(result.exception)
    return result


@pytest.fixture(scope="module")
def converted(stories260k, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("journey") / "stories-mla"
    run("convert", stories260k, out, "-c", "2", *FAST, "--license", "mit", "-q")
    return out


def copy_of(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / folder.name))


@pytest.mark.real_model
def test_eval_update_card_writes_the_measured_numbers(converted, stories260k, tinystories_text, tmp_path):
    folder = copy_of(converted, tmp_path)
    before = (folder / "README.md").read_text()
    assert "## Quality" not in before
    result = run("eval", folder, "--baseline", stories260k, "--data", tinystories_text, "--max-windows", "6",
                 "--json", tmp_path / "eval.json", "--update-card")
    measured = json.loads((tmp_path / "eval.json").read_text())
    report = json.loads((folder / "mla_convert.json").read_text())
    evaluation = report["evaluation"]
    results = measured["results"]
    model_label = next(label for label in results if label != measured["baseline"])
    assert evaluation["converted_perplexity"] == pytest.approx(results[model_label]["perplexity"], rel=1e-12)
    assert evaluation["source_perplexity"] == pytest.approx(results[measured["baseline"]]["perplexity"], rel=1e-12)
    assert evaluation["ratio"] == pytest.approx(measured["ratio"], rel=1e-12)
    assert evaluation["windows"] == 6 and evaluation["context_length"] == 512  # min(1024, max_position_embeddings 512)
    assert evaluation["protocol"].startswith("non-overlapping windows")  # the stride is the context here
    assert not os.path.isabs(evaluation["data"])
    card = (folder / "README.md").read_text()
    assert "## Quality" in card and f"{evaluation['converted_perplexity']:,.4f}" in card
    assert f"{evaluation['source_perplexity']:,.4f}" in card
    # what each model computed in, which the card's sentence omitted
    assert (evaluation["dtype"], evaluation["source_dtype"]) == (measured["settings"]["dtype"],
                                                                 measured["settings"]["baseline_dtype"]) != (None, None)
    assert f"scored tokens, computed in {evaluation['dtype']}):" in card
    assert "wrote the evaluation" in result.output


@pytest.mark.real_model
def test_a_fine_tuned_card_shows_the_converted_models_numbers_as_before_fine_tuning(converted, stories260k,
                                                                                    tinystories_text, tmp_path):
    """`eval --update-card` measured the converted folder; its fine-tuned copy is another model.  Its card keeps
    those numbers as "before fine-tuning" (never as this model's) until the fine-tuned folder is evaluated itself,
    and no card names where the text lay on this machine (reports keep it relative to the folder: ../../...)."""
    folder = copy_of(converted, tmp_path)
    run("eval", folder, "--baseline", stories260k, "--data", tinystories_text, "--max-windows", "4", "--update-card")
    converted_ppl = json.loads((folder / "mla_convert.json").read_text())["evaluation"]["converted_perplexity"]
    tuned = tmp_path / "tuned"
    run("finetune", folder, tuned, "--max-steps", "2", "--lr", "1e-3", "--seq-len", "64", "--teacher-samples", "4",
        "--sample-batch-size", "4", "--micro-batch-size", "2", "--no-verify-save", "--teacher", stories260k,
        "--num-threads", "1", "--warmup-steps", "0")
    report = json.loads((tuned / "mla_convert.json").read_text())
    assert report["evaluation"] is None
    assert report["evaluation_before_finetuning"]["converted_perplexity"] == converted_ppl
    card = (tuned / "README.md").read_text()
    assert f"| MLA before fine-tuning | {converted_ppl:,.4f} |" in card
    quality = card.split("\n## Quality\n")[1].split("\n## ")[0]
    assert "MLA (this model)" not in quality and "the perplexity change above" not in card

    run("eval", tuned, "--baseline", stories260k, "--data", tinystories_text, "--max-windows", "4", "--update-card")
    tuned_ppl = json.loads((tuned / "mla_convert.json").read_text())["evaluation"]["converted_perplexity"]
    assert tuned_ppl != converted_ppl  # two steps of Adam changed the model
    card = (tuned / "README.md").read_text()
    assert f"| MLA (this model) | {tuned_ppl:,.4f} |" in card
    assert f"| MLA before fine-tuning | {converted_ppl:,.4f} |" in card
    assert f"`{tinystories_text.name}`" in card and "../" not in card
    assert "\n\n## Quality\n" in card and "\n\n## How it was made\n" in card  # a blank line before each section


@pytest.mark.real_model
def test_eval_kv_context_reports_the_cache_the_conversion_promised(converted, stories260k, tinystories_text, tmp_path):
    """`eval --kv-context` reads the bytes the transformers cache really holds, for the model and the baseline,
    prints them and adds them to --json; they are the bytes per token the conversion report announced."""
    out = tmp_path / "eval.json"
    result = run("eval", converted, "--baseline", stories260k, "--data", tinystories_text, "--max-windows", "1",
                 "--context", "64", "--kv-context", "48", "--json", out)
    cache = json.loads((converted / "mla_convert.json").read_text())["cache"]
    measured = json.loads(out.read_text())["kv_cache"]
    assert measured[str(converted)]["bytes_per_token"] == cache["mla_bytes_per_token"]
    # keyed as the results are (the baseline's key said "(baseline)" there and not here)
    assert set(measured) == set(json.loads(out.read_text())["results"]) == {str(converted), f"{stories260k} (baseline)"}
    assert measured[f"{stories260k} (baseline)"]["bytes_per_token"] == cache["source_bytes_per_token"]
    assert measured[str(converted)]["tokens"] == 48 and len(measured[str(converted)]["per_layer_bytes"]) == 5
    per_layer = cache["mla_bytes_per_token"] // 5
    assert (f"{converted}: KV cache" in result.output
            and f"({cache['mla_bytes_per_token']} B/token, {per_layer} B/token/layer over 5 layers" in result.output)
    written = json.loads(out.read_text())
    assert "perplexity" in written["results"][str(converted)]  # the evaluation is still there
    assert (written["settings"]["dtype"], written["settings"]["baseline_dtype"]) == ("float32", "float32")


@pytest.mark.real_model
@pytest.mark.parametrize("args, message", [
    (["--context", "1024"], "--context 1024: longer than"),
    (["--dtype", "fp16"], f"--dtype fp16: {T.FP16_REFUSED}"),
    (["--update-card"], "--update-card needs --baseline"),
    (["--batch-size", "0"], "--batch-size 0: must be at least 1"),
    (["--kv-context", "600"], "--kv-context 600: longer than"),  # 100M tokens used to run until the OOM killer
    (["--data", " "], "--data: must not be empty"),  # '' used to evaluate whatever the working folder held
    (["--revision", "v1"], "--revision v1: "),  # a local folder has no revisions: it was ignored
])
def test_eval_refuses_before_loading_anything(converted, tinystories_text, tmp_path, args, message):
    result = run("eval", converted, "--data", tinystories_text, "--json", tmp_path / "out.json", *args, check=False)
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()), result.output
    assert not (tmp_path / "out.json").exists()


@pytest.mark.real_model
@pytest.mark.parametrize("baseline_vocab, own_tokenizer, message", [
    (256, False, "embeds 256 token ids, but the tokenizer of"),  # was an IndexError traceback after both models loaded
    (512, True, "its tokenizer differs from that of"),  # was scored on ids that meant other characters to it
])
def test_eval_refuses_a_baseline_that_cannot_share_the_models_tokens(converted, tinystories_text, tmp_path, baseline_vocab,
                                                                   own_tokenizer, message):
    from tiny_models import save_tiny_model, save_tiny_tokenizer

    baseline = save_tiny_model(tmp_path / "baseline", vocab_size=baseline_vocab)
    if own_tokenizer:
        save_tiny_tokenizer(baseline, vocab_size=baseline_vocab)
    result = run("eval", converted, "--baseline", baseline, "--data", tinystories_text, check=False)
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert message in " ".join(result.output.split()), result.output
    assert f"--baseline {baseline}" in " ".join(result.output.split())


@pytest.mark.real_model
@pytest.mark.parametrize("args, message", [
    (["--temperature", "5", "--seed", "3"], "--temperature, --seed: only change sampling; greedy decoding ignores them"),
    (["--sample", "--temperature", "inf"], "--temperature: 'inf' is not a finite number"),
    (["--sample", "--seed", str(2**70)], f"--seed {2**70}: must be between 0 and"),  # was a torch overflow traceback
    (["--max-new-tokens", "1", "--prompt-words", "600"], "tokens) is longer than the model's max_position_embeddings (512)"),
    # accepted, then 610 MiB and a minute for a dozen tokens
    (["--page-size", "1000000"], "--page-size 1000000: more than the longest sequence this run can hold (512 tokens)"),
])
def test_generate_refuses_settings_that_would_be_ignored_or_crash(converted, args, message):
    prompt = "Once upon a time"
    if "--prompt-words" in args:
        index = args.index("--prompt-words")
        prompt, args = " ".join(["cat"] * int(args[index + 1])), args[:index] + args[index + 2:]
    result = run("generate", converted, prompt, *args, check=False)
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert message in " ".join(result.output.split()), result.output


@pytest.mark.real_model
def test_update_card_refuses_a_baseline_that_is_not_the_source(converted, tinystories_text, tmp_path):
    """The card calls the baseline "original": a converted model (here the folder itself) is not one."""
    folder = copy_of(converted, tmp_path)
    before = (folder / "mla_convert.json").read_text()
    result = run("eval", folder, "--data", tinystories_text, "--baseline", folder, "--update-card", check=False)
    assert result.exit_code == 2
    assert "is not this conversion's source (architecture DeepseekV3ForCausalLM (the source's: LlamaForCausalLM))" in \
        " ".join(result.output.split())
    assert (folder / "mla_convert.json").read_text() == before


@pytest.mark.real_model
@pytest.mark.skipif(os.geteuid() != 0, reason="/proc passes the writability check only for root")
def test_eval_json_that_cannot_be_written_keeps_the_printed_results(converted, tinystories_text):
    result = run("eval", converted, "--data", tinystories_text, "--max-windows", "1", "--context", "64",
                 "--json", "/proc/results.json", check=False)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert f"| {converted} | " in result.output  # the table came first
    assert "--json /proc/results.json: could not write the results" in " ".join(result.output.split())


@pytest.mark.real_model
def test_eval_result_path_of_the_wrong_kind_is_refused_before_the_evaluation(converted, tinystories_text, tmp_path):
    (tmp_path / "a-folder").mkdir()
    for path, message in ((tmp_path / "a-folder", "exists and is not a regular file"),
                          (tmp_path / "missing" / "out.json", "does not exist")):
        result = run("eval", converted, "--data", tinystories_text, "--json", path, check=False)
        assert result.exit_code == 2 and message in result.output, result.output
        assert "perplexity" not in result.output  # nothing was evaluated


@pytest.mark.real_model
def test_push_after_convert_uploads_a_card_for_the_repo_without_local_paths(converted, tmp_path):
    """The card `convert` wrote is recognised as its own: push regenerates it for the repo id."""
    folder = copy_of(converted, tmp_path)
    repo = "alice/stories260k-mla"
    with FakeHub(token=TOKEN) as hub:
        push_to_hub(folder, repo, token=TOKEN, endpoint=hub.url)
        uploaded = hub.files(repo)
    card = uploaded["README.md"].decode()
    report = uploaded["mla_convert.json"].decode()
    assert repo in card and "path/to/this/model" not in card
    for text in (card, report):
        assert str(Path.home()) not in text and str(tmp_path) not in text and str(converted.parent) not in text
        assert not re.search(r"(?<![\w.])/(work|tmp|home|root)/", text), "an absolute path"
    assert "license: mit" in card


@pytest.mark.real_model
def test_card_metadata_names_base_model_license_and_relation(stories260k, tmp_path):
    out = tmp_path / "meta"
    run("convert", stories260k, out, "-c", "2", *FAST, "--base-model", "karpathy/tinyllamas", "-q")
    from huggingface_hub import ModelCard

    data = ModelCard.load(out / "README.md").data
    assert data.base_model == "karpathy/tinyllamas" and data.base_model_relation == "quantized"
    report = json.loads((out / "mla_convert.json").read_text())
    assert report["options"]["method"] == "activation-aware"
    assert "`activation-aware` method" in (out / "README.md").read_text()


# an absolute marker path: transformers copies remote code into its modules cache before importing it
BAIT = """from pathlib import Path
Path({marker!r}).write_text("custom code from the model folder ran")
"""


def plant_bait(folder: Path, marker: Path) -> Path:
    """Point the config's and the tokenizer config's `auto_map` at a module beside them that writes `marker` when
    imported (transformers would import it under trust_remote_code); returns `folder`."""
    (folder / "bait.py").write_text(BAIT.format(marker=str(marker)))
    for name, entry in (("config.json", {"AutoConfig": "bait.Config", "AutoModelForCausalLM": "bait.Model"}),
                        ("tokenizer_config.json", {"AutoTokenizer": ["bait.Tokenizer", None]})):
        config = json.loads((folder / name).read_text())
        config["auto_map"] = entry
        (folder / name).write_text(json.dumps(config))
    return folder


@pytest.mark.real_model
def test_eval_and_generate_never_run_code_from_the_model_folder(converted, stories260k, tinystories_text, tmp_path):
    """A folder whose config and tokenizer config point `auto_map` at a module that leaves a file when imported:
    eval (model and baseline) and generate load the stock classes, and the module is never imported."""
    marker = tmp_path / "IMPORTED"
    folder = plant_bait(copy_of(converted, tmp_path), marker)
    run("eval", folder, "--baseline", folder, "--data", tinystories_text, "--max-windows", "2", "--context", "64")
    run("generate", folder, "Once upon a time", "--max-new-tokens", "4", "--device", "cpu")
    assert not marker.exists()


# ------------------------------------------------------------------------ a model folder transformers cannot place
@pytest.fixture(scope="module")
def tiny_source_and_export(tmp_path_factory) -> tuple[Path, Path, Path]:
    """A tiny Llama with a tokenizer, its conversion, and a text (no real weights needed: the refusals come first)."""
    from tiny_models import save_tiny_model, save_tiny_tokenizer

    root = tmp_path_factory.mktemp("config-problems")
    source = save_tiny_tokenizer(save_tiny_model(root / "src", num_layers=1, vocab_size=512), vocab_size=512)
    export = root / "mla"
    run("convert", source, export, "-c", "2", "--calib-samples", "2", "--calib-seq-len", "16", "--effort", "fast", "-q")
    text = root / "text.txt"
    text.write_text("the cat sat on the mat and looked at the dog. " * 40)
    return source, export, text


def _damaged_config(folder: Path, tmp_path: Path, damage: str) -> tuple[Path, str]:
    """A copy of `folder` whose config.json is gone or lacks model_type, and the one line that must name it."""
    copy = copy_of(folder, tmp_path)
    path = copy / "config.json"
    if damage == "no config.json":
        path.unlink()
        return copy, f"error: {path}: missing (a Hugging Face model folder needs its config.json)"
    config = json.loads(path.read_text())
    del config["model_type"]
    path.write_text(json.dumps(config))
    model_type, name = ("deepseek_v3", "DeepseekV3ForCausalLM") if "mla" in folder.name else ("llama", "LlamaForCausalLM")
    return copy, (f'error: {path}: no "model_type", which transformers needs to pick the model class; its architectures '
                  f'name {name}: add "model_type": "{model_type}"')


@pytest.mark.parametrize("damage", ["no config.json", "no model_type"])
def test_eval_refuses_a_folder_without_config_or_model_type_in_its_own_words(tiny_source_and_export, tmp_path, damage):
    """eval quoted transformers: "transformers cannot read its config (Unrecognized model in X. Should have a
    `model_type` key in its config.json ...)", also for a folder that has no config.json at all."""
    source, export, text = tiny_source_and_export
    bad_source, source_line = _damaged_config(source, tmp_path / "source", damage)
    bad_export, export_line = _damaged_config(export, tmp_path / "export", damage)
    for args, line in (([bad_source], source_line), ([bad_export], export_line),
                       ([export, "--baseline", bad_source], source_line)):
        result = run("eval", *args, "--data", text, "--context", "32", check=False)
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert result.exit_code == 2 and lines == [line], result.output
        assert "model_type` key" not in result.output and "Unrecognized model" not in result.output


@pytest.mark.parametrize("damage", ["no config.json", "no model_type"])
def test_generate_refuses_a_folder_without_config_or_model_type_in_its_own_words(tiny_source_and_export, tmp_path, damage):
    _, export, _ = tiny_source_and_export
    folder, line = _damaged_config(export, tmp_path, damage)
    result = run("generate", folder, "Once upon a time", "--device", "cpu", check=False)
    assert result.exit_code == 2 and [text for text in result.output.splitlines() if text.strip()] == [line], result.output


@pytest.mark.parametrize("damage", ["no config.json", "no model_type"])
def test_finetune_and_sweep_name_a_source_without_config_or_model_type(tiny_source_and_export, tmp_path, damage):
    """finetune's teacher said "cannot load as a causal LM (Unrecognized model in X. Should have a `model_type` key
    ...)"; sweep (whose conversions read `architectures`) the same, when it came to score the source."""
    source, export, text = tiny_source_and_export
    folder, line = _damaged_config(source, tmp_path, damage)
    result = run("finetune", export, tmp_path / "out", "--teacher", folder, "--data", text, "--max-steps", "2",
                 "--warmup-steps", "0", "--seq-len", "16", "--num-threads", "1", check=False)
    assert result.exit_code == 2 and line in result.output.splitlines(), result.output
    assert "model_type` key" not in result.output and not (tmp_path / "out").exists()
    result = run("sweep", folder, "--data", text, "--out-dir", tmp_path / "sweep", "--ratios", "2", "--methods", "svd",
                 "--context", "32", "--calib-samples", "2", "--calib-seq-len", "16", check=False)
    assert result.exit_code == 2 and line in result.output.splitlines(), result.output
    assert "model_type` key" not in result.output
