"""The absorbed-MLA runtime against transformers' own DeepseekV3 on the same exported folders.

Why these checks: the runtime rearranges the attention (W_UK into the query, W_UV after the attention,
a paged (R + D)-wide cache, packed prompts, its own generation loop), so the only trustworthy oracle
is stock `DeepseekV3ForCausalLM.generate` on the very same folder.  fp32 folders make greedy decoding
comparable token for token; the remaining differences are fp32 summation order (~1e-7 relative), far
below the smallest top-2 logit gaps of these models.

Models: tiny random DeepseekV3 checkpoints built here (every attention variant the converter writes:
q_proj or q_a/q_b with biases, tied/untied head, default/linear/yarn RoPE), the real stories260K
converted by `convert` here, and SmolLM2-135M converted once per session (slow).

Torch runs single-threaded in this module: on the shared 2-core machine, batched matmuls of these tiny
sizes spend ~100x longer in thread barriers than computing (a generate call took 10 s instead of 0.1 s).
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import pytest
import torch
from tiny_models import pickled_copy, save_tiny_model, save_tiny_tokenizer, tiny_mla_config

from mla_convert.convert import ConvertOptions, convert
from mla_convert.options import CalibrationOptions
from mla_convert.runtime import (
    AbsorbedMLAModel,
    GenerationSettingsError,
    PagedLatentCache,
    RuntimeModelError,
    generate_ids,
    generate_text,
    run_generation,
)

NEW_TOKENS = 32
PROMPTS = [
    "Once upon a time",
    "The little dog was very happy because he found a big red ball in the park near the",
    "Lily",
]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

TINY_VARIANTS = {
    "q_proj-default-rope": dict(q_lora_rank=None, attention_bias=False, tie_word_embeddings=False,
                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "q_lora-bias-tied-linear-rope": dict(q_lora_rank=32, attention_bias=True, tie_word_embeddings=True,
                                         rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}),
    # mscale != mscale_all_dim: cos/sin carry an attention scaling != 1 and the softmax scale an mscale
    "q_proj-yarn-rope": dict(q_lora_rank=None, attention_bias=False, tie_word_embeddings=False,
                             rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                              "original_max_position_embeddings": 64, "beta_fast": 32.0,
                                              "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.5}),
}


pytestmark = pytest.mark.usefixtures("single_torch_thread")


# ----------------------------------------------------------------------------------------- helpers
def build_tiny_folder(path, tokenizer_dir, seed: int = 0, first_k_dense_replace: int = 2, **variant):
    """Save a tiny random dense DeepseekV3 (+ a character-level tokenizer of 512 ids) at `path`.

    initializer_range 0.2 (not 0.02) makes the next-token distribution peaked enough that greedy
    decoding is decided by clear margins; biases are drawn non-zero so that they matter.
    """
    from transformers import DeepseekV3ForCausalLM

    config = tiny_mla_config(vocab_size=512, kv_lora_rank=24, first_k_dense_replace=first_k_dense_replace,
                             initializer_range=0.2, **variant)
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.1)
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, path / name)
    return path


def prompt_ids(folder) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return [tokenizer(text)["input_ids"] for text in PROMPTS]


def transformers_greedy(folder, prompts: list[list[int]], new_tokens: int = NEW_TOKENS, **generate_kwargs) -> list[list[int]]:
    """Stock DeepseekV3ForCausalLM.generate, each prompt alone (no padding): the generated ids."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    outputs = []
    for prompt in prompts:
        generated = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new_tokens, **generate_kwargs)
        outputs.append(generated[0, len(prompt):].tolist())
    return outputs


def assert_same_tokens(runtime: list[list[int]], reference: list[list[int]]) -> None:
    for index, (ours, theirs) in enumerate(zip(runtime, reference, strict=True)):
        assert ours == theirs, f"prompt {index}: runtime {ours} != transformers {theirs}"


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    return save_tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory, tiny_tokenizer):
    root = tmp_path_factory.mktemp("tiny-mla")
    return {name: build_tiny_folder(root / name, tiny_tokenizer, seed=index, **variant)
            for index, (name, variant) in enumerate(TINY_VARIANTS.items())}


@pytest.fixture(scope="module")
def tiny_folder(tiny_folders):
    return tiny_folders["q_proj-default-rope"]


@pytest.fixture(scope="session")
def smollm2_mla(tmp_path_factory, smollm2):
    """SmolLM2-135M converted once per session (fp32, tiny calibration: ~1 min on 2 cores)."""
    out = tmp_path_factory.mktemp("smollm2-mla") / "out"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        convert(smollm2, out, ConvertOptions(compression=2, dtype="fp32",
                                             calibration=CalibrationOptions(num_samples=2, seq_len=64)))
    finally:
        torch.set_num_threads(threads)
    return out


# ----------------------------------------------------------------------------------------- 1. equivalence
@pytest.mark.parametrize("variant", list(TINY_VARIANTS))
def test_greedy_matches_transformers_on_tiny_models(tiny_folders, variant):
    folder = tiny_folders[variant]
    prompts = prompt_ids(folder)
    assert len({len(p) for p in prompts}) == len(prompts), "the batch must mix prompt lengths"
    runtime = generate_ids(folder, prompts, NEW_TOKENS, device="cpu")
    assert_same_tokens(runtime, transformers_greedy(folder, prompts))


@pytest.mark.real_model
def test_greedy_matches_transformers_on_converted_stories260k(stories_mla):
    prompts = prompt_ids(stories_mla)
    runtime = generate_ids(stories_mla, prompts, NEW_TOKENS, device="cpu")
    assert_same_tokens(runtime, transformers_greedy(stories_mla, prompts))
    assert all(len(ids) == NEW_TOKENS for ids in runtime), "a trained model should not stop at once"


