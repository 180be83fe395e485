"""The cost model (`mla_convert.convert.estimate`) and `mla-convert inspect --estimate`.

The estimator must speak about the phases a conversion really reports (same names; the per-phase
predictions add up to the total), land near a real run, and scale the way the work does.  Its 30 %
validation on real models lives in BENCHMARKS.md ("Cost model: predicted vs measured"); on this shared
machine a test can only hold it to a generous factor.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_shapes_inspect import SMOLLM2, run_cli
from tiny_models import tiny_config

from mla_convert.convert.estimate import PHASES, STARTUP, Sizes, estimate, load_constants, phase_work, working_sets
from mla_convert.convert.report import REPORT_FILE
from mla_convert.options import CalibrationOptions, ConvertOptions
from mla_convert.source.config import SourceConfig
from mla_convert.source.shapes import pick_shape

PER_LAYER_PHASES = ("calibration statistics", "ranking RoPE grids", "measuring RoPE grids", "converting layers")


def config_of(**kwargs) -> SourceConfig:
    return SourceConfig.from_dict(tiny_config(**kwargs).to_dict())


def test_every_phase_has_constants_for_both_device_classes():
    constants = load_constants()
    for kind in ("cpu", "cuda"):
        assert set(constants[kind]["phases"]) == set(PHASES)
        assert constants[kind]["startup"]["fixed_seconds"] > 0
        assert constants[kind]["memory"]["base_bytes"] > 0


def test_phase_seconds_add_up_to_the_total():
    source = SourceConfig.from_dict(SMOLLM2)
    for device in ("cpu", "cuda"):
        result = estimate(source, ConvertOptions(), device=device, cores=4)
        assert math.isclose(sum(result.phases.values()) + result.startup_seconds, result.total_seconds)
        assert all(seconds >= 0 for seconds in result.phases.values())
        assert list(result.phases) == [name for name in PHASES if name in result.phases]  # pipeline order


def test_calibration_text_replaces_sampling_and_one_grid_skips_measuring():
    source = SourceConfig.from_dict(SMOLLM2)
    sampled = estimate(source, ConvertOptions())
    read = estimate(source, ConvertOptions(calibration=CalibrationOptions(data="corpus.txt")))
    assert "sampling calibration text from the source model" in sampled.phases and "reading calibration text" not in sampled.phases
    assert "reading calibration text" in read.phases and "sampling calibration text from the source model" not in read.phases
    full_rope = estimate(source, ConvertOptions(kv_lora_rank=128, rope_dim=64))  # 32 slots of 32 frequencies: one grid
    assert "measuring RoPE grids" not in full_rope.phases


def test_per_layer_phases_grow_linearly_with_layers():
    """Each layer adds the same work; a phase's one-time cost (fitted `fixed_seconds`) is paid once."""
    runs = {layers: estimate(config_of(num_layers=layers, hidden_size=128, intermediate_size=256, vocab_size=256),
                             ConvertOptions(), cores=2) for layers in (4, 8, 16)}
    for phase in PER_LAYER_PHASES:
        if phase in runs[4].phases:
            first, second = runs[8].phases[phase] - runs[4].phases[phase], runs[16].phases[phase] - runs[8].phases[phase]
            assert first > 0 and math.isclose(second, 2 * first, rel_tol=0.05), phase
    assert runs[16].total_seconds > runs[8].total_seconds > runs[4].total_seconds


def test_larger_hidden_needs_more_memory_and_time():
    small = estimate(config_of(hidden_size=64, intermediate_size=96), ConvertOptions(), cores=2)
    large = estimate(config_of(hidden_size=512, intermediate_size=768, head_dim=128), ConvertOptions(), cores=2)
    assert large.peak_rss_bytes > small.peak_rss_bytes
    assert large.statistics_disk_bytes > small.statistics_disk_bytes and large.output_bytes > small.output_bytes
    assert large.total_seconds > small.total_seconds
    gpu_small = estimate(config_of(hidden_size=64, intermediate_size=96), ConvertOptions(), device="cuda")
    gpu_large = estimate(config_of(hidden_size=512, intermediate_size=768, head_dim=128), ConvertOptions(), device="cuda")
    assert gpu_large.peak_device_bytes > gpu_small.peak_device_bytes


