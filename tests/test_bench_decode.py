"""scripts/bench_decode.py end to end on stories260K and its real conversion: the three decoders (source and
converted in transformers, the converted folder in mla-convert's runtime) timed on the same prompts, and what the
table and JSON say about them checked against what each decoder must do (new tokens, cache bytes, greedy tokens)."""

from __future__ import annotations

import json

import pytest
import torch
from test_bench_scripts import load

pytestmark = [pytest.mark.real_model, pytest.mark.slow, pytest.mark.usefixtures("single_torch_thread")]

CONTEXTS = (24, 40)
NEW_TOKENS = 6


def run_bench(tmp_path, stories260k, converted, text, *extra):
    bench = load("bench_decode")
    threads = torch.get_num_threads()  # the script sets torch's threads for its run
    try:
        assert bench.main(["--source", str(stories260k), "--converted", str(converted), "--data", str(text),
                           "--contexts", ",".join(map(str, CONTEXTS)), "--new-tokens", str(NEW_TOKENS), "--device", "cpu",
                           "--threads", "1", "--json", str(tmp_path / "t.json"),
                           "--write-benchmarks", str(tmp_path / "B.md"), *extra]) == 0
    finally:
        torch.set_num_threads(threads)
    return json.loads((tmp_path / "t.json").read_text()), (tmp_path / "B.md").read_text()


def test_runtime_decodes_the_same_prompts_to_the_same_tokens_with_the_same_cache(tmp_path, stories260k, stories_mla,
                                                                                  tinystories_text):
    timings, section = run_bench(tmp_path, stories260k, stories_mla, tinystories_text)
    assert set(timings) == {"source", "converted", "runtime"}
    for label, rows in timings.items():
        assert [row["context"] for row in rows] == list(CONTEXTS), label
        assert all(row["new_tokens"] == NEW_TOKENS and row["decode_tokens_per_s"] > 0 for row in rows), label
    for converted, runtime in zip(timings["converted"], timings["runtime"]):
        # fp32, greedy, stop tokens off: the runtime's tokens are transformers' (its tests' oracle), here on real text
        assert runtime["same_tokens_as_converted"] is True
        # both hold the latent and the shared rope key of context + new tokens - 1 positions, nothing else
        assert runtime["kv_cache_bytes"] == converted["kv_cache_bytes"]
    for source, converted in zip(timings["source"], timings["converted"]):
        assert source["kv_cache_bytes"] == pytest.approx(2 * converted["kv_cache_bytes"], rel=0.2)  # a 2x conversion
    header = next(line for line in section.splitlines() if line.startswith("| context"))
    assert "runtime tok/s" in header and "runtime tokens = converted's" in header
    rows = [line for line in section.splitlines() if line.startswith(f"| {CONTEXTS[0]} |")]
    assert len(rows) == 1 and rows[0].rstrip().endswith("| yes |")
    assert rows[0].count("|") == header.count("|")


def test_no_runtime_leaves_the_two_transformers_columns(tmp_path, stories260k, stories_mla, tinystories_text):
    timings, section = run_bench(tmp_path, stories260k, stories_mla, tinystories_text, "--no-runtime")
    assert set(timings) == {"source", "converted"}
    header = next(line for line in section.splitlines() if line.startswith("| context"))
    assert "runtime" not in header and "runtime:" not in section  # no columns, no note on them


def test_cpu_decode_paths_bench_times_both_paths_to_the_same_tokens(tmp_path, stories_mla):
    """scripts/bench_cpu_decode_paths.py: the loop and the oracle decode the same prompts to the same tokens; the
    table has a row per case with both rates."""
    bench = load("bench_cpu_decode_paths")
    from mla_convert.runtime import torch_decode

    threads, threshold = torch.get_num_threads(), torch_decode.LOOP_FROM_VALUES
    try:
        assert bench.main(["--model", str(stories_mla), "--cases", "2x9,1x40", "--new-tokens", "4", "--repeats", "1",
                           "--json", str(tmp_path / "p.json"), "--write-benchmarks", str(tmp_path / "B.md")]) == 0
    finally:
        torch.set_num_threads(threads)
    assert torch_decode.LOOP_FROM_VALUES == threshold  # forced to 0 for its runs only
    rows = json.loads((tmp_path / "p.json").read_text())
    assert [(row["batch"], row["length"]) for row in rows] == [(2, 9), (1, 40)]
    assert all(row["same_tokens"] and row["reference_tok_s"] > 0 and row["loop_tok_s"] > 0 for row in rows)
    section = (tmp_path / "B.md").read_text()
    assert "| 2 x 9 |" in section and "| 1 x 40 |" in section and section.count("| yes |") == 2
    assert f"takes the loop from {threshold} cached values" in section


@pytest.mark.parametrize("argv, says", [(["--cases", "16by128"], "--cases"), (["--cases", "0x5"], "--cases"),
                                        (["--new-tokens", "2"], "--new-tokens"), (["--repeats", "0"], "--repeats")])
def test_cpu_decode_paths_bench_refuses_bad_arguments(tmp_path, capsys, argv, says):
    from test_bench_scripts import refused

    bench = load("bench_cpu_decode_paths")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    assert says in refused(capsys, lambda: bench.parse_args(["--model", str(tmp_path / "m"), *argv]))
