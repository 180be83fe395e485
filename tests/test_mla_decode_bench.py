"""The kernel benchmark's offline half: rendering a GPU run's JSON into BENCHMARKS.md and the tuned table.

A GPU run (scripts/device_kernel_check.sh) only brings back JSON; these steps happen on a machine
without a GPU, so they are tested here on a synthetic run with the structure `measure` writes.  The
measuring half is exercised end to end by `--dry-run` (slow: the kernel runs in the interpreter).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_mla_decode.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_mla_decode", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def synthetic_run():
    """Two cases of 512+64 x16 (one memory-bound) and a failed one, as `measure` writes them."""
    def case(batch, context, kernel_ms, copy_ms):
        element = 2
        cache = batch * context * 576 * element
        return dict(rank=512, rope_dim=64, heads=16, batch=batch, context=context,
                    config=dict(tile="H16 r1 N32 w8 st2", splits=4, min_split_tokens=240),
                    bytes=cache + batch * 16 * 576 * element, flops=2 * batch * 16 * context * 1088,
                    max_error=3e-3, kernel_ms=kernel_ms, copy_ms=copy_ms, dense_ms=4 * kernel_ms, reference_ms=None)

    return dict(
        meta=dict(device="NVIDIA H200", date="2026-12-01", torch="2.11.0+cu130", triton="3.6.0", dtype="bf16",
                  page_size=64, command="python scripts/bench_mla_decode.py", large_copy_bytes=2 * 1024**3,
                  large_copy_gbps=8000.0, tensor_peak_tflops=989.4, wall_s=95.0),
        tuning=[dict(shape="512+64 x16", key="512+64/rows16/page64/bf16", workload="batch 64, context 4096",
                     best="H16 r1 N64 w8 st2", default="H16 r1 N32 w8 st2",
                     best_tile=dict(block_h=16, r_split=1, block_n=64, num_warps=8, num_stages=2),
                     times_ms={"H16 r1 N32 w8 st2": 0.05, "H16 r1 N64 w8 st2": 0.04}, splits={"H16 r1 N32 w8 st2": 1,
                                                                                           "H16 r1 N64 w8 st2": 1})],
        split_sweep=[dict(shape="512+64 x16", batch=64, context=4096, tile="H16 r1 N32 w8 st3", programs_per_sm=2,
                          chosen=4, times_ms={"1": 0.40, "2": 0.22, "4": 0.12, "5": 0.15}),
                     dict(shape="64+32 x9", batch=16, context=4096, error="OutOfMemoryError: ...")],
        cases=[case(16, 4096, 0.020, 0.030), case(1, 1024, 0.010, 0.004),
               dict(rank=512, rope_dim=64, heads=128, batch=128, context=16384, error="OutOfMemoryError: ...")],
        skipped=["64+32 x9 b1 ctx1024"],
    )


def test_render_reports_percent_of_copy_and_roofline(bench):
    body = bench.render(synthetic_run())
    # 16 x 4096 x 576 x 2 B + queries in 20 us vs the same bytes copied (read + written) in 30 us
    row = next(line for line in body.splitlines() if line.startswith("| 512+64 | 16 | 16 | 4096 "))
    cells = [cell.strip() for cell in row.split("|")]
    bytes_read = 16 * 4096 * 576 * 2 + 16 * 16 * 576 * 2
    assert cells[7] == f"{bytes_read / 20e-6 / 1e9:.0f}"
    assert cells[8] == f"{100 * (bytes_read / 20e-6) / (2 * bytes_read / 30e-6):.0f}%" == "75%"
    # roofline: the bytes bound (30 us / 2) beats the flops bound (~0.15 us), so 15 us of 20 us
    assert cells[9] == "75%"
    assert "| 512+64 | 16 | 1 | 75% | 75% | 4.0x |" in body  # memory-bound summary: the batch-16 case only
    assert "failed: OutOfMemoryError" in body and "Skipped (time budget): 64+32 x9 b1 ctx1024" in body
    assert "| 512+64 x16 | batch 64, context 4096 | H16 r1 N64 w8 st2 | 1 | 40.0 | chosen |" in body


def test_split_sweep_compares_the_launchers_count_with_the_fastest(bench):
    body = bench.render(synthetic_run())
    row = next(line for line in body.splitlines() if line.startswith("| 512+64 x16 | 64 | 4096 | H16 r1 N32 w8 st3 "))
    cells = [cell.strip() for cell in row.split("|")][1:-1]
    assert cells[4:13] == ["2", "4", "120.0", "-", "-", "-", "4", "120.0", "1.00"]  # parts not timed in this run
    assert cells[13] == "1: 400, 2: 220, 4: 120, 5: 150"
    assert "| 64+32 x9 | 16 | 4096 | failed: OutOfMemoryError: ... |" in body
    run = synthetic_run()
    run["split_sweep"][0]["parts_ms"] = {"split": 0.09, "merge": 0.011, "step_without_pdl": 0.125}
    row = next(line for line in bench.render(run).splitlines() if line.startswith("| 512+64 x16 | 64 | 4096 "))
    assert [cell.strip() for cell in row.split("|")][8:11] == ["90.0", "11.0", "125.0"]


def test_tuning_and_split_tables_say_how_they_were_timed(bench):
    """Eagerly timed tuning (runs before 2026-12-04) ranked the host's launch work; the tables say which timer."""
    old_run = synthetic_run()
    body = bench.render(old_run)
    assert body.count("eager launches, host launch work included") == 2 and "replayed from a CUDA graph):" not in body
    old_run["meta"]["tuning_timer"] = "graph"
    body = bench.render(old_run)
    assert "every candidate tile timed once per shape, replayed from a CUDA graph):" in body
    assert "same tile, replayed from a CUDA graph;" in body and "eager launches" not in body


