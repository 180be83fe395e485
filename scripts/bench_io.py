"""Benchmark: copy a multi-GB checkpoint layer by layer through CheckpointReader + CheckpointWriter.

The claim under test is that streaming IO keeps the converter's memory far below the checkpoint size.
This script
  1. writes a synthetic Llama-shaped bf16 checkpoint (>= 4 GiB by default) with
     scripts/make_synthetic_checkpoint.py, and drops it from the page cache;
  2. copies it in a child process: for each layer, `reader.get_many(that layer's names)`,
     `writer.add(...)` per tensor and `reader.close()`, then `writer.commit()`, in the source's tensor
     order and with the source's shard limit;
  3. measures that child's memory and wall time, verifies the copy (identical file set and index,
     sampled tensors byte-identical, every shard byte-identical), and
  4. writes the "## Streaming checkpoint IO" section of BENCHMARKS.md (only that section).

What "peak RSS" means here: `ru_maxrss` from wait4() for the copying child alone, i.e. the kernel's
VmHWM, exact (no sampling) and counting everything resident in the process, mapped file pages included.
That is the headline number and the one the < 25 % target is checked against.  The reader copies each
tensor out of its shard with positioned reads (no memory map: `mla_convert/io/shard_file.py`), so a layer's
tensors are anonymous memory until the copy drops them after the layer, and the writer keeps nothing of a tensor
after `add` returns (its bytes go straight to disk).  Pages of the files read and written are page cache, not
RSS.  The peaks of RssAnon and RssFile, sampled from /proc/<pid>/status every few ms by the parent, show the split.

A child started with posix_spawn (vfork: it runs on the parent's memory until exec) inherits the
parent's peak RSS as a floor of its ru_maxrss.  So the synthetic checkpoint is made in a process of its
own, the measuring parent does not import torch before the copy has finished, and the copying child
also reports its own VmHWM at exit as a cross-check.

    python scripts/bench_io.py                      # ~4.2 GiB checkpoint under /tmp, then deleted
    python scripts/bench_io.py --min-size-gib 8 --max-shard-size 2GB --keep
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmarks_md import write_heading_section  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

SECTION = "## Streaming checkpoint IO"
TARGET_RATIO = 0.25


# --------------------------------------------------------------------------- the measured copy (child process)
def copy_layer_by_layer(source: Path, output: Path, max_shard_size: str) -> dict:
    """Copy `source` to `output` the way a conversion streams it: globals, then one layer at a time."""
    from mla_convert.io.reader import CheckpointReader
    from mla_convert.io.writer import SIDECAR_FILES, CheckpointWriter
    from mla_convert.source.config import SourceConfig

    baseline = read_status(os.getpid())
    started = time.perf_counter()
    config = SourceConfig.from_folder(source)
    spec = config.architecture
    globals_ = {"embed": spec.embed, "final_norm": spec.final_norm} | ({} if config.tied_embeddings else {"lm_head": spec.lm_head})
    largest_read = [0]
    with CheckpointReader(source) as reader, CheckpointWriter(output, max_shard_size=max_shard_size) as writer:

        def copy(names: list[str]) -> None:
            tensors = reader.get_many(names)
            largest_read[0] = max(largest_read[0], sum(t.numel() * t.element_size() for t in tensors.values()))
            for name in names:
                writer.add(name, tensors.pop(name))  # written to disk now; nothing of it kept
            # The tensors were views of the shard's memory map: unmap it, or every page read stays RSS.
            reader.close()

        copy([globals_["embed"]])
        for layer in range(config.num_layers):
            copy(list(config.layer_weight_names(layer).values()))
        copy([name for role, name in globals_.items() if role != "embed"])
        writer.copy_sidecars(source, SIDECAR_FILES + ("config.json",))
        writer.commit()
        files_opened = reader.files_opened
    own_peak = read_status(os.getpid())
    return {
        "own_vm_hwm_kib": own_peak.get("VmHWM", 0),
        "seconds": time.perf_counter() - started,
        "baseline_rss_anon_kib": baseline.get("RssAnon", 0),
        "baseline_vm_rss_kib": baseline.get("VmRSS", 0),
        "files_opened": files_opened,
        "largest_read_bytes": largest_read[0],
    }


def make_source_checkpoint(source: Path, min_size_gib: float, max_shard_size: str) -> dict:
    """The synthetic source (run in its own process), evicted from the page cache so the copy reads the disk."""
    from make_synthetic_checkpoint import evict_from_page_cache, layers_for_size, make_synthetic_checkpoint

    layers = layers_for_size(int(min_size_gib * 2**30), 4096, 32, 8, 14336, 32000)
    print(f"writing a synthetic {layers}-layer Llama checkpoint to {source} ...", flush=True)
    synthetic = make_synthetic_checkpoint(source, layers=layers, max_shard_size=max_shard_size)
    evict_from_page_cache(sorted(source.glob("*.safetensors")))
    return synthetic


def read_status(pid: int) -> dict[str, int]:
    """Memory fields (KiB) of /proc/<pid>/status; empty once the process is gone."""
    fields = {}
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                    fields[key] = int(value.split()[0])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return fields


# --------------------------------------------------------------------------- the driver (parent process)
def run_measured_copy(source: Path, output: Path, max_shard_size: str, result_file: Path, interval: float = 0.005) -> dict:
    """Run the copy in a child; sample its memory from outside (no GIL contention with the child)."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--copy-child", str(source), str(output), max_shard_size, str(result_file)]
    pid = os.posix_spawn(sys.executable, argv, os.environ)
    peaks = {"RssAnon": 0, "RssFile": 0, "VmRSS": 0}
    samples = 0
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            break
        fields = read_status(pid)
        if fields:
            samples += 1
            for key in peaks:
                peaks[key] = max(peaks[key], fields.get(key, 0))
        time.sleep(interval)
    if not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0:
        raise SystemExit(f"copy child failed (wait status {status})")
    child = json.loads(result_file.read_text())
    return {
        **child,
        "peak_rss_anon_kib": peaks["RssAnon"],
        "peak_rss_file_kib": peaks["RssFile"],
        "peak_vm_rss_sampled_kib": peaks["VmRSS"],
        "ru_maxrss_kib": usage.ru_maxrss,  # Linux: KiB; kernel's VmHWM of this child alone
        "samples": samples,
        "sample_interval_s": interval,
    }