@pytest.mark.parametrize("key_width, value_width", [(112, 64), (24, 40), (32, 32)])
@pytest.mark.parametrize("length", [1, 7])
def test_prefill_attention_equals_the_written_out_softmax(key_width, value_width, length):
    """causal_attention pads the narrower of keys / values on a CPU (torch's fused kernel wants one width): the
    result must still be softmax(q k^T * scale, causal) v, computed here in float64 from the definition."""
    from mla_convert.runtime.model import causal_attention

    generator = torch.Generator().manual_seed(key_width + length)
    heads, scale = 3, 0.3
    queries, keys = (torch.randn(heads, length, key_width, generator=generator) for _ in range(2))
    values = torch.randn(heads, length, value_width, generator=generator)
    scores = queries.double() @ keys.double().transpose(1, 2) * scale  # (H, T, T)
    scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
    expected = scores.softmax(-1) @ values.double()  # (H, T, v)
    out = causal_attention(queries, keys, values, scale)
    assert out.shape == (heads, length, value_width)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_yarn_variant_exercises_both_rope_scalings(tiny_folders):
    """The yarn folder really tests cos/sin scaling and the mscale'd softmax scale (both != their plain values)."""
    model = AbsorbedMLAModel.from_folder(tiny_folders["q_proj-yarn-rope"], device="cpu")
    assert model.attention_scaling != pytest.approx(1.0)
    assert model.softmax_scale != pytest.approx((model.nope_dim + model.rope_dim) ** -0.5)


@pytest.mark.real_model
def test_bf16_compute_keeps_the_tiny_scale_latent(stories_mla):
    """bf16 keeps fp32's exponent: the ~1e-7-scale pre-norm latent survives and logits stay within bf16 rounding."""
    prompts = prompt_ids(stories_mla)
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = AbsorbedMLAModel.from_folder(stories_mla, device="cpu", dtype=dtype)
        cache = model.new_cache(num_pages=8, page_size=16)
        seqs = [cache.add_sequence() for _ in prompts]
        model.prefill(cache, seqs, prompts)
        logits[dtype] = model.decode(cache, seqs, [5] * len(prompts)).float()  # (B, vocab), one absorbed step
    error = (logits[torch.bfloat16] - logits[torch.float32]).norm() / logits[torch.float32].norm()
    assert error < 0.03
    with pytest.raises(RuntimeModelError, match="fp16"):
        AbsorbedMLAModel.from_folder(stories_mla, device="cpu", dtype=torch.float16)


@pytest.mark.real_model
def test_generate_text_decodes_the_greedy_continuation(stories_mla):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(stories_mla))
    result = generate_text(stories_mla, PROMPTS[:2], max_new_tokens=12, device="cpu")
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS[:2]]
    reference = transformers_greedy(stories_mla, prompts, new_tokens=12)
    # the continuation reads as the whole sequence decodes: prompt text + continuation == decode(prompt + new)
    for text, prompt_ids, new_ids in zip(result.texts, prompts, reference):
        assert tokenizer.decode(prompt_ids, skip_special_tokens=True) + text == tokenizer.decode(prompt_ids + new_ids,
                                                                                                skip_special_tokens=True)
        assert text.strip() and not text[0].isalnum(), text  # "Once upon a time" + ", there was...", not "timethere"
    assert result.new_tokens == 24 and result.tokens_per_second > 0
    # prefill and decode timed apart (one rate over both read a long prompt's prefill as slow decoding)
    assert result.prompt_tokens == sum(map(len, prompts)) and 0 < result.prefill_seconds < result.seconds
    assert result.decode_seconds == pytest.approx(result.seconds - result.prefill_seconds)
    assert result.decode_tokens_per_second == pytest.approx(24 / result.decode_seconds)
    cached = sum(len(p) + 12 - 1 for p in prompts)  # both sequences (it used to count the longest alone)
    assert len(set(map(len, prompts))) == 2, "prompts of two lengths, so a sum and a maximum differ"
    assert result.cache_bytes_in_use == cached * 5 * (24 + 8) * 4  # 5 layers, R + D = 24 + 8 values, fp32


@pytest.mark.real_model
@pytest.mark.slow
def test_greedy_matches_transformers_on_converted_smollm2(smollm2_mla):
    prompts = prompt_ids(smollm2_mla)
    runtime = generate_ids(smollm2_mla, prompts, NEW_TOKENS, device="cpu")
    assert_same_tokens(runtime, transformers_greedy(smollm2_mla, prompts))


def test_stops_at_eos_like_transformers(tiny_folder):
    """Each sequence stops right after its own eos (kept in the output), the others go on."""
    model = AbsorbedMLAModel.from_folder(tiny_folder, device="cpu")
    prompts = prompt_ids(tiny_folder)
    free_running = run_generation(model, prompts, NEW_TOKENS).sequences
    eos = free_running[1][5]  # a token prompt 1 emits mid-way: make it the end-of-sequence id
    assert eos not in free_running[1][:5]
    model.eos_token_ids = (eos,)
    stopped = run_generation(model, prompts, NEW_TOKENS).sequences
    assert stopped[1] == free_running[1][:6]
    for ours, free in zip(stopped, free_running):
        expected = free[: free.index(eos) + 1] if eos in free else free
        assert ours == expected
    assert_same_tokens(stopped, transformers_greedy(tiny_folder, prompts, eos_token_id=eos))


