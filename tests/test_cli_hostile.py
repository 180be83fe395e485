"""Every command against hostile option values and path kinds (hypothesis): a clean exit or one-line errors.

For each command the generator mixes valid values with ones a careless or hostile user types: negative,
zero, huge, NaN and empty numbers, empty strings, and paths that are missing, a file where a folder is
expected, a folder where a file is expected, a FIFO, a dangling symlink, a symlink loop, or below a
file.  Whatever is drawn, the command must exit with 0 or 2, print no traceback, and leave nothing at
its output path unless it succeeded.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import save_tiny_model, save_tiny_tokenizer
from typer.testing import CliRunner

from mla_convert import cli

FAST = ["--calib-samples", "2", "--calib-seq-len", "16", "--refine-steps", "0", "--no-kv-balance-search", "--rope-finalists", "1"]
INTS = st.sampled_from(["-1", "0", "1", "2", "3", "2147483648", "1" + "0" * 30, "nan", "abc", "", " "])
FLOATS = st.sampled_from(["-1", "0", "0.5", "1", "2", "nan", "inf", "1e308", "x", ""])
WORDS = st.sampled_from(["", " ", "cpu", "cuda", "cuda:7", "meta", "banana", "fp16", "bf16", "fp32", "auto", "5parsecs", "1KB"])
PATH_KINDS = ("missing", "file", "folder", "fifo", "dangling-link", "link-loop", "below-a-file", "valid")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny source with a tokenizer, its conversion, and a text file."""
    root = tmp_path_factory.mktemp("hostile")
    source = save_tiny_model(root / "src", vocab_size=128, num_layers=1)
    save_tiny_tokenizer(source, vocab_size=128)
    text = root / "text.txt"
    text.write_text("Once upon a time there was a tiny model that read a tiny text. " * 40)
    converted = root / "converted"
    result = CliRunner().invoke(cli.app, ["convert", str(source), str(converted), "-c", "2", *FAST, "-q"])
    assert result.exit_code == 0, result.output
    return {"source": source, "text": text, "converted": converted, "root": root}


def make_path(kind: str, base: Path, valid: Path | None) -> Path:
    """A path of the given kind under `base` (fresh for each example)."""
    base.mkdir(parents=True, exist_ok=True)
    path = base / "p"
    if kind == "file":
        path.write_text("not a model")
    elif kind == "folder":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "dangling-link":
        path.symlink_to(base / "nowhere")
    elif kind == "link-loop":
        path.symlink_to(path)
    elif kind == "below-a-file":
        (base / "f").write_text("x")
        path = base / "f" / "p"
    elif kind == "valid" and valid is not None:
        return valid
    return path


def fresh(world, name: str) -> Path:
    base = world["root"] / "examples" / name
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    return base


def check(args: list[str], output: Path | None = None, existed: bool = False) -> None:
    result = CliRunner().invoke(cli.app, [str(a) for a in args])
    text = result.output
    assert result.exit_code in (0, 2), f"exit {result.exit_code} for {args}: {text[-1500:]} {result.exception!r}"
    assert "Traceback" not in text, f"traceback for {args}: {text[-1500:]}"
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"{args}: {result.exception!r}") from result.exception
    if result.exit_code != 0:
        if output is not None and not existed:
            assert not (output.exists() or output.is_symlink()) or output.is_dir() and not (output / "mla_convert.json").exists(), \
                f"{args} failed but left {output}"


