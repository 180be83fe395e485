"""The developer scripts' argument handling: paths resolved from the caller's folder, bad values refused with
one `error:` line (exit 2) before anything is measured or written.  Nothing here converts or times a model."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def refused(capsys, call) -> str:
    """`call()` exits 2 with a one-line `error:` message; returns that line."""
    with pytest.raises(SystemExit) as exit_info:
        call()
    assert exit_info.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(lines) == 1, lines
    return lines[0]


# --------------------------------------------------------------------------- bench_targets.py
def test_bench_targets_resolves_paths_from_the_callers_folder(tmp_path, monkeypatch):
    """The conversions run with cwd=REPO: a relative --work must name the caller's folder, not the repo's."""
    bench = load("bench_targets")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.eval.json").write_text("{}")
    args = bench.parse_args(["--work", "w", "--write-benchmarks", "B.md"])
    assert args.work == tmp_path / "w" and args.write_benchmarks == tmp_path / "B.md"
    assert bench.parse_args(["--from-json", "a.eval.json"]).from_json == [tmp_path / "a.eval.json"]


@pytest.mark.parametrize("argv, says", [
    ([], "--work"),                                  # was a TypeError from Path / None
    (["--work", "w", "--models", "bogus"], "bogus"),  # was a KeyError after parsing
    (["--from-json"], "no files"),                   # zero files fell through to running the conversions
    (["--from-json", "missing.json"], "no such file"),  # was a FileNotFoundError
])
def test_bench_targets_refuses_bad_arguments(tmp_path, monkeypatch, capsys, argv, says):
    bench = load("bench_targets")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench, "run", lambda *a: pytest.fail("ran the conversions"))
    assert says in refused(capsys, lambda: bench.main(argv))


# --------------------------------------------------------------------------- the shell scripts
SHELL_SCRIPTS = ["device_check.sh", "device_kernel_check.sh", "prepare_device_assets.sh", "check_engines.sh"]


def fake_repo(tmp_path: Path, *scripts: str) -> Path:
    """A copy of the scripts in an otherwise empty git repository: what they do to 'the repo' happens there."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for name in (*scripts, "script_args.sh"):  # (what every shell script sources)
        shutil.copy(SCRIPTS / name, repo / "scripts" / name)
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    return repo


@pytest.mark.parametrize("script", SHELL_SCRIPTS)
def test_shell_scripts_parse_and_answer_help(script, tmp_path):
    path = SCRIPTS / script
    subprocess.run(["bash", "-n", str(path)], check=True)
    shown = subprocess.run(["bash", str(path), "--help"], capture_output=True, text=True, cwd=tmp_path, timeout=30)
    assert shown.returncode == 0 and "usage" not in shown.stderr
    assert script in shown.stdout and not shown.stdout.startswith("!")  # the header comment, without its '#'
    bad = subprocess.run(["bash", str(path), "--bogus"], capture_output=True, text=True, cwd=tmp_path, timeout=30)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "error: unknown" in bad.stderr
    assert list(tmp_path.iterdir()) == []  # nothing made in the caller's folder


def test_prepare_device_assets_checks_its_argument_before_removing_anything(tmp_path):
    repo = fake_repo(tmp_path, "prepare_device_assets.sh")
    (repo / ".device_assets").mkdir()
    (repo / ".device_assets" / "keep").write_text("prepared earlier")
    done = subprocess.run(["bash", str(repo / "scripts" / "prepare_device_assets.sh"), str(tmp_path / "nowhere")],
                          capture_output=True, text=True, cwd=tmp_path, timeout=30)
    assert done.returncode == 2 and "error:" in done.stderr and done.stderr.count("\n") == 1
    assert (repo / ".device_assets" / "keep").exists()  # was rm -rf'd before the first cp failed
    assert "device_assets" not in (repo / ".git" / "info" / "exclude").read_text()


