"""Fit the cost model's constants (mla_convert/convert/cost_constants.json) from measured conversions.

Inputs: the runs under docs/bench/cost-model/ (one JSON per `mla-convert convert` process, written by
`scripts/bench_cost_model.py measure`); every CPU run fits the CPU constants.  The H200 runs of
docs/bench/device-convert-check.json are imported as `h200-*` records (`--import-device-check`) and fit
the CUDA constants (there is no other GPU data).  Runs are few, so the validation in BENCHMARKS.md
("Cost model: predicted vs measured") predicts each run both with the shipped constants and with constants
fitted on all the other runs (leave one out): the second is the out-of-sample figure.

Per device class and phase, the measured phase seconds are fitted as a non-negative combination of the
phase's work (`estimate.phase_work`): seconds = ops x seconds_per_op + throughput / efficiency + fixed, where
throughput is the phase's bytes, FLOPs, LAPACK FLOPs and host elements at the class's reference rates
(CPU: kernels timed here, `bench_cost_model.py microbench`; GPU: its data sheet).  Each run is weighted by
1 / its seconds so that small and large runs count alike (relative error).
Memory: peak RSS = base + factor x the largest phase working set (least squares, relative).  Start-up
(wall minus the phases): fixed + per tensor.  Constants that no run can determine (a GPU upload rate for
weights that do not stay resident; how CPU throughput scales with cores) are stated in `assumed`.

    python scripts/fit_cost_model.py --import-device-check   # once: H200 runs -> docs/bench/cost-model/h200-*.json
    python scripts/fit_cost_model.py                         # fit -> mla_convert/convert/cost_constants.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
RUNS = REPO / "docs" / "bench" / "cost-model"
DEVICE_CHECK = REPO / "docs" / "bench" / "device-convert-check.json"
OUTPUT = REPO / "mla_convert" / "convert" / "cost_constants.json"

# Not determined by any measured run here; stated, not fitted
ASSUMED = {
    "cpu": {"note": "reference rates: kernels timed on this machine (reference-rates-cpu2.json); throughput scales "
            "linearly with the cores used, per-op latency does not"},
    "cuda": {"reference_rates": {"flops_per_second": 50e12, "float64_matmul_cost": 1.0, "lapack_flops_per_second": 1e12,
                                 "bytes_per_second": 3e12, "host_elements_per_second": 2e9, "host_to_device_bytes_per_second": 10e9},
             "device_name": "NVIDIA H200", "device_memory_bytes": 143_771_369_472, "resident_weight_share": 0.5,
             "note": "reference rates from the H200 data sheet, rounded down (float32 50 TFLOP/s, float64 matmul the same "
             "on FP64 tensor cores, eigh 1 TFLOP/s, HBM 3 TB/s; the host's softmax/top-k 2e9 elements/s on 16 threads); "
             "weights beyond the resident budget are uploaded at an assumed 10 GB/s each sampling step (no measured run "
             "exceeded the budget); the device's free memory taken as its total"},
}
KEYS = {"ops": "seconds_per_op", "throughput": "efficiency", "fixed": "fixed_seconds"}
MIN_SECONDS = 0.05  # weight floor: phases shorter than this are timer noise


def load_runs(pattern: str = "*.json") -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(RUNS.glob(pattern))]


def sizes_of(run: dict):
    """The estimator's counts for a recorded run (its config.json and resolved options)."""
    from mla_convert.convert.estimate import Sizes
    from mla_convert.options import options_from_record
    from mla_convert.source.config import SourceConfig
    from mla_convert.source.shapes import MLAShape

    options = options_from_record(run["options"])
    source = SourceConfig.from_dict(run["config"])
    mla = MLAShape(options.kv_lora_rank, options.rope_dim, options.q_lora_rank)
    return Sizes(source, mla, options, run["device"])


def work_of(run: dict, float64_cost: float) -> dict:
    from mla_convert.convert.estimate import phase_work

    return phase_work(sizes_of(run), float64_cost, run.get("resident_source_bytes") or 0)