def test_memory_bound_summary_compares_graph_times_with_the_large_copy(bench):
    run = synthetic_run()
    memory_bound = run["cases"][0]  # batch 16, context 4096
    memory_bound.update(kernel_graph_ms=0.018, copy_graph_ms=0.045, dense_graph_ms=0.072)
    body = bench.render(run)
    # bytes / 18 us against 8000 GB/s; against the captured copy of the same bytes: 45 / (2 x 18)
    large = 100 * memory_bound["bytes"] / 18e-6 / 1e9 / 8000
    assert f"| 512+64 | 16 | 1 | 75% | 75% | 4.0x | 125% | 125% | {large:.0f}% | {large:.0f}% | 4.0x |" in body


def test_cases_timed_inside_a_model_step_are_compared_with_one_call_alone(bench):
    """A case timed as 30 calls in one graph gets a row with its per-call time against the one call alone,
    both against the large copy, and against 30 copies of the same bytes; shapes get their min / median."""
    run = synthetic_run()
    memory_bound = run["cases"][0]  # batch 16, context 4096
    memory_bound.update(kernel_graph_ms=0.018, copy_graph_ms=0.045, dense_graph_ms=0.072,
                        kernel_stack_ms=0.012, copy_stack_ms=0.030, stack_layers=30)
    body = bench.render(run)
    assert "Inside a model step" in body and "128 MB" in body
    alone, in_step = (100 * memory_bound["bytes"] / ms / 1e9 / 8000 for ms in (18e-6, 12e-6))
    assert in_step == pytest.approx(1.5 * alone)
    # 30 copies of the same bytes in 30 us per copy: bytes / 12 us against 2 x bytes / 30 us
    assert (f"| 512+64 | 16 | 16 | 4096 | 30 | 18.0 | 12.0 | {alone:.0f}% | {in_step:.0f}% | 125% |") in body
    assert f"| 512+64 | 16 | 1 | {in_step:.0f}% | {in_step:.0f}% |" in body
    # a case without the stack timing is not in that table; a failed stack timing is listed
    assert "| 512+64 | 16 | 1 | 1024 | " not in body.split("Inside a model step")[1]
    run["cases"][1]["stack_error"] = "OutOfMemoryError: ..."
    assert "Not timed inside a model step (failed): 512+64 x16 b1 ctx1024 (OutOfMemoryError: ...)" in bench.render(run)
    del memory_bound["kernel_stack_ms"]
    assert "Inside a model step" not in bench.render(run)


def test_only_small_memory_bound_cases_are_timed_inside_a_model_step(bench):
    small = 16 * 4096 * 96 * 2  # 64+32 at batch 16, context 4K: 12.6 MB
    assert bench.measures_stack(16, 4096, small, dry_run=False)
    assert not bench.measures_stack(8, 4096, small, dry_run=False)  # not memory-bound: batch below 16
    assert not bench.measures_stack(16, 1024, small, dry_run=False)  # nor at 1K tokens
    assert not bench.measures_stack(64, 16384, bench.STACK_MAX_LAYER_BYTES + 1, dry_run=False)
    assert bench.measures_stack(1, 16, 1000, dry_run=True)