def test_more_cores_shorten_throughput_bound_phases_only():
    source = SourceConfig.from_dict(SMOLLM2)
    few, many = estimate(source, cores=2), estimate(source, cores=16)
    assert many.total_seconds < few.total_seconds
    assert many.startup_seconds == few.startup_seconds  # imports and pre-flight do not parallelise


def test_effort_and_calibration_size_move_the_right_phases():
    source = SourceConfig.from_dict(SMOLLM2)
    base = estimate(source, ConvertOptions())
    fast = estimate(source, ConvertOptions(effort="fast"))
    assert fast.phases["converting layers"] < base.phases["converting layers"]  # 1 factorization per layer, not 5
    assert "measuring RoPE grids" not in fast.phases or fast.phases["measuring RoPE grids"] < base.phases["measuring RoPE grids"]
    longer = estimate(source, ConvertOptions(calibration=CalibrationOptions(num_samples=32)))
    for phase in ("sampling calibration text from the source model", "calibration statistics"):
        assert longer.phases[phase] > base.phases[phase]


def test_sampling_batches_follow_the_kv_cache_budget():
    """An 8B-shaped model samples 16 windows in 3 rounds of 6 (32 MiB of bf16 cache each), as sample_from_model does."""
    config = dict(SMOLLM2, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128, num_hidden_layers=32,
                  intermediate_size=14336, vocab_size=128256)
    source = SourceConfig.from_dict(config)
    sizes = Sizes(source, pick_shape(source), ConvertOptions(), "cpu")
    assert sizes.sampling_batch == 6 and sizes.sampling_steps == 255 * 3
    work = phase_work(sizes, 2.0)
    assert work["sampling calibration text from the source model"].flops > 2 * 6 * 765 * 7e9  # ~8B weights per token
    assert max(working_sets(sizes).values()) < 8e9  # one layer + activations, never the model


@pytest.mark.real_model
def test_estimate_has_the_phases_of_a_real_stories260k_conversion(stories260k, tmp_path):
    """Converted in a process of its own, as a user runs it: the report's peak RSS is then that conversion's, not the
    high-water mark of a test process that loaded other models before."""
    options = ConvertOptions(calibration=CalibrationOptions(num_samples=4, seq_len=64))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path), "HF_HUB_OFFLINE": "1"}  # small matmuls, 1 core
    done = subprocess.run([sys.executable, "-m", "mla_convert", "convert", str(stories260k), str(tmp_path / "out"),
                           "--calib-samples", "4", "--calib-seq-len", "64", "-q"], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "out" / REPORT_FILE).read_text())
    assert report["options"]["calibration"] == dataclasses.asdict(options.calibration)
    # each phase's Unix-time window (what places a memory sampler's readings) gives the order the phases ran in (the
    # report's JSON keys are sorted): the estimator's order; one after the other, each as long as its measured seconds
    windows = report["summary"]["phase_windows_unix"]
    assert set(windows) == set(report["summary"]["phase_seconds"])
    measured = {name: report["summary"]["phase_seconds"][name] for name in sorted(windows, key=lambda name: windows[name][0])}
    predicted = estimate(SourceConfig.from_folder(stories260k), options, cores=1)
    assert list(predicted.phases) == list(measured), (list(predicted.phases), list(measured))
    assert math.isclose(sum(predicted.phases.values()) + predicted.startup_seconds, predicted.total_seconds)
    ends = [windows[name][1] for name in measured]
    starts = [windows[name][0] for name in measured]
    assert all(start <= end for start, end in zip(starts, ends))
    assert all(end <= next_start + 0.01 for end, next_start in zip(ends, starts[1:]))  # no two phases overlap
    for name, (start, end) in windows.items():
        assert math.isclose(end - start, measured[name], abs_tol=0.05), (name, end - start, measured[name])
    # how close the seconds are is a benchmark (BENCHMARKS.md, "Cost model: predicted vs measured"), not a test: a
    # timed assertion fails whenever the machine is busy.  Memory does not depend on the load.
    rss_ratio = predicted.peak_rss_bytes / report["summary"]["peak_rss_bytes"]
    assert 1 / 3 < rss_ratio < 3