def verify_copy(source: Path, output: Path) -> dict:
    """Identical index and file set; sampled tensors byte-identical; every shard byte-identical whole."""
    import filecmp

    import torch
    from safetensors import safe_open

    from mla_convert.io.reader import CheckpointReader

    index_name = "model.safetensors.index.json"
    problems = []
    if sorted(os.listdir(source)) != sorted(os.listdir(output)):
        problems.append(f"file sets differ: {sorted(set(os.listdir(source)) ^ set(os.listdir(output)))}")
    if (source / index_name).exists() and (source / index_name).read_text() != (output / index_name).read_text():
        problems.append("index files differ")
    weight_map = CheckpointReader(source).weight_map
    config = json.loads((source / "config.json").read_text())
    last, middle = config["num_hidden_layers"] - 1, config["num_hidden_layers"] // 2
    sample = [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        f"model.layers.{middle}.mlp.down_proj.weight",
        f"model.layers.{middle}.self_attn.v_proj.weight",
        f"model.layers.{last}.post_attention_layernorm.weight",
        "model.norm.weight",
        "lm_head.weight",
    ]
    for name in sample:
        with safe_open(str(source / weight_map[name]), "pt") as a, safe_open(str(output / weight_map[name]), "pt") as b:
            x, y = a.get_tensor(name), b.get_tensor(name)
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8)):
                problems.append(f"{name} differs")
    shards = sorted(set(weight_map.values()))
    for shard in shards:
        if not filecmp.cmp(source / shard, output / shard, shallow=False):
            problems.append(f"{shard} differs")
    return {"problems": problems, "sampled_tensors": len(sample), "shards": len(shards)}


def disk_write_baseline(folder: Path, size: int = 2**30) -> float:
    """Bytes/s of a plain sequential write + fsync in `folder`: the ceiling for the copy's write side."""
    path = folder / "disk-baseline.bin"
    chunk = os.urandom(16 * 2**20)
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        for _ in range(size // len(chunk)):
            os.write(fd, chunk)
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - started
    path.unlink()
    return size / seconds


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.glob("*.safetensors"))


def write_section(markdown: Path, section: str) -> None:
    """Replace this script's section of BENCHMARKS.md (heading to the next heading or marker), or append it."""
    write_heading_section(markdown, SECTION, section)


