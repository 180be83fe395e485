"""The runtime's decode path around the MLA kernel: padded cache rows, the in-place device page table,
W_UK / W_UV folded into the projections, and the CUDA-graph replay of the decode step.

The oracle is the runtime's own separate-weights eager path, itself checked against transformers in
tests/test_runtime.py; greedy tokens are also compared with transformers directly where a new path
could change them.  The tiny random DeepseekV3 folders are built here (as in tests/test_runtime.py,
but without tokenizer files, so that this module also runs on a GPU machine without the shared assets).
"""

from __future__ import annotations

import pytest
import torch

from mla_convert.runtime import AbsorbedMLAModel, PagedLatentCache, run_generation
from mla_convert.runtime.absorption import fuse_output_weight, fuse_query_weight, plan_absorption
from mla_convert.runtime.errors import GenerationSettingsError

NEW_TOKENS = 12
ROPE = {"rope_type": "default", "rope_theta": 10000.0}
Q_PROJ = dict(q_lora_rank=None, attention_bias=False, tie_word_embeddings=False, rope_parameters=ROPE)
Q_LORA = dict(q_lora_rank=32, attention_bias=True, tie_word_embeddings=True,
              rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0})
# Token-id prompts of mixed lengths (vocabulary 512; the folders need no tokenizer, so these tests run
# where the shared assets are absent, e.g. on a lent GPU machine).
PROMPTS = [[1, 45, 311, 7, 90], [1, 17, 233, 102, 64, 5, 480, 77, 301, 12, 9, 150, 44], [1, 300]]


pytestmark = pytest.mark.usefixtures("single_torch_thread")


def build_folder(path, seed: int, **overrides):
    """A tiny random dense DeepseekV3 folder (like tests/test_runtime.py's, without tokenizer files).

    initializer_range 0.2 makes greedy decoding decided by clear margins; biases are drawn non-zero.
    """
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    settings = dict(
        vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        first_k_dense_replace=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=24, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, rope_interleave=True, max_position_embeddings=256, n_routed_experts=1,
        n_shared_experts=0, num_experts_per_tok=1, n_group=1, topk_group=1, num_mtp_layers=0,
        initializer_range=0.2, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**(settings | overrides))).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.1)
    model.save_pretrained(path)
    return path


