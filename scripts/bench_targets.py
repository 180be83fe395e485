"""What each `--target` costs in transformers: perplexity of the serving export vs the default export (issue 13).

  python scripts/bench_targets.py --work WORK_DIR [--models stories260k,smollm2] --write-benchmarks BENCHMARKS.md
  python scripts/bench_targets.py --from-json WORK_DIR/*.eval.json --write-benchmarks BENCHMARKS.md

Per model: the default export (`--target transformers`) and each serving target at the same shape, converted by
`mla-convert convert` with the same (default) calibration, then `mla-convert eval SERVING --baseline DEFAULT`
on one text (stories260K: tinystories excerpt, ctx 256, 60 windows; SmolLM2: WikiText-2 test, ctx 1024, 40
windows, the protocol of BENCHMARKS' one-shot table).  vLLM allows SmolLM2 only 256+64 (1.2x), so the
vllm / all targets are compared with a default export at 256+64; stories260K has no vLLM shape at all.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
from benchmarks_md import write_marked_section  # noqa: E402

from mla_convert.io.paths import absolute_path, output_file_problems  # noqa: E402

BEGIN, END = "<!-- bench_targets:begin -->", "<!-- bench_targets:end -->"
SHARED = REPO.parent / "shared"
MODELS = {
    "stories260k": {"source": SHARED / "assets" / "stories260k", "data": SHARED / "data" / "tinystories-valid-excerpt.txt",
                    "context": 256, "windows": 60,
                    "pairs": [("2x", ["--compression", "2"], ["llama.cpp"])]},
    "smollm2": {"source": Path.home() / ".cache" / "mla-convert" / "SmolLM2-135M-Instruct",
                "data": SHARED / "data" / "wikitext-2-raw-test.txt", "context": 1024, "windows": 40,
                "pairs": [("2x", ["--compression", "2"], ["llama.cpp"]),
                          ("256+64", ["--kv-lora-rank", "256", "--rope-dim", "64"], ["vllm", "all"])]},
}


def sh(*args: str | Path) -> None:
    print("+", " ".join(map(str, args)), flush=True)
    subprocess.run([str(a) for a in args], check=True, cwd=REPO)


def run(work: Path, models: list[str]) -> list[Path]:
    """Convert and evaluate; returns the eval JSON files (one per serving target)."""
    outputs = []
    for name in models:
        spec = MODELS[name]
        for label, shape, targets in spec["pairs"]:
            default = work / f"{name}-{label}-transformers"
            if not (default / "config.json").exists():
                sh(sys.executable, "-m", "mla_convert", "convert", spec["source"], default, "--dtype", "fp32", "-q", *shape)
            for target in targets:
                out = work / f"{name}-{label}-{target}"
                if not (out / "config.json").exists():
                    # the serving targets pick their own shape (vllm / all: 256+64 for SmolLM2, what `shape` names)
                    args = shape if target == "llama.cpp" else []
                    sh(sys.executable, "-m", "mla_convert", "convert", spec["source"], out, "--dtype", "fp32", "-q",
                       "--target", target, *args)
                result = work / f"{name}-{label}-{target}.eval.json"
                if not result.exists():
                    sh(sys.executable, "-m", "mla_convert", "eval", out, "--baseline", default, "--data", spec["data"],
                       "--context", str(spec["context"]), "--max-windows", str(spec["windows"]), "--device", "cpu",
                       "--json", result)
                outputs.append(result)
    return outputs


def section(files: list[Path]) -> str:
    rows = []
    for path in sorted(files):
        data = json.loads(Path(path).read_text())
        settings, results = data["settings"], data["results"]
        base = results[data["baseline"]]
        (serving_key,) = [k for k in results if k != data["baseline"]]
        serving = results[serving_key]
        folder = Path(settings["model"])
        report = json.loads((folder / "mla_convert.json").read_text()) if (folder / "mla_convert.json").exists() else {}
        options = report.get("options", {})
        extra = (report.get("serving") or {}).get("extra_values", {})
        rows.append((
            Path(settings["data"]).name.split(".")[0], f"{options.get('kv_lora_rank')}+{options.get('rope_dim')}",
            options.get("target", "?"), f"{base['perplexity']:.6f}", f"{serving['perplexity']:.6f}",
            f"{serving['perplexity'] / base['perplexity'] - 1:+.2e}",
            ", ".join(f"{k.replace('_', ' ')} +{v:,}" for k, v in extra.items() if v) or "-",
            f"{settings['context_length']} x {base['num_windows']} ({base['num_scored_tokens']:,} tokens)",
        ))
    lines = [BEGIN, "## Serving targets: what `--target` costs in transformers (issue 13)", "",
             "Command: `python scripts/bench_targets.py --work WORK_DIR --write-benchmarks BENCHMARKS.md` (WORK_DIR: any scratch folder)", "",
             "Each serving export against the default export (`--target transformers`) of the same source and shape, both "
             "converted with default settings (fp32, calibration sampled from the source), scored on the same windows by "
             "`mla-convert eval SERVING --baseline DEFAULT`. The serving transforms are exact except the latent-scale refit "
             "(the largest calibration token at 1e-2 of eps instead of the worst-case bound 1e-5) and the identity query path "
             "(exact up to eps / mean(h^2)); the bias removal applies only to biased sources (none here). Extra values: weights "
             "the engines need (vLLM's own lm_head for a tied source; llama.cpp's q_lora_rank = hidden).", "",
             "| text | shape | target | default export ppl | serving export ppl | relative change | extra values | windows |",
             "|---|---|---|---:|---:|---:|---|---|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    lines += ["", END]
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    """Every path is made absolute here, from the caller's folder: the conversions run with cwd=REPO."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=absolute_path, help="scratch folder for the exports and eval JSON files")
    ap.add_argument("--models", default="stories260k,smollm2", help=f"comma-separated, of: {', '.join(MODELS)}")
    ap.add_argument("--from-json", nargs="*", type=absolute_path, help="render these eval JSON files instead of running")
    ap.add_argument("--write-benchmarks", type=absolute_path)
    a = ap.parse_args(argv)
    if a.from_json is not None:
        if not a.from_json:
            ap.error("--from-json: no files given (a glob that matched nothing?)")
        missing = [str(f) for f in a.from_json if not f.is_file()]
        if missing:
            ap.error(f"--from-json: no such file: {', '.join(missing)}")
    elif a.work is None:
        ap.error("one of --work WORK_DIR (run the conversions) or --from-json FILES (render results) is required")
    a.models = [m.strip() for m in a.models.split(",") if m.strip()]
    unknown = [m for m in a.models if m not in MODELS]
    if unknown or not a.models:
        ap.error(f"--models: unknown model {', '.join(unknown) or '(none given)'}; choose from {', '.join(MODELS)}")
    if a.write_benchmarks is not None:
        problems = output_file_problems(a.write_benchmarks, "--write-benchmarks")
        if problems:
            ap.error(problems[0])
    return a


def main(argv=None):
    a = parse_args(argv)
    files = a.from_json if a.from_json is not None else run(a.work, a.models)
    text = section(files)
    print(text)
    if a.write_benchmarks:
        write_marked_section(a.write_benchmarks, BEGIN, END, text)

if __name__ == "__main__":
    main()