def test_the_estimate_follows_the_target(stories260k):
    """`inspect --estimate --target llama.cpp` predicted the transformers export (the identity query path a llama.cpp
    export adds, ~84 KB on stories260K, was missing from the disk figure)."""
    from mla_convert.convert.preflight import estimated_output_bytes, export_dtype
    from mla_convert.source.shapes import pick_target_shape

    source = SourceConfig.from_folder(stories260k)
    plain, serving = (estimate(source, ConvertOptions(compression=2, target=target)) for target in ("transformers", "llama.cpp"))
    mla, dtype = pick_target_shape(source, "llama.cpp", compression=2), export_dtype("auto", source)
    added = estimated_output_bytes(source, mla, dtype, "llama.cpp") - estimated_output_bytes(source, mla, dtype)
    assert serving.output_bytes - plain.output_bytes == added > 0


def test_recorded_runs_still_give_their_options():
    """The cost-model scripts rebuild each recorded run's options; the records hold options removed since
    (`profile_samples`), which made `scripts/fit_cost_model.py` fail on every run."""
    from pathlib import Path

    from mla_convert.options import options_from_record

    records = sorted((Path(__file__).resolve().parents[1] / "docs" / "bench" / "cost-model").glob("*.json"))
    recorded = [json.loads(path.read_text()) for path in records]
    assert any("profile_samples" in (run.get("options") or {}).get("calibration", {}) for run in recorded)
    for run in recorded:
        if "options" in run:
            options = options_from_record(run["options"])
            assert options.calibration.num_samples == run["options"]["calibration"]["num_samples"]


# --------------------------------------------------------------------------- the command line
def test_inspect_estimate_prints_every_phase_and_the_totals(smollm2_config_folder):
    result = run_cli("inspect", smollm2_config_folder, "--estimate", "--cpu-cores", "4", "--compression", "4")
    assert result.returncode == 0, result.stderr
    expected = estimate(SourceConfig.from_dict(SMOLLM2), ConvertOptions(compression=4), cores=4)
    for phase in expected.phases:
        assert f"| {phase} |" in result.stdout, phase
    for row in (STARTUP, "total wall time", "peak host memory (RSS)", "disk: calibration statistics", "disk: output folder"):
        assert row in result.stdout
    assert "cpu, 4 cores" in result.stdout
    total_row = next(line for line in result.stdout.splitlines() if line.startswith("| total wall time"))
    from mla_convert.convert.estimate import format_seconds

    assert format_seconds(expected.total_seconds) in total_row


def test_core_counts_beyond_the_fitted_runs_are_named_or_refused(smollm2_config_folder):
    """The CPU constants come from 2-core runs: a prediction for more cores is printed as an extrapolation, and a
    count no machine has (it printed a confident 0.1 s for 100000 cores) is refused with the other problems."""
    source = SourceConfig.from_dict(SMOLLM2)
    assert not any("extrapolated" in note for note in estimate(source, cores=2).notes)
    assert any("extrapolated: the CPU constants were fitted on 2-core runs; 16 cores" in note
               for note in estimate(source, cores=16).notes)
    printed = run_cli("inspect", smollm2_config_folder, "--estimate", "--cpu-cores", "16")
    assert printed.returncode == 0 and "extrapolated" in printed.stdout + printed.stderr
    absurd = run_cli("inspect", smollm2_config_folder, "--estimate", "--cpu-cores", "100000")
    assert absurd.returncode == 2 and "--cpu-cores 100000: more than any one machine's 1024" in absurd.stderr
    assert "Traceback" not in absurd.stderr


def test_inspect_estimate_cuda_reports_device_memory_and_options_change_it(smollm2_config_folder):
    result = run_cli("inspect", smollm2_config_folder, "--estimate", "--device", "cuda")
    assert result.returncode == 0, result.stderr
    assert "peak device memory" in result.stdout and "NVIDIA H200" in result.stdout
    # explicit cores: this process's torch thread count can differ from the subprocess's (tests set it)
    fast = run_cli("inspect", smollm2_config_folder, "--estimate", "--effort", "fast", "--calib-samples", "8", "--cpu-cores", "2")
    expected = estimate(SourceConfig.from_dict(SMOLLM2), dataclasses.replace(
        ConvertOptions(effort="fast"), calibration=CalibrationOptions(num_samples=8)), cores=2)
    total_row = next(line for line in fast.stdout.splitlines() if line.startswith("| total wall time"))
    from mla_convert.convert.estimate import format_seconds

    assert format_seconds(expected.total_seconds) in total_row


