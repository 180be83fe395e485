"""transformers side of the engine harness: perplexity (llama-perplexity protocol) and greedy decode.

Runs in the project venv.  Two sub-commands:

  tokens  MODEL DOMAIN OUT.json [--n-ctx N --n-chunks K]   token ids with the HF tokenizer
  run     MODEL TOKENS.json OUT.json [--dtype fp32|bf16]    score those ids, decode greedily

TOKENS.json: {"ppl_tokens": [...], "bos": id|null, "n_ctx": N, "n_chunks": K, "prompts": [[ids], ...]}
(also written by llamacpp_run.py from llama-tokenize, so transformers scores llama.cpp's own ids).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import GREEDY_TOKENS, PROMPTS, ppl_chunks, ppl_from_chunk_logprobs, read_json, text_for, write_json  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def load(model_dir: str, dtype: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype], attn_implementation="eager")
    model.eval()
    return model


def make_tokens(model_dir: str, domain: str, n_ctx: int, n_chunks: int) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    text = text_for(domain).read_text()
    ids = tok(text, add_special_tokens=True)["input_ids"]
    bos = tok.bos_token_id if (tok.bos_token_id is not None and ids and ids[0] == tok.bos_token_id) else None
    prompts = [tok(p, add_special_tokens=True)["input_ids"] for p in PROMPTS[domain]]
    return {"source": "transformers", "ppl_tokens": ids[: n_ctx * n_chunks], "bos": bos, "n_ctx": n_ctx,
            "n_chunks": n_chunks, "prompts": prompts, "domain": domain}


@torch.inference_mode()
def chunk_logprobs(model, chunk: list[int]) -> list[float]:
    ids = torch.tensor([chunk])
    logits = model(ids).logits[0].double()
    lp = torch.log_softmax(logits, dim=-1)
    return lp[:-1].gather(1, ids[0, 1:, None]).view(-1).tolist()


@torch.inference_mode()
def greedy(model, prompt: list[int], n: int = GREEDY_TOKENS, ban: list[int] | None = None) -> list[int]:
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    ids = torch.tensor([prompt])
    out = []
    for _ in range(n):
        logits = model(ids, cache=cache, use_cache=True).logits[0, -1]
        if ban:  # llama.cpp's --ignore-eos is a -inf logit bias on end-of-generation tokens: mirror it
            logits[ban] = -float("inf")
        nxt = int(torch.argmax(logits.float()))
        out.append(nxt)
        ids = torch.tensor([[nxt]])
    return out


def run(model_dir: str, tokens: dict, dtype: str, do_greedy: bool = True) -> dict:
    t0 = time.time()
    torch.manual_seed(0)
    model = load(model_dir, dtype)
    chunks = ppl_chunks(tokens["ppl_tokens"], tokens["n_ctx"], tokens["n_chunks"], tokens["bos"])
    lps = [chunk_logprobs(model, c) for c in chunks]
    res = ppl_from_chunk_logprobs(lps, tokens["n_ctx"])
    if do_greedy:
        res["greedy"] = [greedy(model, p, ban=tokens.get("ban")) for p in tokens["prompts"]]
    res["engine"] = "transformers"
    res["dtype"] = dtype
    res["seconds"] = round(time.time() - t0, 2)
    import transformers

    res["versions"] = {"transformers": transformers.__version__, "torch": torch.__version__}
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tokens")
    t.add_argument("model")
    t.add_argument("domain", choices=sorted(PROMPTS))
    t.add_argument("out")
    t.add_argument("--n-ctx", type=int, default=128)
    t.add_argument("--n-chunks", type=int, default=4)
    r = sub.add_parser("run")
    r.add_argument("model")
    r.add_argument("tokens")
    r.add_argument("out")
    r.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    r.add_argument("--no-greedy", action="store_true", help="perplexity only")
    a = ap.parse_args(argv)
    torch.set_num_threads(int(__import__("os").environ.get("MLA_ENGINES_THREADS", "1")))
    if a.cmd == "tokens":
        write_json(a.out, make_tokens(a.model, a.domain, a.n_ctx, a.n_chunks))
    else:
        res = run(a.model, read_json(a.tokens), a.dtype, not a.no_greedy)
        write_json(a.out, res)
        print(f"transformers {a.model} [{a.dtype}]: ppl {res['ppl']:.6f} over {res['count']} tokens ({res['seconds']} s)")


if __name__ == "__main__":
    main()
