#!/usr/bin/env python
"""Benchmark: perplexity against KV-cache size for stories260K and SmolLM2 (`mla_convert.eval.sweep.run_sweep`).

For each model: one calibration, conversions at every ratio with the activation-aware method and with
weight-only SVD, every model (the source included) scored on the project's protocol text; the table,
CSV, JSON and plot go to docs/sweeps/<model>/, and the "## KV-cache sweeps" section of BENCHMARKS.md
gets (or replaces) that model's part, with the exact command.  Models not run keep their part.

Protocols (the project's; every setting can be overridden on the command line):

    stories260k  ../shared/assets/stories260k on tinystories-valid-excerpt.txt, 256-token windows x 60,
                 calibration text sampled from the model itself
    smollm2      SmolLM2-135M-Instruct (`mla-convert fetch-demo-model`) on wikitext-2-raw-test.txt,
                 1024-token windows x 40, calibration text sampled from the model itself
                 (both: the converter's default calibration size and sequential calibration)

    python scripts/bench_sweeps.py --model stories260k                   # a few minutes on 1 CPU thread
    python scripts/bench_sweeps.py --model smollm2                       # ~1 h on 1 CPU thread
    python scripts/bench_sweeps.py --model smollm2 --max-windows 10      # quicker, marked as not the protocol
    python scripts/bench_sweeps.py --replot                              # redraw from docs/sweeps/*/sweep.json
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shlex
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SHARED = Path(os.environ.get("MLA_CONVERT_SHARED", REPO.parent / "shared"))

from mla_convert.convert.decisions import Progress  # noqa: E402  (after the repo is importable)
from mla_convert.options import CalibrationOptions  # noqa: E402

SECTION_BEGIN = "<!-- bench_sweeps:begin -->"
SECTION_END = "<!-- bench_sweeps:end -->"
HEADING = "## KV-cache sweeps: perplexity against cache size"
DOCS = REPO / "docs" / "sweeps"


@dataclass(frozen=True)
class Protocol:
    """One model's sweep settings; `calib_data=None` means text sampled from the model itself."""

    name: str
    title: str
    data: str
    context: int
    max_windows: int
    ratios: str
    calib_data: str | None
    calib_samples: int
    calib_seq_len: int

    def source(self) -> str:
        if self.name == "smollm2":
            from mla_convert.io.assets import fetch_smollm2

            return str(fetch_smollm2(quiet=True))
        return str(SHARED / "assets" / "stories260k")


# the product's defaults (text sampled from the model): a sweep shows what `mla-convert convert` gives
DEFAULT_CALIBRATION = CalibrationOptions()
PROTOCOLS = {
    "stories260k": Protocol("stories260k", "stories260K", str(SHARED / "data" / "tinystories-valid-excerpt.txt"),
                            context=256, max_windows=60, ratios="2,4,8", calib_data=None,
                            calib_samples=DEFAULT_CALIBRATION.num_samples, calib_seq_len=DEFAULT_CALIBRATION.seq_len),
    "smollm2": Protocol("smollm2", "SmolLM2-135M-Instruct", str(SHARED / "data" / "wikitext-2-raw-test.txt"),
                        context=1024, max_windows=40, ratios="2,4,8", calib_data=None,
                        calib_samples=DEFAULT_CALIBRATION.num_samples, calib_seq_len=DEFAULT_CALIBRATION.seq_len),
}


