"""One-shot conversion benchmark: quality per KV ratio on the project protocol, time and peak memory.

Each conversion runs as its own `mla-convert convert` process (exactly what a user runs), so its wall
time and its peak RSS (its own VmHWM, recorded in its report; counts mapped file pages too)
belong to the conversion alone.  Each result is then scored on the project's protocol: non-overlapping
windows, token-weighted NLL (WikiText-2 test, ctx 1024, first 40 windows for SmolLM2; the TinyStories
excerpt, ctx 256, 60 windows for stories260K).  The source model is scored in the same run.

    python scripts/bench_convert.py                      # both models, ratios 2 4 8, both methods
    python scripts/bench_convert.py --model stories260k  # one model
    python scripts/bench_convert.py --json run.json --write-benchmarks BENCHMARKS.md  # merged into the section
    python scripts/bench_convert.py --from-json a.json b.json --write-benchmarks BENCHMARKS.md  # combine runs

A measuring run with --write-benchmarks merges its rows into the section as --from-json does: the section is
rendered again from the JSON files its Command line names plus this run's --json (so --json is required then),
and its Command line names them all.

Reference figures in the written table come from issue "Conversion to stock DeepseekV3 MLA" (measured
on this protocol before this tool existed); they are quoted, not re-measured.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
from benchmarks_md import recorded_command, repo_path, write_marked_section  # noqa: E402

from mla_convert.io.paths import absolute_path, output_file_problems  # noqa: E402
from mla_convert.options import METHODS  # noqa: E402

SHARED = Path(os.environ.get("MLA_CONVERT_SHARED", REPO.parent / "shared"))
SECTION_BEGIN = "<!-- bench_convert:begin -->"
SECTION_END = "<!-- bench_convert:end -->"

PROTOCOLS = {
    "stories260k": dict(source=lambda: SHARED / "assets" / "stories260k", data=SHARED / "data" / "tinystories-valid-excerpt.txt",
                        context=256, windows=60, calib=[]),
    "smollm2": dict(source=None, data=SHARED / "data" / "wikitext-2-raw-test.txt", context=1024, windows=40, calib=[]),
}
# (ratio -> {column: value}) quoted from the issue, same protocol
REFERENCE = {
    "stories260k": {2: {"TransMLA": "10.05", "prototype": "7.17"}, 4: {"TransMLA": "64.06", "prototype": "23.4"},
                    8: {"TransMLA": "-", "prototype": "49.6"}},
    "smollm2": {2: {"TransMLA": "63.31 (160+32); 59.08 (128+64)", "MHA2MLA-style SVD": "1317", "prototype": "52.3"},
                4: {"TransMLA": "260.7", "MHA2MLA-style SVD": "5827", "prototype": "495 (10 windows)"},
                8: {"TransMLA": "666.9", "MHA2MLA-style SVD": "17697", "prototype": "1060 (10 windows)"}},
}

# time and peak RSS of the research converter on the same model, quoted from the issue (quiet machine)
RESOURCE_REFERENCE = {"smollm2": {"name": "TransMLA", "what": "160+32", "seconds": 258.0, "peak_bytes": 8.0e9}}


def source_path(model: str) -> Path:
    if model == "smollm2":
        from mla_convert.io.assets import fetch_smollm2

        return fetch_smollm2(quiet=True)
    return PROTOCOLS[model]["source"]()


def run_conversion(source: Path, out: Path, extra: list[str], threads: int | None) -> dict:
    command = [sys.executable, "-m", "mla_convert", "convert", str(source), str(out), "--quiet", *extra]
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    started = time.time()
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.time() - started
    process.stdout.read()
    stderr = process.stderr.read()
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"conversion failed: {shlex.join(command)}\n{stderr[-2000:]}")
    # the child's own high-water mark (VmHWM, recorded in its report): ru_maxrss from wait4 would include
    # this (large) parent's peak, which fork/exec pass on to children as a floor
    report = json.loads((out / "mla_convert.json").read_text())
    return {"seconds": seconds, "peak_rss_bytes": report["summary"]["peak_rss_bytes"],
            "command": "mla-convert convert SRC OUT " + shlex.join(extra)}


def score(folder: Path, data: Path, context: int, windows: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mla_convert.eval.perplexity import evaluate_perplexity

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    result = evaluate_perplexity(model, tokenizer, data.read_text(), context_length=context, max_windows=windows, progress=False)
    return result.perplexity


def effort_of(extra: list[str]) -> str:
    """The `--effort` the conversions run with: the last one in the arguments passed on, else the default."""
    effort = "default"
    for index, arg in enumerate(extra):
        if arg == "--effort" and index + 1 < len(extra):
            effort = extra[index + 1]
        elif arg.startswith("--effort="):
            effort = arg.split("=", 1)[1]
    return effort


def bench_model(model: str, ratios: list[float], methods: list[str], threads: int | None, extra: list[str]) -> dict:
    import torch

    if threads:
        torch.set_num_threads(threads)
    protocol = PROTOCOLS[model]
    source = source_path(model)
    rows = []
    source_ppl = score(source, protocol["data"], protocol["context"], protocol["windows"])
    print(f"{model}: source perplexity {source_ppl:.3f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-convert-") as work:
        for method in methods:
            for ratio in ratios:
                out = Path(work) / f"{method}-{ratio:g}x"
                args = ["--compression", f"{ratio:g}", "--method", method, *extra]
                run = run_conversion(source, out, args, threads)
                report = json.loads((out / "mla_convert.json").read_text())
                ppl = score(out, protocol["data"], protocol["context"], protocol["windows"])
                row = {"ratio": ratio, "method": method, "perplexity": ppl,
                       "shape": f"{report['options']['kv_lora_rank']}+{report['options']['rope_dim']}", **run}
                rows.append(row)
                print(f"  {method:16s} {ratio:g}x {row['shape']:>8s}  ppl {ppl:9.3f}  {run['seconds']:6.1f} s  "
                      f"peak RSS {run['peak_rss_bytes'] / 2**20:7.1f} MiB", flush=True)
                import shutil

                shutil.rmtree(out)
    return {"model": model, "effort": effort_of(extra), "source_perplexity": source_ppl, "rows": rows, "protocol": {
        "data": protocol["data"].name, "context": protocol["context"], "windows": protocol["windows"]},
        "source_weight_bytes": sum(p.stat().st_size for p in Path(source).glob("*.safetensors"))}


def markdown(results: list[dict], command: str) -> str:
    lines = [SECTION_BEGIN, "## One-shot conversion: quality, time, memory", "",
             f"Command: `{command}`", "",
             "Each conversion is a separate `mla-convert convert` process with default calibration (text sampled "
             "from the source model); time is its wall time and peak RSS its own VmHWM (includes mapped file "
             "pages). Perplexity: non-overlapping windows, token-weighted NLL. Reference columns are quoted from "
             "the issue (same protocol), not re-measured.", ""]
    if any("effort" not in result for result in results):
        lines += ["Runs without an `effort` field were measured before `--effort` existed (2026-11-29).  For stories260K "
                  "those conversions are today's `--effort thorough` (the same perplexities: see the `--effort` section, "
                  "which also has today's default); for SmolLM2 they are today's default (its layers were too costly to "
                  "refine by default then, and are now).", ""]
    for result in results:
        model, protocol = result["model"], result["protocol"]
        refs = REFERENCE[model]
        ref_cols = sorted({col for by_ratio in refs.values() for col in by_ratio})
        lines += [f"### {model} ({protocol['data']}, ctx {protocol['context']}, {protocol['windows']} windows; "
                  f"source {result['source_perplexity']:.2f})", "",
                  *([f"Rows measured by: `{result['command']}`" + (" (the later run's rows replace the earlier's)"
                                                                   if "`; `" in result["command"] else ""), ""]
                    if result.get("command") else []),
                  "| ratio | method | shape R+D | perplexity | x source | " + " | ".join(ref_cols) + " | time | peak RSS |",
                  "|---|---|---|---:|---:|" + "---|" * len(ref_cols) + "---:|---:|"]
        for row in result["rows"]:
            ratio = int(row["ratio"]) if float(row["ratio"]).is_integer() else row["ratio"]
            ref = [refs.get(ratio, {}).get(col, "") if row["method"] == "activation-aware" else "" for col in ref_cols]
            lines.append(f"| {ratio}x | {row['method']} | {row['shape']} | {row['perplexity']:.2f} | "
                         f"{row['perplexity'] / result['source_perplexity']:.2f} | " + " | ".join(ref) +
                         f" | {row['seconds']:.0f} s | {row['peak_rss_bytes'] / 2**20:.0f} MiB |")
        lines += ["", f"Source weights on disk: {result['source_weight_bytes'] / 2**20:.0f} MiB.", ""]
        budget = RESOURCE_REFERENCE.get(model)
        default = next((r for r in result["rows"] if r["method"] == "activation-aware" and r["ratio"] == 2), None)
        if budget and default:
            seconds, peak = default["seconds"], default["peak_rss_bytes"]
            lines += [f"Default 2x conversion against {budget['name']} on the same model ({budget['what']}, quoted from "
                      f"the issue): {seconds:.0f} s vs {budget['seconds']:.0f} s ({seconds / budget['seconds']:.2f}x its "
                      f"time; target <= 0.5x), peak RSS {peak / 1e9:.3f} GB vs {budget['peak_bytes'] / 1e9:.1f} GB "
                      f"(1/{budget['peak_bytes'] / peak:.1f} of its memory; target <= 1/15).", ""]
    lines.append(SECTION_END)
    return "\n".join(lines) + "\n"


def merge_results(results: list[dict]) -> list[dict]:
    """One result per model; a later run's row replaces an earlier one of the same ratio and method.

    Each row keeps the command that measured it, so a table mixing runs says which row came from which.
    """
    merged: dict[str, dict] = {}
    for result in results:
        for row in result["rows"]:
            row.setdefault("run_command", result.get("command"))
        if result["model"] not in merged:
            merged[result["model"]] = {**result, "rows": list(result["rows"])}
            continue
        target = merged[result["model"]]
        replaced = {(row["ratio"], row["method"]) for row in result["rows"]}
        target["rows"] = [row for row in target["rows"] if (row["ratio"], row["method"]) not in replaced] + result["rows"]
        target["rows"].sort(key=lambda row: (row["method"] != "activation-aware", row["method"], row["ratio"]))
    for result in merged.values():
        commands = list(dict.fromkeys(row.get("run_command") for row in result["rows"] if row.get("run_command")))
        result["command"] = "`; `".join(commands) if commands else result.get("command")
    return list(merged.values())


def write_section(path: Path, text: str) -> None:
    write_marked_section(path, SECTION_BEGIN, SECTION_END, text)


def section_sources(path: Path) -> list[Path] | None:
    """The JSON files the section in `path` was rendered from (its Command line's --from-json list, relative to
    the repo); [] when the file has no section; None when its section was not rendered from JSON files."""
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    if SECTION_BEGIN not in text:
        return []
    body = text.split(SECTION_BEGIN, 1)[1].split(SECTION_END, 1)[0]
    line = next((line for line in body.splitlines() if line.startswith("Command: `")), "")
    words = shlex.split(line[len("Command: `"):].rstrip("`")) if line else []
    if "--from-json" not in words:
        return None
    files = []
    for word in words[words.index("--from-json") + 1:]:
        if word.startswith("-"):
            break
        files.append(Path(word) if Path(word).is_absolute() else REPO / word)
    return files


def ratio_list(text: str) -> list[float]:
    try:
        ratios = [float(r) for r in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers (e.g. 2,4,8)") from None
    if not ratios or any(not r > 1 for r in ratios):
        raise argparse.ArgumentTypeError(f"{text!r}: each ratio must be above 1")
    return ratios


def method_list(text: str) -> list[str]:
    methods = [m.strip() for m in text.split(",")]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown method {', '.join(map(repr, unknown))}; choose from {', '.join(METHODS)}")
    return methods


def parse_args(argv: list[str] | None = None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """Everything is checked here, before the first (minutes-long) scoring of the source."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["stories260k", "smollm2", "both"], default="both")
    parser.add_argument("--ratios", type=ratio_list, default=[2.0, 4.0, 8.0], help="comma-separated (default 2,4,8)")
    parser.add_argument("--methods", type=method_list, default=["activation-aware", "svd"],
                        help=f"comma-separated, of {', '.join(METHODS)} (default activation-aware,svd)")
    parser.add_argument("--threads", type=int, default=None, help="OMP threads for every process (default: torch's)")
    parser.add_argument("--write-benchmarks", type=absolute_path, default=None,
                        help="merge the rows into this file's section (a measuring run needs --json)")
    parser.add_argument("--json", type=absolute_path, default=None)
    parser.add_argument("--from-json", type=absolute_path, nargs="+", default=None, metavar="RESULTS.json",
                        help="no conversions: render the section from --json files of earlier runs (each model's "
                             "rows keep the command that measured them)")
    parser.add_argument("extra", nargs="*", help="extra arguments for `mla-convert convert` (after --)")
    args = parser.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be at least 1")
    for flag, path in (("--json", args.json), ("--write-benchmarks", args.write_benchmarks)):
        problems = output_file_problems(path, flag)
        if problems:
            parser.error(problems[0])
    args.results = []
    for path in args.from_json or []:
        try:
            args.results += json.loads(path.read_text())
        except FileNotFoundError:
            parser.error(f"--from-json {path}: no such file")
        except (OSError, ValueError) as error:
            parser.error(f"--from-json {path}: not a bench_convert JSON file ({error})")
    args.earlier = []
    if args.write_benchmarks and not args.from_json:
        if args.json is None:
            parser.error("--write-benchmarks on a measuring run needs --json FILE: the section is merged from JSON "
                         "files and its Command line must name this run's")
        sources = section_sources(args.write_benchmarks)
        if sources is None:
            parser.error(f"--write-benchmarks {args.write_benchmarks}: its section was not rendered with --from-json, "
                         "so its rows cannot be merged; render it with --from-json first")
        missing = [str(p) for p in sources if not p.is_file()]
        if missing:
            parser.error(f"--write-benchmarks: the section's JSON files are missing: {', '.join(missing)}")
        args.earlier = [p for p in sources if os.path.abspath(p) != os.path.abspath(args.json)]
    return parser, args


def main(argv: list[str] | None = None) -> None:
    parser, args = parse_args(argv)
    if args.from_json:
        results = merge_results(args.results)
        text = markdown(results, recorded_command(__file__, argv, parser))
        print(text)
        if args.write_benchmarks:
            write_section(args.write_benchmarks, text)
        return
    models = ["stories260k", "smollm2"] if args.model == "both" else [args.model]
    results = [bench_model(model, args.ratios, args.methods, args.threads, args.extra) for model in models]
    command = recorded_command(__file__, argv, parser)
    for result in results:
        result["command"] = command
    text = markdown(results, command)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    if args.write_benchmarks:
        # rendered as `--from-json EARLIER... THIS_RUN.json` would render it: the earlier rows stay, this run's
        # replace those of the same model, ratio and method
        earlier = [result for path in args.earlier for result in json.loads(path.read_text())]
        sources = [repo_path(p) for p in [*args.earlier, args.json]]
        command = shlex.join(["python", "scripts/bench_convert.py", "--from-json", *sources,
                              "--write-benchmarks", repo_path(args.write_benchmarks)])
        text = markdown(merge_results(earlier + results), command)
        write_section(args.write_benchmarks, text)
    print(text)


if __name__ == "__main__":
    main()