def transformers_greedy(folder, prompts, new_tokens):
    """Stock DeepseekV3ForCausalLM.generate, each prompt alone (no padding): the generated ids."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    outputs = []
    for prompt in prompts:
        generated = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new_tokens)
        outputs.append(generated[0, len(prompt):].tolist())
    return outputs


def assert_same_tokens(runtime, reference):
    for index, (ours, theirs) in enumerate(zip(runtime, reference, strict=True)):
        assert ours == theirs, f"prompt {index}: runtime {ours} != transformers {theirs}"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("decode-path")
    return {
        "q_proj": build_folder(root / "q_proj", 0, **Q_PROJ),
        "q_lora": build_folder(root / "q_lora", 1, **Q_LORA),
        # 20 + 6 = 26 values per row: padded to 28 values (fp32) in the cache
        "odd_rows": build_folder(root / "odd", 2, kv_lora_rank=20, qk_rope_head_dim=6, **Q_PROJ),
    }


# ----------------------------------------------------------------------------------------- paged cache
@pytest.mark.parametrize("dtype, row_width", [(torch.float32, 28), (torch.bfloat16, 32)])
def test_cache_rows_are_padded_to_16_bytes_and_padding_is_not_payload(dtype, row_width):
    cache = PagedLatentCache(num_layers=3, num_pages=4, page_size=2, kv_lora_rank=20, rope_dim=6, dtype=dtype,
                             device="cpu")
    element = torch.empty((), dtype=dtype).element_size()
    assert cache.row_width == row_width and (row_width * element) % 16 == 0
    assert cache.storage.shape == (3, 4, 2, row_width)
    assert cache.layer(1).shape == (4, 2, 26) and cache.layer(1).stride(1) == row_width
    assert cache.bytes_per_token == 3 * 26 * element
    assert cache.padding_bytes_per_token == 3 * (row_width - 26) * element
    assert cache.bytes_allocated == 4 * 2 * cache.bytes_per_token
    assert cache.storage_bytes == cache.bytes_allocated + 4 * 2 * cache.padding_bytes_per_token
    seq = cache.add_sequence()
    _, slots = cache.append(seq, 3)
    rows = torch.randn(3, 26).to(dtype)
    cache.write(1, torch.tensor(slots), rows)
    flat = cache.storage[1].reshape(-1, row_width)  # (slots, row_width)
    assert torch.equal(flat[slots, :26], rows)
    assert not flat[:, 26:].any()  # the padding is never written


def test_aligned_shapes_need_no_padding():
    for rank, rope, dtype in [(512, 64, torch.bfloat16), (144, 48, torch.bfloat16), (64, 32, torch.bfloat16),
                              (24, 8, torch.bfloat16), (4, 4, torch.bfloat16), (24, 8, torch.float32)]:
        cache = PagedLatentCache(1, 1, 1, rank, rope, dtype, "cpu")
        assert cache.row_width == rank + rope and cache.padding_bytes_per_token == 0


def test_device_page_table_is_updated_in_place():
    """Pages taken are written into the sequence's own table row; the table is not rebuilt per step."""
    cache = PagedLatentCache(1, num_pages=40, page_size=4, kv_lora_rank=8, rope_dim=8, dtype=torch.float32,
                             device="cpu", max_sequences=2, max_pages_per_sequence=4)
    first, second = cache.add_sequence(), cache.add_sequence()
    table = cache.device_table()
    cache.append(first, 9)  # 3 pages
    for _ in range(6):
        cache.append(second, 1)  # 2 pages, one at a time
        assert cache.device_table() is table  # same tensor, same storage: a captured graph keeps reading it
    for seq in (first, second):
        pages = cache.page_table([seq])[0].tolist()
        assert table[cache.row(seq), : len(pages)].tolist() == pages
    # outgrowing the table reallocates it once (version bump) and keeps every entry
    cache.append(first, 9)  # 5 pages > 4 columns
    grown = cache.device_table()
    assert cache.table_version == 1 and grown.shape == (2, 8)
    assert grown[cache.row(first), :5].tolist() == cache.page_table([first])[0].tolist()
    assert grown[cache.row(second), :2].tolist() == cache.page_table([second])[0].tolist()
    # a released row is reused by the next sequence, whose entries then replace the old ones
    cache.release(second)
    third = cache.add_sequence()
    assert cache.row(third) == 1
    cache.append(third, 1)
    assert cache.device_table()[1, 0].item() == cache.page_table([third])[0, 0].item()
    cache.add_sequence()  # a third open sequence: more rows
    assert cache.device_table().shape[0] == 4 and cache.table_version == 2


# ----------------------------------------------------------------------------------------- absorption
def test_absorption_plan_follows_the_weight_counts():
    smollm_4x = plan_absorption("auto", heads=9, nope=64, rope_dim=32, v_dim=64, rank=64, q_in=576, hidden=576)
    assert smollm_4x.fuse_query and smollm_4x.fuse_output
    assert smollm_4x.query_costs == (534528, 497664) and smollm_4x.output_costs == (368640, 331776)
    smollm_2x = plan_absorption("auto", heads=9, nope=64, rope_dim=48, v_dim=64, rank=144, q_in=576, hidden=576)
    assert not smollm_2x.fuse_query and not smollm_2x.fuse_output
    assert plan_absorption("fused", 9, 64, 48, 64, 144, 576, 576).fuse_query
    assert not plan_absorption("separate", 9, 64, 32, 64, 64, 576, 576).fuse_output
    with pytest.raises(GenerationSettingsError, match="absorb='both'"):
        plan_absorption("both", 9, 64, 32, 64, 64, 576, 576)


def test_fused_weights_compute_what_the_per_head_products_compute():
    generator = torch.Generator().manual_seed(0)
    heads, nope, rope, v, rank, q_in, hidden, batch = 3, 5, 4, 6, 7, 11, 13, 2
    q_weight = torch.randn(heads * (nope + rope), q_in, generator=generator)
    w_uk = torch.randn(heads, nope, rank, generator=generator)
    o_proj = torch.randn(hidden, heads * v, generator=generator)
    w_uv_t = torch.randn(heads, rank, v, generator=generator)
    x = torch.randn(batch, q_in, generator=generator)
    q = (x @ q_weight.T).view(batch, heads, nope + rope)  # (B, H, nope + D)
    q_latent = torch.einsum("bhn,hnr->bhr", q[..., :nope], w_uk)
    fused = (x @ fuse_query_weight(q_weight, w_uk, nope, rope).T).view(batch, heads, rank + rope)
    torch.testing.assert_close(fused[..., :rank], q_latent)
    torch.testing.assert_close(fused[..., rank:], q[..., nope:])
    out = torch.randn(batch, heads, rank, generator=generator)
    values = torch.einsum("bhr,hrv->bhv", out, w_uv_t).reshape(batch, heads * v)
    torch.testing.assert_close(out.reshape(batch, -1) @ fuse_output_weight(o_proj, w_uv_t).T, values @ o_proj.T)