class PrintProgress(Progress):
    """Sweep-level messages with elapsed time; the converter's phases only with --verbose.  (A subclass of the
    converter's `Progress`, so a hook it gains later, such as `end`, is there: without it the sweep crashed.)"""

    def __init__(self, verbose: bool):
        self.verbose = verbose
        self.started = time.time()

    def _stamp(self) -> str:
        return f"[{time.time() - self.started:7.1f}s]"

    def phase(self, name: str, total: int | None = None) -> None:
        if self.verbose:
            print(f"{self._stamp()}   {name}" + (f" ({total})" if total else ""), file=sys.stderr, flush=True)

    def advance(self, done: int, total: int | None = None) -> None:
        pass

    def message(self, text: str) -> None:
        print(f"{self._stamp()} {text}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", choices=sorted(PROTOCOLS), help="model to sweep (repeatable; default: both)")
    parser.add_argument("--ratios", help="KV-cache ratios, e.g. 2,4,8 (default: the protocol's)")
    parser.add_argument("--methods", default="activation-aware,svd", help="conversion methods to compare")
    parser.add_argument("--data", help="evaluation text (default: the protocol's)")
    parser.add_argument("--context", type=int, help="tokens per evaluation window (default: the protocol's)")
    parser.add_argument("--max-windows", type=int, help="evaluation windows (default: the protocol's)")
    parser.add_argument("--calib-data", help="calibration text; 'sample' = text sampled from the model (default: the protocol's)")
    parser.add_argument("--calib-samples", type=int, help="calibration windows (default: the protocol's)")
    parser.add_argument("--calib-seq-len", type=int, help="tokens per calibration window (default: the protocol's)")
    parser.add_argument("--seed", type=int, default=0, help="seed for sampled calibration text")
    parser.add_argument("--refine-steps", type=int, default=None, help="per-layer refinement steps (default: the converter's auto)")
    parser.add_argument("--no-sequential", dest="sequential", action="store_false",
                        help="calibrate every layer on the source's activations (default: on the converted layers' outputs)")
    parser.add_argument("--dtype", default="auto", help="export (and so evaluation) dtype: auto, bf16 or fp32")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 on the shared 2-core box)")
    parser.add_argument("--out-dir", type=Path, default=DOCS, help="where <model>/sweep.{md,csv,json,png} go")
    parser.add_argument("--no-markdown", action="store_true", help="do not touch BENCHMARKS.md")
    parser.add_argument("--verbose", action="store_true", help="print every conversion phase")
    parser.add_argument("--replot", action="store_true",
                        help="no sweep: redraw plots and tables and rewrite BENCHMARKS.md from the saved sweep.json files")
    args = parser.parse_args(argv)
    for flag in ("threads", "context", "max_windows", "calib_samples", "calib_seq_len"):
        value = getattr(args, flag)
        if value is not None and value < 1:  # 0 used to mean "the protocol's" without a word
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    return args


def settings_for(protocol: Protocol, args: argparse.Namespace) -> Protocol:
    """The protocol with the command line's overrides applied."""
    calib_data = protocol.calib_data
    if args.calib_data is not None:
        calib_data = None if args.calib_data == "sample" else args.calib_data
    return replace(
        protocol,
        data=protocol.data if args.data is None else args.data,
        context=protocol.context if args.context is None else args.context,
        max_windows=protocol.max_windows if args.max_windows is None else args.max_windows,
        ratios=protocol.ratios if args.ratios is None else args.ratios,
        calib_data=calib_data,
        calib_samples=protocol.calib_samples if args.calib_samples is None else args.calib_samples,
        calib_seq_len=protocol.calib_seq_len if args.calib_seq_len is None else args.calib_seq_len,
    )


def deviations(used: Protocol, protocol: Protocol) -> list[str]:
    """Human-readable list of the settings that differ from the project protocol."""
    out = []
    for name in ("data", "context", "max_windows", "ratios", "calib_data", "calib_samples", "calib_seq_len"):
        a, b = getattr(used, name), getattr(protocol, name)
        if a != b:
            out.append(f"{name.replace('_', '-')} {_short(a)} (protocol: {_short(b)})")
    return out


def _short(value) -> str:
    if value is None:
        return "sampled from the model"
    text = str(value)
    return Path(text).name if os.sep in text else text


def run_one(name: str, args: argparse.Namespace, command: str) -> str:
    import torch
    import transformers

    from mla_convert.convert import ConvertOptions
    from mla_convert.eval.sweep import run_sweep

    protocol = PROTOCOLS[name]
    used = settings_for(protocol, args)
    progress = PrintProgress(args.verbose)
    progress.message(f"{protocol.title}: ratios {used.ratios}, {used.max_windows} x {used.context}-token windows of {_short(used.data)}")
    started = time.time()
    out_dir = args.out_dir / name
    calibration = CalibrationOptions(data=used.calib_data, num_samples=used.calib_samples, seq_len=used.calib_seq_len,
                                     seed=args.seed)
    options = ConvertOptions(dtype=args.dtype, refine_steps=args.refine_steps, sequential=args.sequential)
    result = run_sweep(protocol.source(), used.ratios, used.data, out_dir, context_length=used.context,
                       max_windows=used.max_windows, methods=args.methods, calibration=calibration, options=options,
                       model_name=protocol.title, progress=progress,
                       overwrite=True)  # it regenerates docs/sweeps/<model>: replacing the committed run is its purpose
    seconds = time.time() - started
    # how this run was made, kept in sweep.json so --replot can rebuild the BENCHMARKS.md part exactly
    result.settings["bench"] = {
        "command": command, "seconds": round(seconds, 1), "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()} Linux, {os.cpu_count()} CPU cores (shared)",
        "threads": torch.get_num_threads(), "torch": torch.__version__, "transformers": transformers.__version__,
        "settings": asdict(used),
    }
    result.save(out_dir)
    progress.message(f"{protocol.title}: done in {seconds / 60:.1f} min; files in {out_dir}")
    print(result.markdown())
    return render_block(protocol, result, out_dir)