def test_a_generation_config_decides_the_stop_tokens_alone(tiny_folder, tmp_path):
    """With a generation_config.json, generate() stops at its eos ids only, even none; config.json's count only
    where there is no such file.  The runtime fell back to config.json's id when the file named none, and with
    `generation_config=False` still stopped at the file's ids."""
    import json

    model = AbsorbedMLAModel.from_folder(tiny_folder, device="cpu")
    prompts = prompt_ids(tiny_folder)
    free_running = run_generation(model, prompts, NEW_TOKENS, generation_config=False).sequences
    emitted = free_running[1][5]  # a token prompt 1 emits mid-way
    other = next(token for token in range(model.embed_tokens.shape[0]) if all(token not in f for f in free_running))

    def folder(name: str, generation_config: dict | None):
        made = Path(shutil.copytree(tiny_folder, tmp_path / name))
        config = json.loads((made / "config.json").read_text())
        (made / "config.json").write_text(json.dumps({**config, "eos_token_id": emitted}))
        (made / "generation_config.json").unlink(missing_ok=True)
        if generation_config is not None:
            (made / "generation_config.json").write_text(json.dumps(generation_config))
        return made

    for name, generation_config, stops in (("no-file", None, True), ("file-without-eos", {"bos_token_id": 1}, False),
                                           ("file-eos-null", {"eos_token_id": None}, False),
                                           ("file-other-eos", {"eos_token_id": [other]}, False)):
        made = folder(name, generation_config)
        ours = run_generation(AbsorbedMLAModel.from_folder(made, device="cpu"), prompts, NEW_TOKENS).sequences
        assert (ours[1] == free_running[1][:6]) == stops, name
        assert_same_tokens(ours, transformers_greedy(made, prompts))
    # the file ignored entirely: its eos ids too, config.json's apply as when there is no file
    made = folder("ignored", {"eos_token_id": [free_running[0][3]]})
    ignoring = run_generation(AbsorbedMLAModel.from_folder(made, device="cpu"), prompts, NEW_TOKENS,
                              generation_config=False).sequences
    assert ignoring[0] != free_running[0][:4] and ignoring[1] == free_running[1][:6]


