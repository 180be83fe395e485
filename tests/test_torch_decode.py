"""The runtime's CPU decode attention (`mla_convert.runtime.torch_decode`) against the kernel's torch oracle.

Inputs come from `mla_decode_triton.testing`: shuffled pages, NaN in every slot no sequence owns and in the
rows' padding columns, out-of-range ids in the page table past each sequence's last page, a table much wider
than the lengths need.  The same caches are also laid out with every sequence's pages consecutive, the case
this path reads in place.  The runtime's greedy tokens against transformers' (tests/test_runtime.py) run on
this path too: it is the CPU default.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from mla_decode_triton.reference import mla_decode_reference
from mla_decode_triton.testing import LSE_TOLERANCE, TOLERANCE, UNUSED_PAGE, make_decode_inputs

from mla_convert.runtime import torch_decode
from mla_convert.runtime.decode_backends import decode_attention, resolve_backend
from mla_convert.runtime.errors import GenerationSettingsError
from mla_convert.runtime.torch_decode import mla_decode_torch, sequence_rows, uses_loop

LENGTHS = [0, 1, 7, 33, 64]  # an idle slot, a lone token, ragged last pages, whole pages
RANK, ROPE, HEADS = 24, 8, 3


def consecutive_layout(inputs, page_size: int, row_width: int | None = None):
    """The same sequences with each one's pages next to each other (page 0 left as poison, so no sequence starts
    at the pool's first page), the table past each last page still out of range; rows padded with NaN to
    `row_width` if given.  Returns (kv_cache, page_table)."""
    lens = inputs.seq_lens.tolist()
    owned = [inputs.page_table[seq, page].item() for seq, n in enumerate(lens) for page in range(-(-n // page_size))]
    poison_page = torch.full_like(inputs.kv_cache[:1], float("nan"))
    cache = torch.cat([poison_page, inputs.kv_cache[owned]])  # (1 + owned pages, page_size, R + D)
    if row_width is not None:
        padding = torch.full((*cache.shape[:2], row_width - cache.shape[2]), float("nan"), dtype=cache.dtype)
        cache = torch.cat([cache, padding], dim=-1)[..., : inputs.kv_cache.shape[2]]  # a column slice, as the runtime's
    table = torch.full_like(inputs.page_table, UNUSED_PAGE)
    next_page = 1
    for seq, n in enumerate(lens):
        pages = -(-n // page_size)
        table[seq, :pages] = torch.arange(next_page, next_page + pages, dtype=table.dtype)
        next_page += pages
    return cache, table


@pytest.fixture
def loop_always(monkeypatch):
    """These caches are short: without this the call would go to the reference itself (`uses_loop`)."""
    monkeypatch.setattr(torch_decode, "LOOP_FROM_VALUES", 0)


@pytest.mark.usefixtures("loop_always")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("layout", ["shuffled", "consecutive", "consecutive, padded rows", "shuffled, padded rows"])
def test_equals_the_reference_on_poisoned_paged_caches(dtype, page_size, layout):
    row_width = RANK + ROPE + 8 if "padded" in layout else None
    inputs = make_decode_inputs(len(LENGTHS), HEADS, RANK, ROPE, LENGTHS, page_size, dtype=dtype, seed=page_size,
                                row_width=row_width if layout.startswith("shuffled") else None, table_pages=40)
    kv_cache, page_table = inputs.kv_cache, inputs.page_table
    if layout.startswith("consecutive"):
        kv_cache, page_table = consecutive_layout(inputs, page_size, row_width)
    args = (inputs.q_latent, inputs.q_rope, kv_cache, page_table, inputs.seq_lens, inputs.softmax_scale)
    out, lse = mla_decode_torch(*args)
    expected_out, expected_lse = mla_decode_reference(*args)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert torch.isfinite(out).all(), "read a poisoned slot"
    torch.testing.assert_close(out, expected_out, **TOLERANCE[dtype])
    torch.testing.assert_close(lse, expected_lse, **LSE_TOLERANCE)
    assert (out[0] == 0).all() and (lse[0] == float("-inf")).all()  # the idle slot


def test_short_caches_go_to_the_reference_long_ones_to_the_loop():
    width = 192  # SmolLM2 2x: the measured crossover lies between 256 and 512 tokens per sequence on average
    assert not uses_loop([256] * 8, width) and uses_loop([512] * 8, width)
    assert uses_loop([4096], width) and not uses_loop([0, 0], width)
    inputs = make_decode_inputs(2, HEADS, RANK, ROPE, [3, 5], 4)
    # below the threshold the call is the reference's, to the bit
    for got, expected in zip(mla_decode_torch(*inputs.args()), mla_decode_reference(*inputs.args()), strict=True):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("row_width", [None, RANK + ROPE + 8])
def test_consecutive_pages_are_read_in_place_and_others_gathered(row_width):
    inputs = make_decode_inputs(len(LENGTHS), HEADS, RANK, ROPE, LENGTHS, 4, table_pages=40)
    kv_cache, page_table = consecutive_layout(inputs, 4, row_width)
    pages = page_table[3].tolist()  # 33 tokens: 9 consecutive pages
    in_place = sequence_rows(kv_cache, pages, 33)
    assert in_place.shape == (33, RANK + ROPE)
    assert in_place.data_ptr() == kv_cache[pages[0]].data_ptr()  # a view of the pool, nothing copied
    shuffled = sequence_rows(inputs.kv_cache, inputs.page_table[3].tolist(), 33)
    torch.testing.assert_close(shuffled, in_place, rtol=0, atol=0)  # the same rows, gathered


def test_backend_choice():
    assert decode_attention("auto", torch.device("cpu")) is mla_decode_torch
    assert resolve_backend("auto", torch.device("cuda")) == "triton"
    assert decode_attention("reference", torch.device("cpu")) is mla_decode_reference
    with pytest.raises(GenerationSettingsError, match="synchronise"):
        resolve_backend("torch", torch.device("cuda"))  # host reads every layer: no CUDA graphs
    with pytest.raises(GenerationSettingsError, match="choose one of auto, triton, torch, reference"):
        resolve_backend("fast", torch.device("cpu"))


def test_a_cpu_only_install_decodes_without_triton(tmp_path):
    """triton is an optional dependency: with it unimportable, the runtime still generates on a CPU (this path),
    and the tokens are those it generates with triton importable."""
    from test_runtime_decode_path import PROMPTS, build_folder

    from mla_convert.runtime import generate_ids

    folder = build_folder(tmp_path / "tiny", seed=3)
    script = ("import sys, json; sys.modules['triton'] = None  # `import triton` now raises ImportError\n"
              "from mla_convert.runtime import generate_ids\n"
              f"print(json.dumps(generate_ids({str(folder)!r}, {PROMPTS!r}, 6, device='cpu')))\n"
              "assert 'triton' not in sys.modules or sys.modules['triton'] is None\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            env=os.environ | {"TRITON_INTERPRET": "0"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == generate_ids(folder, PROMPTS, 6, device="cpu")


@pytest.mark.usefixtures("loop_always")
def test_runtime_on_the_loop_generates_transformers_tokens(tmp_path):
    """The runtime's own tests decode short prompts, which go to the reference: here the loop decodes them."""
    from test_runtime_decode_path import PROMPTS, assert_same_tokens, build_folder, transformers_greedy

    from mla_convert.runtime import generate_ids

    folder = build_folder(tmp_path / "tiny", seed=5)
    assert_same_tokens(generate_ids(folder, PROMPTS, 12, device="cpu"), transformers_greedy(folder, PROMPTS, 12))
