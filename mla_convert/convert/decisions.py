"""The measured choices of a conversion: the model-wide RoPE grid, each layer's K/V balance, and refinement.

Each choice is made by measuring the attention-output error on the layer's calibration inputs, not by
a fixed rule: the estimate ranks RoPE grids well when they differ a lot and the measurement settles the
close ones; the best K/V balance differed between models by more than 100x; refinement is kept only
where it beats the closed form on a held-out window.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import ConversionError, NonFiniteError
from ..options import ConvertOptions, error_windows_kept
from ..source.config import SourceConfig
from ..source.model import StreamedSourceModel, attention_from_qkv, mlp, project_qkv, rms_norm, rope_inv_freq, rotate_qk
from ..source.shapes import MLAShape
from . import target as T
from .calibration import LayerInputStats
from .factorize import Whitening
from .layer import LayerReport, assemble_attention, convert_attention, factorize_latent, prepare_attention
from .reference import mla_attention, project_queries
from .rope import RopeGrid, SlotPlan, candidate_grids, frame_positions, plan_layer

# `--method` names -> the factorization's internal names (factorize.METHODS), and back
METHOD_ALIASES = {"activation-aware": "output", "output": "output", "input": "input", "svd": "weight", "weight": "weight"}
METHOD_NAMES = {"output": "activation-aware", "input": "input", "weight": "svd"}
# K/V balance: multiplies the equal-energy weighting of NoPE-key errors against value errors; measured
# per layer.  SmolLM2 layers mostly chose the top of (0.25 .. 4), so the search spans 1/8 .. 32.
KV_BALANCE_COARSE = (0.25, 1.0, 4.0, 16.0)
# Layer refinement is Adam on each layer's attention-output error, kept where a held-out window improves.
# thorough: AUTO_REFINE_STEPS steps of REFINE_BATCH_WINDOWS windows on every layer, stopping early (stories260K 8x:
# 46.4 against 54.5 closed form).  default: DEFAULT_REFINE_STEPS steps of DEFAULT_REFINE_WINDOWS window each, on every
# layer whose step costs at most DEFAULT_REFINE_MAX_STEP_FLOPS.  Measured (perplexity; process CPU s, 1 thread): a
# 2.25 GFLOP budget per layer of 2-window steps (16 on stories260K, none on SmolLM2's 3.6 GFLOP steps) gave stories260K
# 2x/4x/8x 6.4512/13.8844/54.4518, this rule 6.4366/13.6369/51.8375 for about 1 s more; SmolLM2-135M 2x, no refinement
# against this rule: 41.56 -> 38.84 on 10 WikiText-2 windows for 50 s more of a 196 s conversion (calibration included).
# One window a step: noisier steps, but 40 of them cost what 20 of two windows would, and the held-out check every 10
# steps keeps the best.
AUTO_REFINE_STEPS = 200  # thorough: every layer
AUTO_REFINE_PATIENCE = 2  # held-out checks (25 steps each) without a new best before a layer stops
DEFAULT_REFINE_STEPS = 40
DEFAULT_REFINE_WINDOWS = 1
DEFAULT_REFINE_CHECK_EVERY = 10
# SmolLM2-135M: 1.8 GFLOP a one-window step of 256 tokens; Llama-3-8B's layers (about 68) are left to thorough
DEFAULT_REFINE_MAX_STEP_FLOPS = 4e9


@dataclass(frozen=True)
class Effort:
    """How much measured search one `--effort` level spends."""

    refine: str  # "off", "cheap" (DEFAULT_REFINE_STEPS where a step is cheap) or "all" (AUTO_REFINE_STEPS, every layer)
    kv_balance_search: bool
    rope_finalists: int


EFFORTS = {
    "fast": Effort("off", False, 1),
    "default": Effort("cheap", True, 2),
    "thorough": Effort("all", True, 4),
}


def effort_of(options: ConvertOptions) -> Effort:
    """The effort level with every explicit option applied on top."""
    level = EFFORTS[options.effort]
    return Effort(level.refine,
                  level.kv_balance_search if options.kv_balance_search is None else options.kv_balance_search,
                  level.rope_finalists if options.rope_finalists is None else options.rope_finalists)
REFINE_BATCH_WINDOWS = 2  # calibration windows per refinement step (refine_layer's default)
# RoPE grid: finalists whose estimated error is within this factor of the best are measured (the estimate
# ranks well when the gap is wide: SmolLM2 2x, 69.8 vs 121, the measurement agreed)
ROPE_MEASURE_WITHIN = 1.5


class Progress:
    """Callbacks the CLI turns into progress bars; the library itself prints nothing."""

    def phase(self, name: str, total: int | None = None) -> None: ...
    def advance(self, done: int, total: int | None = None) -> None: ...
    def message(self, text: str) -> None: ...

    def end(self) -> None:
        """The current phase is over and no other has started yet (a log can show its time now, not
        after whatever comes next)."""


class ForwardingProgress(Progress):
    """Passes every callback on to `inner`; a subclass overrides what it adds (timing, filtering)."""

    def __init__(self, inner: Progress):
        self.inner = inner

    def phase(self, name: str, total: int | None = None) -> None:
        self.inner.phase(name, total)

    def advance(self, done: int, total: int | None = None) -> None:
        self.inner.advance(done, total)

    def message(self, text: str) -> None:
        self.inner.message(text)

    def end(self) -> None:
        self.inner.end()


class PhaseTimer(ForwardingProgress):
    """Passes every callback on to `inner` and adds each phase's wall time to `seconds` (name -> seconds).

    A phase lasts until the next one starts or `stop()` is called; the report records the totals, which is
    where a conversion's time goes (and what the cost model is fitted to).
    """

    def __init__(self, inner: Progress, seconds: dict[str, float], cpu_seconds: dict[str, float] | None = None,
                 windows: dict[str, list[float]] | None = None):
        super().__init__(inner)
        self.seconds = seconds
        self.cpu_seconds = {} if cpu_seconds is None else cpu_seconds  # process CPU time (all threads) per phase
        # name -> [first start, last end] in Unix time: lets a memory sampler outside the process tell which phase
        # it saw (durations alone place the phases only up to whatever runs between and after them)
        self.windows = {} if windows is None else windows
        self._current: tuple[str, float, float] | None = None

    def phase(self, name: str, total: int | None = None) -> None:
        self.stop()
        self._current = (name, time.perf_counter(), time.process_time())
        now = time.time()
        self.windows.setdefault(name, [now, now])
        self.inner.phase(name, total)

    def end(self) -> None:
        self.stop()
        self.inner.end()

    def stop(self) -> None:
        if self._current is not None:
            name, started, cpu_started = self._current
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started
            self.cpu_seconds[name] = self.cpu_seconds.get(name, 0.0) + time.process_time() - cpu_started
            self.windows[name][1] = time.time()
            self._current = None


# --------------------------------------------------------------------------- checks
def check_finite(tensors: dict[str, torch.Tensor], where: str) -> None:
    """`where` names the layer and the step ("layer 3, step 'factorization'"); the message names the tensor."""
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            bad = (~torch.isfinite(tensor)).sum().item()
            raise NonFiniteError(f"{where}: {name} holds {bad} NaN/Inf values (of {tensor.numel()}); refusing to write the output")


def check_statistics(stats: LayerInputStats, index: int, step: str) -> None:
    """Statistics the factorization can use, not a LinAlgError deep in torch."""
    check_finite(stats.to_tensors(), f"layer {index}, step '{step}'")
    if not bool(stats.second_moment.abs().sum() > 0):
        raise ConversionError(
            f"layer {index}, step '{step}': the attention input is identically zero (an all-zero input_layernorm "
            "weight, or hidden states that overflow float32); this layer cannot be calibrated"
        )


# --------------------------------------------------------------------------- attention error
def source_attention_output(layer, x: torch.Tensor, model: StreamedSourceModel) -> torch.Tensor:
    cos, sin = model.cos_sin(x.shape[1])
    q, k, v = project_qkv(x, layer, model.shape)
    return attention_from_qkv(*rotate_qk(q, k, cos, sin, model.shape, layer.index), v, layer, model.shape)


def float32_popped(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same tensors in float32, each taken out of `weights` (emptied) as its copy is made, so that its float64
    original can be freed before the next copy exists."""
    return {name: weights.pop(name).float() for name in list(weights)}


