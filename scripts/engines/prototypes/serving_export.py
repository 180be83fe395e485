"""PROTOTYPE (issue 13): rewrite a finished mla-convert export so that serving engines accept it.

  serving_export.py IN OUT [options]        (project venv; IN = a DeepseekV3 export folder)

Post-processing only -- a measurement vehicle for the exporter fixes, not a user tool.  Every step
is exact in real arithmetic except where noted, and each is a switch so the variants can be measured:

(a) --untie: lm_head.weight = copy of embed_tokens, tie_word_embeddings = false (vLLM's DeepseekV2/V3
    never ties and would run with an uninitialised head).
(b) --dense-config: n_group / topk_group -> null (llama.cpp aborts with n_expert_groups < n_expert for
    expert_count = expert_group_count = 1).  transformers ignores both for dense layers.
    --q-path: llama.cpp requires deepseek2.attention.q_lora_rank (unless the model looks like
    DeepSeek-V2-Lite), which its converter writes only when config.q_lora_rank is set:
      keep      leave q_proj (llama.cpp then refuses to load);
      identity  q_lora_rank = hidden: input_layernorm gain g moves into q_a_layernorm; q_a_proj = I/s,
                q_b_proj = the old q_proj, kv_a_proj_with_mqa absorbs diag(g).  q_a sees x_hat (RMS 1),
                so q_a_layernorm is exact up to eps/mean(h^2) -- no tiny weights;  costs hidden^2 per layer;
      gguf-key  config gets "language_config": {"q_lora_rank": 0}: llama.cpp's loader
                (conversion/base.py ModelBase.load_hparams) renames language_config to text_config and
                merges it, so the GGUF carries q_lora_rank = 0 and llama.cpp uses wq.  Zero bytes, but a hack.
(c) magnitudes.  Today the latent rows of kv_a_proj_with_mqa are alpha * W_down with alpha ~ 1e-7 so that
    kv_a_layernorm (eps 1e-6, hard-coded in transformers, config.rms_norm_eps in vLLM/llama.cpp) is linear.
      --margin M     re-choose the latent scale from calibration: max over calibration tokens of
                     mean(c^2)/eps = M (today's worst-case bound is ~1e-5 of eps for ANY input).
                     M >= 1 means "let the norm act".  The gain is refit by least squares over the
                     calibration tokens (the average effect of the norm folded back in).
      --split        per layer s: input_layernorm *= s; q_proj (q_a_proj) and all kv_a rows /= s.  Exact.
                     s = sqrt(rms(latent rows) / rms(input-norm output)) puts both on the same scale.
      --gain-to-kvb  kv_a_layernorm gain (large, sqrt(eps)/alpha) moved into kv_b_proj (norm gain 1).
A JSON report (OUT/serving_export.json) lists, per tensor, the magnitudes that decide f16 / Q8_0 / Q4_K
survival: fraction of entries below the f16 normal minimum 6.1e-5 and flushed to 0 in f16, and the
fraction of 32-wide Q8_0 blocks whose f16 scale amax/127 is subnormal / zero.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

F16_MIN_NORMAL = 6.103515625e-05
F16_MIN_SUBNORMAL = 5.960464477539063e-08


def magnitude(t: torch.Tensor) -> dict:
    """What f16 / Q8_0 / Q4_K would do to a 2-D weight (rows = outputs, blocks along the input dim)."""
    a = t.detach().abs().double()
    nz = a[a > 0]
    # fractions over the non-zero entries (exact zeros, e.g. of an identity, survive every format)
    out = {"max": a.max().item(), "median_nonzero": nz.median().item(), "min_nonzero": nz.min().item() if nz.numel() else 0.0,
           "frac_below_f16_normal": (nz < F16_MIN_NORMAL).double().mean().item(),
           "frac_zero_in_f16": (nz.to(torch.float16) == 0).double().mean().item()}
    if t.dim() == 2 and t.shape[1] % 32 == 0:
        blocks = a.view(t.shape[0], -1, 32).amax(-1)
        q8 = blocks[blocks > 0] / 127
        out["q8_0_scale_median"] = q8.median().item()
        out["frac_q8_0_scale_subnormal"] = (q8 < F16_MIN_NORMAL).double().mean().item()
        out["frac_q8_0_scale_zero"] = (q8 < F16_MIN_SUBNORMAL / 2).double().mean().item()
    if t.dim() == 2 and t.shape[1] % 256 == 0:
        # Q4_K super-block scale ~ amax/15/63 (f16); Q6_K ~ amax/32/127
        sb = a.view(t.shape[0], -1, 256).amax(-1)
        sb = sb[sb > 0]
        out["frac_q4_k_superscale_subnormal"] = (sb / 945 < F16_MIN_NORMAL).double().mean().item()
        out["frac_q4_k_superscale_zero"] = (sb / 945 < F16_MIN_SUBNORMAL / 2).double().mean().item()
    return out


def load_state(folder: Path) -> dict[str, torch.Tensor]:
    state = {}
    for f in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state


@torch.inference_mode()
def collect(folder: Path, text: str, n_tokens: int, seq: int, use_q_lora: bool) -> dict:
    """Per layer: latent c (kv_a_layernorm input), q latent (q_a_layernorm input), input-norm output rms."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    ids = tok(text, add_special_tokens=False)["input_ids"][:n_tokens]
    stats: dict = {}

    def hook(name, kind):
        def fn(mod, inp, out):
            x = (inp[0] if kind != "act" else out).detach().double().reshape(-1, (inp[0] if kind != "act" else out).shape[-1])
            d = stats.setdefault(name, {"ms": [], "sq": 0.0, "n": 0, "absmax": 0.0})
            d["ms"].append(x.pow(2).mean(-1))
            d["sq"] += x.pow(2).sum().item()
            d["n"] += x.numel()
            d["absmax"] = max(d["absmax"], x.abs().max().item())
        return fn

    def dim_hook(name):
        def fn(mod, inp, out):
            x = out.detach().double().reshape(-1, out.shape[-1])
            d = stats.setdefault(name, {"sumsq": 0.0, "n": 0})
            d["sumsq"] = d["sumsq"] + x.pow(2).sum(0)
            d["n"] += x.shape[0]
        return fn

    hs = []
    for i, layer in enumerate(model.model.layers):
        hs.append(layer.self_attn.kv_a_proj_with_mqa.register_forward_hook(dim_hook(f"{i}.kvdim")))
        hs.append(layer.self_attn.kv_a_layernorm.register_forward_hook(hook(f"{i}.kv", "in")))
        hs.append(layer.input_layernorm.register_forward_hook(hook(f"{i}.act", "act")))
        if use_q_lora:
            hs.append(layer.self_attn.q_a_layernorm.register_forward_hook(hook(f"{i}.q", "in")))
    for s in range(0, len(ids) - 1, seq):
        model(torch.tensor([ids[s : s + seq]]))
    for h in hs:
        h.remove()
    for d in stats.values():
        if "ms" in d:
            d["ms"] = torch.cat(d["ms"])
            d["rms"] = math.sqrt(d["sq"] / d["n"])
        else:
            d["dim_rms"] = (d["sumsq"] / d["n"]).sqrt()
    return stats


