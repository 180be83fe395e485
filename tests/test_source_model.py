"""The functional, layer-streamed source forward must equal transformers' own models."""

from __future__ import annotations

import gc

import pytest
import torch
from tiny_models import mapped_files, save_tiny_model, tiny_model
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from mla_convert.errors import CheckpointError
from mla_convert.io.reader import CheckpointReader
from mla_convert.source.config import SourceConfig
from mla_convert.source.folds import source_folds
from mla_convert.source.model import SourceLayer, StreamedRows, StreamedSourceModel, rope_inv_freq


def forward(model, ids):
    hidden = model.embed(ids)
    cos, sin = model.cos_sin(ids.shape[1])
    for index in range(model.shape.num_layers):
        hidden, _ = model.layer_forward(hidden, model.load_layer(index), cos, sin)
    return model.logits(model.final_norm(hidden))


def streamed_logits(folder, ids):
    """The source's logits as the converter computes them: read as the Llama it equals (source/folds.py)."""
    shape = SourceConfig.from_folder(folder)
    with CheckpointReader(folder) as reader:
        reader.fold(source_folds(shape))
        return forward(StreamedSourceModel(reader, shape), ids)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(family="llama", num_heads=4, num_kv_heads=2),
        dict(family="llama", num_heads=4, num_kv_heads=4, attention_bias=True, tie_word_embeddings=True),
        dict(family="llama", num_heads=4, num_kv_heads=1),
        dict(family="mistral", num_heads=4, num_kv_heads=2),
        dict(family="qwen2", num_heads=4, num_kv_heads=2),
        dict(family="phi3", num_heads=4, num_kv_heads=2),  # q/k/v and gate/up read as rows of fused matrices
        dict(family="phi3", num_heads=4, num_kv_heads=4, tie_word_embeddings=True),
        dict(family="smollm3", num_heads=4, num_kv_heads=2, num_layers=4),  # layers 1 and 3 without RoPE
        dict(family="granite", num_heads=4, num_kv_heads=2, tie_word_embeddings=True),  # read with its multipliers folded
        dict(family="ernie4_5", num_heads=4, num_kv_heads=2),  # adjacent-pair RoPE: q/k rows read reordered
        dict(family="helium", num_heads=4, num_kv_heads=1, attention_bias=True),  # and q/k biases with them
        dict(family="ministral", num_heads=4, num_kv_heads=2),
        dict(family="seed_oss", num_heads=4, num_kv_heads=2, attention_bias=True),  # q/k/v and o biases
    ],
)
def test_streamed_forward_matches_transformers_on_tiny_models(tmp_path, kwargs):
    folder = save_tiny_model(tmp_path / "m", max_shard_size="40KB", weight_scale=4.0, **kwargs)
    ids = torch.randint(0, 128, (2, 17))
    expected = AutoModelForCausalLM.from_pretrained(folder).eval()(ids).logits
    torch.testing.assert_close(streamed_logits(folder, ids), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.real_model
def test_streamed_forward_matches_transformers_on_stories260k(stories260k):
    ids = torch.randint(0, 512, (2, 40))
    expected = AutoModelForCausalLM.from_pretrained(stories260k).eval()(ids).logits
    torch.testing.assert_close(streamed_logits(stories260k, ids), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 100000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ],
)
def test_rope_inv_freq_matches_llama_rotary_embedding(rope):
    config = LlamaConfig(hidden_size=512, num_attention_heads=4, head_dim=128, rope_parameters=dict(rope), max_position_embeddings=131072)
    expected = LlamaRotaryEmbedding(config).inv_freq
    assert torch.equal(rope_inv_freq(rope, 128), expected)