def test_generate_takes_the_files_length_when_no_flag_gives_one(tiny_folder, tmp_path):
    """transformers' generate() without a length generates the file's max_new_tokens; the command generated 64
    tokens and said nothing.  A max_length it does not apply (prompt and new tokens together) is named."""
    import json

    from typer.testing import CliRunner

    from mla_convert.cli import app

    made = Path(shutil.copytree(tiny_folder, tmp_path / "length"))
    path = made / "generation_config.json"
    path.write_text(json.dumps({"max_new_tokens": 3, "max_length": 40}))
    result = CliRunner().invoke(app, ["generate", str(made), "Once upon", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert re.match(r"prompt \d+ tokens in [\d.]+ s; 3 new tokens in ", result.stderr), result.stderr
    result = CliRunner().invoke(app, ["generate", str(made), "Once upon", "--device", "cpu", "--max-new-tokens", "5"])
    assert result.exit_code == 0 and re.match(r"prompt \d+ tokens in [\d.]+ s; 5 new tokens in ", result.stderr), result.output
    path.write_text(json.dumps({"max_length": 40}))
    result = CliRunner().invoke(app, ["generate", str(made), "Once upon", "--device", "cpu", "--max-new-tokens", "4"])
    assert result.exit_code == 0 and re.match(r"prompt \d+ tokens in [\d.]+ s; 4 new tokens in ", result.stderr), result.output
    result = CliRunner().invoke(app, ["generate", str(made), "Once upon", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    # the 64 is --max-new-tokens' default, not a flag the user gave (the note said "... 64 new tokens per prompt
    # instead (--max-new-tokens)")
    assert "; 64 new tokens in" in result.stderr, result.stderr  # (the length stays 64)
    assert ("note: generation_config.json sets max_length 40 (prompt and new tokens), which mla-convert generate does "
            "not apply: this run generates up to 64 new tokens per prompt, the default of --max-new-tokens") in \
        " ".join(result.stderr.split())
    # a length from the file that does not fit is named as the file's, not as a flag the user never gave
    path.write_text(json.dumps({"max_new_tokens": 600}))
    result = CliRunner().invoke(app, ["generate", str(made), "Once upon", "--device", "cpu"])
    assert result.exit_code == 2 and "error: generation_config.json max_new_tokens 600: the longest prompt" in \
        " ".join(result.output.split()), result.output
    for bad, message in ((0, "`max_new_tokens` must be greater than 0"),  # transformers' own check
                         (2.5, "max_new_tokens 2.5: must be a whole number, 1 or more")):
        path.write_text(json.dumps({"max_new_tokens": bad}))
        result = CliRunner().invoke(app, ["generate", str(made), "Once upon", "--device", "cpu"])
        assert result.exit_code == 2 and message in result.output, result.output


def test_the_folders_generation_config_applies_as_in_transformers(tiny_folder, tmp_path):
    """A converted folder keeps its source's generation_config.json; transformers' generate() applies its repetition
    penalty and no-repeat n-grams even when decoding greedily.  The runtime ignored them and decoded other tokens."""
    import json

    folder = Path(shutil.copytree(tiny_folder, tmp_path / "with-penalty"))
    path = folder / "generation_config.json"
    settings = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**settings, "repetition_penalty": 1.8, "no_repeat_ngram_size": 2, "do_sample": True,
                                "temperature": 0.7}))
    prompts = prompt_ids(folder)
    reference = transformers_greedy(folder, prompts)
    model = AbsorbedMLAModel.from_folder(folder, device="cpu")
    assert_same_tokens(run_generation(model, prompts, NEW_TOKENS).sequences, reference)
    ignoring = run_generation(model, prompts, NEW_TOKENS, generation_config=False).sequences
    assert ignoring != reference, "the penalties must change these tokens, or this test proves nothing"
    from typer.testing import CliRunner

    from mla_convert.cli import app

    result = CliRunner().invoke(app, ["generate", str(folder), "Once upon", "--max-new-tokens", "2", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "note: generation_config.json samples (do_sample true, temperature 0.7" in result.stderr


def test_generation_config_settings_the_runtime_lacks_are_named(tmp_path):
    from transformers import GenerationConfig

    from mla_convert.runtime.generation_settings import TRANSFORMERS_DEFAULTS, GenerationSettings

    defaults = GenerationConfig._get_default_generation_params()
    assert {name: defaults[name] for name in TRANSFORMERS_DEFAULTS} == TRANSFORMERS_DEFAULTS
    assert GenerationSettings.from_folder(tmp_path) == GenerationSettings()  # no file: transformers' defaults
    (tmp_path / "generation_config.json").write_text(
        '{"do_sample": true, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_new_tokens": 4, "num_beams": 1}')
    settings = GenerationSettings.from_folder(tmp_path)
    assert (settings.do_sample, settings.temperature, settings.top_p, settings.top_k) == (True, 0.7, 0.8, 20)
    assert settings.not_applied == {"min_new_tokens": 4}  # num_beams 1 asks for nothing
    # generate() applies these to a decoder-only model too (the prompt is their "encoder input"): not silently dropped
    (tmp_path / "generation_config.json").write_text('{"encoder_repetition_penalty": 3.0, "encoder_no_repeat_ngram_size": 1, '
                                                     '"token_healing": true, "do_sample": true, '
                                                     '"num_return_sequences": 2}')
    assert GenerationSettings.from_folder(tmp_path).not_applied == {
        "encoder_repetition_penalty": 3.0, "encoder_no_repeat_ngram_size": 1, "token_healing": True,
        "num_return_sequences": 2}
    (tmp_path / "generation_config.json").write_text(
        '{"do_sample": true, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_new_tokens": 4, "num_beams": 1}')
    settings = GenerationSettings.from_folder(tmp_path)
    greedy, sampled = settings.notes(sampling=False), settings.notes(sampling=True)
    assert "this run decodes greedily: add --sample" in greedy[0] and "min_new_tokens 4; mla-convert generate" in greedy[1]
    assert len(sampled) == 1
    # values transformers' processors refuse, and a file that is not JSON: one clear error, not a traceback at token 1
    from mla_convert.runtime.errors import GenerationSettingsError

    for text, message in (('{"repetition_penalty": 0, "no_repeat_ngram_size": -1}',
                           # one line each (they were joined by "; ")
                           "repetition_penalty 0: must be a number above 0\n.*: no_repeat_ngram_size -1: must be a whole"),
                          ("{not json", "generation_config.json: It looks like")):
        (tmp_path / "generation_config.json").write_text(text)
        with pytest.raises(GenerationSettingsError, match=message):
            GenerationSettings.from_folder(tmp_path)
    # sampling values matter only to a sampled run, and only where no flag replaces them (transformers' greedy
    # generate() ignores them too): a greedy run with temperature 0 in its config was refused
    (tmp_path / "generation_config.json").write_text('{"do_sample": false, "temperature": 0.0, "top_k": -1}')
    settings = GenerationSettings.from_folder(tmp_path)
    assert settings.sampling_problems(temperature=0.5) == ["generation_config.json top_k -1: must be a whole number, "
                                                           "0 or more"]
    assert len(settings.sampling_problems()) == 2


def test_the_preflight_counts_the_positions_a_run_takes(tiny_folder):
    """The last new token is never fed back, so prompt + new tokens - 1 positions must fit (runs that fit, a prompt
    of exactly max_position_embeddings tokens with one new token among them, were refused)."""
    import json

    from transformers import AutoTokenizer

    from mla_convert.runtime.checks import generation_problems

    positions = json.loads((tiny_folder / "config.json").read_text())["max_position_embeddings"]
    prompt = "Once upon"
    length = len(AutoTokenizer.from_pretrained(str(tiny_folder))(prompt)["input_ids"])

    def problems(new_tokens, text=prompt):
        return generation_problems(tiny_folder, [text], new_tokens, None, None, "cpu", "auto", 1, False)[0]

    assert problems(positions - length + 1) == []
    assert f"take {positions + 1} positions, more than" in " ".join(problems(positions - length + 2))
    whole = "a" * (positions - length) + prompt  # (a character-level tokenizer: one token per character)
    assert problems(1, whole) == [] and "is longer than" in " ".join(problems(1, whole + "a"))


def test_generate_reports_the_storage_the_row_padding_adds(tiny_tokenizer, tmp_path):
    """R + D = 24 + 2 fp32 values (104 bytes) are stored in 112-byte rows: the line said only the payload allocated."""
    from typer.testing import CliRunner

    from mla_convert.cli import app
    from mla_convert.units import human_bytes

    folder = build_tiny_folder(tmp_path / "unaligned", tiny_tokenizer, rope_dim=2)
    result = generate_text(folder, ["Once upon"], max_new_tokens=3, device="cpu", page_size=4)
    slots = result.cache_bytes_allocated // (2 * 26 * 4)  # 2 layers of 26 fp32 values per token
    assert slots % 4 == 0 and result.cache_storage_bytes == slots * 2 * 28 * 4
    line = CliRunner().invoke(app, ["generate", str(folder), "Once upon", "--max-new-tokens", "3", "--page-size", "4",
                                    "--device", "cpu"]).stderr
    assert (f"{human_bytes(slots * 208)} allocated (R + D values per token and layer; {human_bytes(slots * 224)} with the "
            "rows padded to 16 bytes)") in " ".join(line.split())


# ----------------------------------------------------------------------------------------- 2. cache
def test_page_sizes_give_the_same_tokens_and_cache_holds_r_plus_d_per_token(tiny_folder):
    model = AbsorbedMLAModel.from_folder(tiny_folder, device="cpu")
    prompts = prompt_ids(tiny_folder)
    by_page_size = {size: run_generation(model, prompts, NEW_TOKENS, page_size=size) for size in (1, 16)}
    assert by_page_size[1].sequences == by_page_size[16].sequences

    width = model.kv_lora_rank + model.rope_dim
    element = torch.empty((), dtype=model.dtype).element_size()
    fed_back = sum(len(p) + len(out) - 1 for p, out in zip(prompts, by_page_size[1].sequences))
    for size, output in by_page_size.items():
        cache = output.cache
        assert cache.storage.shape == (model.num_layers, cache.num_pages, size, width)
        assert cache.values_per_token_per_layer == width == 24 + 8
        assert cache.bytes_per_token == model.num_layers * width * element
        assert cache.bytes_allocated == cache.num_pages * size * cache.bytes_per_token
        assert cache.tokens_written == fed_back
    # page size 1 wastes nothing: the pool is exactly the worst case, (R + D) values per token and layer
    exact = by_page_size[1].cache
    assert exact.num_pages == sum(len(p) + NEW_TOKENS - 1 for p in prompts)
    assert exact.peak_pages_in_use <= exact.tokens_written
    assert exact.bytes_in_use == 0  # every sequence gave its pages back


def test_cache_rows_are_transformers_latent_and_rotated_key(tiny_folders):
    """After prefill + decode, the paged cache holds exactly what transformers caches: kv_a_layernorm(c) and k_rot."""
    from transformers import AutoModelForCausalLM

    folder = tiny_folders["q_lora-bias-tied-linear-rope"]
    model = AbsorbedMLAModel.from_folder(folder, device="cpu")
    prompt = prompt_ids(folder)[1]
    cache = model.new_cache(num_pages=64, page_size=4)
    other = cache.add_sequence()  # a neighbour, so that the sequence's pages are not simply 0, 1, 2...
    seq = cache.add_sequence()
    model.prefill(cache, [other, seq], [prompt[:3], prompt])
    extra = [5, 6]
    for token in extra:
        model.decode(cache, [other, seq], [7, token])
    tokens = prompt + extra
    pages = cache.page_table([seq])[0].long()  # (max_pages,)
    rows = cache.layer(1)[pages].reshape(-1, cache.width)[: len(tokens)]  # (T, R + D) in token order
    assert cache.length(seq) == len(tokens)

    hf = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        past = hf(torch.tensor([tokens]), use_cache=True).past_key_values
    latent = past.layers[1].keys[0, 0]  # (T, R): DeepseekV3 caches the normalised latent as "keys"
    k_rot = past.layers[1].values[0, 0]  # (T, D) and the rotated shared key as "values"
    torch.testing.assert_close(rows[:, : model.kv_lora_rank], latent, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rows[:, model.kv_lora_rank :], k_rot, rtol=1e-5, atol=1e-5)


def test_prompts_and_lengths_of_the_wrong_kind_are_one_clear_error(tiny_folder):
    """A flat list of ids was a TypeError, a text among the prompts a ValueError from int(), and 2.5 new tokens
    generated 3."""
    from mla_convert.runtime import GenerationSettingsError, generate_text

    model = AbsorbedMLAModel.from_folder(tiny_folder, device="cpu")
    for prompts, message in (([1, 5, 7], "prompt 0: a list of token ids"), (["hello"], "prompt 0: a list of token ids"),
                             ([[1, 2], [0.5, 3]], "prompt 1: a list of token ids"), ("hello", "prompts: a list of prompts"),
                             (torch.tensor([[1, 2]]), "prompts: a list of prompts")):
        with pytest.raises(GenerationSettingsError, match=re.escape(message)):
            run_generation(model, prompts, 2)
    with pytest.raises(GenerationSettingsError, match="max_new_tokens must be a whole number of at least 1, got 2.5"):
        run_generation(model, [[1, 2]], 2.5)
    with pytest.raises(GenerationSettingsError, match="prompts: a list of strings"):
        generate_text(tiny_folder, [[1, 2]], 2, device="cpu")
    tensor_prompt = run_generation(model, [torch.tensor([1, 2, 3])], 3).sequences  # a 1-D id tensor is a prompt
    assert tensor_prompt == run_generation(model, [(1, 2, 3)], 3).sequences


def test_full_cache_and_second_prefill_are_clear_errors(tiny_folder):
    model = AbsorbedMLAModel.from_folder(tiny_folder, device="cpu")
    with pytest.raises(GenerationSettingsError, match="cache is full"):
        run_generation(model, [[1, 2, 3, 4]], 8, page_size=2, num_pages=3)
    cache = model.new_cache(num_pages=4, page_size=4)
    seq = cache.add_sequence()
    model.prefill(cache, [seq], [[1, 2, 3]])
    with pytest.raises(GenerationSettingsError, match="new sequences only"):
        model.prefill(cache, [seq], [[4, 5]])


# ----------------------------------------------------------------------------------------- 3. kernel path
def test_triton_kernel_path_matches_reference_path(tiny_folder):
    """The runtime driving the Triton kernel (interpreter on CPU, compiled on CUDA) equals the reference path."""
    from mla_decode_triton import mla_decode, mla_decode_reference
    from mla_decode_triton.launcher import INTERPRETED

    device = "cpu" if INTERPRETED else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("TRITON_INTERPRET=0 and no CUDA device: the kernel cannot run here")
    kernel = AbsorbedMLAModel.from_folder(tiny_folder, device=device, decode_backend="triton")
    reference = AbsorbedMLAModel.from_folder(tiny_folder, device=device, decode_backend="reference")
    assert kernel.decode_attention is mla_decode and reference.decode_attention is mla_decode_reference
    prompts = prompt_ids(tiny_folder)[:2]
    caches = {name: m.new_cache(num_pages=64, page_size=4) for name, m in (("kernel", kernel), ("reference", reference))}
    seqs = {name: [cache.add_sequence() for _ in prompts] for name, cache in caches.items()}
    logits_k = kernel.prefill(caches["kernel"], seqs["kernel"], prompts)
    logits_r = reference.prefill(caches["reference"], seqs["reference"], prompts)
    for _ in range(3):  # a few decode steps: each one runs the kernel once per layer
        tokens = logits_r.argmax(-1).tolist()
        assert logits_k.argmax(-1).tolist() == tokens
        logits_k = kernel.decode(caches["kernel"], seqs["kernel"], tokens)
        logits_r = reference.decode(caches["reference"], seqs["reference"], tokens)
        torch.testing.assert_close(logits_k, logits_r, rtol=1e-4, atol=1e-4)
    assert not torch.equal(caches["kernel"].storage, torch.zeros_like(caches["kernel"].storage))


# ----------------------------------------------------------------------------------------- sampling
def test_sampling_is_seeded_per_prompt(tiny_folder):
    model = AbsorbedMLAModel.from_folder(tiny_folder, device="cpu")
    prompts = prompt_ids(tiny_folder)
    settings = dict(do_sample=True, temperature=1.5, top_p=0.9)
    first = generate_ids(model, prompts, 16, seed=3, **settings)
    assert first == generate_ids(model, prompts, 16, seed=3, **settings)
    assert first != generate_ids(model, prompts, 16, seed=4, **settings)
    # each prompt has its own generator: prompt 0's sample does not depend on its batch mates
    assert generate_ids(model, prompts[:1], 16, seed=3, **settings) == first[:1]
    greedy = generate_ids(model, prompts, 16)
    assert first != greedy
    # a nucleus that only holds the top token is greedy decoding through the sampling code path
    assert generate_ids(model, prompts, 16, do_sample=True, top_p=1e-6, seed=5) == greedy


# ----------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt_ids=[[]]), "empty"),
    (dict(prompt_ids=[[1, 512]]), "outside the vocabulary"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(do_sample=True, temperature=0.0), "temperature"),
    (dict(do_sample=True, top_p=0.0), "top_p"),
    (dict(decode_backend="cuda-graphs"), "decode backend"),
    (dict(page_size=0), "page_size must be a whole number of at least 1"),  # was a ZeroDivisionError
])
def test_bad_settings_are_one_line_errors(tiny_folder, kwargs, message):
    arguments = dict(prompt_ids=[[1, 2, 3]], max_new_tokens=4, device="cpu") | kwargs
    with pytest.raises(GenerationSettingsError, match=message) as error:
        generate_ids(tiny_folder, **arguments)
    assert "\n" not in str(error.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_device_that_is_not_there_is_one_clear_error(tiny_folder):
    """Was torch's "Torch not compiled with CUDA enabled" AssertionError from deep inside loading."""
    with pytest.raises(RuntimeModelError, match="device cuda: no CUDA device is available"):
        generate_ids(tiny_folder, [[1, 2, 3]], 2, device="cuda")


def test_generate_text_refuses_one_string_for_the_list_of_prompts(tiny_folder):
    with pytest.raises(GenerationSettingsError, match="wrap it in a list"):
        generate_text(tiny_folder, "Hello", 2, device="cpu")


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")  # the MoE block's empty shared expert
def test_moe_and_non_deepseek_folders_are_refused(tmp_path, tiny_tokenizer):
    moe = build_tiny_folder(tmp_path / "moe", tiny_tokenizer, first_k_dense_replace=1, q_lora_rank=None)
    with pytest.raises(RuntimeModelError, match="MoE"):
        AbsorbedMLAModel.from_folder(moe, device="cpu")
    llama = save_tiny_model(tmp_path / "llama")
    with pytest.raises(RuntimeModelError, match="model_type 'llama'"):
        AbsorbedMLAModel.from_folder(llama, device="cpu")


@pytest.mark.parametrize("eos, message", [
    ("x", "transformers cannot read its config (Validation error for field 'eos_token_id': TypeError"),
    ([2, -1], "config.json: eos_token_id [2, -1]: must be a token id or a list of them"),
])
def test_a_config_transformers_or_we_refuse_is_one_error_line_in_every_command(tmp_path, tiny_tokenizer, eos, message):
    """eval, generate and finetune ended in huggingface_hub's StrictDataclassFieldValidationError traceback for a
    config.json field of the wrong type (`"eos_token_id": "x"`); a negative id was taken as a stop token."""
    import json

    from typer.testing import CliRunner

    from mla_convert.cli import app

    folder = build_tiny_folder(tmp_path / "mla", tiny_tokenizer)
    (folder / "generation_config.json").unlink(missing_ok=True)
    config = json.loads((folder / "config.json").read_text())
    config["eos_token_id"] = eos
    (folder / "config.json").write_text(json.dumps(config))
    text = tmp_path / "text.txt"
    text.write_text("Once upon a time there was a tiny model. " * 20)
    commands = [["generate", str(folder), "Once", "--max-new-tokens", "2", "--device", "cpu"]]
    if eos == "x":  # transformers itself refuses this one, wherever the folder is loaded
        commands += [["eval", str(folder), "--data", str(text), "--context", "32", "--max-windows", "1"],
                     ["finetune", str(folder), str(tmp_path / "ft"), "--max-steps", "2", "--warmup-steps", "0",
                      "--data", str(text), "--teacher", str(folder)]]
    for command in commands:
        result = CliRunner().invoke(app, command)
        output = " ".join(result.output.split())
        assert result.exit_code == 2 and "Traceback" not in output and message in output, (command, result.output)


def test_pages_needed_counts_each_sequence_separately():
    assert PagedLatentCache.pages_needed([1, 16, 17], 16) == 1 + 1 + 2
    assert PagedLatentCache.pages_needed([5, 3], 1) == 8


@pytest.mark.parametrize("top_p", [1e-46, 1e-300])
def test_a_top_p_below_float32s_smallest_number_keeps_the_top_token(top_p):
    """The nucleus test ran in float32, where such a top_p is 0: no token was kept and torch.multinomial raised
    (generate --top-p 1e-46, convert --calib-top-p 1e-300 after calibration sampling had started)."""
    from mla_convert.data.sampling import top_p_sample

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))  # (batch, vocab)
    chosen = top_p_sample(logits, 1.0, top_p, torch.Generator().manual_seed(1))
    assert torch.equal(chosen, logits.argmax(dim=-1))


