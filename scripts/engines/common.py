"""Shared pieces of the engine harness (issue 13): paths, prompts, the perplexity protocol.

Imported by the runners that live in *different* virtual environments (transformers in the project
venv, vLLM and llama.cpp in their own venvs under ~/.cache/mla-convert-engines), so this module uses
the standard library only.

The perplexity protocol is llama.cpp's `llama-perplexity` (tools/perplexity/perplexity.cpp,
`perplexity()`): the token stream is cut into chunks of `n_ctx` tokens; when the vocabulary adds a
BOS token, the first token of every chunk is replaced by BOS; only the second half of each chunk is
scored (positions first = n_ctx/2 .. n_ctx-2 predict tokens first+1 .. n_ctx-1).  Running the same
protocol on the same token ids in transformers and vLLM makes the three numbers directly comparable.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ENGINES_HOME = Path(os.environ.get("MLA_CONVERT_ENGINES_HOME", Path.home() / ".cache" / "mla-convert-engines"))
SHARED = Path(os.environ.get("MLA_CONVERT_SHARED", REPO.parent / "shared"))

# Four fixed prompts per text domain; greedy decoding of 32 new tokens each, EOS ignored.
PROMPTS = {
    "stories": [
        "Once upon a time, there was a little girl named Lily.",
        "The dog saw a big red ball in the park.",
        "Tom and his mom went to the store.",
        "One day, a bird flew into the",
    ],
    "general": [
        "The capital of France is",
        "In 1905, Albert Einstein published",
        "def fibonacci(n):",
        "The best way to learn a new language is",
    ],
}
GREEDY_TOKENS = 32


def text_for(domain: str) -> Path:
    """The fixed evaluation text of a domain (tinystories excerpt / wikitext-2 test)."""
    name = "tinystories-valid-excerpt.txt" if domain == "stories" else "wikitext-2-raw-test.txt"
    return SHARED / "data" / name


def ppl_chunks(tokens: list[int], n_ctx: int, n_chunks: int, bos: int | None) -> list[list[int]]:
    """llama-perplexity's chunks: n_ctx tokens each, first token replaced by BOS when the vocab adds one."""
    out = []
    for i in range(min(n_chunks, len(tokens) // n_ctx)):
        chunk = list(tokens[i * n_ctx : (i + 1) * n_ctx])
        if bos is not None:
            chunk[0] = bos
        out.append(chunk)
    if not out:
        raise ValueError(f"text too short: {len(tokens)} tokens < n_ctx {n_ctx}")
    return out


def ppl_from_chunk_logprobs(chunk_logprobs: list[list[float]], n_ctx: int) -> dict:
    """chunk_logprobs[i][p] = log P(token p | tokens < p) for p = 1..n_ctx-1 (index p-1).

    Scores positions first+1 .. n_ctx-1 (first = n_ctx // 2) like llama-perplexity.
    """
    first = n_ctx // 2
    nll, count = 0.0, 0
    for lps in chunk_logprobs:
        scored = lps[first : n_ctx - 1]  # token p = first+1 .. n_ctx-1  <->  index p-1
        nll -= sum(scored)
        count += len(scored)
    return {"ppl": math.exp(nll / count), "nll": nll, "count": count}


def write_json(path: str | Path, obj) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def read_json(path: str | Path):
    return json.loads(Path(path).read_text())