def _decode_logits(model, prompts, steps=3):
    cache = model.new_cache(num_pages=32, page_size=4)
    seqs = [cache.add_sequence() for _ in prompts]
    logits = [model.prefill(cache, seqs, prompts)]
    for _ in range(steps):
        logits.append(model.decode(cache, seqs, logits[-1].argmax(-1).tolist()))
    return torch.stack(logits[1:]), cache


@pytest.mark.parametrize("variant", ["q_proj", "q_lora"])
def test_fused_projections_decode_like_the_separate_ones(folders, variant):
    folder = folders[variant]
    prompts = PROMPTS
    fused = AbsorbedMLAModel.from_folder(folder, device="cpu", absorb="fused")
    separate = AbsorbedMLAModel.from_folder(folder, device="cpu", absorb="separate")
    assert fused.layers[0].attention.q_decode is not None and fused.layers[0].attention.o_decode is not None
    assert separate.layers[0].attention.q_decode is None and separate.layers[0].attention.o_decode is None
    torch.testing.assert_close(_decode_logits(fused, prompts)[0], _decode_logits(separate, prompts)[0],
                               rtol=1e-4, atol=1e-4)
    tokens = run_generation(fused, prompts, NEW_TOKENS).sequences
    assert_same_tokens(tokens, transformers_greedy(folder, prompts, new_tokens=NEW_TOKENS))


# ----------------------------------------------------------------------------------------- kernel path
def test_kernel_path_on_padded_rows_matches_the_reference_path(folders):
    """26-value rows padded to 28: the Triton kernel (interpreter on CPU) reads the slice, never the padding."""
    from mla_decode_triton.launcher import INTERPRETED

    if not INTERPRETED and not torch.cuda.is_available():
        pytest.skip("TRITON_INTERPRET=0 and no CUDA device: the kernel cannot run here")
    device = "cpu" if INTERPRETED else "cuda"
    folder = folders["odd_rows"]
    prompts = PROMPTS[:2]
    kernel = AbsorbedMLAModel.from_folder(folder, device=device, decode_backend="triton", cuda_graphs=False)
    reference = AbsorbedMLAModel.from_folder(folder, device=device, decode_backend="reference", cuda_graphs=False)
    kernel_logits, cache = _decode_logits(kernel, prompts)
    assert cache.row_width == 28 and cache.width == 26
    torch.testing.assert_close(kernel_logits, _decode_logits(reference, prompts)[0], rtol=1e-4, atol=1e-4)
    assert not cache.storage[..., 26:].any()


# ----------------------------------------------------------------------------------------- CUDA graphs
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_cuda_graph_decode_equals_eager_decode(folders, backend):
    from mla_decode_triton.launcher import INTERPRETED

    if backend == "triton" and INTERPRETED:
        pytest.skip("TRITON_INTERPRET=1: the kernel cannot run on the GPU")
    folder = folders["q_lora"]
    prompts = PROMPTS
    graphed = AbsorbedMLAModel.from_folder(folder, device="cuda", decode_backend=backend, cuda_graphs=True)
    eager = AbsorbedMLAModel.from_folder(folder, device="cuda", decode_backend=backend, cuda_graphs=False)
    graph_logits, cache = _decode_logits(graphed, prompts, steps=8)
    torch.testing.assert_close(graph_logits, _decode_logits(eager, prompts, steps=8)[0], rtol=1e-4, atol=1e-4)
    captures = graphed._graphs[cache].captures
    assert 1 <= captures <= 4  # 8 steps replay a few captured graphs (one per length bucket)
    tokens = run_generation(graphed, prompts, NEW_TOKENS).sequences
    assert_same_tokens(tokens, transformers_greedy(folder, prompts, new_tokens=NEW_TOKENS))


def test_cuda_graphs_need_cuda(folders):
    with pytest.raises(GenerationSettingsError, match="CUDA graphs need a CUDA device"):
        AbsorbedMLAModel.from_folder(folders["q_proj"], device="cpu", cuda_graphs=True)