def render_section(command: str, synthetic: dict, measured: dict, verified: dict, size: int) -> str:
    gib = 2**30
    anon = measured["peak_rss_anon_kib"] * 1024
    hwm = measured["ru_maxrss_kib"] * 1024
    file_backed = measured["peak_rss_file_kib"] * 1024
    base = measured["baseline_rss_anon_kib"] * 1024
    shape = synthetic["shape"]
    import safetensors
    import torch

    verdict = "met" if hwm / size < TARGET_RATIO else "MISSED"
    ok = "all identical" if not verified["problems"] else "FAILED: " + "; ".join(verified["problems"])
    return f"""{SECTION}

`scripts/bench_io.py` copies a synthetic Llama-shaped bf16 checkpoint layer by layer through
`CheckpointReader.get_many` + `CheckpointWriter.add` (source tensor order, same `max_shard_size`) in a child
process and measures that process. Run {datetime.date.today().isoformat()} on {platform.machine()} Linux,
{os.cpu_count()} CPU cores (shared), {os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / gib:.0f} GiB RAM,
torch {torch.__version__}, safetensors {safetensors.__version__}; the source was evicted from the page cache
(`posix_fadvise(DONTNEED)`) before the copy, so it was read from disk.

| quantity | value |
|---|---|
| checkpoint | {size / 1e9:.2f} GB ({size / gib:.2f} GiB) of tensors in {verified["shards"]} shards (max_shard_size {synthetic["max_shard_size"]}); {shape["layers"]} layer{"s" if shape["layers"] != 1 else ""}, hidden {shape["hidden"]}, {shape["heads"]} heads / {shape["kv_heads"]} kv heads, intermediate {shape["intermediate"]}, vocab {shape["vocab"]} |
| **peak RSS** (`ru_maxrss` = VmHWM of the copying process, kernel-exact, mapped file pages included) | **{hwm / 2**20:.0f} MiB = {100 * hwm / size:.1f} % of the checkpoint** (target < {TARGET_RATIO:.0%}: {verdict}) |
| cross-check: VmHWM read by the copying process at exit | {measured["own_vm_hwm_kib"] / 1024:.0f} MiB (the measuring parent's own peak, a floor of the child's `ru_maxrss`: {measured["parent_ru_maxrss_kib"] / 1024:.0f} MiB) |
| of which before the first read (interpreter + torch, VmRSS) | {measured["baseline_vm_rss_kib"] / 1024:.0f} MiB |
| peak anonymous RSS (RssAnon, sampled every {measured["sample_interval_s"] * 1000:.0f} ms) | {anon / 2**20:.0f} MiB ({base / 2**20:.0f} MiB before the first read) |
| peak file-backed RSS (RssFile: mapped files, sampled) | {file_backed / 2**20:.0f} MiB |
| largest layer read at once | {measured["largest_read_bytes"] / 2**20:.0f} MiB |
| copy time (read + write + fsync) | {measured["seconds"]:.1f} s ({size / measured["seconds"] / 1e9:.2f} GB/s; plain sequential write + fsync on the same disk: {measured["disk_write_bytes_per_s"] / 1e9:.2f} GB/s) |
| shard opens by the reader | {measured["files_opened"]} |
| verification | index file and shard names identical, {verified["sampled_tensors"]} sampled tensors byte-identical, all {verified["shards"]} shards byte-identical to the source's (`save_file` output): {ok} |

Command: `{command}`

What is measured: `ru_maxrss` from `wait4()` for the copying child alone, the kernel's exact peak of
everything resident in it. The reader copies each tensor out of its shard with positioned reads (no memory map,
so a shard cut short while it is read is an error naming it, not SIGBUS); the copy holds one layer's tensors at a
time (the largest layer read bounds it). The writer keeps nothing of a tensor once `add` returns: its bytes are
appended to a spool file in the partial folder, and a finished shard is laid out from the spool with
`copy_file_range` (page cache, not RSS), so the shard limit does not enter these numbers; tensors a
conversion *computes* cost their own size only until they are added.
"""


WORKDIR_MARKER = ".mla-convert-bench-io"