@pytest.mark.parametrize("args, fragment", [
    (["--estimate", "--cpu-cores", "0"], "--cpu-cores 0"),
    (["--estimate", "--device", "tpu"], "--device 'tpu'"),
    (["--estimate", "--calib-samples", "0"], "--calib-samples 0"),
    (["--estimate", "--effort", "maximal"], "--effort 'maximal'"),
    (["--estimate", "--device", "cuda", "--cpu-cores", "8"], "--cpu-cores"),
    (["--cpu-cores", "8"], "add --estimate"),
    (["--calib-seq-len", "128"], "add --estimate"),
    # what convert says about them (inspect said "must be at least 1" for nan, "leaves 0 cached values" for inf)
    (["--estimate", "--compression", "nan"], "--compression: 'nan' is not a finite number"),
    (["--estimate", "--compression", "inf"], "--compression: 'inf' is not a finite number"),
    # convert refuses a calibration text for a folder without a tokenizer; the estimate predicted its cost
    (["--estimate", "--calib-data", str(Path(__file__).resolve().parents[1] / "README.md")],
     "--calib-data needs the source model's tokenizer"),
])
def test_inspect_estimate_bad_flags_are_one_error_line(smollm2_config_folder, args, fragment):
    result = run_cli("inspect", smollm2_config_folder, *args)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_inspect_estimate_of_a_folder_without_a_stated_dtype_counts_the_weights_dtype(tmp_path):
    """A config.json without a dtype: the estimate reads the local folder's headers (bf16 here), as convert does, and
    predicts what a config stating bf16 predicts; it counted float32 weights (twice the disk and memory)."""
    from tiny_models import tiny_model

    folders = {}
    for name in ("stated", "unstated"):
        folders[name] = tmp_path / name
        tiny_model(num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64).to(torch.bfloat16).save_pretrained(folders[name])
    config = json.loads((folders["unstated"] / "config.json").read_text())
    assert config.pop("dtype") == "bfloat16"
    (folders["unstated"] / "config.json").write_text(json.dumps(config))
    outputs = {name: run_cli("inspect", folder, "--estimate", "--cpu-cores", "2") for name, folder in folders.items()}
    assert all(result.returncode == 0 for result in outputs.values()), outputs
    tables = {name: result.stdout[result.stdout.index("predicted conversion cost"):].replace(str(folders[name]), "F")
              for name, result in outputs.items()}
    note = "note: config.json states no dtype; the weights are stored as bfloat16"
    assert note in outputs["unstated"].stdout and note not in outputs["stated"].stdout
    assert tables["unstated"] == tables["stated"]


def test_inspect_estimate_of_a_damaged_folder_without_a_stated_dtype_says_what_it_assumed(tmp_path):
    """A shard too damaged to read leaves the weights' dtype unknown: the estimate says it assumed float32 (beside
    convert's refusal of the shard) instead of silently counting float32 weights."""
    import os

    from tiny_models import tiny_model

    folder = tmp_path / "unstated"
    tiny_model(num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64).to(torch.bfloat16).save_pretrained(
        folder, max_shard_size="100KB")
    config = json.loads((folder / "config.json").read_text())
    assert config.pop("dtype") == "bfloat16"
    (folder / "config.json").write_text(json.dumps(config))
    last = sorted(folder.glob("*.safetensors"))[-1]
    os.truncate(last, last.stat().st_size // 2)
    result = run_cli("inspect", folder, "--estimate", "--cpu-cores", "2")
    output = " ".join(result.stdout.split())
    assert result.returncode == 0, result.stderr
    assert f"note: convert will refuse these weights: {last}: truncated or corrupt" in output
    assert "the estimate assumes float32 weights" in output and "the weights are stored as" not in output