def refit_latent(rows: torch.Tensor, gain: torch.Tensor, ms_old: torch.Tensor, eps: float, margin: float | None):
    """rows/gain of one latent (kv or q): new scale so that max_t mean(c^2)/eps = margin; LS gain fold.

    Old:  out_t = gain * c_t / sqrt(ms_t + eps) with c_t = rows x_t.  New rows = b * rows, new gain = k * gain:
    out'_t = out_t * g_t,  g_t = k * b * sqrt(ms_t + eps) / sqrt(b^2 ms_t + eps).  k minimises
    sum_t ||out'_t - out_t||^2 ~ sum_t ms_t/(ms_t+eps) (g_t - 1)^2  (energy of out_t ~ ms_t/(ms_t+eps)).
    """
    if margin is None:
        return rows, gain, {"scale_factor": 1.0, "gain_factor": 1.0}
    b = math.sqrt(margin * eps / ms_old.max().item())
    h = b * torch.sqrt(ms_old + eps) / torch.sqrt(b * b * ms_old + eps)
    w = ms_old / (ms_old + eps)
    k = (w * h).sum() / (w * h * h).sum()
    g = k * h
    info = {"scale_factor": b, "gain_factor": k.item(), "max_ms_over_eps": (b * b * ms_old.max() / eps).item(),
            "token_factor_rel_std": (g.std() / g.mean()).item(), "token_factor_min": g.min().item(), "token_factor_max": g.max().item()}
    return rows * b, gain * k, info


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--untie", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--dense-config", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--q-path", choices=["keep", "identity", "gguf-key"], default="identity")
    ap.add_argument("--margin", type=float, default=None, help="calibration max mean(c^2)/eps (default: keep today's scale)")
    ap.add_argument("--split", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--split-bias", type=float, default=1.0, help="multiply the balanced s by this (<1: bigger weights)")
    ap.add_argument("--gain-to-kvb", action=argparse.BooleanOptionalAction, default=False)
    ap.add_argument("--balance-cache", action=argparse.BooleanOptionalAction, default=True,
                    help="equalise the per-dimension RMS of what the KV cache stores (exact): latent dims via the "
                         "kv_a_layernorm gain vector / kv_b_proj columns, RoPE pairs via kv_a rope rows / query rope rows")
    ap.add_argument("--calib-text", type=Path, default=None)
    ap.add_argument("--calib-tokens", type=int, default=2048)
    ap.add_argument("--overwrite", action="store_true")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)

    cfg = json.loads((a.src / "config.json").read_text())
    state = load_state(a.src)
    eps = float(cfg["rms_norm_eps"])
    L, R, D, d = cfg["num_hidden_layers"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["hidden_size"]
    q_lora = cfg.get("q_lora_rank") is not None
    report: dict = {"src": str(a.src), "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
                    "layers": [], "extra_params": 0}
    need_stats = a.margin is not None or a.split or a.balance_cache
    stats = {}
    if need_stats:
        import os

        shared = Path(os.environ.get("MLA_CONVERT_SHARED", Path(__file__).resolve().parents[3].parent / "shared"))
        text_path = a.calib_text or (shared / "data" / "sotu.txt")
        text = text_path.read_text()[-200_000:]  # the end of the file: away from the evaluation texts' starts
        stats = collect(a.src, text, a.calib_tokens, 256, q_lora)
        report["calibration"] = {"text": str(text_path), "tokens": a.calib_tokens}

    if a.untie and cfg.get("tie_word_embeddings", False):
        state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
        cfg["tie_word_embeddings"] = False
        report["extra_params"] += state["lm_head.weight"].numel()
        report["untied_lm_head_params"] = state["lm_head.weight"].numel()
    if a.dense_config:
        cfg["n_group"] = None
        cfg["topk_group"] = None

    for i in range(L):
        p = f"model.layers.{i}."
        at = p + "self_attn."
        info: dict = {"layer": i}
        if stats:
            info["kv_max_ms_over_eps_before"] = stats[f"{i}.kv"]["ms"].max().item() / eps
            info["kv_mean_ms_over_eps_before"] = stats[f"{i}.kv"]["ms"].mean().item() / eps
        kv_a = state[at + "kv_a_proj_with_mqa.weight"].double()
        kv_norm = state[at + "kv_a_layernorm.weight"].double()
        in_norm = state[p + "input_layernorm.weight"].double()
        # (c) latent scale from calibration
        if a.margin is not None:
            rows, kv_norm, info["kv_latent"] = refit_latent(kv_a[:R], kv_norm, stats[f"{i}.kv"]["ms"], eps, a.margin)
            kv_a = torch.cat([rows, kv_a[R:]])
        q_keys = {}
        if q_lora:
            qa = state[at + "q_a_proj.weight"].double()
            qn = state[at + "q_a_layernorm.weight"].double()
            if a.margin is not None:
                qa, qn, info["q_latent"] = refit_latent(qa, qn, stats[f"{i}.q"]["ms"], eps, a.margin)
            q_keys = {"q_a_proj.weight": qa, "q_a_layernorm.weight": qn}
        if a.balance_cache:
            H, hq, dn = cfg["num_attention_heads"], cfg["qk_nope_head_dim"] + D, cfg["qk_nope_head_dim"]
            dim = stats[f"{i}.kvdim"]["dim_rms"]
            lat = dim[:R] * kv_norm.abs()  # cache value per dim ~ gain_i * c_i (linear regime)
            t = lat.log().mean().exp() / lat.clamp_min(1e-30)
            kv_norm = kv_norm * t
            kvb = state[at + "kv_b_proj.weight"].double()
            state[at + "kv_b_proj.weight"] = kvb / t[None, :]
            pr = dim[R:].view(-1, 2).pow(2).mean(-1).sqrt()  # RoPE pairs share one scale
            tr = (pr.log().mean().exp() / pr.clamp_min(1e-30)).repeat_interleave(2)
            kv_a = torch.cat([kv_a[:R], kv_a[R:] * tr[:, None]])
            qname = "q_b_proj.weight" if (q_lora or "q_b_proj.weight" in q_keys) else "q_proj.weight"
            qw = q_keys[qname] if qname in q_keys else state[at + qname].double()
            qw = qw.view(H, hq, -1).clone()
            qw[:, dn:, :] /= tr[None, :, None]
            qw = qw.view(H * hq, -1)
            if qname in q_keys:
                q_keys[qname] = qw
            else:
                state[at + qname] = qw
            info["cache_balance"] = {"latent_rms_spread_before": (lat.max() / lat.min()).item(),
                                     "rope_pair_rms_spread_before": (pr.max() / pr.min()).item()}
        act_rms = stats[f"{i}.act"]["rms"] if stats else 1.0
        if not q_lora and a.q_path == "identity":
            # input norm gain g -> q_a_layernorm; x_hat (RMS 1) feeds q_a = I and kv_a * diag(g)
            q_keys = {"q_a_proj.weight": torch.eye(d, dtype=torch.float64),
                      "q_a_layernorm.weight": in_norm * math.sqrt(1 + eps),
                      "q_b_proj.weight": state.pop(at + "q_proj.weight").double()}
            kv_a = kv_a * in_norm[None, :]
            act_rms = stats[f"{i}.act"]["rms"] / in_norm.pow(2).mean().sqrt().item() if stats else 1.0
            in_norm = torch.ones_like(in_norm)
            report["extra_params"] += d * d + d
        # split: input_layernorm *= s; every consumer /= s
        s = 1.0
        if a.split:
            lat_rms = kv_a[:R].pow(2).mean().sqrt().item()
            s = math.sqrt(lat_rms / act_rms) * a.split_bias
            in_norm = in_norm * s
            kv_a = kv_a / s
            if "q_a_proj.weight" in q_keys:
                q_keys["q_a_proj.weight"] = q_keys["q_a_proj.weight"] / s
            else:
                state[at + "q_proj.weight"] = state[at + "q_proj.weight"].double() / s
        info["split_s"] = s
        info["input_activation_rms"] = act_rms * s
        if a.gain_to_kvb:
            kvb = state[at + "kv_b_proj.weight"].double()
            state[at + "kv_b_proj.weight"] = kvb * kv_norm[None, :]
            kv_norm = torch.ones_like(kv_norm)
        state[at + "kv_a_proj_with_mqa.weight"] = kv_a
        state[at + "kv_a_layernorm.weight"] = kv_norm
        state[p + "input_layernorm.weight"] = in_norm
        for k, v in q_keys.items():
            state[at + k] = v
        mags = {"kv_a_latent_rows": magnitude(kv_a[:R].float()), "kv_a_rope_rows": magnitude(kv_a[R:].float()),
                "kv_b_proj": magnitude(state[at + "kv_b_proj.weight"].float())}
        for k in ("q_proj.weight", "q_a_proj.weight", "q_b_proj.weight"):
            if at + k in state:
                mags[k.split(".")[0]] = magnitude(state[at + k].float())
        info["magnitudes"] = mags
        info["kv_a_layernorm_gain"] = kv_norm.abs().max().item()
        report["layers"].append(info)

    if not q_lora and a.q_path == "identity":
        cfg["q_lora_rank"] = d
    if not q_lora and a.q_path == "gguf-key":
        cfg["language_config"] = {"q_lora_rank": 0}

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[cfg.get("dtype", "float32")]
    if a.dst.exists():
        if not a.overwrite:
            sys.exit(f"{a.dst} exists")
        shutil.rmtree(a.dst)
    a.dst.mkdir(parents=True)
    for f in a.src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(f, a.dst / f.name)
    save_file({k: v.to(dtype).contiguous() for k, v in state.items()}, str(a.dst / "model.safetensors"), metadata={"format": "pt"})
    (a.dst / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    # worst case over layers, for the summary
    summ = {}
    for info in report["layers"]:
        for name, m in info["magnitudes"].items():
            s_ = summ.setdefault(name, {})
            for key, v in m.items():
                if key.startswith("frac"):
                    s_[key] = max(s_.get(key, 0.0), v)
                elif key in ("min_nonzero", "median_nonzero", "q8_0_scale_median"):
                    s_[key + "_min"] = min(s_.get(key + "_min", math.inf), v)
                elif key == "max":
                    s_["max_max"] = max(s_.get("max_max", 0.0), v)
    report["summary"] = summ
    report["total_params"] = sum(v.numel() for v in state.values())
    (a.dst / "serving_export.json").write_text(json.dumps(report, indent=2, default=float) + "\n")
    print(json.dumps({"summary": summ, "extra_params": report["extra_params"], "total_params": report["total_params"],
                      "split_s": [round(x["split_s"], 6) for x in report["layers"]]}, indent=1, default=float))


if __name__ == "__main__":
    main()
