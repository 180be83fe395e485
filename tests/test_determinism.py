"""Determinism: the same source, options and seed give byte-identical output shards.

The default calibration samples text from the source model with a seeded generator, so the whole
conversion is a pure function of (source, options, seed) on a given machine and torch build.  Checked
in-process on a tiny random model (every output file, the report up to its timing fields) and across
two separate processes of the real CLI on stories260K; a different seed must change the result, or the
first check would pass for a conversion that ignores its calibration.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import save_tiny_model

from mla_convert.convert import ConvertOptions, convert
from mla_convert.options import CalibrationOptions

# Fields of mla_convert.json that measure the run rather than describe the result.
RUN_MEASUREMENTS = ("seconds", "peak_rss_bytes", "cpu_seconds", "phase_seconds", "phase_cpu_seconds", "phase_windows_unix", "device",
                    "peak_device_bytes")


def digests(folder: Path, pattern: str = "*") -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(folder.glob(pattern)) if path.is_file()}


def report_without_timing(folder: Path) -> dict:
    """The report minus what measures the run (time, memory) and the command line (it names the output path)."""
    report = json.loads((folder / "mla_convert.json").read_text())
    for key in RUN_MEASUREMENTS:
        report["summary"].pop(key, None)
    report.pop("command")
    return report


def options(seed: int) -> ConvertOptions:
    return ConvertOptions(kv_lora_rank=24, rope_dim=8, max_shard_size="40KB",
                          calibration=CalibrationOptions(num_samples=4, seq_len=24, seed=seed))


def test_same_seed_gives_identical_files_and_another_seed_does_not(tmp_path):
    source = save_tiny_model(tmp_path / "src", num_layers=2, weight_scale=4.0, seed=1)
    first = convert(source, tmp_path / "a", options(seed=7))
    second = convert(source, tmp_path / "b", options(seed=7))
    shards = digests(first.output, "*.safetensors")
    assert len(shards) >= 3, "the case must exercise several shards"
    assert shards == digests(second.output, "*.safetensors")
    everything_but_report = {k: v for k, v in digests(first.output).items() if k != "mla_convert.json"}
    assert everything_but_report == {k: v for k, v in digests(second.output).items() if k != "mla_convert.json"}
    assert report_without_timing(first.output) == report_without_timing(second.output)

    other = convert(source, tmp_path / "c", options(seed=8))
    assert digests(other.output, "*.safetensors") != shards, "the seed must matter (calibration text is sampled with it)"


@pytest.mark.slow
@pytest.mark.real_model
def test_two_cli_processes_on_stories260k_write_identical_shards(stories260k, tmp_path):
    """Byte-identical shards with 1 and with 2 threads: LAPACK's eigen/SVD bases come out with other signs on other
    thread counts, and the converter fixes every sign (largest-magnitude component positive) before writing."""
    outputs = []
    for name, threads in (("first", "1"), ("second", "2")):
        env = {**os.environ, "OMP_NUM_THREADS": threads, "TMPDIR": str(tmp_path), "HF_HUB_OFFLINE": "1"}
        output = tmp_path / name
        done = subprocess.run(
            [sys.executable, "-m", "mla_convert", "convert", str(stories260k), str(output), "--calib-samples", "4",
             "--calib-seq-len", "64", "--seed", "3", "-q"],
            capture_output=True, text=True, env=env, timeout=600,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        outputs.append(output)
    assert digests(outputs[0], "*.safetensors") == digests(outputs[1], "*.safetensors")
    assert report_without_timing(outputs[0]) == report_without_timing(outputs[1])
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("mla-convert-")] == [], "statistics folders left"