def test_prepare_device_assets_reads_a_relative_shared_folder_from_the_callers_folder(tmp_path):
    repo = fake_repo(tmp_path, "prepare_device_assets.sh")
    caller = tmp_path / "caller"
    (caller / "mine" / "assets" / "stories260k").mkdir(parents=True)
    (caller / "mine" / "assets" / "stories260k" / "config.json").write_text("{}")
    (caller / "mine" / "data").mkdir()
    (caller / "mine" / "data" / "tinystories-valid-excerpt.txt").write_text("one\ntwo\nthree\nfour\n")
    done = subprocess.run(["bash", str(repo / "scripts" / "prepare_device_assets.sh"), "mine"],
                          capture_output=True, text=True, cwd=caller, timeout=60)
    assert done.returncode == 0, done.stderr
    assert (repo / ".device_assets" / "stories260k" / "config.json").exists()
    assert (repo / ".device_assets" / "texts" / "held-out.txt").read_text()


def test_device_check_writes_a_relative_out_in_the_callers_folder(tmp_path):
    """SKIP_KERNEL=1 in a repo without device_convert_check.py: the conversion fails at once, the packing still runs."""
    repo = fake_repo(tmp_path, "device_check.sh")
    caller = tmp_path / "caller"
    caller.mkdir()
    env = {**os.environ, "OUT": "results", "SKIP_KERNEL": "1", "CONVERT_LIMIT": "20"}
    subprocess.run(["bash", str(repo / "scripts" / "device_check.sh")], capture_output=True, text=True, cwd=caller,
                   env=env, timeout=60)
    assert (caller / "results" / "summary.txt").exists() and not (repo / "results").exists()


STUB_PYTHON = """#!/usr/bin/env bash
# the interpreter check_engines.sh is given: logs each call; `-m mla_convert convert SRC OUT ...` writes OUT/config.json
# (refused, exit 2, for a --target all command), a make_tiny_qwen2.py call its OUT/config.json
echo "$*" >> "$STUB_LOG"
if [[ "$1" == "-m" && "$3" == "convert" ]]; then
  [[ "$*" != *"--target all"* ]] || exit 2
  mkdir -p "$5" && echo '{}' > "$5/config.json"
elif [[ "$1" == */make_tiny_qwen2.py ]]; then
  mkdir -p "$2" && echo '{}' > "$2/config.json"
fi
"""


def test_check_engines_makes_an_export_again_when_the_converter_changed(tmp_path):
    """check_engines.sh reused any export already in its cache: one made by an older converter (a llama3-RoPE vLLM
    export the converter no longer writes) would have been run and filed again as today's result.  Now an export is
    reused only while the converter's sources and the command are those that made it; a refused export leaves no older
    one behind to be run."""
    repo = fake_repo(tmp_path, "check_engines.sh")
    (repo / "mla_convert").mkdir()
    (repo / "mla_convert" / "pipeline.py").write_text("# converter, version 1\n")
    stub = tmp_path / "python-stub"
    stub.write_text(STUB_PYTHON)
    stub.chmod(0o755)
    smol = tmp_path / "smollm2"
    smol.mkdir()
    (smol / "config.json").write_text("{}")
    engines_home = tmp_path / "engines"
    log = tmp_path / "calls.log"
    env = {**os.environ, "PYTHON": str(stub), "STUB_LOG": str(log), "ENGINES": "none", "SMOLLM2_DIR": str(smol),
           "MLA_CONVERT_ENGINES_HOME": str(engines_home), "MLA_CONVERT_SHARED": str(tmp_path / "shared")}
    stale = engines_home / "exports" / "smollm2-all"  # --target all: refused by this "converter"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text('{"made": "by an older converter"}')

    def run() -> list[str]:
        log.write_text("")
        done = subprocess.run(["bash", str(repo / "scripts" / "check_engines.sh")], capture_output=True, text=True,
                              cwd=tmp_path, env=env, timeout=60)
        assert done.returncode == 0, done.stderr
        return [line.split()[4] for line in log.read_text().splitlines() if line.startswith("-m mla_convert convert")]

    made = run()
    assert [Path(out).name for out in made] == ["stories-2x-transformers", "stories-2x-llamacpp", "smollm2-2x-llamacpp",
                                                "smollm2-vllm", "smollm2-all", "qwen2-tiny-all"]
    assert not stale.exists()  # refused now: the older converter's export is not left to be run
    # the refused ones (both --target all) are tried again, the others reused
    assert run() == [str(engines_home / "exports" / name) for name in ("smollm2-all", "qwen2-tiny-all")]
    (repo / "mla_convert" / "pipeline.py").write_text("# converter, version 2\n")
    assert len(run()) == 6  # another converter: every export made again