def replot_one(name: str, args: argparse.Namespace) -> str:
    """Redraw the plot and tables of an earlier run from its sweep.json (no conversion, no evaluation)."""
    from mla_convert.eval.sweep import load_sweep

    out_dir = args.out_dir / name
    result = load_sweep(out_dir / "sweep.json")
    result.save(out_dir)
    return render_block(PROTOCOLS[name], result, out_dir)


def render_block(protocol: Protocol, result, out_dir: Path) -> str:
    bench = result.settings.get("bench", {})
    rel = os.path.relpath(out_dir, REPO)
    changed = deviations(Protocol(**bench["settings"]), protocol) if "settings" in bench else []
    reduced = ("**Not the project protocol:** " + "; ".join(changed) + ".\n\n") if changed else ""
    threads = bench.get("threads", "?")
    return f"""### {protocol.title}

{reduced}{result.describe_protocol()}
Run {bench.get('date', '?')} on {bench.get('machine', '?')}, {threads} torch thread{'s' if threads != 1 else ''},
torch {bench.get('torch', '?')}, transformers {bench.get('transformers', '?')}; whole sweep {bench.get('seconds', 0) / 60:.1f} min.

{result.markdown()}

![{protocol.title}: perplexity against KV-cache size]({rel}/sweep.png)

Files: [`{rel}/sweep.csv`]({rel}/sweep.csv), [`{rel}/sweep.json`]({rel}/sweep.json).
Command: `{bench.get('command', '?')}`
"""


# --------------------------------------------------------------------------- BENCHMARKS.md
def _block_markers(name: str) -> tuple[str, str]:
    return f"<!-- bench_sweeps:{name}:begin -->", f"<!-- bench_sweeps:{name}:end -->"


def existing_blocks(text: str) -> dict[str, str]:
    """The per-model blocks of the current section, so a run of one model keeps the others."""
    blocks = {}
    for name in PROTOCOLS:
        begin, end = _block_markers(name)
        match = re.search(re.escape(begin) + r"\n(.*?)" + re.escape(end), text, re.S)
        if match:
            blocks[name] = match.group(1)
    return blocks


def render_section(blocks: dict[str, str]) -> str:
    parts = [HEADING, "",
             "`scripts/bench_sweeps.py` converts each model at several KV-cache ratios with one calibration pass "
             "(`mla_convert.eval.sweep.run_sweep`), once with the activation-aware factorization and once with "
             "weight-only SVD of the same shapes, and scores every model, the source included, on the same "
             "non-overlapping windows (token-weighted NLL). \"ratio\" is the exact source / MLA cache size from "
             "the shapes; \"attn. error\" is the conversion's mean relative attention-output error on its "
             "calibration windows; times are wall-clock seconds on this machine.", ""]
    for name in PROTOCOLS:  # fixed order, whichever ran last
        if name in blocks:
            begin, end = _block_markers(name)
            parts += [begin, blocks[name].rstrip("\n"), end, ""]
    return "\n".join(parts).rstrip("\n") + "\n"


def write_section(path: Path, new_blocks: dict[str, str]) -> None:
    """Replace this script's marked section of BENCHMARKS.md (keeping models not rerun), or append it."""
    text = path.read_text(encoding="utf-8") if path.exists() else "# Benchmarks\n"
    if SECTION_BEGIN in text and SECTION_END in text:
        before, rest = text.split(SECTION_BEGIN, 1)
        current, after = rest.split(SECTION_END, 1)
        blocks = {**existing_blocks(current), **new_blocks}
        text = before + SECTION_BEGIN + "\n" + render_section(blocks) + SECTION_END + after
    else:
        text = text.rstrip("\n") + "\n\n" + SECTION_BEGIN + "\n" + render_section(new_blocks) + SECTION_END + "\n"
    path.write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    from mla_convert.errors import MLAConvertError

    command = "python " + shlex.join([os.path.relpath(__file__, REPO), *(sys.argv[1:] if argv is None else argv)])
    blocks = {}
    for name in args.model or list(PROTOCOLS):
        if args.replot and not (args.out_dir / name / "sweep.json").exists():
            print(f"{name}: no {args.out_dir / name / 'sweep.json'} to redraw; skipped", file=sys.stderr)
            continue
        try:
            blocks[name] = replot_one(name, args) if args.replot else run_one(name, args, command)
        except MLAConvertError as error:
            print(f"error: {name}: {error}", file=sys.stderr)
            return 2
        if not args.no_markdown:  # after each model, so a later failure keeps the earlier one
            write_section(REPO / "BENCHMARKS.md", {name: blocks[name]})
            print(f"wrote the {PROTOCOLS[name].title} part of '{HEADING}' in BENCHMARKS.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