def test_resident_weights_are_kept_within_their_budget_and_give_the_same_logits(tmp_path):
    """With a residency budget (what a GPU conversion gets) weights read once are kept, in their stored dtype:
    the forward still equals streaming, a whole-model budget needs the files no more, a small one keeps less."""
    folder = save_tiny_model(tmp_path / "m", max_shard_size="40KB", weight_scale=4.0, family="llama", num_heads=4, num_kv_heads=2)
    ids = torch.randint(0, 128, (2, 17))
    expected = streamed_logits(folder, ids)
    shape = SourceConfig.from_folder(folder)
    with CheckpointReader(folder) as reader:
        total = reader.total_bytes()
        small = StreamedSourceModel(reader, shape, resident_bytes=total // 3)
        torch.testing.assert_close(forward(small, ids), expected, rtol=0, atol=0)
        assert 0 < small.resident_tensor_bytes <= total // 3
        whole = StreamedSourceModel(reader, shape, resident_bytes=total)
        torch.testing.assert_close(forward(whole, ids), expected, rtol=0, atol=0)
        assert whole.resident_tensor_bytes == total
        for shard in folder.glob("*.safetensors"):
            shard.rename(shard.with_suffix(".moved"))  # every weight now comes from the kept copies
        reader.close()
        torch.testing.assert_close(forward(whole, ids), expected, rtol=0, atol=0)
        with pytest.raises(CheckpointError, match="moved or deleted while converting"):  # the weights it did not keep are gone
            forward(small, ids)


def test_a_bf16_layer_keeps_its_mlp_as_stored_and_runs_it_as_if_widened(tmp_path):
    """load_layer widens attention and norms only (an 8B layer's MLP is 0.66 GiB in fp32): the MLP stays bf16 and is
    widened when it runs, so the layer's output is bit-identical to running it with every weight widened."""
    tiny_model(family="llama", num_heads=4, num_kv_heads=2, weight_scale=4.0).to(torch.bfloat16).save_pretrained(tmp_path / "m")
    shape = SourceConfig.from_folder(tmp_path / "m")
    mlp_roles = set(shape.mlp_weight_names(0))
    with CheckpointReader(tmp_path / "m") as reader:
        model = StreamedSourceModel(reader, shape)
        layer = model.load_layer(0)
        assert {role: tensor.dtype for role, tensor in layer.weights.items()} == {
            role: torch.bfloat16 if role in mlp_roles else torch.float32 for role in layer.weights}
        widened = SourceLayer(0, {role: tensor.float() for role, tensor in layer.weights.items()})
        hidden = torch.randn(2, 9, shape.hidden_size)
        cos, sin = model.cos_sin(9)
        out, _ = model.layer_forward(hidden, layer, cos, sin)
        expected, _ = model.layer_forward(hidden, widened, cos, sin)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("bias", [False, True])
def test_narrow_weights_widened_in_row_blocks_give_the_whole_product(bias, monkeypatch):
    """`widened_linear` widens a bf16 weight a block of rows at a time (at Llama-3-8B width one whole float32 MLP
    matrix is 235 MB): the product must equal the one with the whole weight widened."""
    from mla_convert.source import model as model_module

    monkeypatch.setattr(model_module, "WIDENED_BLOCK_BYTES", 7 * 24 * 4)  # 7 rows per block: 37 rows in 6 blocks
    torch.manual_seed(4)
    weight = torch.randn(37, 24).to(torch.bfloat16)
    b = torch.randn(37).to(torch.bfloat16) if bias else None
    x = torch.randn(3, 5, 24)
    whole = torch.nn.functional.linear(x, weight.float(), None if b is None else b.float())
    blocked = model_module.widened_linear(x, weight, b)
    assert blocked.shape == (3, 5, 37) and blocked.dtype == torch.float32
    # float32 sums of 24 products of size ~1: the GEMM kernel (CPU model, block shape) moves the last bits, a wrong
    # block would be off by O(1)
    torch.testing.assert_close(blocked, whole, rtol=1e-5, atol=1e-5)
    same = torch.randn(37, 24)  # same dtype as x: no widening, the plain product
    torch.testing.assert_close(model_module.widened_linear(x, same), torch.nn.functional.linear(x, same), rtol=0, atol=0)


@pytest.mark.parametrize("family", ["llama", "phi3"])  # phi3: gate and up are row views of one gate_up_proj
def test_mlp_matrices_larger_than_a_block_stay_in_their_shard_and_run_block_by_block(tmp_path, monkeypatch, family):
    """An MLP matrix that spans several widened blocks is not loaded with its layer: its rows are read a block at a
    time and each block's mapping is closed, so after `load_layer` and after the layer ran no shard is mapped (at
    Llama-3-8B width the mapped MLP was 0.33 GiB of resident pages through every peak of the layer).  The output
    equals the layer run with every weight loaded and widened."""
    from mla_convert.source import model as model_module

    folder = tmp_path / "m"
    tiny_model(family=family, num_heads=4, num_kv_heads=2, weight_scale=4.0).to(torch.bfloat16).save_pretrained(folder)
    shape = SourceConfig.from_folder(folder)
    monkeypatch.setattr(model_module, "WIDENED_BLOCK_BYTES", 5 * shape.intermediate_size * 4)  # 5 to 7 rows a block
    mlp_names = shape.mlp_weight_names(0)
    with CheckpointReader(folder) as reader:
        model = StreamedSourceModel(reader, shape)
        layer = model.load_layer(0)
        streamed = {role for role, value in layer.weights.items() if isinstance(value, StreamedRows)}
        assert streamed == set(mlp_names)
        gc.collect()
        assert mapped_files(folder) == set(), "the layer holds no mapping of its shard"
        hidden = torch.randn(2, 9, shape.hidden_size)
        cos, sin = model.cos_sin(9)
        out, _ = model.layer_forward(hidden, layer, cos, sin)
        gc.collect()
        assert mapped_files(folder) == set(), "every block's mapping was closed after use"
        whole = SourceLayer(0, {role: (reader.get(mlp_names[role]) if role in streamed else value).float()
                                for role, value in layer.weights.items()})
        expected, _ = model.layer_forward(hidden, whole, cos, sin)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)  # blocked products (see the test above)
    block = layer.weights["gate_weight"].read(3, 11, torch.float32)
    assert torch.equal(block, whole.weights["gate_weight"][3:11])