# --------------------------------------------------------------------------- bench_convert.py
def fake_conversions(bench, monkeypatch, tmp_path):
    """bench_model without converting or scoring anything: each conversion writes a report and takes 1 s."""
    def run_conversion(source, out, extra, threads):
        out.mkdir(parents=True)
        (out / "mla_convert.json").write_text(json.dumps({"options": {"kv_lora_rank": 8, "rope_dim": 4}}))
        return {"seconds": 1.0, "peak_rss_bytes": 2**20, "command": "mla-convert convert SRC OUT " + " ".join(extra)}

    monkeypatch.setattr(bench, "source_path", lambda model: tmp_path)
    monkeypatch.setattr(bench, "score", lambda *a: 5.0)
    monkeypatch.setattr(bench, "run_conversion", run_conversion)


def test_bench_convert_records_the_effort_the_conversions_ran_with(tmp_path, monkeypatch):
    bench = load("bench_convert")
    fake_conversions(bench, monkeypatch, tmp_path)
    assert bench.bench_model("stories260k", [2.0], ["svd"], None, ["--effort", "fast"])["effort"] == "fast"
    assert bench.bench_model("stories260k", [2.0], ["svd"], None, ["--effort=thorough"])["effort"] == "thorough"
    assert bench.bench_model("stories260k", [2.0], ["svd"], None, [])["effort"] == "default"


def test_bench_convert_merges_a_measuring_run_into_the_section(tmp_path, monkeypatch):
    """A one-model run used to replace the whole section (the other model's table and rows were dropped)."""
    bench = load("bench_convert")
    fake_conversions(bench, monkeypatch, tmp_path)
    earlier = tmp_path / "earlier.json"
    benchmarks = tmp_path / "BENCHMARKS.md"
    monkeypatch.chdir(tmp_path)
    bench.main(["--model", "smollm2", "--ratios", "2", "--methods", "svd", "--json", "earlier.json"])
    bench.main(["--from-json", "earlier.json", "--write-benchmarks", "BENCHMARKS.md"])
    bench.main(["--model", "stories260k", "--ratios", "4", "--methods", "svd", "--json", "new.json",
                "--write-benchmarks", "BENCHMARKS.md"])
    text = benchmarks.read_text()
    assert "### smollm2" in text and "### stories260k" in text  # the earlier table kept, the new one added
    command = next(line for line in text.splitlines() if line.startswith("Command: "))
    assert f"--from-json {earlier} {tmp_path / 'new.json'}" in command  # re-runnable from the repo root
    assert text.count("<!-- bench_convert:begin -->") == 1


@pytest.mark.parametrize("argv, says", [
    (["--ratios", "abc"], "--ratios"),                      # was a ValueError traceback
    (["--methods", "bogus"], "unknown method"),              # was refused by the conversion, after scoring the source
    (["--from-json", "missing.json"], "no such file"),       # was a FileNotFoundError
    (["--write-benchmarks", "B.md"], "needs --json"),        # the section could not be merged again
])
def test_bench_convert_refuses_bad_arguments_before_measuring(tmp_path, monkeypatch, capsys, argv, says):
    bench = load("bench_convert")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench, "bench_model", lambda *a: pytest.fail("measured"))
    assert says in refused(capsys, lambda: bench.main(argv))


# --------------------------------------------------------------------------- benchmarks_md.py
def test_recorded_commands_can_be_run_again_from_the_repo_root(tmp_path, monkeypatch):
    """`--json ../bc.json` typed in scripts/ was recorded as is; the script called by absolute path recorded its
    absolute path (or only its name)."""
    import argparse

    sys.path.insert(0, str(SCRIPTS))
    from benchmarks_md import recorded_command

    parser = argparse.ArgumentParser()
    parser.add_argument("--json", type=Path)
    parser.add_argument("--from-json", type=Path, nargs="+")
    parser.add_argument("--ratios")
    parser.add_argument("extra", nargs="*")
    monkeypatch.chdir(SCRIPTS)
    argv = ["--json", "../bc.json", "--from-json", "a.json", str(tmp_path / "b.json"), "--ratios", "2,4",
            f"--json={tmp_path}/c.json", "out", "--", "--calib-data", "x.txt"]
    assert recorded_command(SCRIPTS / "bench_convert.py", argv, parser) == (
        f"python scripts/bench_convert.py --json bc.json --from-json scripts/a.json {tmp_path}/b.json --ratios 2,4 "
        f"--json={tmp_path}/c.json out -- --calib-data x.txt")