def relative_error(approx: torch.Tensor, reference: torch.Tensor) -> float:
    return ((approx.double() - reference.double()).norm() / reference.double().norm().clamp_min(1e-30)).item()


def converted_attention_output(weights: dict[str, torch.Tensor], x: torch.Tensor, source: SourceConfig, mla: MLAShape,
                               slot_inv_freq: torch.Tensor, queries: torch.Tensor | None = None) -> torch.Tensor:
    return mla_attention(x, weights, source.num_heads, source.head_dim, mla.rope_dim, source.head_dim, slot_inv_freq,
                         queries=queries)


def served_attention_error(weights: dict[str, torch.Tensor], input_norm_before: torch.Tensor,
                           input_norm_after: torch.Tensor, layer, stats: LayerInputStats, model: StreamedSourceModel,
                           mla: MLAShape, slot_inv_freq: torch.Tensor) -> float:
    """Relative error of a served layer's attention (after `serving.serve_layer`) against the source's, on the kept
    windows.  Why again: the serving transforms move the input norm's gain into the projections (what the attention
    receives changes) and keep the latent norm linear only to about 1 % of eps on calibration tokens, so the error of
    the closed form (exact to ~1e-7 at full rank) says nothing about theirs (~1e-3 measured)."""
    x = stats.samples.to(model.dtype)  # (windows, T, d): the source's normalised inputs, x_hat * g
    before = input_norm_before.to(x)
    ratio = torch.where(before != 0, input_norm_after.to(x) / torch.where(before != 0, before, 1), 0)  # (d,): g' / g
    served = {name: tensor.to(model.dtype) for name, tensor in weights.items()}
    out = converted_attention_output(served, x * ratio, model.shape, mla, slot_inv_freq)  # the export's input: x_hat * g'
    return relative_error(out, source_attention_output(layer, x, model))


