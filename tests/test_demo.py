"""The demo's own evaluation text: windows sampled from a real model, scored by that model.

Why: `mla-convert demo` scores source and converted model on text the source samples itself (no dataset
download on a fresh machine), so that text must be seeded and must be the model's kind of text.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from mla_convert.convert.pipeline import Progress
from mla_convert.data.sampling import sample_from_model
from mla_convert.data.textdata import tokenize_with_offsets
from mla_convert.demo import compare_models, demo_problems, run_demo, self_sampled_perplexity
from mla_convert.errors import PreflightError
from mla_convert.io.hf_loading import load_tokenizer


class UniformModel(torch.nn.Module):
    """A causal LM that predicts every token with equal probability: perplexity = vocabulary size."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab
        self.anchor = torch.nn.Parameter(torch.zeros(1))

    def get_input_embeddings(self):
        return torch.nn.Embedding(1, 1)

    def forward(self, input_ids, **kwargs):
        logits = torch.zeros(*input_ids.shape, self.vocab) + self.anchor
        return type("Output", (), {"logits": logits})()


@pytest.mark.real_model
def test_self_sampled_windows_are_seeded_and_the_models_kind_of_text(stories260k):
    model = AutoModelForCausalLM.from_pretrained(stories260k, dtype=torch.float32).eval()
    first = sample_from_model(model, 3, 48, seed=1)
    assert first.shape == (3, 48)
    assert (first[:, 0] == model.config.bos_token_id).all()
    assert torch.equal(first, sample_from_model(model, 3, 48, seed=1))
    assert not torch.equal(first, sample_from_model(model, 3, 48, seed=2))
    scores = self_sampled_perplexity({"model": model, "uniform": UniformModel(model.config.vocab_size)}, model,
                                     num=3, length=48, seed=1)
    assert scores["uniform"] == pytest.approx(model.config.vocab_size, rel=1e-4)
    assert scores["model"] < 0.1 * scores["uniform"], scores
    assert scores == self_sampled_perplexity({"model": model, "uniform": UniformModel(model.config.vocab_size)}, model,
                                             num=3, length=48, seed=1)



@pytest.mark.real_model
def test_sampling_draws_from_the_most_likely_candidates(stories260k):
    """`candidates` bounds the nucleus without changing what it is: where the vocabulary fits in the default bound
    (stories260K: 512 tokens) the samples equal the exact full sort's; one candidate is the greedy sequence, the same
    for every seed and the same as a nucleus of one token."""
    model = AutoModelForCausalLM.from_pretrained(stories260k, dtype=torch.float32).eval()
    assert torch.equal(sample_from_model(model, 3, 32, seed=1), sample_from_model(model, 3, 32, seed=1, candidates=None))
    greedy = sample_from_model(model, 2, 32, seed=1, candidates=1)
    assert torch.equal(greedy, sample_from_model(model, 2, 32, seed=9, candidates=1))
    assert torch.equal(greedy, sample_from_model(model, 2, 32, seed=3, top_p=1e-9, candidates=None))
    assert not torch.equal(greedy, sample_from_model(model, 2, 32, seed=1, candidates=8))

class PhaseRecorder(Progress):
    def __init__(self):
        self.phases: list[str] = []
        self.advances: list[tuple[int, int | None]] = []

    def phase(self, name: str, total: int | None = None) -> None:
        self.phases.append(name)

    def advance(self, done: int, total: int | None = None) -> None:
        self.advances.append((done, total))


@pytest.mark.real_model
def test_comparison_runs_as_its_own_phases_and_a_model_matches_itself(stories260k, capfd, tmp_path):
    """The demo's comparison after the conversion: announced as two phases (so the console does not count
    its time into the conversion's last phase), and a model compared with itself scores and continues
    identically (the oracle for the side-by-side plumbing)."""
    phases = PhaseRecorder()
    short = tmp_path / "short.txt"
    short.write_text("Once upon a time there was a little cat. " * 20)  # one window of 1024 tokens at most
    perplexity, generations = compare_models(stories260k, stories260k, str(short), prompts=("Once upon a time", "The cat"),
                                             max_new_tokens=8, progress=phases)
    assert phases.phases == ["perplexity of the source and the MLA model", "greedy continuations from both models"]
    assert phases.advances == [(1, 2), (2, 2)]
    sampled, on_the_text = perplexity  # (the label said "first 10 windows" whatever the text held)
    tokens = len(tokenize_with_offsets(load_tokenizer(stories260k), short.read_text()))
    assert tokens < 1024 and on_the_text == f"{short} (ctx {tokens}, 1 window)"  # was "ctx 1024": the window's real length
    assert perplexity[on_the_text]["source"] == perplexity[on_the_text]["converted"]
    scores = perplexity[sampled]
    assert scores["source"] == scores["converted"] and 1 < scores["source"] < 100
    assert [prompt for prompt, _, _ in generations] == ["Once upon a time", "The cat"]
    assert all(source == converted and source.strip() for _, source, converted in generations)
    assert "Loading weights" not in capfd.readouterr().err  # transformers' bar would cut across ours


def test_unreadable_eval_data_is_refused_before_the_model_is_fetched(tmp_path):
    # --eval-data used to be read only after the minutes-long SmolLM2 conversion
    (tmp_path / "empty-folder").mkdir()
    text = tmp_path / "text.txt"
    text.write_text("Some text to score. " * 10)
    assert demo_problems(2.0, None, str(text)) == []
    for bad, expected in ((str(tmp_path / "missing.txt"), "no such file"), ("", "must not be empty"),
                          (str(tmp_path / "empty-folder"), str(tmp_path / "empty-folder"))):
        (problem,) = demo_problems(2.0, None, bad)
        assert problem.startswith("--eval-data") and expected in problem
    with pytest.raises(PreflightError, match="missing.txt"):
        run_demo(output=tmp_path / "never-written", eval_data=str(tmp_path / "missing.txt"))
    assert not (tmp_path / "never-written").exists()


def test_an_output_the_demo_did_not_make_is_refused_before_the_model_is_fetched(tmp_path):
    """`demo --output` replaced any mla-convert folder, a fine-tuned model included, after 11 minutes of work."""
    import json

    from mla_convert.demo import earlier_demo_output

    def folder(name: str, report: dict | None):
        (tmp_path / name).mkdir()
        if report is not None:
            (tmp_path / name / "mla_convert.json").write_text(json.dumps(report))
        return tmp_path / name

    earlier = folder("earlier", {"command": "mla-convert demo --output earlier", "finetuning": None})
    api = folder("api", {"command": "mla_convert.demo.run_demo(compression=2)"})
    tuned = folder("tuned", {"command": "mla-convert demo", "finetuning": {"steps": 3}})
    converted = folder("converted", {"command": "mla-convert convert src converted -c 2"})
    notes = folder("notes", None)
    assert earlier_demo_output(earlier) and earlier_demo_output(api)
    for other in (tuned, converted, notes):
        (problem,) = demo_problems(2.0, other)
        assert "exists and is not an earlier demo's output" in problem
    assert demo_problems(2.0, earlier) == []  # its own earlier output: replaced when the demo writes it


def test_the_demo_cards_base_model_and_license_are_ones_convert_accepts():
    """The demo converts with --base-model/--license of SmolLM2; a bad constant would fail only after the download."""
    from mla_convert.hub.card import card_option_problems
    from mla_convert.io.assets import SMOLLM2_HUB_ID, SMOLLM2_LICENSE

    assert card_option_problems(SMOLLM2_HUB_ID, SMOLLM2_LICENSE) == []