def test_the_imported_modules_say_so_on_their_own(tmp_path):
    for name in ("benchmarks_md.py", "cost_model_report.py"):
        shown = subprocess.run([sys.executable, str(SCRIPTS / name), "--help"], capture_output=True, text=True,
                               cwd=tmp_path, timeout=60)
        assert shown.returncode == 0 and "imported by" in shown.stdout and shown.stdout.count("\n") == 1
        bad = subprocess.run([sys.executable, str(SCRIPTS / name)], capture_output=True, text=True, cwd=tmp_path,
                             timeout=60)
        assert bad.returncode == 2 and "error:" in bad.stderr and bad.stderr.count("\n") == 1


# --------------------------------------------------------------------------- bench_effort.py
@pytest.mark.parametrize("argv, says", [
    (["--efforts", "bogus"], "invalid choice"),             # was passed to every conversion, which refused it
    (["--from-json", "missing.json"], "no such file"),      # was a FileNotFoundError
])
def test_bench_effort_refuses_bad_arguments(tmp_path, monkeypatch, capsys, argv, says):
    bench = load("bench_effort")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench, "run_one", lambda *a: pytest.fail("converted"))
    assert says in refused(capsys, lambda: bench.main(argv))


def test_bench_effort_records_paths_as_the_repo_root_sees_them(monkeypatch, tmp_path):
    bench = load("bench_effort")
    seen = {}
    monkeypatch.setattr(bench, "run_one", lambda work, effort, ratio: {"effort": effort, "ratio": ratio})
    monkeypatch.setattr(bench, "render", lambda results: seen.update(results) or "")
    monkeypatch.chdir(SCRIPTS)
    bench.main(["--efforts", "fast", "--ratios", "2", "--json", str(tmp_path / "e.json"), "--write-benchmarks",
                str(tmp_path / "B.md")])
    assert seen["command"] == (f"python scripts/bench_effort.py --efforts fast --ratios 2 --json {tmp_path}/e.json "
                               f"--write-benchmarks {tmp_path}/B.md")
    monkeypatch.chdir(tmp_path)
    bench.main(["--efforts", "fast", "--ratios", "2", "--json", "e.json"])
    assert seen["command"].endswith(f"--json {tmp_path}/e.json")  # was `--json e.json`: not re-runnable from the repo


# --------------------------------------------------------------------------- bench_decode.py
@pytest.mark.parametrize("extra, says", [
    (["--contexts", "abc"], "--contexts"),          # was a ValueError after loading both models
    (["--contexts", "0"], "--contexts"),            # an empty prompt, found by generate
    (["--dtype", "fp64"], "--dtype"),               # was an InvalidShapeError traceback
    (["--device", "cuda:99"], "--device"),          # no such device (none at all on a CPU machine)
    (["--data", "missing.txt"], "--data"),          # was found when the first prompt was built
    (["--source", "./missing"], "--source"),        # neither a folder nor a hub id
    (["--json", "no/such/folder/t.json"], "--json"),  # was found after all the timing
    (["--repeats", "0"], "--repeats"),              # no run at all: a KeyError in the table
    (["--threads", "0"], "--threads"),              # silently meant 'the default'
])
def test_bench_decode_refuses_bad_arguments_before_timing(tmp_path, monkeypatch, capsys, extra, says):
    bench = load("bench_decode")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    argv = ["--source", "model", "--converted", "model", *extra]
    assert says in refused(capsys, lambda: bench.parse_args(argv))


def test_bench_decode_records_paths_as_the_repo_root_sees_them(tmp_path, monkeypatch):
    bench = load("bench_decode")
    (tmp_path / "model").mkdir()
    monkeypatch.chdir(tmp_path)
    args = bench.parse_args(["--source", "model", "--converted", "HuggingFaceTB/SmolLM2-135M", "--json", "t.json"])
    assert args.command == (f"python scripts/bench_decode.py --source {tmp_path}/model "
                            f"--converted HuggingFaceTB/SmolLM2-135M --json {tmp_path}/t.json")