@pytest.mark.real_model
def test_the_calibration_description_counts_the_windows_it_used(stories260k, tmp_path):
    """A text too short for --calib-samples gave fewer windows, while the summary, report and card said the number
    asked for; greedy sampling gives one sequence, however many windows are asked for."""
    from mla_convert.convert.calibration import calibration_ids
    from mla_convert.options import CalibrationOptions
    from mla_convert.source.model import StreamedSourceModel

    text = tmp_path / "short.txt"
    text.write_text("Once upon a time there was a little cat. " * 20)
    shape = SourceConfig.from_folder(stories260k)
    with CheckpointReader(stories260k) as reader:
        model = StreamedSourceModel(reader, shape)
        ids, description = calibration_ids(model, stories260k, CalibrationOptions(data=str(text), num_samples=100,
                                                                                  seq_len=64))
        assert ids.shape[0] < 100
        assert description == f"{ids.shape[0]} x 64 token windows of short.txt (the text holds {ids.shape[0]} of the 100 asked for)"
        ids, description = calibration_ids(model, stories260k, CalibrationOptions(num_samples=3, seq_len=8, temperature=0))
        assert torch.equal(ids[0], ids[1]) and torch.equal(ids[0], ids[2])
        assert description == "3 x 8 tokens sampled greedily from the source model (one sequence, 3 times)"


@pytest.mark.parametrize("family", ["llama", "smollm3"])  # smollm3: its NoPE layers must not rotate in the cache either
def test_sampling_with_a_nucleus_of_one_token_is_transformers_greedy_decoding(tmp_path, family):
    """The calibration sampler decodes token by token from its own KV cache; with top-p so small that only the most
    likely token is left, it must produce what transformers' greedy generate produces."""
    from mla_convert.convert.calibration import sample_from_model

    folder = save_tiny_model(tmp_path / "m", family=family, num_heads=4, num_kv_heads=2, num_layers=4, weight_scale=4.0)
    shape = SourceConfig.from_folder(folder)
    with CheckpointReader(folder) as reader:
        sampled = sample_from_model(StreamedSourceModel(reader, shape), num=3, length=16, seed=0, top_p=1e-9,
                                    start_id=5)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    greedy = model.generate(torch.full((3, 1), 5), max_new_tokens=15, do_sample=False, eos_token_id=None,
                            pad_token_id=0)
    assert torch.equal(sampled, greedy)
