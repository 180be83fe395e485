"""Property tests: for any small Llama/Qwen2 shape and any rank request, a conversion either produces a
folder that stock transformers loads and runs, or stops in pre-flight with a clear `MLAConvertError`,
never with a traceback from deep inside torch.  A second property does the same for damaged configs.

Examples are tiny (hidden <= 64, 1-2 layers, 2 x 16 calibration tokens) and bounded in number;
`derandomize=True` makes every run try the same examples (CI stays reproducible).  Set
`MLA_CONVERT_PROPERTY_EXAMPLES=500` to explore more, with fresh random examples.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from tiny_models import tiny_config, tiny_model
from transformers import AutoModelForCausalLM

from mla_convert.convert import ConvertOptions, Progress, convert
from mla_convert.convert.preflight import estimated_output_bytes
from mla_convert.errors import MLAConvertError, PreflightError
from mla_convert.io.writer import partial_path_for
from mla_convert.options import CalibrationOptions
from mla_convert.source.config import SourceConfig
from mla_convert.source.shapes import MLAShape

EXPLORE = int(os.environ.get("MLA_CONVERT_PROPERTY_EXAMPLES", "0"))
SETTINGS = settings(
    max_examples=EXPLORE or 50,
    deadline=None,
    database=None,
    derandomize=not EXPLORE,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
QUICK = dict(calibration=CalibrationOptions(num_samples=2, seq_len=16), rope_finalists=1, kv_balance_search=False)
VOCAB = 64


class PhaseRecorder(Progress):
    """Records which phases started: a pre-flight failure must come before the first one."""

    def __init__(self):
        self.phases: list[str] = []

    def phase(self, name, total=None):
        self.phases.append(name)


BIASED_FAMILIES = ("llama", "smollm3", "granite", "seed_oss")  # attention_bias: q/k/v and o biases (tiny_config)


@st.composite
def conversions(draw):
    family = draw(st.sampled_from(["llama", "qwen2", "phi3", "smollm3", "granite", "ernie4_5", "helium", "ministral", "seed_oss"]))
    kv_heads = draw(st.sampled_from([1, 2, 4]))
    heads = kv_heads * draw(st.sampled_from([1, 2, 3]))
    head_dim = draw(st.integers(2, 16))  # odd ones included: pre-flight must refuse them
    hidden = draw(st.sampled_from([16, 32, 48, 64]))
    bias = family == "qwen2" or (family in BIASED_FAMILIES and draw(st.booleans()))  # phi3: never
    max_rank = min(2 * kv_heads * head_dim, hidden + int(bias))
    return dict(
        model=dict(family=family, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, hidden_size=hidden,
                   num_layers=draw(st.integers(1, 2)), intermediate_size=draw(st.sampled_from([16, 40, 64])),
                   attention_bias=bias if family in BIASED_FAMILIES else False, tie_word_embeddings=draw(st.booleans()),
                   vocab_size=VOCAB),
        kv_lora_rank=draw(st.one_of(st.none(), st.integers(-1, max_rank + 3))),
        rope_dim=draw(st.one_of(st.none(), st.integers(-1, head_dim + 3))),
        max_rank=max_rank,
    )


def write_checkpoint(folder: Path, family: str, num_heads: int, num_kv_heads: int, head_dim: int, hidden_size: int,
                     num_layers: int, intermediate_size: int, attention_bias: bool, tie_word_embeddings: bool,
                     vocab_size: int, seed: int = 0) -> None:
    """A random checkpoint laid out as save_pretrained lays it out, for any shape.

    Written directly because transformers 5 refuses to build a Llama whose hidden size is not a
    multiple of its heads (even with an explicit head_dim) or whose head_dim is odd, and those are the
    sources pre-flight must judge.  The config starts from a real one and only the shape keys change.
    """
    config = tiny_config(family=family, num_layers=num_layers, intermediate_size=intermediate_size, vocab_size=vocab_size,
                         attention_bias=attention_bias, tie_word_embeddings=tie_word_embeddings).to_dict()
    config.update(hidden_size=hidden_size, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=head_dim)
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape, std=0.1):
        return torch.randn(*shape, generator=generator) * std

    q_bias = family == "qwen2" or attention_bias
    tensors = {"model.embed_tokens.weight": normal(vocab_size, hidden_size, std=1.0), "model.norm.weight": torch.ones(hidden_size)}
    if not tie_word_embeddings:
        tensors["lm_head.weight"] = normal(vocab_size, hidden_size)
    for i in range(num_layers):
        p = f"model.layers.{i}."
        rows = {"q": num_heads * head_dim, "k": num_kv_heads * head_dim, "v": num_kv_heads * head_dim}
        for name, count in rows.items():
            tensors[p + f"self_attn.{name}_proj.weight"] = normal(count, hidden_size, std=hidden_size**-0.5)
            if q_bias:
                tensors[p + f"self_attn.{name}_proj.bias"] = normal(count, std=0.02)
        tensors[p + "self_attn.o_proj.weight"] = normal(hidden_size, num_heads * head_dim, std=(num_heads * head_dim) ** -0.5)
        if family in BIASED_FAMILIES and attention_bias:
            tensors[p + "self_attn.o_proj.bias"] = normal(hidden_size, std=0.02)
        tensors[p + "mlp.gate_proj.weight"] = normal(intermediate_size, hidden_size)
        tensors[p + "mlp.up_proj.weight"] = normal(intermediate_size, hidden_size)
        tensors[p + "mlp.down_proj.weight"] = normal(hidden_size, intermediate_size)
        if family == "phi3":  # stored fused, as Phi3ForCausalLM saves them: [q | k | v] and [gate | up]
            tensors[p + "self_attn.qkv_proj.weight"] = torch.cat([tensors.pop(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
            tensors[p + "mlp.gate_up_proj.weight"] = torch.cat([tensors.pop(p + f"mlp.{n}_proj.weight") for n in ("gate", "up")])
        tensors[p + "input_layernorm.weight"] = torch.ones(hidden_size)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(hidden_size)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def expected_to_work(case: dict) -> bool | None:
    """The spec, written out independently: True/False where it is clear-cut, None where defaults decide."""
    model, rank, rope = case["model"], case["kv_lora_rank"], case["rope_dim"]
    if model["head_dim"] % 2:
        return False
    if rank is not None and not 1 <= rank <= case["max_rank"]:
        return False
    if rope is not None and not (2 <= rope <= model["head_dim"] and rope % 2 == 0):
        return False
    if rank is None or rope is None:
        return None  # the default shape fills in the rest, and may itself be impossible for tiny kv caches
    return True


def check_loads_and_runs(folder: Path, vocab: int) -> None:
    model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        logits = model(torch.arange(8).view(1, 8) % vocab).logits
    assert logits.shape == (1, 8, vocab) and bool(torch.isfinite(logits).all())


@SETTINGS
@given(case=conversions())
def test_conversion_loads_in_transformers_or_fails_preflight(case):
    verdict = expected_to_work(case)
    with tempfile.TemporaryDirectory(prefix="mla-property-") as tmp:
        source, output = Path(tmp) / "src", Path(tmp) / "out"
        write_checkpoint(source, **case["model"])
        progress = PhaseRecorder()
        options = ConvertOptions(kv_lora_rank=case["kv_lora_rank"], rope_dim=case["rope_dim"], **QUICK)
        try:
            result = convert(source, output, options, progress)
        except PreflightError as error:  # anything else (torch errors included) fails the test
            assert verdict is not True, f"refused a feasible request: {error}"
            assert progress.phases == [], f"failed after heavy work started ({progress.phases}): {error}"
            assert all(line.strip() for line in str(error).splitlines())
            assert not output.exists() and not partial_path_for(output).exists()
            event("refused in pre-flight")
            return
        assert verdict is not False, f"accepted an impossible request: {case}"
        event("converted, loaded and ran in transformers")
        check_loads_and_runs(output, VOCAB)
        config = json.loads((source / "config.json").read_text())
        shape = SourceConfig.from_dict(config)
        opts = result.report["options"]
        estimate = estimated_output_bytes(shape, MLAShape(opts["kv_lora_rank"], opts["rope_dim"]), torch.float32)
        written = sum(p.stat().st_size for p in output.glob("*.safetensors"))
        assert written <= estimate + 16 * 1024, "the disk estimate must not undershoot (headers aside)"


# --------------------------------------------------------------------------- damaged configs
CONFIG_KEYS = ["architectures", "model_type", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
               "num_hidden_layers", "vocab_size", "intermediate_size", "rms_norm_eps", "rope_parameters", "hidden_act",
               "tie_word_embeddings", "max_position_embeddings", "dtype", "torch_dtype", "bos_token_id", "eos_token_id",
               "pad_token_id", "attention_bias", "mlp_bias", "rope_theta", "rope_scaling", "initializer_range"]
JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-3, 10**6), st.floats(allow_nan=False, allow_infinity=False),
              st.sampled_from(["", "2", "silu", "bfloat16", "yarn", "llama3", "linear", "default", "LlamaForCausalLM"])),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(["rope_type", "rope_theta", "factor", "type", "low_freq_factor",
                                                                           "high_freq_factor", "original_max_position_embeddings"]),
                                                          inner, max_size=4)),
    max_leaves=5,
)


@pytest.fixture(scope="module")
def valid_source(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("config-fuzz") / "src"
    tiny_model(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=32,
               vocab_size=VOCAB).save_pretrained(folder)
    return folder


@settings(max_examples=EXPLORE or 40, deadline=None, database=None, derandomize=not EXPLORE,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.sampled_from(CONFIG_KEYS), st.one_of(st.just("<delete>"), JSON_VALUES)), min_size=1, max_size=3))
def test_damaged_config_is_a_user_error_or_converts(valid_source, edits):
    config = json.loads((valid_source / "config.json").read_text())
    for key, value in edits:
        if value == "<delete>":
            config.pop(key, None)
        else:
            config[key] = value
    with tempfile.TemporaryDirectory(prefix="mla-config-fuzz-") as tmp:
        source, output = Path(tmp) / "src", Path(tmp) / "out"
        source.mkdir()
        shutil.copyfile(valid_source / "model.safetensors", source / "model.safetensors")
        (source / "config.json").write_text(json.dumps(config))
        try:
            convert(source, output, ConvertOptions(**QUICK))
        except MLAConvertError as error:  # anything else fails the test
            assert all(line.strip() for line in str(error).splitlines())
            assert not output.exists() and not partial_path_for(output).exists()
            return
        assert (output / "config.json").exists() and math.isfinite(json.loads((output / "mla_convert.json").read_text())["summary"]["mean_kept_energy"])