# --------------------------------------------------------------------------- bench_sweeps.py, bench_io.py
@pytest.mark.parametrize("flag", ["--threads", "--max-windows", "--context", "--calib-samples", "--calib-seq-len"])
def test_bench_sweeps_refuses_zero_instead_of_taking_the_protocols_value(flag, capsys):
    """`args.x or protocol.x` replaced an explicit 0 with the protocol's value without a word."""
    bench = load("bench_sweeps")
    assert flag in refused(capsys, lambda: bench.parse_args([flag, "0"]))
    settings = bench.settings_for(bench.PROTOCOLS["stories260k"], bench.parse_args(["--max-windows", "3"]))
    assert settings.max_windows == 3


@pytest.mark.parametrize("argv, says", [
    (["--max-shard-size", "abc"], "--max-shard-size"),   # was found by the child making the checkpoint
    (["--min-size-gib", "0"], "--min-size-gib"),          # an empty 'checkpoint'
    (["--min-size-gib", "-1"], "--min-size-gib"),
])
def test_bench_io_refuses_bad_sizes_before_making_anything(tmp_path, capsys, argv, says):
    bench = load("bench_io")
    work = tmp_path / "work"
    assert says in refused(capsys, lambda: bench.main(["--workdir", str(work), *argv]))
    assert not work.exists()


# --------------------------------------------------------------------------- the GPU scripts' offline halves
def test_bench_runtime_decode_cpu_smoke_honours_explicit_values():
    bench = load("bench_runtime_decode")
    smoke = bench.parse_args(["--cpu-smoke"])
    assert (smoke.layers, smoke.prompt, smoke.new_tokens, smoke.batches) == (2, 24, 6, [1, 2])
    given = bench.parse_args(["--cpu-smoke", "--batches", "3", "--prompt", "40", "--new-tokens", "5", "--layers", "1"])
    assert (given.layers, given.prompt, given.new_tokens, given.batches) == (1, 40, 5, [3])  # were silently replaced
    plain = bench.parse_args([])
    assert (plain.layers, plain.prompt, plain.new_tokens, plain.batches) == (30, 512, 64, [1, 16])


@pytest.mark.parametrize("name", ["bench_runtime_decode", "bench_mla_decode"])
def test_gpu_benchmarks_record_the_script_as_the_repo_root_sees_it(name, tmp_path, monkeypatch):
    """Called by absolute path, the command was recorded as `python bench_runtime_decode.py`."""
    bench = load(name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(SCRIPTS / f"{name}.py"), "--json", "r.json"])
    assert bench.parse_args(None).command == f"python scripts/{name}.py --json {tmp_path}/r.json"


def test_device_convert_check_refuses_the_fixed_text_case_without_its_text_before_making_anything(tmp_path, capsys):
    bench = load("device_convert_check")
    out = tmp_path / "out"
    says = refused(capsys, lambda: bench.main(["--out", str(out), "--cases", "stories-fixed", "--devices", "cpu"]))
    assert "--calib-text" in says and not out.exists()  # was a KeyError after making OUT/work


# --------------------------------------------------------------------------- bench_finetune.py
def test_bench_finetune_render_only_without_results_is_one_error_line(tmp_path, monkeypatch, capsys):
    bench = load("bench_finetune")
    monkeypatch.chdir(tmp_path)  # main() moves to the repo root; this puts the test's folder back afterwards
    work = tmp_path / "work"
    assert "--render-only" in refused(capsys, lambda: bench.main(["--render-only", "--work", str(work)]))  # was a ValueError


def test_bench_finetune_no_markdown_leaves_the_shipped_plot_alone(tmp_path, monkeypatch):
    bench = load("bench_finetune")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "results.json").write_text(json.dumps({"stories260k": {"bench_command": "x"}}))
    drawn = []
    monkeypatch.setattr(bench, "plot_curves", lambda results, path: drawn.append(path))
    monkeypatch.setattr(bench, "render_section", lambda results, command: "")
    monkeypatch.setattr(bench, "write_section", lambda *a: pytest.fail("wrote BENCHMARKS.md"))
    bench.main(["--render-only", "--no-markdown", "--work", str(tmp_path)])
    assert drawn == [tmp_path / "finetune_curves.png"]  # was docs/finetune_curves.png