@pytest.mark.parametrize("poison", ["nan", "+inf", "every -inf"])
def test_logits_that_are_not_finite_are_a_named_error_not_a_multinomial_traceback(poison):
    """NaN / +Inf logits (a model whose activations overflow) reached torch.multinomial, whose RuntimeError named no
    model; a row where every token is -Inf too.  -Inf on some tokens (masked ones) stays a valid distribution."""
    from mla_convert.data.sampling import top_p_sample
    from mla_convert.errors import NonFiniteError

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))  # (batch, vocab)
    masked = logits.clone()
    masked[:, 10:] = float("-inf")
    assert int(top_p_sample(masked, 1.0, 0.9, torch.Generator().manual_seed(1)).max()) < 10
    if poison == "nan":
        logits[1, 7] = float("nan")
    elif poison == "+inf":
        logits[2, 3] = float("inf")
    else:
        logits[0] = float("-inf")
    with pytest.raises(NonFiniteError, match="next-token logits are not finite"):
        top_p_sample(logits, 1.0, 0.9, torch.Generator().manual_seed(1))


@pytest.mark.parametrize("sample", [False, True])
def test_generate_from_a_model_whose_logits_overflow_is_an_error_not_text(tiny_folder, tmp_path, sample):
    """Finite weights whose logits overflow (the final norm's gain at 3e38, one token's head row all ones): greedy
    decoding printed the argmax of NaN logits as text, exit 0; sampling raised torch.multinomial's traceback."""
    from safetensors.torch import load_file, save_file
    from typer.testing import CliRunner

    from mla_convert.cli import app

    folder = Path(shutil.copytree(tiny_folder, tmp_path / "overflowing"))
    weights = load_file(folder / "model.safetensors")
    weights["model.norm.weight"] = torch.full_like(weights["model.norm.weight"], 3e38)
    head = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
    weights[head][5] = 1.0
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    assert all(bool(torch.isfinite(tensor).all()) for tensor in weights.values())
    result = CliRunner().invoke(app, ["generate", str(folder), "Once upon", "--device", "cpu", "--max-new-tokens", "4",
                                      *(["--sample"] if sample else [])])
    text = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert ("error: new token 1: the model's next-token logits are not finite (NaN, +Inf, or -Inf for every token: "
            f"its activations overflow its dtype), so no token can be {'sampled' if sample else 'chosen'}") in text, text