SETTINGS = dict(max_examples=10, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@settings(**SETTINGS)
@given(kind=st.sampled_from(PATH_KINDS), rank=INTS, rope=INTS, compression=FLOATS, context=INTS, dtype=WORDS)
def test_inspect(world, kind, rank, rope, compression, context, dtype):
    model = make_path(kind, fresh(world, "inspect"), world["source"])
    check(["inspect", model, "--kv-lora-rank", rank, "--rope-dim", rope, "--context", context, "--dtype", dtype]
          + (["--compression", compression] if compression not in ("", "x") else []))


@settings(**SETTINGS)
@given(source_kind=st.sampled_from(PATH_KINDS), output_kind=st.sampled_from(PATH_KINDS), compression=FLOATS,
       samples=INTS, device=WORDS, dtype=WORDS, shard=WORDS, calib=st.sampled_from(PATH_KINDS + ("none",)))
def test_convert(world, source_kind, output_kind, compression, samples, device, dtype, shard, calib):
    base = fresh(world, "convert")
    source = make_path(source_kind, base / "source", world["source"])
    output = make_path(output_kind, base / "output", base / "output" / "new")
    existed = output.exists() or output.is_symlink()
    args = ["convert", source, output, "-c", compression, "--calib-samples", samples, "--device", device, "--dtype", dtype,
            "--max-shard-size", shard, "--calib-seq-len", "16", "--refine-steps", "0", "--no-kv-balance-search",
            "--rope-finalists", "1", "-q"]
    if calib != "none":
        args += ["--calib-data", make_path(calib, base / "calib", world["text"])]
    check(args, output, existed)


@settings(**SETTINGS)
@given(model_kind=st.sampled_from(PATH_KINDS), data_kind=st.sampled_from(PATH_KINDS), json_kind=st.sampled_from(PATH_KINDS),
       context=INTS, batch=INTS, windows=INTS, device=WORDS, dtype=WORDS)
def test_eval(world, model_kind, data_kind, json_kind, context, batch, windows, device, dtype):
    base = fresh(world, "eval")
    model = make_path(model_kind, base / "model", world["converted"])
    data = make_path(data_kind, base / "data", world["text"])
    json_out = make_path(json_kind, base / "json", base / "json" / "out.json")
    existed = json_out.exists() or json_out.is_symlink()
    check(["eval", model, "--data", data, "--context", context, "--batch-size", batch, "--max-windows", windows,
           "--device", device, "--dtype", dtype, "--json", json_out], json_out, existed)


@settings(**SETTINGS)
@given(model_kind=st.sampled_from(PATH_KINDS), tokens=INTS, page=INTS, temperature=FLOATS, top_p=FLOATS, device=WORDS,
       dtype=WORDS, sample=st.booleans())
def test_generate(world, model_kind, tokens, page, temperature, top_p, device, dtype, sample):
    model = make_path(model_kind, fresh(world, "generate"), world["converted"])
    check(["generate", model, "Once upon", "--max-new-tokens", tokens, "--page-size", page, "--temperature", temperature,
           "--top-p", top_p, "--device", device, "--dtype", dtype] + (["--sample"] if sample else []))


@settings(**SETTINGS)
@given(folder_kind=st.sampled_from(PATH_KINDS), repo=st.sampled_from(["alice/model", "", "a/b/c", "-x", "alice/" + "m" * 200]))
def test_push_dry_run(world, folder_kind, repo):
    folder = make_path(folder_kind, fresh(world, "push"), world["converted"])
    check(["push", folder, repo, "--dry-run"])


@settings(**SETTINGS)
@given(source_kind=st.sampled_from(PATH_KINDS), out_kind=st.sampled_from(PATH_KINDS),
       ratios=st.sampled_from(["2", "0", "-1", "nan", "", "2,abc", "1000"]), context=INTS, windows=INTS)
def test_sweep(world, source_kind, out_kind, ratios, context, windows):
    base = fresh(world, "sweep")
    source = make_path(source_kind, base / "source", world["source"])
    out_dir = make_path(out_kind, base / "out", base / "out" / "new")
    existed = out_dir.exists() or out_dir.is_symlink()
    check(["sweep", source, "--data", world["text"], "--out-dir", out_dir, "--ratios", ratios, "--methods", "svd",
           "--context", context, "--max-windows", windows, "--calib-samples", "2", "--calib-seq-len", "16",
           "--refine-steps", "0", "-q"])
    if not existed and out_dir.exists():
        assert (out_dir / "sweep.json").exists(), "a failed sweep left its output folder behind"


@settings(**SETTINGS)
@given(model_kind=st.sampled_from(PATH_KINDS), output_kind=st.sampled_from(PATH_KINDS), steps=INTS, lr=FLOATS,
       seq=INTS)
def test_finetune(world, model_kind, output_kind, steps, lr, seq):
    base = fresh(world, "finetune")
    model = make_path(model_kind, base / "model", world["converted"])
    output = make_path(output_kind, base / "output", base / "output" / "new")
    existed = output.exists() or output.is_symlink()
    check(["finetune", model, output, "--max-steps", steps, "--lr", lr, "--seq-len", seq, "--teacher-samples", "4",
           "--sample-batch-size", "4", "--micro-batch-size", "2", "--no-verify-save", "--teacher", world["source"],
           "--num-threads", "1", "--warmup-steps", "0"], output, existed)


@settings(**{**SETTINGS, "max_examples": 6})
@given(compression=st.sampled_from(["0", "-1", "nan", "1000", "", "x"]), output_kind=st.sampled_from(PATH_KINDS))
def test_demo_refuses_bad_settings_before_work(world, compression, output_kind):
    output = make_path(output_kind, fresh(world, "demo"), world["root"] / "examples" / "demo" / "new")
    check(["demo", "--compression", compression, "--output", output, "-q"], output, output.exists() or output.is_symlink())