# --------------------------------------------------------------------------- bench_cost_model.py
def test_bench_cost_model_microbench_writes_where_it_is_told(tmp_path, monkeypatch):
    """measure / microbench always wrote into docs/bench/cost-model/, which fit_cost_model.py reads."""
    bench = load("bench_cost_model")
    monkeypatch.setattr(bench, "microbench", lambda threads: {"name": f"reference-rates-cpu{threads}"})
    monkeypatch.chdir(tmp_path)
    assert bench.main(["microbench", "--threads", "1", "--out-dir", "rates"]) == 0
    assert json.loads((tmp_path / "rates" / "reference-rates-cpu1.json").read_text())["name"] == "reference-rates-cpu1"


def test_bench_cost_model_creates_a_missing_benchmarks_file(tmp_path, monkeypatch):
    sys.path.insert(0, str(SCRIPTS))
    import cost_model_report

    bench = load("bench_cost_model")
    monkeypatch.setattr(cost_model_report.fitting, "load_runs", lambda: [])
    monkeypatch.setattr(cost_model_report, "validation_section", lambda runs: "validation")
    monkeypatch.setattr(cost_model_report, "plans_section", lambda runs: "plans")
    assert bench.main(["--write-benchmarks", str(tmp_path / "NEW.md")]) == 0  # was a FileNotFoundError
    text = (tmp_path / "NEW.md").read_text()
    assert text.startswith("# Benchmarks\n") and "validation" in text and "plans" in text


# --------------------------------------------------------------------------- engines/record_runs.py
def test_the_engine_record_and_its_tables_are_what_the_filed_results_give(tmp_path):
    """engine_runs.json (what convert and the card say about the engines), README's engine table and BENCHMARKS'
    KV table are generated from docs/engines-results-*/: a result filed without regenerating them, or edited by
    hand, leaves the tool saying what no run showed.  The KV table has one row per engine and export (the
    stories260K llama.cpp export was listed twice, once per date)."""
    import glob

    for name in ("README.md", "BENCHMARKS.md"):
        shutil.copy(REPO / name, tmp_path / name)
    results = sorted(glob.glob(str(REPO / "docs" / "engines-results-*" / "*.json")))
    subprocess.run([sys.executable, str(SCRIPTS / "engines" / "record_runs.py"), *results, "--out", str(tmp_path / "runs.json"),
                    "--benchmarks", str(tmp_path / "BENCHMARKS.md"), "--readme", str(tmp_path / "README.md")],
                   check=True, capture_output=True, text=True, cwd=tmp_path)
    assert json.loads((tmp_path / "runs.json").read_text()) == json.loads(
        (REPO / "mla_convert" / "convert" / "engine_runs.json").read_text())
    for name in ("README.md", "BENCHMARKS.md"):
        assert (tmp_path / name).read_text() == (REPO / name).read_text(), f"{name}: run record_runs.py (see its docstring)"
    table = (REPO / "BENCHMARKS.md").read_text().split("<!-- engines_kv:begin -->")[1].split("<!-- engines_kv:end -->")[0]
    rows = [line.split(" | ")[:2] for line in table.splitlines() if line.startswith("| llama.cpp") or line.startswith("| vLLM")]
    assert rows and len(rows) == len({tuple(row) for row in rows}), rows