def test_generate_refusing_pickles_offers_no_allow_pickle_flag(tiny_folder, tmp_path):
    """generate reads safetensors only and has no --allow-pickle, but its refusal of a pickled-only folder said
    "... or pass --allow-pickle to load them" and a folder without weights "(expected ... or, with --allow-pickle,
    pytorch_model.bin)" (found by the runtime/push probe).  eval, which has the flag, still offers it."""
    from typer.testing import CliRunner

    from mla_convert.cli import app

    pickled = pickled_copy(tiny_folder, tmp_path / "pickled")
    result = CliRunner().invoke(app, ["generate", str(pickled), "Once upon", "--device", "cpu"])
    text = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert (f"error: {pickled}: holds only pickled PyTorch weights (*.bin); unpickling can run arbitrary code. "
            "This command reads safetensors only: convert them to safetensors first") in text, text
    assert "--allow-pickle" not in text, text
    (pickled / "pytorch_model.bin").rename(tmp_path / "weights.bin")
    result = CliRunner().invoke(app, ["generate", str(pickled), "Once upon", "--device", "cpu"])
    text = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert f"error: {pickled}: no weights found (expected model.safetensors or model.safetensors.index.json)" in text, text
    (tmp_path / "weights.bin").rename(pickled / "pytorch_model.bin")
    (tmp_path / "text.txt").write_text("Once upon a time there was a cat. " * 20)
    result = CliRunner().invoke(app, ["eval", str(pickled), "--data", str(tmp_path / "text.txt"), "--device", "cpu"])
    text = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert "Convert them to safetensors first, or pass --allow-pickle to load them with torch.load(weights_only=True)" \
        in text, text