def advance_through_converted(model: StreamedSourceModel, layer, weights, hidden: torch.Tensor, mla: MLAShape,
                              slot_inv_freq: torch.Tensor, chunk: int) -> None:
    """Push the calibration hidden states through the converted layer (MLA attention + source MLP), in place."""
    source = model.shape
    attention_weights = {k: v.to(model.dtype) for k, v in weights.items()}
    for start in range(0, hidden.shape[0], chunk):
        h = hidden[start : start + chunk]
        x = rms_norm(h, layer.weights["input_norm"], source.rms_norm_eps)
        h = h + converted_attention_output(attention_weights, x, source, mla, slot_inv_freq)
        hidden[start : start + chunk] = h + mlp(rms_norm(h, layer.weights["post_attn_norm"], source.rms_norm_eps), layer)


# --------------------------------------------------------------------------- RoPE grid
def choose_rope_grid(
    rope_stats: list,
    layers: Callable[[int], object],
    samples: Callable[[int], LayerInputStats],
    model: StreamedSourceModel,
    mla: MLAShape,
    measured: int,
    progress: Progress,
    offsets: bool = True,
    frame: torch.Tensor | None = None,
) -> tuple[RopeGrid, list[SlotPlan], list[dict]]:
    """Pick the model-wide RoPE grid: rank all candidates by estimated error, measure the best few (`offsets`: the
    target's `rope_offsets`; `frame`: the geometric grid the positions count in, `rope.grid_frame`)."""
    source = model.shape
    frame = model.inv_freq if frame is None else frame
    grids = rope_grid_candidates(source, mla, offsets, frame)
    scored = []  # (estimated error, grid, plans); plans kept only while a grid is among the best `keep`
    keep = max(1, measured)
    progress.phase("ranking RoPE grids", len(grids))
    for number, grid in enumerate(grids):
        plans = [plan_layer(stats, grid, model.inv_freq, source.num_kv_heads, max_fold=grid.step, frame=frame,
                            rotates=source.rotates(index)) for index, stats in enumerate(rope_stats)]
        scored.append((sum(p.estimated_error for p in plans), grid, plans))
        scored.sort(key=lambda item: item[0])
        # every grid's plans for every layer add up (8x on SmolLM2: +360 MiB); only finalists need theirs
        scored[keep:] = [(est, other, None) for est, other, _ in scored[keep:]]
        progress.advance(number + 1, len(grids))
    # the best always; the runners-up only when close (a NaN/inf estimate compares false: best alone)
    finalists = scored[:1] + [item for item in scored[1:keep] if item[0] <= ROPE_MEASURE_WITHIN * scored[0][0]]
    table = [{"grid": grid.describe(), "estimated_error": est} for est, grid, _ in scored[:10]]
    if len(finalists) == 1:
        return finalists[0][1], finalists[0][2], table
    # measured: attention output error with full-rank K/V (only the RoPE choice differs)
    full = MLAShape(source.max_kv_lora_rank, mla.rope_dim, mla.q_lora_rank)
    progress.phase("measuring RoPE grids", len(finalists) * source.num_layers)
    errors = [0.0] * len(finalists)
    for index in range(source.num_layers):
        for rank, error in enumerate(_finalist_errors(layers(index), samples(index), [plans[index] for _, _, plans in finalists],
                                                       model, full)):
            errors[rank] += error**2 / source.num_layers
            progress.advance(index * len(finalists) + rank + 1)
        model.release()
    for rank, (_, grid, _) in enumerate(finalists):
        for row in table:
            if row["grid"] == grid.describe():
                row["measured_attention_error"] = math.sqrt(errors[rank])
    best = min(range(len(finalists)), key=lambda r: (not math.isfinite(errors[r]), errors[r]))
    return finalists[best][1], finalists[best][2], table