# --------------------------------------------------------------------------- engines/make_rope_source.py
@pytest.mark.real_model
def test_make_rope_source_edits_only_the_rope_and_transformers_rotates_as_declared(stories260k, tmp_path):
    """The RoPE runs of docs/engines.md start from trained weights with only their RoPE edited; check_engines.sh makes
    those sources with this script (they were made by hand before).  The weights are copied byte for byte, and
    transformers' rotary frequencies are Llama-3's formula, computed here on its own, on stories260K's head_dim 8."""
    import math

    import torch
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    script = SCRIPTS / "engines" / "make_rope_source.py"
    out = tmp_path / "stories-llama3"
    subprocess.run([sys.executable, str(script), str(stories260k), str(out), "--rope", "llama3", "--original-context",
                    "64"], check=True, capture_output=True, timeout=120)
    source_config = json.loads((stories260k / "config.json").read_text())
    config = json.loads((out / "config.json").read_text())
    assert {key: value for key, value in config.items() if key != "rope_parameters"} == {
        key: value for key, value in source_config.items() if key != "rope_parameters"}
    assert config["rope_parameters"] == {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 64}
    for name in ("model.safetensors", "tokenizer.json"):
        assert not (out / name).is_symlink() and (out / name).read_bytes() == (stories260k / name).read_bytes()

    head_dim = source_config["hidden_size"] // source_config["num_attention_heads"]
    base = [10000.0 ** (-2 * i / head_dim) for i in range(head_dim // 2)]
    expected = []
    for frequency in base:  # Llama 3.1's rule: long wavelengths / factor, short ones kept, a blend between
        wavelength = 2 * math.pi / frequency
        if wavelength < 64 / 4.0:
            expected.append(frequency)
        elif wavelength > 64 / 1.0:
            expected.append(frequency / 8.0)
        else:
            smooth = (64 / wavelength - 1.0) / (4.0 - 1.0)
            expected.append((1 - smooth) * frequency / 8.0 + smooth * frequency)
    rotary = LlamaRotaryEmbedding(AutoConfig.from_pretrained(out))
    assert torch.allclose(rotary.inv_freq.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-6)
    assert sum(abs(e - b) > 1e-9 * b for e, b in zip(expected, base)) == 3  # as docs/engines.md says

    again = subprocess.run([sys.executable, str(script), str(stories260k), str(out), "--rope", "linear"],
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "exists" in again.stderr and config == json.loads((out / "config.json").read_text())
    for args, says in (([str(stories260k), str(tmp_path / "a"), "--rope", "linear", "--original-context", "64"],
                        "--original-context: only llama3"), ([str(tmp_path), str(tmp_path / "b"), "--rope", "linear"],
                                                              "no config.json")):
        refused_run = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=120)
        assert refused_run.returncode == 2 and says in refused_run.stderr and "Traceback" not in refused_run.stderr
        assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# --------------------------------------------------------------------------- count_bad_input_tests.py
def test_bad_input_counts_refuse_to_write_when_pytest_collects_nothing(tmp_path, monkeypatch):
    """A failed collection (here: a tree with no tests) is an error, and the doc keeps its table (it was overwritten
    with zeros when the script ran under an interpreter without pytest)."""
    counter = load("count_bad_input_tests")
    doc = tmp_path / "robustness.md"
    doc.write_text(f"intro\n{counter.START}\nthe table\n{counter.END}\n")
    (tmp_path / "tests").mkdir()
    monkeypatch.setattr(counter, "REPO", tmp_path)
    monkeypatch.setattr(counter, "DOC", doc)
    with pytest.raises(SystemExit, match=r"pytest could not collect the suite .*\(exit [1-9]"):
        counter.main(["--write"])
    assert doc.read_text() == f"intro\n{counter.START}\nthe table\n{counter.END}\n"


def test_the_robustness_docs_bad_input_counts_are_the_suites():
    """docs/robustness.md's table of bad inputs tested per command is generated from the suite's collection; nothing
    checked it, and it fell behind twice (push 55 for 56, generate 26 for 27): regenerate it with
    `python scripts/count_bad_input_tests.py --write`."""
    script = load("count_bad_input_tests")
    doc = script.DOC.read_text()
    recorded = doc[doc.index(script.START):doc.index(script.END) + len(script.END)]
    assert script.render(*script.count(script.collected())) == recorded


# --------------------------------------------------------------------------- bench_quality.py
@pytest.mark.parametrize("argv, says", [
    (["--ratios", "2,x"], "--ratios: whole KV-cache ratios"),
    (["--ratios", "1"], "--ratios: whole KV-cache ratios"),
    (["--max-windows", "0"], "--max-windows: at least 1"),
    (["--from-json", "missing.json"], "--from-json: missing.json is not a file"),
])
def test_bench_quality_refuses_bad_arguments(capsys, argv, says):
    bench = load("bench_quality")
    assert says in refused(capsys, lambda: bench.main(argv))


def test_bench_quality_renders_its_rows_against_the_source_and_says_when_windows_are_cut(tmp_path):
    bench = load("bench_quality")
    stamp = {"command": "python scripts/bench_quality.py", "date": "2026-12-07", "machine": "x86_64"}
    rows = [{"ratio": 1, "lever": "source", "shape": "GQA K+V", "cpu_seconds": 0.0, "perplexity": 5.0},
            {"ratio": 2, "lever": "default", "shape": "24+8", "cpu_seconds": 9.0, "perplexity": 6.0}]
    heal = [{"lever": "defaults", "tokens": 1000, "perplexity_after": 7.5, "gap_closed": 0.5, "wall_seconds": 10,
             "cpu_seconds": 9, "tokens_per_second": 100}]
    results = {"one_shot": {"smollm2": {**stamp, "windows": 10, "rows": rows}},
               "heal": {**stamp, "rows": heal, "before": 10.0, "teacher": 5.0}}
    path = tmp_path / "q.json"
    path.write_text(json.dumps(results))
    markdown = tmp_path / "BENCHMARKS.md"
    assert bench.main(["--from-json", str(path), "--write-benchmarks", str(markdown)]) == 0
    text = markdown.read_text()
    assert "| 2x | default | 24+8 | 6.0000 | 1.200 | 9.0 |" in text
    assert "**not the project protocol**: 10 windows, it has 40" in text
    assert "| defaults | 1,000 | 7.5000 | 50.0 % | 10 | 9 | 100 |" in text
    assert bench.neighbour_rope_dims(48, 192, 64) == [32, 64] and bench.neighbour_rope_dims(4, 8, 8) == [2, 6]
    assert bench.neighbour_rope_dims(2, 8, 8) == [4] and bench.neighbour_rope_dims(8, 32, 8) == [6]


# --------------------------------------------------------------------------- quality_summary.py
def test_quality_summary_judges_each_default_against_its_target_and_numbers_the_commands():
    summary = load("quality_summary")
    sources = {"stories260K": 5.0, "SmolLM2-135M-Instruct": 20.0}
    rows = [{"model": "stories260K", "ratio": 8, "stage": "one-shot", "setting": "--effort default", "perplexity": 30.0,
             "cpu_seconds": 10.0, "commands": ["a"]},
            {"model": "stories260K", "ratio": 8, "stage": "healed", "setting": "defaults (...)", "perplexity": 8.0,
             "cpu_seconds": 200.0, "commands": ["b"]},
            {"model": "stories260K", "ratio": 8, "stage": "healed", "setting": "lr 3e-3", "perplexity": 15.0,
             "cpu_seconds": 200.0, "commands": ["b"]},
            {"model": "SmolLM2-135M-Instruct", "ratio": 2, "stage": "one-shot", "setting": "default", "perplexity": 25.0,
             "cpu_seconds": 300.0, "commands": ["c", "a"], "contended": True}]
    text = summary.render(sources, rows)
    assert "| stories260K | 8x | one-shot | --effort default | 30.0000 | 6.000 | <= 5x: missed | 10 | 1 |" in text
    # (30 - 8) / (30 - 5) = 88 % closed: the recipe's row meets the 85 % target; a lever's row names no target
    assert "| 88.0 % of the gap closed (>= 85% in 20 CPU-min: met) | 200 | 2 |" in text
    assert "| 60.0 % of the gap closed | 200 | 2 |" in text
    assert "| SmolLM2-135M-Instruct | 2x | one-shot | default | 25.0000 | 1.250 | <= 1.3x: met | 300* | 3, 1 |" in text
    assert text.index("1. `a`") < text.index("2. `b`") < text.index("3. `c`")


def test_benchmarks_quality_table_is_rendered_from_the_recorded_runs():
    """The table is data: BENCHMARKS.md holds what the recorded runs render to (regenerate with the script)."""
    summary = load("quality_summary")
    text = (REPO / "BENCHMARKS.md").read_text()
    assert summary.render(*summary.load_rows()) in text
    for row in json.loads((REPO / "docs" / "bench" / "quality-runs.json").read_text())["runs"]:
        assert row["commands"] and all(command.startswith("mla-convert ") for command in row["commands"])


# --------------------------------------------------------------------------- bench_sampling.py
def test_bench_sampling_times_both_caches_and_says_they_drew_the_same_tokens(tmp_path, capsys):
    """On a tiny fp32 model the two caches' logits agree to rounding, so the table's last line reports equal draws."""
    from tiny_models import save_tiny_model

    model = save_tiny_model(tmp_path / "model", vocab_size=128, num_layers=1)
    assert load("bench_sampling").main([str(model), "--rows", "4", "--length", "12", "--dtype", "fp32",
                                        "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "| growing (DynamicCache) |" in out and "| static (StaticCache) |" in out
    assert "same tokens: True (100.0 % of positions agree" in out
