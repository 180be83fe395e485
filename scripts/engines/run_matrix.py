"""Drive the engine harness for one export (and its source): llama.cpp and vLLM against transformers.

  run_matrix.py --export DIR --source DIR --domain stories|general --work DIR --out results.json
                [--engines llamacpp,vllm] [--weights f32,f16,bf16,q8_0,Q4_K_M] [--kv f16,q8_0]

Runs in the project venv (transformers); each engine runs in its own venv under
~/.cache/mla-convert-engines (see scripts/check_engines.sh).  Both models go through the same engine
path (the source as Llama, the export as DeepSeek-V3), each scored on the engine's own token ids, and
transformers scores exactly those ids, so:
  * engine vs transformers on the same model: relative perplexity difference, greedy identity;
  * converted/source perplexity ratio in the engine vs the same ratio in transformers.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ENGINES_HOME, read_json, write_json  # noqa: E402

HERE = Path(__file__).resolve().parent
HF_PY = sys.executable


def venv_python(name: str) -> str:
    return str(ENGINES_HOME / name / "bin" / "python")


def sh(cmd, log: Path, timeout=3600) -> int:
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with open(log, "w") as f:
        p = subprocess.run([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
    print(f"  [{time.time() - t0:6.1f}s rc={p.returncode}] {' '.join(str(c) for c in cmd[:3])} ... -> {log.name}", flush=True)
    return p.returncode


def hf(model: Path, tokens: Path, out: Path, dtype="fp32") -> dict | None:
    if not out.exists() or out.stat().st_mtime < tokens.stat().st_mtime:
        sh([HF_PY, HERE / "hf_run.py", "run", model, tokens, out, "--dtype", dtype], out.with_suffix(".log"))
    return read_json(out) if out.exists() else None


def decode(model: Path, ids: list[int]) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model).decode(ids)


def rel(a, b):
    return None if a is None or b is None else abs(a - b) / abs(b)


def run_llamacpp(models: dict, a, work: Path) -> dict:
    out = {}
    for label, model in models.items():
        w = work / "llamacpp" / label
        res_file = w / "result.json"
        if not (a.reuse and res_file.exists()):
            sh([venv_python("llamacpp"), HERE / "llamacpp_run.py", model, w, a.domain, res_file, "--weights", a.weights,
                "--kv", a.kv, "--n-ctx", a.n_ctx, "--n-chunks", a.n_chunks, "--greedy", a.greedy,
                *(["--quantize-extra", a.quantize_extra] if a.quantize_extra else [])], w / "llamacpp_run.log")
        if not res_file.exists():
            out[label] = {"status": "harness-error", "log": str(w / "llamacpp_run.log")}
            continue
        res = read_json(res_file)
        if "tokens_file" in res:
            ref = hf(model, Path(res["tokens_file"]), w / "hf_fp32.json")
            res["transformers"] = {"ppl": ref["ppl"], "count": ref["count"]} if ref else None
            if ref:
                texts = [decode(model, g) for g in ref["greedy"]]
                res["transformers"]["greedy_text"] = texts
                for r in res.get("runs", {}).values():
                    if r.get("ok"):
                        r["rel_diff_vs_transformers"] = rel(r["ppl"], ref["ppl"])
                        if r.get("greedy"):
                            # llama-completion --special prints the 32 tokens' text, then a blank line at exit;
                            # SentencePiece decoding in transformers drops the first token's leading space
                            same = [bool(g.get("ok")) and g["text"].strip().startswith(t.strip())
                                    and not g["text"].strip()[len(t.strip()):].strip() for g, t in zip(r["greedy"], texts)]
                            r["greedy_identical"] = f"{sum(same)}/{len(same)}"
        out[label] = res
    if "source" in out and "export" in out and out["source"].get("transformers") and out["export"].get("transformers"):
        hf_ratio = out["export"]["transformers"]["ppl"] / out["source"]["transformers"]["ppl"]
        ratios = {"transformers_fp32": hf_ratio}
        for key, r in out["export"].get("runs", {}).items():
            s = out["source"].get("runs", {}).get(key, {})
            if r.get("ok") and s.get("ok"):
                ratio = r["ppl"] / s["ppl"]
                kv = key.split("/")[1]
                ratios[key] = {"ratio": ratio, "vs_transformers_ratio": ratio / hf_ratio - 1,
                               "kv_MiB_export": ((out["export"].get("kv_4096") or {}).get(kv) or {}).get("MiB"),
                               "kv_MiB_source": ((out["source"].get("kv_4096") or {}).get(kv) or {}).get("MiB")}
        out["ratios"] = ratios
    return out


def random_tokens(vocab: int, n_ctx: int, n_chunks: int) -> dict:
    """Token ids for a checkpoint without a tokenizer (synthetic weights): seeded random ids, 4 prompts of 8."""
    import random

    rng = random.Random(0)
    return {"source": "random ids (synthetic checkpoint has no tokenizer)", "ppl_tokens": [rng.randrange(vocab) for _ in range(n_ctx * n_chunks)],
            "bos": None, "n_ctx": n_ctx, "n_chunks": n_chunks, "domain": "synthetic",
            "prompts": [[rng.randrange(vocab) for _ in range(8)] for _ in range(4)]}


def run_vllm(models: dict, a, work: Path) -> dict:
    out = {}
    for label, model in models.items():
        w = work / "vllm" / label
        tokens = w / "tokens_hf.json"
        if not tokens.exists() and a.random_tokens:
            write_json(tokens, random_tokens(a.random_tokens, a.n_ctx, a.n_chunks))
        if not tokens.exists():
            sh([HF_PY, HERE / "hf_run.py", "tokens", model, a.domain, tokens, "--n-ctx", a.n_ctx, "--n-chunks", a.n_chunks], w / "tokens.log")
        res_file = w / "result.json"
        if not (a.reuse and res_file.exists()):
            sh([venv_python("vllm"), HERE / "vllm_run.py", model, tokens, res_file, "--dtype", "float32", *a.vllm_args.split()], w / "vllm_run.log")
        res = read_json(res_file) if res_file.exists() else {"ok": False, "error": "harness error, see log"}
        ref = hf(model, tokens, w / "hf_fp32.json")
        if ref:
            res["transformers_ppl"] = ref["ppl"]
            if res.get("ok"):
                res["rel_diff_vs_transformers"] = rel(res["ppl"], ref["ppl"])
                same = [x == y for x, y in zip(res["greedy"], ref["greedy"])]
                res["greedy_identical"] = f"{sum(same)}/{len(same)}"
                res["greedy_tokens_matching"] = [next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), len(x))
                                                 for x, y in zip(res["greedy"], ref["greedy"])]
        out[label] = res
    return out


def export_info(folder: Path, model_name: str | None = None) -> dict:
    """What scripts/engines/record_runs.py needs to file the runs: shape, target, tying, biases, who made the export."""
    cfg = read_json(folder / "config.json")
    report_file = folder / "mla_convert.json"
    report = read_json(report_file) if report_file.exists() else {}
    options = report.get("options", {})
    source = (report.get("source") or {}).get("name_or_path")
    return {
        "kv_lora_rank": cfg.get("kv_lora_rank"), "rope_dim": cfg.get("qk_rope_head_dim"), "q_lora_rank": cfg.get("q_lora_rank"),
        "tie_word_embeddings": cfg.get("tie_word_embeddings"), "attention_bias": cfg.get("attention_bias"),
        "target": options.get("target", "transformers") if report else None,
        "made_by": f"mla-convert {report.get('mla_convert_version')}" if report else "not an mla-convert export",
        "model": model_name or (Path(source).name if source else folder.name),
        "command": report.get("command"),
        # which RoPE the engine ran: a run counts only for exports with the same type (mla_convert/convert/engines.py)
        "rope_type": (cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}).get("rope_type", "default"),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--export", type=Path, required=True)
    ap.add_argument("--source", type=Path)
    ap.add_argument("--domain", default="general")
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--engines", default="llamacpp,vllm")
    ap.add_argument("--weights", default="f32,f16,bf16,q8_0,Q4_K_M")
    ap.add_argument("--kv", default="f16,q8_0")
    ap.add_argument("--n-ctx", type=int, default=128)
    ap.add_argument("--n-chunks", type=int, default=4)
    ap.add_argument("--quantize-extra", default="")
    ap.add_argument("--greedy", default="all", help="llama.cpp weight types to decode greedily with ('all', 'none', list)")
    ap.add_argument("--vllm-args", default="")
    ap.add_argument("--vllm-source", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--reuse", action="store_true", help="keep engine result files that already exist (re-summarise)")
    ap.add_argument("--random-tokens", type=int, default=0, metavar="VOCAB",
                    help="vLLM: score seeded random ids below VOCAB (a checkpoint without a tokenizer) instead of the domain's text")
    ap.add_argument("--model-name", default=None, help="how the engine record names the source model (default: its folder name)")
    a = ap.parse_args(argv)
    models = {"export": a.export.resolve()}
    if a.source:
        models = {"source": a.source.resolve(), **models}
    t0 = time.time()
    result = {"export": str(a.export), "source": str(a.source), "domain": a.domain, "date": time.strftime("%Y-%m-%d"),
              "export_info": export_info(a.export, a.model_name)}
    if "llamacpp" in a.engines:
        result["llamacpp"] = run_llamacpp(models, a, a.work)
    if "vllm" in a.engines:
        vm = models if a.vllm_source else {"export": models["export"]}
        result["vllm"] = run_vllm(vm, a, a.work)
    result["seconds"] = round(time.time() - t0, 1)
    write_json(a.out, result)
    print(summary(result))


def summary(r: dict) -> str:
    lines = [f"== {r['export']} (source {r['source']})"]
    lc = r.get("llamacpp")
    if lc:
        for label in ("source", "export"):
            x = lc.get(label)
            if not x:
                continue
            tr = (x.get("transformers") or {}).get("ppl")
            lines.append(f"llama.cpp {label}: transformers ppl {tr}  convert: {x.get('status', 'ok')}")
            for key, run in x.get("runs", {}).items():
                if run.get("ok"):
                    lines.append(f"  {key:14s} ppl {run['ppl']:.4f}  rel {run.get('rel_diff_vs_transformers', float('nan')):.2e}"
                                 f"  greedy {run.get('greedy_identical')}  fa={run.get('flash_attn')}")
                else:
                    lines.append(f"  {key:14s} FAILED: {(run.get('error') or '')[-200:]!r}")
        for key, v in (lc.get("ratios") or {}).items():
            if isinstance(v, dict):
                lines.append(f"  ratio {key:14s} {v['ratio']:.4f}  vs transformers ratio {v['vs_transformers_ratio']:+.2%}  "
                             f"KV@4096 {v['kv_MiB_export']} vs {v['kv_MiB_source']} MiB")
            else:
                lines.append(f"  ratio {key}: {v:.4f}")
    vl = r.get("vllm")
    if vl:
        for label, x in vl.items():
            if x.get("ok"):
                lines.append(f"vLLM {label}: ppl {x['ppl']:.6f} vs transformers {x.get('transformers_ppl'):.6f} rel {x.get('rel_diff_vs_transformers'):.2e}"
                             f" greedy {x.get('greedy_identical')} {x.get('greedy_tokens_matching')}"
                             f" KV tokens/GiB {x.get('kv_cache_tokens_per_gib')} workarounds {x.get('workarounds')}")
            else:
                lines.append(f"vLLM {label}: FAILED {x.get('error', '')[:300]}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
