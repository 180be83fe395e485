"""Which inference engines can run a given export, and what each one's constraints are.

Facts, kept as data: stock transformers runs any DeepseekV3 shape; vLLM's and SGLang's DeepSeek MLA
layers have no attention-bias slot and their fast MLA kernels (FlashMLA, FlashInfer MLA, their Triton
backends' tuned paths) are built for DeepSeek's kv_lora_rank 512 + rope 64; our Triton kernel takes
any shape.
"""

from __future__ import annotations

from ..source.shapes import MLAShape
from .target import DEEPSEEK_KV_LORA_RANK, DEEPSEEK_ROPE_DIM

SERVING_ENGINES = ("vllm", "sglang")


def engine_compatibility(mla: MLAShape, attention_bias: bool, q_lora_rank: int | None) -> dict:
    """{engine: {"ok": bool, "fast_path": bool, "notes": [...]}} for the export's shape and biases."""
    report = {
        "transformers": {"ok": True, "fast_path": True, "notes": ["stock DeepseekV3ForCausalLM, no remote code"]},
        "mla_decode_triton": {"ok": True, "fast_path": True, "notes": ["any (kv_lora_rank, rope_dim)"]},
    }
    deepseek_shape = mla.kv_lora_rank == DEEPSEEK_KV_LORA_RANK and mla.rope_dim == DEEPSEEK_ROPE_DIM
    for engine in SERVING_ENGINES:
        notes = []
        ok = True
        if attention_bias:
            ok = False
            notes.append("the export has attention biases (q_a_proj/kv_a_proj_with_mqa/o_proj); "
                         "the engine's DeepSeek MLA layer has no bias slot and would drop them")
        if not deepseek_shape:
            notes.append(
                f"shape {mla.kv_lora_rank}+{mla.rope_dim}: the fast MLA kernels want {DEEPSEEK_KV_LORA_RANK}+{DEEPSEEK_ROPE_DIM}; "
                "expect a slower fallback backend or a rejection at load time"
            )
        report[engine] = {"ok": ok, "fast_path": ok and deepseek_shape, "notes": notes}
    return report