def test_generate_reports_prefill_and_decode_apart(tiny_folder):
    """generate printed "N new tokens in S s (X tokens/s)" with S holding the prompt's prefill too, so a long prompt
    read as slow decoding (1,519-token prompt, 5 tokens: "0.6 tokens/s") (found by the runtime/push probe)."""
    from transformers import AutoTokenizer
    from typer.testing import CliRunner

    from mla_convert.cli import app

    prompt = "Once upon a time " * 8
    tokens = len(AutoTokenizer.from_pretrained(str(tiny_folder))(prompt)["input_ids"])
    result = CliRunner().invoke(app, ["generate", str(tiny_folder), prompt, "--device", "cpu", "--max-new-tokens", "3"])
    assert result.exit_code == 0, result.output
    line = " ".join(result.stderr.split())
    found = re.search(r"prompt (\d+) tokens in ([\d.]+) s; 3 new tokens in ([\d.]+) s \(first decode step ([\d.]+) s, "
                      r"warm-up included; then 1 token in ([\d.]+) s, ([\d.]+) tokens/s\); latent cache ", line)
    assert found, line
    assert int(found[1]) == tokens and float(found[6]) > 0
    # (printed to 2 decimals: the decode's two parts add up to its time within the rounding)
    assert float(found[3]) == pytest.approx(float(found[4]) + float(found[5]), abs=0.011)


class SlowFirstDecode:
    """A model whose first decode step takes `delay` seconds longer: what a CUDA run's first step (the kernel's
    compilation, the first allocations) does to the timing.  Records how many sequences each decode step ran."""

    def __init__(self, model: AbsorbedMLAModel, delay: float):
        self.model, self.delay, self.batches = model, delay, []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def decode(self, cache, seq_ids, tokens):
        if not self.batches:
            time.sleep(self.delay)
        self.batches.append(len(seq_ids))
        return self.model.decode(cache, seq_ids, tokens)


def test_the_first_decode_steps_warm_up_is_timed_apart_from_the_steady_decode(tiny_folder):
    """generate reported "N new tokens in S s (X tokens/s)" with S holding the first decode step, whose warm-up (on
    CUDA the kernel's compilation and first allocations) can take longer than every later step together: the rate
    read as slow decoding.  Now the first step is timed apart and the steady rate counts only the later steps' tokens.
    """
    model = AbsorbedMLAModel.from_folder(tiny_folder, device="cpu")
    slow = SlowFirstDecode(model, delay=0.3)
    prompts = prompt_ids(tiny_folder)[:2]
    started = time.perf_counter()
    output = run_generation(slow, prompts, max_new_tokens=6, generation_config=False)
    total = time.perf_counter() - started
    lengths = [len(sequence) for sequence in output.sequences]
    assert len(slow.batches) == max(lengths) - 1  # a sequence's first token comes from the prefill's logits
    assert output.first_decode_step_tokens == slow.batches[0] == sum(length >= 2 for length in lengths)
    assert output.steady_decode_tokens == sum(slow.batches[1:]) == sum(lengths) - len(prompts) - slow.batches[0]
    assert output.first_decode_step_seconds >= 0.3 > output.steady_decode_seconds  # the warm-up is the first step's
    parts = output.prefill_seconds + output.first_decode_step_seconds + output.steady_decode_seconds
    assert parts == pytest.approx(total, abs=0.02)  # three consecutive parts: together the whole call

    result = generate_text(tiny_folder, ["Once upon a time", "The dog"], max_new_tokens=6, device="cpu")
    parts = result.prefill_seconds + result.first_decode_step_seconds + result.steady_decode_seconds
    assert parts == pytest.approx(result.seconds, abs=0.02)
    assert result.decode_seconds == pytest.approx(result.first_decode_step_seconds + result.steady_decode_seconds,
                                                  abs=0.02)
    assert result.new_tokens == 2 + result.first_decode_step_tokens + result.steady_decode_tokens  # 2: the prefill's
    assert result.steady_decode_tokens_per_second == pytest.approx(
        result.steady_decode_tokens / result.steady_decode_seconds)
    # the fields that were there keep their meaning: everything after the prefill, every new token
    assert result.decode_tokens_per_second == pytest.approx(result.new_tokens / result.decode_seconds)
    one = generate_text(tiny_folder, ["Once upon a time"], max_new_tokens=2, device="cpu")
    assert (one.first_decode_step_tokens, one.steady_decode_tokens, one.steady_decode_tokens_per_second) == (1, 0, None)