def nnls(a: np.ndarray, b: np.ndarray, iterations: int = 500) -> np.ndarray:
    """Lawson-Hanson non-negative least squares: min ||a x - b|| with x >= 0."""
    rows, cols = a.shape
    x = np.zeros(cols)
    passive = np.zeros(cols, dtype=bool)
    for _ in range(iterations):
        gradient = a.T @ (b - a @ x)
        candidates = ~passive & (gradient > 1e-12 * max(1.0, np.abs(gradient).max()))
        if not candidates.any():
            break
        passive[np.argmax(np.where(candidates, gradient, -np.inf))] = True
        while True:
            z = np.zeros(cols)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            negative = passive & (z <= 0)
            alpha = np.min(x[negative] / (x[negative] - z[negative]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
    return x


def fit_phase(runs: list[dict], works: list[dict], phase: str, reference: dict) -> dict:
    """Per-op seconds, efficiency against the reference rates and fixed seconds of one phase (non-negative, relative)."""
    from mla_convert.convert.estimate import throughput_seconds

    rows, targets = [], []
    for run, work in zip(runs, works):
        if phase in work and phase in run["phase_seconds"]:
            phase_work = work[phase]
            rows.append({"ops": phase_work.ops, "throughput": throughput_seconds(phase_work, reference), "fixed": phase_work.fixed})
            targets.append(run["phase_seconds"][phase])
    if not rows:
        return {}
    kinds = [k for k in KEYS if any(row[k] > 0 for row in rows)]
    a = np.array([[row[k] for k in kinds] for row in rows], dtype=float)
    b = np.array(targets, dtype=float)
    weight = 1.0 / np.maximum(b, MIN_SECONDS)
    scale = np.abs(a * weight[:, None]).max(axis=0)
    scale[scale == 0] = 1.0
    coef = nnls(a * weight[:, None] / scale, b * weight) / scale
    out = {}
    for kind, value in zip(kinds, coef):
        if value > 0:
            out[KEYS[kind]] = float(1.0 / value) if kind == "throughput" else float(value)
    out["runs"] = len(rows)
    return out


def fit_linear(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """y ~ c0 + c1 x, relative least squares, both non-negative."""
    weight = 1.0 / np.maximum(y, 1e-9)
    a = np.stack([np.ones_like(x), x], axis=1) * weight[:, None]
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    c = nnls(a / scale, y * weight) / scale
    return float(c[0]), float(c[1])


def reference_rates(kind: str) -> dict:
    """The device class's reference rates: timed kernels for the CPU (the newest record), the data sheet for the GPU."""
    if kind == "cuda":
        return dict(ASSUMED["cuda"]["reference_rates"])
    records = [run for run in load_runs("reference-rates-cpu*.json")]
    if not records:
        raise SystemExit("no docs/bench/cost-model/reference-rates-cpu*.json: run scripts/bench_cost_model.py microbench first")
    record = records[-1]
    return {key: record[key] for key in ("flops_per_second", "float64_matmul_cost", "lapack_flops_per_second", "bytes_per_second",
                                         "host_elements_per_second")}


def fit_device(kind: str, runs: list[dict]) -> dict:
    from mla_convert.convert.estimate import PHASES, Sizes, expected_tensor_shapes, working_sets

    reference = reference_rates(kind)
    works = [work_of(run, reference["float64_matmul_cost"]) for run in runs]
    constants = {"reference_cores": runs[0]["threads"], "fitted_from": [run["name"] for run in runs],
                 "reference_rates": reference, "phases": {}}
    for phase in PHASES:
        constants["phases"][phase] = fit_phase(runs, works, phase, reference)
    if kind == "cuda":
        for key in ("device_name", "device_memory_bytes", "resident_weight_share"):
            constants[key] = ASSUMED["cuda"][key]
    startup = np.array([run["wall_seconds"] - sum(run["phase_seconds"].values()) for run in runs])
    tensors = np.array([len(expected_tensor_shapes(sizes_of(run).source)) for run in runs], dtype=float)
    fixed, per_tensor = fit_linear(tensors, startup)
    constants["startup"] = {"fixed_seconds": fixed, "seconds_per_tensor": per_tensor}
    sizes: list[Sizes] = [sizes_of(run) for run in runs]
    peak_sets = np.array([max(working_sets(z).values()) for z in sizes])
    rss = np.array([run["peak_rss_bytes"] for run in runs], dtype=float)
    if kind == "cpu":
        base, factor = fit_linear(peak_sets, rss)
        constants["memory"] = {"base_bytes": base, "working_set_factor": factor}
    else:
        host_layer = np.array([z.layer_params * z.stored for z in sizes], dtype=float)
        base, factor = fit_linear(host_layer, rss)
        device = np.array([run["peak_device_bytes"] - (run.get("resident_source_bytes") or 0) for run in runs], dtype=float)
        device_base, device_factor = fit_linear(peak_sets, device)
        constants["memory"] = {"base_bytes": base, "working_set_factor": factor, "device_base_bytes": device_base,
                               "device_working_set_factor": device_factor}
    return constants


def import_device_check() -> list[Path]:
    """H200 runs of device-convert-check.json -> records in the measured-run schema (configs and options rebuilt)."""
    from device_convert_check import LLAMA3_8B_SHAPE, SMOLLM2_SHAPE
    from make_synthetic_checkpoint import llama_config

    from mla_convert.options import ConvertOptions

    data = json.loads(DEVICE_CHECK.read_text())
    stories_config = json.loads((REPO.parent / "shared" / "assets" / "stories260k" / "config.json").read_text())
    written = []
    for case in data["cases"]:
        name = case["case"]
        if name.startswith("stories260K"):
            config, key = stories_config, "stories260k-fixed" if "fixed" in name else "stories260k-sampled"
        elif name.startswith("Llama-3-8B"):
            config, key = _synthetic_config(llama_config, LLAMA3_8B_SHAPE, 2), "llama3-8b-width-2"
        else:
            layers = int(name.split(",")[1].split()[0])
            config, key = _synthetic_config(llama_config, SMOLLM2_SHAPE, layers), f"smollm2-shaped-{layers}"
        for run in case["runs"]:
            if "error" in run:
                continue
            # the GPU machine's own CPU runs (16 threads, another processor) check how the CPU constants carry over; not fitted
            prefix, role = ("h200", "fit") if run["device"] == "cuda" else ("gpu-host-cpu16", "cross-check")
            rank, rope = (int(v) for v in run["shape"].split("+"))
            options = ConvertOptions(kv_lora_rank=rank, rope_dim=rope, dtype="fp32", device=run["device"]).to_dict()
            if "--calib-data" in case["args"]:
                options["calibration"]["data"] = "calibration.txt"
            record = {"name": f"{prefix}-{key}", "role": role,
                      "command": f"mla-convert convert SRC OUT --device {run['device']} --dtype fp32 -q " + " ".join(
                          a if not a.startswith("/") else Path(a).name for a in case["args"]),
                      "source": name, "config": config, "options": options, "device": run["device"], "threads": data["meta"]["cpu_threads"],
                      "wall_seconds": run["seconds"], "report_seconds": run["report_seconds"], "peak_rss_bytes": run["peak_rss_bytes"],
                      "peak_device_bytes": run["peak_device_bytes"], "resident_source_bytes": run["resident_source_bytes"],
                      "phase_seconds": run["phases"], "machine": {**data["meta"]}, "from": "docs/bench/device-convert-check.json"}
            path = RUNS / f"{record['name']}.json"
            path.write_text(json.dumps(record, indent=1) + "\n")
            written.append(path)
    return written


def _synthetic_config(llama_config, shape: dict, layers: int) -> dict:
    config = llama_config(shape["hidden"], shape["heads"], shape["kv_heads"], shape["intermediate"], layers, shape["vocab"])
    raw = json.loads(config.to_json_string())
    return raw


def fit(runs: list[dict] | None = None) -> dict:
    """Constants from `runs` (default: every recorded run; the validation leaves one out at a time)."""
    runs = load_runs() if runs is None else runs
    runs = [run for run in runs if run.get("role") not in ("cross-check", "reference")]
    cpu = [run for run in runs if run["device"] == "cpu"]
    cuda = [run for run in runs if run["device"] == "cuda"]
    constants = {
        "about": "Cost-model constants (mla_convert/convert/estimate.py), fitted by scripts/fit_cost_model.py from the runs "
                 "named in fitted_from (docs/bench/cost-model/). Rates are effective units per second of each phase's work by kind; "
                 "a missing rate means that kind did not explain any measured time.",
        "assumed": {kind: value["note"] for kind, value in ASSUMED.items()},
        "cpu": fit_device("cpu", cpu),
        "cuda": fit_device("cuda", cuda),
    }
    return constants


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--import-device-check", action="store_true", help="write the H200 runs as docs/bench/cost-model/h200-*.json")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args(argv)
    if args.import_device_check:
        for path in import_device_check():
            print(f"wrote {path.relative_to(REPO)}")
        return 0
    constants = fit()
    args.output.write_text(json.dumps(constants, indent=1, sort_keys=False) + "\n")
    print(f"wrote {args.output.relative_to(REPO) if args.output.is_relative_to(REPO) else args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
