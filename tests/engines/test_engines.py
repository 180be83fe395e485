"""vLLM and llama.cpp against transformers on stories260K exports (issue 13 acceptance, small scale).

The serving fixes are prototyped as a post-processing step (scripts/engines/prototypes/serving_export.py)
until the exporter's `--target` lands; the raw export is kept to pin the issue's findings.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts" / "engines"))
from common import ENGINES_HOME  # noqa: E402


def need(engine: str):
    py = ENGINES_HOME / engine / "bin" / "python"
    if not py.exists():
        pytest.skip(f"{engine} venv not installed at {py} (run scripts/check_engines.sh --install-only)")


@pytest.fixture(scope="session")
def stories_exports(tmp_path_factory, stories260k):
    root = tmp_path_factory.mktemp("engines")
    raw = root / "s2x"
    subprocess.run([sys.executable, "-m", "mla_convert", "convert", str(stories260k), str(raw), "--compression", "2",
                    "--dtype", "fp32", "-q"], check=True, cwd=REPO)
    serving = root / "s2x_serving"
    subprocess.run([sys.executable, str(REPO / "scripts/engines/prototypes/serving_export.py"), str(raw), str(serving),
                    "--q-path", "identity", "--margin", "1e-2",
                    "--calib-text", str(stories260k.parents[1] / "data" / "tinystories-valid-excerpt.txt")], check=True)
    return {"root": root, "raw": raw, "serving": serving, "source": stories260k}


def matrix(ex, export: Path, engines: str, name: str, **kw) -> dict:
    out = ex["root"] / f"{name}.json"
    args = [sys.executable, str(REPO / "scripts/engines/run_matrix.py"), "--export", str(export), "--source", str(ex["source"]),
            "--domain", "stories", "--work", str(ex["root"] / name), "--out", str(out), "--engines", engines]
    for k, v in kw.items():
        flag = k.replace("_", "-")
        args += [f"--{flag}" if v is True else f"--no-{flag}"] if isinstance(v, bool) else [f"--{flag}", str(v)]
    subprocess.run(args, check=True, cwd=REPO)
    return json.loads(out.read_text())


def test_llamacpp_raw_export_does_not_load(stories_exports):
    """Issue finding: today's export aborts at load (n_expert_groups < n_expert / missing q_lora_rank)."""
    need("llamacpp")
    r = matrix(stories_exports, stories_exports["raw"], "llamacpp", "raw_llamacpp", weights="f32", kv="f16")
    export = r["llamacpp"]["export"]
    assert export.get("status") == "load-failed"
    assert "n_expert_groups < hparams.n_expert" in export["error"]


def test_llamacpp_serving_export(stories_exports):
    """Loads with no --override-kv; f32 matches transformers; f16 / q8_0 weights keep the converted/source ratio.

    stories260K cannot use a q8_0 KV cache in llama.cpp at all (source head_dim 8, export kv_lora_rank 24:
    q8_0 blocks of 32 must divide them); the q8_0-cache check is test_llamacpp_smollm2_q8_0_cache.
    """
    need("llamacpp")
    r = matrix(stories_exports, stories_exports["serving"], "llamacpp", "serving_llamacpp", kv="f16", greedy="f32,f16")
    lc = r["llamacpp"]
    f32 = lc["export"]["runs"]["f32/f16"]
    assert f32["ok"] and f32["rel_diff_vs_transformers"] < 1e-3
    assert f32["greedy_identical"] == "4/4"
    for key, tol in (("f16/f16", 0.02), ("bf16/f16", 0.02), ("q8_0/f16", 0.05)):
        assert abs(lc["ratios"][key]["vs_transformers_ratio"]) < tol, (key, lc["ratios"][key])


def test_llamacpp_smollm2_q8_0_cache(tmp_path):
    """SmolLM2 at 256+64 (a shape whose latent and key sizes are multiples of 32): q8_0 weights and cache.

    Uses the export that scripts/check_engines.sh caches (converting SmolLM2 here would take minutes)."""
    need("llamacpp")
    export = ENGINES_HOME / "exports" / "smollm2-256-64-serving"
    source = Path.home() / ".cache" / "mla-convert" / "SmolLM2-135M-Instruct"
    if not (export / "config.json").exists() or not (source / "config.json").exists():
        pytest.skip(f"{export} not built (run scripts/check_engines.sh first)")
    ex = {"root": tmp_path, "source": source}
    r = matrix(ex, export, "llamacpp", "smollm2", weights="f32,f16,q8_0", greedy="f32")
    lc = r["llamacpp"]
    assert lc["export"]["runs"]["f32/f16"]["rel_diff_vs_transformers"] < 1e-3
    for key, tol in (("f16/f16", 0.02), ("f16/q8_0", 0.02), ("q8_0/f16", 0.05), ("q8_0/q8_0", 0.05)):
        assert abs(lc["ratios"][key]["vs_transformers_ratio"]) < tol, (key, lc["ratios"][key])


def test_vllm_serving_export(stories_exports):
    need("vllm")
    r = matrix(stories_exports, stories_exports["serving"], "vllm", "serving_vllm", vllm_source=False)
    v = r["vllm"]["export"]
    assert v["ok"], v.get("error")
    assert v["rel_diff_vs_transformers"] < 1e-3
    assert v["greedy_identical"] == "4/4"