# --------------------------------------------------------------------------- --chat
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory, tiny_folder):
    """The tiny export with a chat template in its tokenizer_config.json (as instruct models ship one)."""
    import json

    folder = tmp_path_factory.mktemp("chat") / "model"
    shutil.copytree(tiny_folder, folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("system", [None, "Be brief."])
def test_chat_prompts_are_the_templates_turns_and_decode_as_transformers_does(chat_folder, system):
    """An instruct model answers its template's turns: `--chat` renders each prompt as a user turn (after the system
    turn when given) ending in the assistant's turn, decodes those ids token for token as transformers' generate() does,
    and returns the reply alone."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(chat_folder))
    prompts = ["Once upon a time", "Lily"]
    expected_text = [("" if system is None else f"<system>{system}</s>") + f"<user>{p}</s><assistant>" for p in prompts]
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in expected_text]  # the template, rendered by hand
    result = generate_text(chat_folder, prompts, max_new_tokens=8, device="cpu", chat=True, system=system)
    reference = transformers_greedy(chat_folder, ids, new_tokens=8)
    assert result.prompt_tokens == sum(map(len, ids)) > sum(len(tokenizer(p)["input_ids"]) for p in prompts)
    assert result.texts == [tokenizer.decode(new, skip_special_tokens=True) for new in reference]
    plain = generate_text(chat_folder, prompts, max_new_tokens=8, device="cpu")
    assert plain.prompt_tokens == sum(len(tokenizer(p)["input_ids"]) for p in prompts)  # without --chat: the text alone


def test_chat_is_refused_where_it_cannot_act(chat_folder, tiny_folder):
    """--chat on a folder without a chat template, and --system without --chat, would be ignored or crash: refused in one
    line each, before the model is loaded; the API refuses the same."""
    from typer.testing import CliRunner

    from mla_convert.cli import app
    from mla_convert.runtime import GenerationSettingsError

    no_template = CliRunner().invoke(app, ["generate", str(tiny_folder), "Hi", "--chat", "--device", "cpu"])
    assert no_template.exit_code == 2
    assert f"--chat: {tiny_folder} has no chat template" in " ".join(no_template.stderr.split())
    system_alone = CliRunner().invoke(app, ["generate", str(chat_folder), "Hi", "--system", "Be brief.", "--device", "cpu"])
    assert system_alone.exit_code == 2 and "--system: sets the chat's system turn; only with --chat" in system_alone.stderr
    with pytest.raises(GenerationSettingsError, match="has no chat template"):
        generate_text(tiny_folder, ["Hi"], 2, device="cpu", chat=True)


def test_a_chat_template_that_never_ends_is_stopped_and_named(chat_folder, tmp_path, monkeypatch):
    """jinja2's sandbox bounds what a template may call, not how long it loops: 10^10 empty iterations hung
    `generate --chat`.  Rendering is bounded in time (shortened here) and the refusal says what to do."""
    import json
    import time

    from typer.testing import CliRunner

    from mla_convert.cli import app
    from mla_convert.runtime import generate as generate_module

    folder = Path(shutil.copytree(chat_folder, tmp_path / "model"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    monkeypatch.setattr(generate_module, "CHAT_TEMPLATE_SECONDS", 0.5)
    started = time.monotonic()
    result = CliRunner().invoke(app, ["generate", str(folder), "Hi", "--chat", "--device", "cpu"])
    assert time.monotonic() - started < 60
    assert result.exit_code == 2, result.output
    assert "--chat: the folder's chat template did not finish within 0.5 s" in " ".join(result.stderr.split())
    assert "Traceback" not in result.output


def test_generate_chat_prints_the_reply_on_its_own_line(chat_folder):
    from typer.testing import CliRunner

    from mla_convert.cli import app

    result = CliRunner().invoke(app, ["generate", str(chat_folder), "Lily", "--chat", "--device", "cpu",
                                      "--max-new-tokens", "4"])
    assert result.exit_code == 0, result.output
    reply = generate_text(chat_folder, ["Lily"], 4, device="cpu", chat=True).texts[0]
    assert result.stdout == f"Lily\n{reply}\n"


def test_generate_says_its_timing_line_totals_a_batch_of_prompts(tiny_folder):
    """With several prompts the line read "prompt 9 tokens ...; 64 new tokens ..." (the prompts' totals, one batched
    run) as if of one prompt (found by the README-journey probe)."""
    from transformers import AutoTokenizer
    from typer.testing import CliRunner

    from mla_convert.cli import app

    prompts = ["Once upon a time", "The cat"]
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_folder))
    total = sum(len(tokenizer(p)["input_ids"]) for p in prompts)
    result = CliRunner().invoke(app, ["generate", str(tiny_folder), *prompts, "--device", "cpu", "--max-new-tokens", "3"])
    assert result.exit_code == 0, result.output
    line = " ".join(result.stderr.split())
    assert re.search(rf"2 prompts, batched: {total} tokens in [\d.]+ s; 6 new tokens in ", line), line