def test_shapes_option_parses_rank_rope_and_heads(bench):
    assert bench.parse_args(["--shapes", "512+64x32", "64+32x9"]).shapes == [(512, 64, 32), (64, 32, 9)]
    assert bench.parse_args([]).shapes is None  # the default shapes
    for bad in ("512x64", "512+64", "0+64x16", "512+64x"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--shapes", bad])


def test_write_section_replaces_only_its_own_section(bench, tmp_path):
    path = tmp_path / "BENCHMARKS.md"
    path.write_text("# Benchmarks\n\n## Other\n\nkept\n\n## MLA decode kernel (GPU)\n\nold\n\n## Later\n\nalso kept\n")
    bench.write_section(path, "new body")
    text = path.read_text()
    assert "old" not in text and "new body" in text and "kept" in text and "also kept" in text
    assert text.index("## Other") < text.index("new body") < text.index("## Later")


def test_tuned_table_from_a_gpu_run_is_used_by_the_launcher(bench, tmp_path):
    from mla_decode_triton import configs

    path = bench.write_tuned_table(synthetic_run(), tmp_path / "tuned.json")
    stored = json.loads(path.read_text())
    assert "NVIDIA H200" in stored["source"]
    table = configs.load_table(path)
    saved, configs._TABLE = configs._TABLE, table
    try:
        tile = configs.choose_tile(512, 64, 16, 64, torch.bfloat16)
        assert (tile.block_n, tile.num_warps) == (64, 8)
    finally:
        configs._TABLE = saved


@pytest.mark.slow
def test_dry_run_measures_renders_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--batches", "2", "--contexts", "40",
                           "--also-tune-page-size", "4", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(out.read_text())
    assert len(results["cases"]) == 4 and all("error" not in case for case in results["cases"])
    # the split sweep: every shape once (16 and 128 heads are both 3 in a dry run), each count timed, the
    # launcher's own count among them
    assert [entry["shape"] for entry in results["split_sweep"]] == ["512+64 x3", "512+64 x3", "144+48 x3", "64+32 x3"]
    for entry in results["split_sweep"]:
        assert {"1", "2", "3", str(entry["chosen"])} == set(entry["times_ms"]), entry
        assert all(ms > 0 for ms in entry["times_ms"].values())
        assert set(entry["parts_ms"]) == ({"split", "merge"} if entry["chosen"] > 1 else {"split"}), entry
    assert "Split counts (`launcher.splits_for_gpu`" in done.stdout
    # a dry run times every case inside a model step too, over DRY_STACK_LAYERS distinct caches
    assert all(case["stack_layers"] == 2 and case["kernel_stack_ms"] > 0 and case["copy_stack_ms"] > 0
               for case in results["cases"])
    assert "Inside a model step" in done.stdout and "| 64+32 | 3 | 2 | 40 | 2 | - |" in done.stdout
    assert {entry["shape"] for entry in results["tuning"]} == {"512+64 x3", "144+48 x3", "64+32 x3"}
    # every shape tuned at the run's pages (16 in a dry run) and then again at the second page size, last
    assert [entry["page_size"] for entry in results["tuning"]] == [16] * 4 + [4] * 4
    assert all(entry["key"].endswith(f"/page{entry['page_size']}/bf16") for entry in results["tuning"])
    assert "| 64+32 x3 | batch 2, context 40, pages of 4 |" in done.stdout
    assert "## " not in done.stdout and "| 144+48 | 3 | 2 | 40 |" in done.stdout


def test_second_tuning_pass_defaults_to_the_runtimes_page_size(bench):
    """The shipped table is keyed by page size: the benchmark's default second pass must tune at the page
    size `mla-convert generate` decodes with, or the runtime would never use a tuned tile."""
    from mla_convert.runtime.generate import DEFAULT_PAGE_SIZE

    assert bench.RUNTIME_PAGE_SIZE == DEFAULT_PAGE_SIZE
    assert bench.parse_args([]).also_tune_page_size == DEFAULT_PAGE_SIZE != bench.parse_args([]).page_size


def test_the_tuned_table_is_written_only_from_a_gpu_runs_json(bench, tmp_path, capsys):
    """`--dry-run --write-tuned-table` would replace the shipped tile table with CPU-interpreter timings."""
    for argv in (["--dry-run", "--write-tuned-table"], ["--write-tuned-table"]):
        with pytest.raises(SystemExit) as refused:
            bench.parse_args(argv)
        assert refused.value.code == 2 and "--write-tuned-table needs --from-json" in capsys.readouterr().err


def test_a_missing_json_is_one_error_line(bench, tmp_path, capsys):
    with pytest.raises(SystemExit) as refused:
        bench.parse_args(["--from-json", str(tmp_path / "missing.json")])
    assert refused.value.code == 2 and "error: --from-json" in capsys.readouterr().err  # was a FileNotFoundError
