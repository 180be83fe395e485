"""Calibration: token windows, and per-layer activation statistics collected layer by layer.

Memory stays at one layer's weights plus the calibration hidden states: the layer-streamed source
forward runs every calibration window through layer i, accumulates that layer's statistics, and moves
the hidden states on; big per-layer statistics (input second moments) are spilled to a temporary folder.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ..data.sampling import NUCLEUS_CANDIDATES, top_p_sample
from ..errors import MLAConvertError, NonFiniteError, OutputWriteError
from ..io.writer import STATS_SCRATCH_PREFIX, ScratchFolder, write_failure_errno
from ..options import CalibrationOptions
from ..source.model import (
    StreamedSourceModel,
    attention_from_qkv,
    attention_statistics,
    mlp,
    project_qkv,
    rms_norm,
    rotate_qk,
)
from .rope import RopeStats, rope_stats_from_moments


# --------------------------------------------------------------------------- token windows
def calibration_ids(
    model: StreamedSourceModel, folder: Path, options: CalibrationOptions, progress: Callable | None = None
) -> tuple[torch.Tensor, str]:
    """(num_samples, seq_len) token ids and a description of where they came from."""
    if options.data is None:
        ids = sample_from_model(model, options.num_samples, options.seq_len, options.seed, options.temperature,
                                options.top_p, progress=progress)
        if options.temperature == 0:  # greedy from one start token: every window is the same sequence
            return ids, (f"{options.num_samples} x {options.seq_len} tokens sampled greedily from the source model"
                         + (f" (one sequence, {options.num_samples} times)" if options.num_samples > 1 else ""))
        return ids, f"{options.num_samples} x {options.seq_len} tokens sampled from the source model (seed {options.seed})"
    # a local text by its name (the report records its path relative to the model folder; this line is read in cards
    # and must not depend on where the command ran); a datasets spec as given
    local = Path(str(options.data)).expanduser()
    text = local.name if local.exists() else str(options.data)
    ids = text_windows(folder, options)
    vocab = model.shape.vocab_size
    if int(ids.max()) >= vocab:  # the embedding has no row for them: the statistics would be garbage
        raise MLAConvertError(f"calibration text {text}: the tokenizer in {folder} gives token id {int(ids.max())}, but the "
                              f"model's vocab_size is {vocab}; the tokenizer does not belong to this model")
    short = f" (the text holds {ids.shape[0]} of the {options.num_samples} asked for)" if ids.shape[0] < options.num_samples else ""
    return ids, f"{ids.shape[0]} x {options.seq_len} token windows of {text}{short}"


def text_windows(folder: Path, options: CalibrationOptions) -> torch.Tensor:
    """Evenly spaced windows of a tokenised text (only as much text as the windows need is tokenised)."""
    from ..data.textdata import load_text
    from ..io.hf_loading import load_tokenizer

    needed = options.num_samples * options.seq_len
    # ~4 characters per token for English BPE; take generously, tokenise once
    text = load_text(options.data, text_column=options.text_column, max_chars=needed * 12)
    tokenizer = load_tokenizer(folder)
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    del tokenizer
    if ids.numel() < options.seq_len:
        raise MLAConvertError(
            f"calibration text {options.data!r} has {ids.numel()} tokens; need at least --calib-seq-len {options.seq_len}"
        )
    count = min(options.num_samples, ids.numel() // options.seq_len)
    starts = torch.linspace(0, ids.numel() - options.seq_len, count).long()
    return torch.stack([ids[s : s + options.seq_len] for s in starts.tolist()])  # (count, seq_len)


# Largest bf16 KV cache sampling keeps at once; more sequences are sampled in several rounds, so the
# default calibration of SmolLM2 (16 x 256 tokens, 94 MB of cache) runs in one round (rounds cost time: each
# streams every layer again per step).
SAMPLING_CACHE_BYTES = 192 * 2**20


@torch.no_grad()
def sample_from_model(
    model: StreamedSourceModel,
    num: int,
    length: int,
    seed: int,
    temperature: float = 1.0,
    top_p: float = 0.95,
    start_id: int | None = None,
    progress: Callable | None = None,
    max_cache_bytes: int = SAMPLING_CACHE_BYTES,
) -> torch.Tensor:
    """Batched, seeded ancestral sampling from the layer-streamed source model (no text needed).

    Each step streams the layers from the checkpoint (the OS page cache makes re-reads cheap) and keeps
    a bf16 KV cache, so memory is the cache plus one layer, never the model.  Sequences are sampled in
    rounds whose cache fits `max_cache_bytes`; one generator runs through all rounds (seeded, so the
    same seed gives the same text).
    """
    shape = model.shape
    generator = torch.Generator().manual_seed(seed)
    if start_id is None:
        start_id = model.shape.first_token_id
    ids = torch.full((num, length), start_id, dtype=torch.long)
    per_sequence = shape.num_layers * 2 * shape.num_kv_heads * length * shape.head_dim * 2  # bf16 bytes
    batch = max(1, min(num, max_cache_bytes // per_sequence))
    steps = (length - 1) * -(-num // batch)
    done = 0
    for first in range(0, num, batch):
        rows = ids[first : first + batch]
        # one allocation for every layer's keys and values: freed as a whole (back to the OS) after the round
        cache = torch.empty(shape.num_layers, 2, rows.shape[0], shape.num_kv_heads, length, shape.head_dim,
                            dtype=torch.bfloat16, device=model.device)
        cache_k, cache_v = cache[:, 0], cache[:, 1]  # (layers, rows, G, length, h) each
        for t in range(length - 1):
            hidden = model.embed(rows[:, t : t + 1])  # (rows, 1, d)
            cos, sin = model.cos_sin(1, offset=t)
            for index in range(shape.num_layers):
                layer = model.load_layer(index)
                x = rms_norm(hidden, layer.weights["input_norm"], shape.rms_norm_eps)
                q, k, v = project_qkv(x, layer, shape)
                q, k = rotate_qk(q, k, cos, sin, shape, index)
                cache_k[index][:, :, t : t + 1] = k.to(torch.bfloat16)
                cache_v[index][:, :, t : t + 1] = v.to(torch.bfloat16)
                keys = cache_k[index][:, :, : t + 1].to(model.dtype)
                values = cache_v[index][:, :, : t + 1].to(model.dtype)
                hidden = hidden + attention_from_qkv(q, keys, values, layer, shape)
                hidden = hidden + mlp(rms_norm(hidden, layer.weights["post_attn_norm"], shape.rms_norm_eps), layer)
                del layer
                model.release()
            logits = model.logits(model.final_norm(hidden))[:, -1].cpu()  # (rows, vocab); sampled on the CPU: same RNG anywhere
            try:
                rows[:, t + 1] = top_p_sample(logits, temperature, top_p, generator, NUCLEUS_CANDIDATES)
            except NonFiniteError as error:  # every weight is finite (checked before): the forward pass overflows
                raise NonFiniteError(
                    f"sampling calibration text from the source model, token {t + 1}: {error}. Every weight is finite "
                    "(checked), so the source model itself computes this: check the checkpoint (transformers computes "
                    "the same NaN); --calib-data would calibrate on a text, but the model would still not work") from None
            model.release()
            done += 1
            if progress:
                progress(done, steps)
        del cache, cache_k, cache_v
    return ids


# --------------------------------------------------------------------------- statistics
class StatsStore:
    """Per-layer statistics spilled to a temporary folder (the model's layers never all sit in memory)."""

    def __init__(self, parent: str | Path | None = None):
        self._folder = ScratchFolder(STATS_SCRATCH_PREFIX, parent)  # a later run removes it if this one is killed
        self.path = self._folder.path

    def save(self, layer: int, tensors: dict[str, torch.Tensor]) -> None:
        path = self.path / f"layer-{layer:05d}.safetensors"
        try:
            save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(path))
        except Exception as error:  # disk full in the temp folder: one line naming what was removed
            if write_failure_errno(error) is None:
                raise
            self.cleanup()
            raise OutputWriteError(f"{self.path.parent}: the temp folder is full or read-only while writing the calibration "
                                   f"statistics; removed {self.path.name}, nothing was written. Set TMPDIR to a folder "
                                   "with more space") from error

    def load(self, layer: int, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """The layer's statistics as tensors of their own, not views of the file.

        Why copies: the pages of a mapped file stay resident while any tensor of it lives, so a step that is done with
        the d x d moments (134 MB each at hidden 4096; `convert_layer`, the RoPE measurement consume them) could not
        give their memory back while the samples were still in use.  Each tensor is read with the file mapped for it
        alone.
        """
        path = str(self.path / f"layer-{layer:05d}.safetensors")
        if torch.device(device).type != "cpu":
            return load_file(path, device=str(device))
        with safe_open(path, framework="pt") as handle:
            names = list(handle.keys())
        out = {}
        for name in names:
            with safe_open(path, framework="pt") as handle:
                out[name] = handle.get_tensor(name).clone()
        return out

    def cleanup(self) -> None:
        self._folder.cleanup()


@dataclass
class LayerInputStats:
    # (d, d) float64, E[x x^T] of the normalised attention input; this moment and `attention_moment` are set to None
    # by a conversion step that has used them and whose caller needs them no more (decisions.convert_layer)
    second_moment: torch.Tensor
    mean: torch.Tensor  # (d,) float64
    samples: torch.Tensor  # (error_samples, T, d) attention inputs kept to measure conversion error
    distance_profile: torch.Tensor  # (H, T)
    # (d, d) E[m_s x_s x_s^T] / E[m_s], m_s = attention key position s receives: an error in a key or value
    # costs in proportion to how much attention reads it (attention sinks above all)
    attention_moment: torch.Tensor | None = None

    def to_tensors(self) -> dict[str, torch.Tensor]:
        out = {"second_moment": self.second_moment, "mean": self.mean, "samples": self.samples,
               "distance_profile": self.distance_profile}
        if self.attention_moment is not None:
            out["attention_moment"] = self.attention_moment
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> LayerInputStats:
        return cls(tensors["second_moment"], tensors["mean"], tensors["samples"], tensors["distance_profile"],
                   tensors.get("attention_moment"))


def layer_input_stats(
    model: StreamedSourceModel, layer, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    options: CalibrationOptions, move_hidden: bool = True,
) -> LayerInputStats:
    """Statistics of layer `layer`'s attention input over all windows.

    With `move_hidden`, `hidden` is also pushed through the (source) layer in place, so one pass over the
    layers both measures and advances the calibration activations.
    """
    shape = model.shape
    d = shape.hidden_size
    device = hidden.device
    moment = torch.zeros(d, d, dtype=torch.float64, device=device)
    total = torch.zeros(d, dtype=torch.float64, device=device)
    count = 0
    profile = torch.zeros(shape.num_heads, hidden.shape[1], dtype=torch.float64, device=device)
    profiled = 0
    weighted = torch.zeros(d, d, dtype=torch.float64, device=device)
    total_mass = 0.0
    samples = []
    for start in range(0, hidden.shape[0], options.chunk):
        chunk = hidden[start : start + options.chunk]
        x = rms_norm(chunk, layer.weights["input_norm"], shape.rms_norm_eps)
        flat = x.reshape(-1, d).double()  # (chunk * T, d)
        moment += flat.T @ flat
        total += flat.sum(0)
        count += flat.shape[0]
        if len(samples) < options.error_samples:
            samples.extend(x[: options.error_samples - len(samples)])
        q, k, v = project_qkv(x, layer, shape)
        q, k = rotate_qk(q, k, cos, sin, shape, layer.index)
        distance, mass = attention_statistics(q, k, shape.head_dim**-0.5, shape.num_heads // shape.num_kv_heads)
        profile += distance
        profiled += q.shape[0] * q.shape[2]
        mass = mass.reshape(-1)  # (chunk * T,)
        weighted += (flat * mass[:, None]).T @ flat
        total_mass += mass.sum().item()
        if move_hidden:
            new = chunk + attention_from_qkv(q, k, v, layer, shape)
            hidden[start : start + options.chunk] = new + mlp(rms_norm(new, layer.weights["post_attn_norm"], shape.rms_norm_eps), layer)
    return LayerInputStats(moment / count, total / count, torch.stack(samples), profile / max(profiled, 1),
                           weighted / max(total_mass, 1e-30))


def rope_stats_for_layer(layer, stats: LayerInputStats, shape) -> RopeStats:
    """Computed where the layer is; kept on the CPU (small), where the RoPE planning runs."""
    w = layer.weights
    stats = rope_stats_from_moments(
        w["q_weight"], w.get("q_bias"), w["k_weight"], w.get("k_bias"), stats.second_moment, stats.mean,
        shape.num_heads, shape.num_kv_heads, shape.head_dim, stats.distance_profile,
    )
    return RopeStats(stats.key_cov.cpu(), stats.query_energy.cpu(), stats.distance_profile.cpu())