def rope_grid_candidates(source, mla: MLAShape, offsets: bool = True, frame: torch.Tensor | None = None) -> list[RopeGrid]:
    """The grids a conversion ranks, over the source's frequencies as they sit on `frame` (`rope.grid_frame`; by
    default the source's own grid).  Only whole steps from the first frequency for a llama3 source on its own
    (scaled, not geometric) grid."""
    source_inv_freq = rope_inv_freq(source.rope_parameters, source.head_dim)
    frame = source_inv_freq if frame is None else frame
    own = torch.equal(frame.detach().double().cpu(), source_inv_freq.double())
    llama3 = own and source.rope_parameters.get("rope_type") == "llama3"
    span = float(frame_positions(source_inv_freq, frame).max()) + 1  # (the frequencies' index range on the frame)
    return candidate_grids(span, mla.rope_dim // 2, llama3=llama3, offsets=offsets)


def _finalist_errors(layer, stats: LayerInputStats, plans: list[SlotPlan], model: StreamedSourceModel, full: MLAShape):
    """One layer's attention-output error under each finalist's slot plan, with full-rank K/V; yields one per plan.

    A function of its own so that the layer's tensors (its whitening, samples and reference output) are freed before
    the next layer is loaded, not held through its peak.
    """
    source = model.shape
    stats.attention_moment = None  # the measurement whitens by the plain moment: 134 MB fewer at hidden 4096
    x = stats.samples.to(model.dtype)
    reference = source_attention_output(layer, x, model)
    # one d x d eigendecomposition per layer, shared by the finalists; written over the moment unless the query LoRA
    # factorization (a q_lora_rank or a query bias) reads the moment again
    keeps_moment = full.q_lora_rank is not None or layer.get("q_bias") is not None
    whitening = Whitening.of(stats.second_moment, consume=not keeps_moment)
    moment, stats.second_moment = (stats.second_moment if keeps_moment else None), None
    for plan in plans:
        weights, _ = convert_attention(layer.weights, source, full, plan, moment, stats.mean, method="input", whitening=whitening)
        # float32, one tensor at a time: the float64 weights (full rank: about 2 x W_q at hidden 4096) are not held
        # beside their copies through the measurement, nor while the next finalist is converted
        out = converted_attention_output(float32_popped(weights), x, source, full, plan.slot_inv_freq)
        yield relative_error(out, reference)
        del out


# --------------------------------------------------------------------------- refinement policy
@dataclass
class RefinePolicy:
    """How many refinement steps each layer gets, and why (recorded in the report)."""

    steps: int
    patience: int | None
    decision: str
    batch_windows: int = REFINE_BATCH_WINDOWS  # calibration windows per step
    check_every: int = 25  # steps between held-out checks

    @classmethod
    def of(cls, options: ConvertOptions, source: SourceConfig, windows: int | None = None) -> RefinePolicy:
        """`windows`: the calibration windows actually read (a short text gives fewer than --calib-samples)."""
        kept = error_windows_kept(options.calibration, windows)
        if kept < 2 and options.refine_steps != 0:  # one window to fit and to judge on: it would never run
            return cls(0, None, f"off (refinement needs 2 error windows per layer; this run keeps {kept}: "
                                "--calib-error-samples / --calib-samples)")
        if options.refine_steps is not None:
            return cls(options.refine_steps, None, f"{options.refine_steps} steps per layer (given)")
        if METHOD_ALIASES.get(options.method) == "weight":  # the baseline stays free of calibration data
            return cls(0, None, "off (weight-only SVD uses no calibration data)")
        effort = effort_of(options)
        if effort.refine == "off":
            return cls(0, None, f"off (--effort {options.effort})")
        if effort.refine == "all":
            return cls(AUTO_REFINE_STEPS, AUTO_REFINE_PATIENCE, f"{AUTO_REFINE_STEPS} steps per layer, stopping early "
                       f"(--effort {options.effort})")
        per_step = refine_flops(source, options.calibration.seq_len, 1, DEFAULT_REFINE_WINDOWS)
        if per_step <= DEFAULT_REFINE_MAX_STEP_FLOPS:
            return cls(DEFAULT_REFINE_STEPS, None, f"{DEFAULT_REFINE_STEPS} steps per layer of {DEFAULT_REFINE_WINDOWS} "
                       f"window ({per_step / 1e9:.2f} GFLOP each; --effort thorough: {AUTO_REFINE_STEPS})",
                       DEFAULT_REFINE_WINDOWS, DEFAULT_REFINE_CHECK_EVERY)
        return cls(0, None, f"off ({per_step / 1e9:.2f} GFLOP per step, more than the {DEFAULT_REFINE_MAX_STEP_FLOPS / 1e9:g} "
                            "the default spends; --effort thorough or --refine-steps N turn it on)")


def refine_flops(source: SourceConfig, seq_len: int, steps: int, windows: int = REFINE_BATCH_WINDOWS) -> float:
    """Rough cost of refining one layer: forward + backward (3x forward) of its attention on the step's tokens."""
    projections = 2 * source.hidden_size * source.head_dim * (source.num_heads + source.num_kv_heads)  # q, o + k, v
    tokens = windows * seq_len
    per_token = 2 * projections + 4 * source.num_heads * source.head_dim * seq_len  # matmuls + scores/values
    return 3.0 * per_token * tokens * steps


# --------------------------------------------------------------------------- one layer
def convert_layer(layer, stats: LayerInputStats, mla: MLAShape, plan: SlotPlan, method: str, options: ConvertOptions,
                  model: StreamedSourceModel, use_q_lora: bool, refine: RefinePolicy,
                  keep_moments: bool = True) -> tuple[dict, LayerReport]:
    """Convert one layer; with the output-aware method, pick the K/V balance by measured attention error.

    Calibration tokens weigh in the factorization by how much attention reads them (the attention-mass
    moment; attention sinks above all), and NoPE queries are scaled by the least-squares factor for the
    rotation they lose: both measured better on every model tried, so they are not options.
    `keep_moments=False`: the caller needs no more of `stats` than its samples, so its two d x d moments are
    dropped (set to None) as soon as they are used (Llama-3-8B width: 2 x 134 MB during the K/V search).
    """
    source = model.shape
    by_attention = stats.attention_moment is not None
    moment = stats.attention_moment if by_attention else stats.second_moment
    # the attention moment, when the caller needs it no more, becomes the whitening's eigenvectors in place
    whitening = None if method == "weight" else Whitening.of(moment, consume=by_attention and not keep_moments)
    del moment
    if not keep_moments:
        stats.attention_moment = None
    x = stats.samples.to(model.dtype)
    reference = source_attention_output(layer, x, model)
    # queries, o_proj and the RoPE key do not depend on the balance: built once and shared by every attempt
    parts = prepare_attention(layer.weights, source, mla, plan, stats.second_moment, stats.mean, method, use_q_lora,
                              nope_scaling=True)
    if not keep_moments:
        stats.second_moment = None
    # the queries do not depend on the balance: projected once, so no attempt builds or holds q_proj (1.5 W_q in float64)
    queries = project_queries(x, float32_popped({name: tensor for name, tensor in parts.tensors().items()
                                                 if name in T.QUERY_NAMES}))
    other_fixed = {name: tensor for name, tensor in parts.fixed.items() if name not in T.QUERY_NAMES}
    best = None  # (factors, balance, attention error): only the best latent is kept, never two attempts' weights

    def attempt(balance: float):
        nonlocal best
        factors = factorize_latent(parts, mla.kv_lora_rank, whitening, layer.weights["input_norm"], balance)
        # float32 copies made here, after the factorization's peak, not held through it
        measured = float32_popped({**other_fixed, **factors.tensors()})
        error = relative_error(converted_attention_output(measured, x, source, mla, plan.slot_inv_freq, queries), reference)
        del measured
        if best is None or error < best[2]:
            best = (factors, balance, error)
        return error

    if method == "output" and effort_of(options).kv_balance_search:
        # coarse (x4 apart), then the x2 step from the best towards its better coarse neighbour (beyond the
        # end of the grid when the best is at an end): 1/8 .. 32 in 5 conversions
        errors = [attempt(balance) for balance in KV_BALANCE_COARSE]
        position = min(range(len(errors)), key=errors.__getitem__)
        centre = KV_BALANCE_COARSE[position]
        if position in (0, len(errors) - 1):
            towards_below = position == 0
        else:
            towards_below = errors[position - 1] < errors[position + 1]
        attempt(centre / 2 if towards_below else centre * 2)
    else:
        attempt(1.0)
    whitening = queries = other_fixed = None  # not needed past the search
    factors, balance, error = best
    best = assemble_attention(parts, factors, layer.index, balance)
    best[1].attention_error = error
    parts = factors = None
    check_finite(best[0], f"layer {layer.index}, step 'factorization'")  # before refinement hides it
    if refine.steps > 0 and x.shape[0] >= 2:
        from .refine import refine_layer

        weights, report = best
        result = refine_layer(weights, x, reference, source.num_heads, source.head_dim, mla.rope_dim, source.head_dim,
                              plan.slot_inv_freq, steps=refine.steps, lr=options.refine_lr, patience=refine.patience,
                              batch_windows=refine.batch_windows, check_every=refine.check_every,
                              latent_scale_fn=lambda down: T.latent_scale_for(down, layer.weights["input_norm"]))
        out = converted_attention_output({k: v.float() for k, v in result.weights.items()}, x, source, mla, plan.slot_inv_freq)
        report.extra["closed_form_attention_error"] = report.attention_error
        report.attention_error = relative_error(out, reference)
        report.latent_scale = T.latent_scale_of(result.weights[T.KV_A_NORM][0].item())
        report.extra["refine_best_step"] = result.steps
        report.extra["refine_held_out_error"] = [result.error_before, result.error_after]  # closed form, refined
        best = (result.weights, report)
    return best
