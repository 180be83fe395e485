"""Which inference engines run an export: the record of measured engine runs, and what it says about one export.

`engine_runs.json` (package data) is generated from the engine harness's result files by
`scripts/engines/record_runs.py` (see docs/engines.md): one record per (engine, model, target, shape,
weights, KV cache) that somebody actually ran, with the engine version, the date and what was measured.
`engine_compatibility` turns it into the table the convert summary and the model card print:

* an engine is "yes" for an export only when a run of the same target at the same kv_lora_rank + rope_dim
  passed (the records of other models at that shape are named with it);
* "no" when the export breaks a constraint the engine's code imposes (target.py: widths, tying, biases,
  q_lora_rank, weight magnitudes) -- each with the `--target` that fixes it;
* "not measured" otherwise: nobody ran that target at that shape.

A run that passed only with one of the harness's patches to the engine (`PATCHES`) says what the patched engine
does, not the released one: the verdict then says "only patched" and names the patches.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from ..io.paths import read_model_text
from ..source.shapes import MLAShape
from . import target as T

RUNS_FILE = Path(__file__).with_name("engine_runs.json")
# engines the table always lists; SGLang has no CPU build to measure here
ENGINES = ("transformers", "vllm", "llama.cpp", "sglang", "mla_decode_triton")
# The engine harness's patches (scripts/engines/, marked HARNESS WORKAROUND; docs/engines.md), as the records name them
PATCHES = {
    "rotary": "vLLM-CPU's rotary op mis-rotates DeepSeek queries: vLLM's own torch rotary used instead",
    "allowlist": "vLLM's MLA head-size allow-list lifted",
    "decode": "vLLM-CPU's MLA decode kernel (512+64 only) replaced by a torch stand-in",
    "vocab": "llama.cpp's DeepSeek converter refuses SentencePiece-style vocabularies: its Llama vocabulary routine used "
             "instead",
}
# llama.cpp's deepseek2 loader takes a 26- or 27-layer model for DeepSeek-V2-Lite and then ignores q_lora_rank
# (src/models/deepseek2.cpp, read in b11434; no such model was run)
LLAMA_CPP_LITE_LAYERS = (26, 27)
# What is known of each engine's handling of a RoPE other than the default grid.  The records made before 2026-12-02
# do not name their exports' RoPE (the harness did not write it down), so they count only for a default-RoPE export;
# a record that names its `rope_type` counts for exports of that type.  Reconverted
# 2026-12-02, stories260K (24+8) and SmolLM2 (144+48) with --target llama.cpp export default RoPE, and a rope_dim
# equal to the source's head_dim (the 256+64 SmolLM2 and Qwen2 records) always does; the synthetic 512+64 vLLM
# record was not reconverted.
# ROPE_FAILURES: RoPE types an engine cannot run as declared in a DeepSeek export, whatever the shape: it computes them
# otherwise (a transformers model changed to do what the engine does reproduces its perplexity to 2e-4) or does not
# load the export.  Runs:
# docs/engines-results-2026-12-03-rope/ (llama.cpp: stories260K with its RoPE edited, 24+8; vLLM: SmolLM2-135M with
# its RoPE edited, 256+64; f32 weights; docs/engines.md).
VLLM_YARN = ("vLLM 0.32.0's DeepSeek attention runs every RoPE type other than default as DeepSeek YaRN "
             "(model_executor/models/deepseek_v2.py)")
ROPE_FAILURES = {
    ("llama.cpp", "linear"): "llama.cpp b11434 multiplies its attention scale by (1 + 0.1 ln factor)^2 for a linear "
                             "RoPE factor, where transformers' DeepseekV3 does not (measured 2026-12-03: perplexity "
                             "20.5 % off transformers' on the same ids at factor 4, 14.8 % at factor 10; greedy 0/4)",
    ("llama.cpp", "llama3"): "llama.cpp b11434's DeepSeek GGUF converter writes no llama3 frequency table and its "
                             "DeepSeek graph passes none, so it rotates at the unscaled frequencies (measured "
                             "2026-12-03: perplexity 70.8 % off transformers' on the same ids; greedy 0/4)",
    ("vllm", "llama3"): f"{VLLM_YARN}: YaRN frequencies and a rotary gain of 1 + 0.1 ln factor instead of llama3's "
                        "(measured 2026-12-03: perplexity 32.2 % off transformers' on the same ids; greedy 0/4)",
    ("vllm", "linear"): f"{VLLM_YARN}, which reads original_max_position_embeddings, a key a linear declaration does "
                        "not have: the export does not load (measured 2026-12-03: KeyError: "
                        "'original_max_position_embeddings')",
}


def rope_problems(target: T.Target, rope_parameters: dict | None) -> list[str]:
    """Why `target` cannot export a source with these RoPE parameters, one line per engine of the target that is
    measured not to run that RoPE as declared (empty: no such failure is known).  A linear factor of 1 is the default
    RoPE; a llama3 source is exported as default RoPE for a target whose engines ignore or misread llama3 scaling
    (`Target.llama3_scaling`)."""
    params = rope_parameters or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "linear" and float(params.get("factor", 1.0)) == 1.0:
        return []
    if rope_type == "llama3" and not target.llama3_scaling:
        return []
    return [f"RoPE {rope_type}: {ROPE_FAILURES[engine, rope_type]}" for engine in target.engines
            if (engine, rope_type) in ROPE_FAILURES]


@lru_cache(maxsize=1)
def engine_runs() -> tuple[dict, ...]:
    """Every recorded run (empty when the data file is missing)."""
    try:
        data = json.loads(RUNS_FILE.read_text())
    except (OSError, ValueError):
        return ()
    return tuple(data.get("runs", []))


def _shape(run: dict) -> tuple[int, int]:
    return int(run["kv_lora_rank"]), int(run["rope_dim"])


def _same_export_kind(run: dict, target: str, shape: tuple[int, int], q_lora_rank: int | None) -> bool:
    """Whether a recorded run was of an export like this one: the same target and kv_lora_rank + rope_dim, with a query
    latent exactly when this one has one (llama.cpp refuses a DeepSeek export without q_lora_rank: another key,
    another outcome)."""
    return run.get("target") == target and _shape(run) == shape and (run.get("q_lora_rank") is None) == (q_lora_rank is None)


def recorded_runs(target: str, mla: MLAShape, q_lora_rank: int | None, rope_type: str = "default",
                  runs: tuple[dict, ...] | None = None) -> list[dict]:
    """The recorded runs that count for an export of `target` at this shape and RoPE type, every engine's: the runs
    `engine_compatibility` rests its verdicts on (records made before the harness wrote down the RoPE are of
    default-RoPE exports).  They are runs of the models they name, not of the export asked about."""
    shape = (mla.kv_lora_rank, mla.rope_dim)
    return [r for r in (engine_runs() if runs is None else runs)
            if _same_export_kind(r, target, shape, q_lora_rank) and r.get("rope_type", "default") == rope_type]


def describe_run(run: dict) -> str:
    """One measured run as a short phrase: 'SmolLM2-135M-Instruct 256+64 q8_0/f16: ok, ratio +0.2 % (llama.cpp b11434, 2026-12-01)'."""
    setting = "/".join(str(run[key]) for key in ("weights", "kv_cache") if run.get(key))
    what = run["status"]
    facts = []
    if run.get("ppl_rel_diff_vs_transformers") is not None:
        # a relative difference, not a perplexity ("ppl 3.0e-03" read as one): worded as README's engine table words it
        facts.append(f"perplexity {run['ppl_rel_diff_vs_transformers']:.1e} (relative) from transformers'")
    if run.get("ratio_deviation") is not None:
        facts.append(f"converted/source ratio {run['ratio_deviation']:+.1%} of transformers'")
    if run.get("greedy"):
        facts.append(f"greedy {run['greedy']} identical")
    if run.get("workarounds"):
        facts.append("harness workarounds: " + ",".join(run["workarounds"]))
    if run.get("error") and what != "ok":
        facts.append(run["error"])
    details = f" ({'; '.join(facts)})" if facts else ""
    shape = f"{run['kv_lora_rank']}+{run['rope_dim']}" + (f" {setting}" if setting else "")
    return f"{run['model']} {shape}: {what}{details} [{run['engine']} {run['version']}, {run['date']}]"


def constraint_problems(engine: str, mla: MLAShape, target: T.Target, attention_bias: bool, q_lora_rank: int | None,
                        tied: bool) -> list[str]:
    """What in this export breaks `engine`'s known constraints (target.py data; the engine's code and measured failures)."""
    own = T.TARGETS.get(engine)
    if own is None:
        return []
    problems = []
    width = own.width_problem(mla.kv_lora_rank, mla.rope_dim)
    if width:
        problems.append(width)
    if tied and not own.ties_embeddings:
        problems.append("tied embeddings: the engine builds its own lm_head and never ties it (vllm-cpu 0.32.0: "
                        "uninitialised head, flat logits, measured)")
    if attention_bias and not own.attention_bias:
        problems.append("attention biases: the engine's DeepSeek attention has no bias slot")
    if own.needs_q_lora_rank and q_lora_rank is None:
        problems.append("no q_lora_rank: llama.cpp b11434 refuses to load a DeepSeek model without it (measured)")
    if own.name == "llama.cpp" and not target.serving:
        problems.append("latent weights ~1e-7: f16 / q8_0 GGUF weights lose them (stories260K 2x in llama.cpp b11434: "
                        "perplexity 17.14 with f32 weights, 21.73 with f16, 418.7 with q8_0)")
    return problems


# the engines whose constraints (target.py data) engine_compatibility checks an export against
CONSTRAINED_ENGINES = ("vllm", "llama.cpp")


def export_constraint_problems(target: str | None, mla: MLAShape, attention_bias: bool, q_lora_rank: int | None,
                               tied: bool) -> dict[str, list[str]]:
    """{engine: what in this export breaks its known constraints}, for each engine `engine_compatibility` checks that
    cannot run the export as is (its verdict is then ok false, whatever runs are recorded)."""
    chosen = T.target_of(target)
    found = {engine: constraint_problems(engine, mla, chosen, attention_bias, q_lora_rank, tied)
             for engine in CONSTRAINED_ENGINES}
    return {engine: problems for engine, problems in found.items() if problems}


def sentencepiece_vocabulary(folder: str | Path | None) -> bool:
    """Whether a model folder's tokenizer is SentencePiece-style (a tokenizer.model, or a byte-fallback BPE in
    tokenizer.json), the kind llama.cpp's DeepSeek converter refused (stories260K); SmolLM2's byte-level BPE passed."""
    if folder is None:
        return False
    folder = Path(folder)
    if (folder / "tokenizer.model").is_file():
        return True
    try:
        model = json.loads(read_model_text(folder / "tokenizer.json")).get("model") or {}
    except (OSError, ValueError, AttributeError):
        return False
    return bool(isinstance(model, dict) and model.get("byte_fallback"))


def engine_compatibility(mla: MLAShape, attention_bias: bool, q_lora_rank: int | None, target: str | None = None,
                         tied: bool = False, runs: tuple[dict, ...] | None = None,
                         servable: frozenset[str] | None = None, sentencepiece: bool = False,
                         num_layers: int | None = None, rope_parameters: dict | None = None) -> dict:
    """{engine: {"ok": True / False / None (not measured), "notes": [...], "runs": [...], "patches": [...]}} for one
    export; `patches`: the harness's patches the engine needed to run it (empty: the released engine ran it).

    `servable`: the targets that have a shape for this source (None: not known, every target assumed to), so
    that the advice to convert with another target is only given where that target would not refuse.
    `sentencepiece`: the tokenizer is SentencePiece-style (llama.cpp's converter then needs the `vocab` patch).
    `rope_parameters`: the export's; a RoPE other than the default grid is one no recorded run is known to have had.
    """
    chosen = T.target_of(target)
    runs = engine_runs() if runs is None else runs
    shape = (mla.kv_lora_rank, mla.rope_dim)
    report: dict = {
        "transformers": {"ok": True, "notes": ["stock DeepseekV3ForCausalLM, no remote code (every export; tests/test_convert.py)"]},
    }
    rope_type = (rope_parameters or {}).get("rope_type", "default")
    for engine in CONSTRAINED_ENGINES:
        mine = [r for r in runs if r["engine"] == engine and r.get("target") == chosen.name]
        here = [r for r in mine if _same_export_kind(r, chosen.name, shape, q_lora_rank)]
        # ... and it ran the same RoPE (records made before the harness wrote it down are of default-RoPE exports)
        same_rope = [r for r in here if r.get("rope_type", "default") == rope_type]
        problems = constraint_problems(engine, mla, chosen, attention_bias, q_lora_rank, tied)
        notes: list[str] = []
        if problems:
            ok = False
            notes += problems
            if engine in chosen.engines:
                notes.append("this shape is outside what the target allows")
            elif servable is None or engine in servable:
                notes.append(f"convert with --target {engine}" + (" (or all)" if servable is None or "all" in servable else "")
                             + (", which removes the attention biases and refuses the model where that costs too much "
                                "(measured per layer during the conversion)" if attention_bias else ""))
            else:
                notes.append(f"--target {engine} has no shape that fits this model")
        elif (engine, rope_type) in ROPE_FAILURES:
            ok = False
            notes.append(f"RoPE {rope_type}: {ROPE_FAILURES[engine, rope_type]}")
        elif same_rope:
            ok = all(r["status"] == "ok" for r in same_rope)
            notes.append(f"measured at {shape[0]}+{shape[1]} with --target {chosen.name}")
        elif here:  # runs at this shape, but of another RoPE
            ok = None
            notes.append(f"RoPE {rope_type}: the runs at {shape[0]}+{shape[1]} with --target {chosen.name} had another "
                         "RoPE (a record without a RoPE type is of a default-RoPE export); this one was not run")
        else:
            ok = None
            others = sorted({f"{r['kv_lora_rank']}+{r['rope_dim']}" for r in mine if r["status"] == "ok"})
            notes.append(f"not measured at {shape[0]}+{shape[1]} with --target {chosen.name}"
                         + (f" (measured at {', '.join(others)})" if others else ""))
        patches = sorted({name for r in same_rope if r["status"] == "ok" for name in r.get("workarounds") or []})
        if engine == "llama.cpp" and sentencepiece and not problems:
            patches = sorted({*patches, "vocab"})
        if engine == "llama.cpp" and num_layers in LLAMA_CPP_LITE_LAYERS and not problems:
            ok = None if ok else ok
            notes = [note for note in notes if not note.startswith("measured at")]  # (runs of other layer counts)
            notes.append(f"{num_layers} layers: llama.cpp b11434 takes a 26- or 27-layer DeepSeek model for V2-Lite and "
                         "ignores its q_lora_rank (read in src/models/deepseek2.cpp; no such model was run)")
        if patches and ok is not False:
            notes.append("runs only with the harness's patches to the engine: "
                         + "; ".join(f"{name} ({PATCHES.get(name, 'see docs/engines.md')})" for name in patches))
        if engine == "vllm" and not problems and mla.kv_values_per_token_layer != 576:
            notes.append("vLLM's CPU backend decodes only 512+64 (vllm-cpu 0.32.0, measured)")
        report[engine] = {"ok": ok, "notes": notes, "runs": [describe_run(r) for r in same_rope], "patches": patches}
    report["sglang"] = {"ok": None, "notes": ["not measured: no run of SGLang is recorded (it has no CPU build to run "
                                             "here)"], "runs": []}
    report["mla_decode_triton"] = {"ok": True, "notes": ["mla-convert's kernel: any (kv_lora_rank, rope_dim) "
                                                        "(tests/test_mla_decode_kernel.py)"]}
    return report


def measured_runs_table(runs: tuple[dict, ...] | None = None) -> list[tuple[str, ...]]:
    """(engine, version, date, model, target, shape, weights/KV, status, ppl vs transformers, ratio deviation, greedy) rows."""
    rows = []
    for r in engine_runs() if runs is None else runs:
        rows.append((r["engine"], r["version"], r["date"], r["model"], r.get("target") or "-", f"{r['kv_lora_rank']}+{r['rope_dim']}",
                     "/".join(str(r[k]) for k in ("weights", "kv_cache") if r.get(k)), r["status"],
                     "-" if r.get("ppl_rel_diff_vs_transformers") is None else f"{r['ppl_rel_diff_vs_transformers']:.1e}",
                     "-" if r.get("ratio_deviation") is None else f"{r['ratio_deviation']:+.2%}",
                     r.get("greedy") or "-"))
    return rows
