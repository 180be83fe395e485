"""The decode kernels compile for a Hopper GPU (sm_90) without spilling, on a machine with no GPU.

The interpreter-based tests check the arithmetic; this one checks what only the compiler knows: that
every launch `mla_decode` makes for the project's shapes compiles for sm_90, keeps its registers
(no stack frame, no local loads/stores), uses tensor cores for fp16/bf16 caches, software-pipelines
the cache loads (cp.async), and fits its shared memory.  The compile runs in a subprocess because the
kernels must be JIT functions there, while this test session has TRITON_INTERPRET=1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# Hopper allows 227 KB of shared memory per block; the launcher aims for tiles that leave room for a
# second program per multiprocessor, so the split kernel should stay well below half of that.
MAX_SPLIT_SHARED_BYTES = 110 * 1024


@pytest.fixture(scope="module")
def reports():
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    done = subprocess.run(
        [sys.executable, "-m", "mla_decode_triton.compile_check", "--json"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_every_launch_compiles_for_sm90_without_spills(reports):
    assert {r["kernel"] for r in reports} == {"mla_decode_split_kernel", "mla_decode_merge_kernel"}
    for report in reports:
        assert report["stack_bytes"] == 0 and report["local_memory_ops"] == 0, report


@pytest.mark.slow
def test_split_kernel_uses_tensor_cores_and_pipelined_loads(reports):
    split = [r for r in reports if r["kernel"] == "mla_decode_split_kernel"]
    assert len(split) >= 5
    for report in split:
        assert report["async_copies"] > 0, report  # cache tiles are prefetched with cp.async
        assert report["shared_bytes"] <= MAX_SPLIT_SHARED_BYTES, report
        if "float32" not in report["case"]:
            assert report["tensor_core_ops"] > 0, report