def shard_size(text: str) -> str:
    """A shard-size limit as `save_pretrained` reads it (bytes, or a number with KB/MB/GB/TB), kept as typed; checked
    here without mla_convert.io.writer's parse_shard_size, which imports torch (this process must stay small)."""
    number, unit = text.strip(), ""
    if number[-2:].upper() in ("KB", "MB", "GB", "TB"):
        number, unit = number[:-2].strip(), number[-2:]
    try:
        value = float(number) if unit else int(number)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected bytes or a size like '1GB' (units KB, MB, GB, TB)") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be above 0")
    return text


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be above 0")
    return value


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "mla-convert-bench-io"),
                        help="where the data goes (deleted afterwards unless --keep)")
    parser.add_argument("--min-size-gib", type=positive_float, default=4.0)
    parser.add_argument("--max-shard-size", type=shard_size, default="1GB")
    parser.add_argument("--keep", action="store_true", help="keep the synthetic checkpoint and the copy")
    parser.add_argument("--no-markdown", action="store_true", help="print the section instead of writing BENCHMARKS.md")
    parser.add_argument("--copy-child", nargs=4, metavar=("SOURCE", "OUTPUT", "MAX_SHARD_SIZE", "RESULT"), help=argparse.SUPPRESS)
    parser.add_argument("--make-child", nargs=4, metavar=("SOURCE", "MIN_SIZE_GIB", "MAX_SHARD_SIZE", "RESULT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.make_child:
        source, min_size_gib, max_shard_size, result = args.make_child
        Path(result).write_text(json.dumps(make_source_checkpoint(Path(source), float(min_size_gib), max_shard_size)))
        return
    if args.copy_child:
        source, output, max_shard_size, result = args.copy_child
        Path(result).write_text(json.dumps(copy_layer_by_layer(Path(source), Path(output), max_shard_size)))
        return

    command = "python " + shlex.join([os.path.relpath(__file__, REPO), *(sys.argv[1:] if argv is None else argv)])
    workdir = Path(args.workdir)
    if workdir.exists():
        # only a folder an earlier run of this benchmark made (and kept) is replaced; anything else is the user's
        if not (workdir / WORKDIR_MARKER).is_file() and any(workdir.iterdir()):
            raise SystemExit(f"--workdir {workdir}: exists and is not a folder this benchmark made; the benchmark "
                             "deletes its work folder, so give a new or empty one")
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    (workdir / WORKDIR_MARKER).write_text("made by scripts/bench_io.py; deleted by its next run\n")
    source, output = workdir / "source", workdir / "copy"
    try:
        # In a process of its own: save_file holds a whole source shard, and this process's peak would
        # become a floor of the measured child's ru_maxrss (see the module docstring).
        made = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--make-child", str(source), str(args.min_size_gib),
             args.max_shard_size, str(workdir / "synthetic.json")]
        )
        if made.returncode != 0:
            raise SystemExit(f"making the synthetic checkpoint failed (exit status {made.returncode})")
        synthetic = json.loads((workdir / "synthetic.json").read_text())
        size = folder_bytes(source)
        print(f"  {size / 1e9:.2f} GB in {synthetic['shards']} shards, {synthetic['seconds']:.0f} s", flush=True)

        print("copying layer by layer in a child process ...", flush=True)
        parent_peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        assert "torch" not in sys.modules, "the measuring process must stay small until the copy is done"
        measured = run_measured_copy(source, output, args.max_shard_size, workdir / "result.json")
        measured["parent_ru_maxrss_kib"] = parent_peak_kib
        measured["disk_write_bytes_per_s"] = disk_write_baseline(workdir)
        print(f"  {measured['seconds']:.1f} s; ru_maxrss {measured['ru_maxrss_kib'] / 1024:.0f} MiB "
              f"({100 * measured['ru_maxrss_kib'] * 1024 / size:.1f} % of the checkpoint), "
              f"peak RssAnon {measured['peak_rss_anon_kib'] / 1024:.0f} MiB", flush=True)
        print("verifying ...", flush=True)
        verified = verify_copy(source, output)
        section = render_section(command, synthetic, measured, verified, size)
        if args.no_markdown:
            print(section)
        else:
            write_section(REPO / "BENCHMARKS.md", section)
            print(section)
            print(f"wrote the '{SECTION}' section of {REPO / 'BENCHMARKS.md'}")
        if verified["problems"]:
            raise SystemExit("verification failed: " + "; ".join(verified["problems"]))
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
