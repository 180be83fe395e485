"""Write the fine-tuned model as the same stock DeepseekV3 folder `convert` writes.

Same tensors (names, shards via `CheckpointWriter`, atomic appearance), `config.json` rebuilt by the
installed `DeepseekV3Config`, the converted folder's tokenizer / generation config / chat template,
`mla_convert.json` (the conversion report with a `finetuning` section, and a serving export's weight magnitudes
measured again on the fine-tuned weights) and the model card regenerated from that report.  The latent scales are
folded back first (`latent.fold_latent_scales`), each with the alpha it was trained under, so the folder computes
the trained model exactly and keeps its export's weight scale.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch

from ..convert.report import REPORT_FILE
from ..errors import MLAConvertError
from ..hub.card import CARD_FILE
from ..io.reader import CheckpointReader
from ..io.writer import CheckpointWriter
from ..units import parse_dtype
from .config import FINETUNE_FP16
from .latent import LatentSite, fold_latent_scales


class FinetuneSaveError(MLAConvertError):
    pass


def stored_tensor_names(folder: Path) -> list[str]:
    """Tensor names of a safetensors model folder, in the order its index (or single file) lists them."""
    try:
        with CheckpointReader(folder) as reader:
            return reader.keys()
    except MLAConvertError as error:
        raise FinetuneSaveError(str(error)) from error


def resolve_save_dtype(name: str, converted_config) -> torch.dtype:
    """`save_dtype` -> the saved dtype; auto is the converted folder's, except fp16 (a serving export's), saved in bf16
    (`FINETUNE_FP16`)."""
    if name == "auto":
        dtype = getattr(converted_config, "dtype", None) or torch.float32
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        return torch.bfloat16 if dtype == torch.float16 else dtype
    else:
        dtype = parse_dtype(name)
    if dtype == torch.float16:
        raise FinetuneSaveError(f"save_dtype fp16: {FINETUNE_FP16}")
    return dtype


def fp16_save_note(save_dtype: str, converted: Path) -> str | None:
    """The run-time note of a `save_dtype` auto that does not keep the converted folder's dtype (an fp16 export is
    saved in bf16: `FINETUNE_FP16`); None when auto keeps it or a dtype was chosen."""
    if save_dtype != "auto":
        return None
    from ..errors import MLAConvertError
    from ..io.config_file import read_config_json
    from ..source.config import ExportConfig

    try:
        stored = ExportConfig.from_dict(read_config_json(converted)).torch_dtype
    except MLAConvertError:
        return None
    if stored != torch.float16:
        return None
    return ("note: the converted folder is fp16; the fine-tuned one is saved in bf16 (save_dtype auto: fp16 is not "
            "a fine-tuning save dtype); give --save-dtype fp32 for fp32")


def rebased_path(recorded, old_folder: Path, new_folder: Path):
    """A path a report records relative to `old_folder`, made relative to `new_folder` (anything else as it was).

    Reports name local sources and texts relative to the model folder; a fine-tuned copy at another depth
    must not inherit the relative paths of the folder it came from (a second fine-tuning would look for its
    teacher in the wrong place).
    """
    if not isinstance(recorded, str) or not recorded or Path(recorded).is_absolute():
        return recorded
    target = Path(old_folder) / recorded
    if not target.exists():
        return recorded
    return os.path.relpath(target.resolve(), Path(new_folder).resolve())


def _rebase_report_paths(out: dict, old_folder: Path, new_folder: Path) -> None:
    source = out.get("source")
    if isinstance(source, dict) and not source.get("hub_id"):
        source["name_or_path"] = rebased_path(source.get("name_or_path"), old_folder, new_folder)
    calibration = (out.get("options") or {}).get("calibration") if isinstance(out.get("options"), dict) else None
    if isinstance(calibration, dict):
        calibration["data"] = rebased_path(calibration.get("data"), old_folder, new_folder)
    for key in ("evaluation", "evaluation_before_finetuning"):
        if isinstance(out.get(key), dict):
            out[key]["data"] = rebased_path(out[key].get("data"), old_folder, new_folder)
    # an earlier fine-tuning round (of a fine-tuned input) names its teacher and texts from that folder too
    for entry in [out.get("finetuning"), *(out.get("finetuning_earlier") or [])]:
        if isinstance(entry, dict):
            for key in ("teacher", "data", "eval_data"):
                entry[key] = _rebased_description(entry.get(key), old_folder, new_folder)


def _rebased_description(recorded, old_folder: Path, new_folder: Path):
    """A path, or a description that starts with one ("../t.txt (12 windows of 256 tokens)", "../t.txt: context 256,
    ..."), with the path made relative to `new_folder` (anything else as it was)."""
    if not isinstance(recorded, str):
        return recorded
    for head, separator, tail in [(recorded, "", ""), recorded.partition(" ("), recorded.partition(": ")]:
        moved = rebased_path(head, old_folder, new_folder)
        if moved != head:
            return moved + separator + tail
    return recorded


def updated_report(report: dict, finetuning: dict, dtype: torch.dtype, converted: Path | None = None,
                   output: Path | None = None, weights: dict[str, torch.Tensor] | None = None) -> dict:
    """The conversion report with the save dtype, the finetuning section and, for a serving export, the magnitudes
    of the fine-tuned `weights` (the stored form).

    The conversion's `options` stay as the conversion recorded them (the card shows them next to its command); the
    saved dtype goes into the finetuning section (`saved_dtype`) and the `cache` section, whose dtype and bytes are
    the saved weights' (config.json's: `push` checks them against it).

    A perplexity measured on the input folder is kept as `evaluation_before_finetuning`, not as this model's.
    Paths recorded relative to `converted` are made relative to `output`.
    """
    out = copy.deepcopy(report) if report else {}
    if converted is not None and output is not None:
        _rebase_report_paths(out, Path(converted), Path(output))
    dtype_name = str(dtype).replace("torch.", "")
    cache = out.get("cache")
    if isinstance(cache, dict) and cache.get("dtype") and cache["dtype"] != dtype_name:
        old = torch.empty((), dtype=getattr(torch, cache["dtype"])).element_size()
        new = torch.empty((), dtype=dtype).element_size()
        for key in ("source_bytes_per_token", "mla_bytes_per_token"):
            if isinstance(cache.get(key), (int, float)):
                cache[key] = cache[key] * new // old
        cache["dtype"] = dtype_name
    # fine-tuning a fine-tuned folder: its round is kept (without the curves, which its own folder plots), so the
    # card can still say that an earlier round trained every parameter (a second round does not replace the first)
    rounds = [entry for entry in (out.get("finetuning_earlier") or []) if isinstance(entry, dict)]
    if isinstance(out.get("finetuning"), dict):
        rounds.append({key: value for key, value in out["finetuning"].items() if key not in ROUND_PLOT_KEYS})
    if rounds:
        out["finetuning_earlier"] = rounds
    out["finetuning"] = {**finetuning, "saved_dtype": dtype_name}
    # `mla-convert eval --update-card` measured the folder that was fine-tuned, not this one: its numbers move
    # to their own key (the card shows them as "before fine-tuning") until this folder is evaluated itself.  Without
    # such numbers, an earlier round's "before" stays: it was measured before that round.
    earlier = out.get("evaluation")
    out["evaluation"] = None
    if isinstance(earlier, dict):
        out["evaluation_before_finetuning"] = {**earlier, "before_round": len(rounds) + 1}
    elif not isinstance(out.get("evaluation_before_finetuning"), dict):
        out["evaluation_before_finetuning"] = None
    if weights is not None:
        remeasure_serving_magnitudes(out, weights)
    return out


def remeasure_serving_magnitudes(report: dict, weights: dict[str, torch.Tensor]) -> None:
    """A serving export's `magnitudes` (what f16 / Q8_0 / Q4_K do to its weights, per layer and worst case) measured
    again on the fine-tuned stored weights, in place: the card's "latent weight scale" caveat must describe this
    folder, not the one it was trained from."""
    from ..convert import target as T
    from ..convert.serving import layer_magnitudes, summarize_magnitudes

    serving = report.get("serving")
    if not isinstance(serving, dict) or not isinstance(serving.get("layers"), list):
        return
    rank = (report.get("options") or {}).get("kv_lora_rank")
    for position, info in enumerate(serving["layers"]):
        if not isinstance(info, dict) or not isinstance(rank, int):
            continue
        prefix = T.attention_prefix(info.get("layer", position))
        layer = {name: weights[prefix + name] for name in (T.KV_A_PROJ, T.KV_B_PROJ, T.Q_PROJ, T.Q_A_PROJ, T.Q_B_PROJ)
                 if prefix + name in weights}
        if T.KV_A_PROJ in layer:
            info["magnitudes"] = layer_magnitudes(layer, rank)
    serving["magnitudes"] = summarize_magnitudes(serving["layers"])
    serving["magnitudes_measured_on"] = "the fine-tuned weights"


# entries of a fine-tuning section that belong to its own folder's plot, not to the history of a later round
ROUND_PLOT_KEYS = ("loss_curve", "perplexity_curve", "curve_png")


def save_finetuned(
    state_dict: dict[str, torch.Tensor],
    sites: list[LatentSite],
    converted: Path,
    output: Path,
    report: dict,
    finetuning: dict,
    save_dtype: str = "auto",
    max_shard_size: str = "5GB",
    overwrite: bool = False,
    force: bool = False,
) -> Path:
    """Fold the latent scales, write the folder atomically; returns its path."""
    from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config

    converted, output = Path(converted), Path(output)
    config = DeepseekV3Config.from_pretrained(str(converted), trust_remote_code=False)
    dtype = resolve_save_dtype(save_dtype, config)
    folded = fold_latent_scales(state_dict, sites)
    names = stored_tensor_names(converted)
    missing = [name for name in names if name not in folded]
    if missing:
        raise FinetuneSaveError(f"trained state dict lacks {len(missing)} tensors of {converted} (first: {missing[0]})")
    final_report = updated_report(report, finetuning, dtype, converted, output, folded)
    writer = CheckpointWriter(output, max_shard_size, overwrite, force)
    with writer:
        for name in names:
            writer.add(name, folded[name].detach().to(device="cpu", dtype=dtype))
        config.dtype = dtype
        if getattr(config, "auto_map", None) is not None:  # code the folder pointed at: never loaded, not copied either
            del config.auto_map
        config.save_pretrained(writer.partial)
        writer.copy_sidecars(converted)
        if write_curves(writer.partial / CURVES_FILE, finetuning):
            final_report["finetuning"]["curve_png"] = CURVES_FILE
        write_report(writer.partial, final_report)
        path = writer.commit()
    return path


CURVES_FILE = "finetune_curves.png"


def write_curves(path: Path, finetuning: dict) -> bool:
    """Training loss and evaluation perplexity per step as a PNG beside the weights (False: nothing to plot)."""
    losses, perplexities = finetuning.get("loss_curve") or [], finetuning.get("perplexity_curve") or []
    if not losses:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, loss_axis = plt.subplots(figsize=(7.0, 4.0), dpi=100)
    loss_axis.plot([step for step, _ in losses], [loss for _, loss in losses], color="tab:blue", label="training loss")
    loss_axis.set_xlabel("optimizer step")
    loss_axis.set_ylabel("loss", color="tab:blue")
    if perplexities:
        ppl_axis = loss_axis.twinx()
        ppl_axis.plot([step for step, _ in perplexities], [ppl for _, ppl in perplexities], "o-", color="tab:orange")
        ppl_axis.set_ylabel("evaluation perplexity", color="tab:orange")
    loss_axis.set_title("fine-tuning after the MLA conversion")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return True


def write_report(folder: Path, report: dict) -> None:
    """`mla_convert.json` (as `CheckpointWriter.write_json` writes it) and the model card built from it (and from the
    folder's config.json, written before it)."""
    from ..hub.card import build_model_card, export_config, save_card

    (Path(folder) / REPORT_FILE).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    save_card(build_model_card(report, config=export_config(folder)), Path(folder) / CARD_FILE)
