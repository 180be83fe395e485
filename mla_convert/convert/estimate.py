"""What a conversion will cost before it runs: wall time per phase, peak host and device memory, disk.

Why a model and not a rule of thumb: the phases grow with different things.  Sampling calibration text
streams every layer and the head once per generated token (weights x tokens); the statistics pass is a
forward over the calibration tokens plus d x d float64 moments; the conversion is dominated by d^3
eigendecompositions and, on small models, by Python overhead; ranking RoPE grids is a loop over
candidate grids x layers on the host.  "SmolLM2 takes 100 s" says nothing about an 8B model.

Each phase's work is counted from the source config, the MLA shape and the options, in five kinds:

- ops: torch calls and Python steps (a layer's kernels, a shard opened, a RoPE member visited): latency;
- bytes: memory traffic (weights read from the page cache and widened to float32, activations, statistics);
- flops: float32 matmul-class FLOPs (a float64 matmul counts `float64_matmul_cost` times);
- lapack: float64 eigendecompositions and SVDs (d^3 work that runs well below matmul speed);
- host: elementwise work on the host whatever the device (nucleus sampling over the vocabulary, RoPE plans);

plus `fixed` (once per phase).  The throughput kinds are turned into seconds at the device class's reference
rates (float32 and float64 matmul, eigh, widening bf16 weights, softmax/top-k: kernels timed on the machine,
`bench_cost_model.py microbench`; for the GPU, its data sheet); each phase then has two fitted numbers, its
efficiency against those rates and its seconds per op, plus fixed seconds.  Fitting a rate per kind per
phase would need more runs than a 2-core machine can make: the kinds grow together in small models, and
the fit would pick whichever explains them, which extrapolates to an 8B model badly.  The constants are data
(`cost_constants.json`), fitted by `scripts/fit_cost_model.py` from measured runs (docs/bench/cost-model/,
docs/bench/device-convert-check.json).  On a CPU, throughput scales with the cores used; per-op latency does not.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from functools import lru_cache
from pathlib import Path

from ..options import ConvertOptions
from ..source.config import SourceConfig
from ..source.model import WIDENED_BLOCK_BYTES
from ..source.shapes import MLAShape, pick_target_shape
from ..units import dtype_bytes, human_bytes
from .calibration import SAMPLING_CACHE_BYTES
from .decisions import METHOD_ALIASES, RefinePolicy, effort_of, refine_flops, rope_grid_candidates
from .preflight import OUTPUT_OVERHEAD_BYTES, estimated_output_bytes, estimated_statistics_bytes, expected_tensor_shapes, export_dtype
from .target import target_of

CONSTANTS_FILE = Path(__file__).with_name("cost_constants.json")

# The phase names the pipeline reports (summary.phase_seconds), in the order it runs them.
NAN_CHECK = "checking source weights for NaN/Inf"
SAMPLING = "sampling calibration text from the source model"
READING = "reading calibration text"
STATISTICS = "calibration statistics"
RANKING = "ranking RoPE grids"
MEASURING = "measuring RoPE grids"
CONVERTING = "converting layers"
WRITING = "writing the output"
PHASES = (NAN_CHECK, SAMPLING, READING, STATISTICS, RANKING, MEASURING, CONVERTING, WRITING)
STARTUP = "start-up, pre-flight and finishing"  # outside every phase: imports, pre-flight, model card, commit
KINDS = ("ops", "bytes", "flops", "lapack", "host", "fixed")
DEVICE_CLASSES = ("cpu", "cuda")

# Counts of torch calls (the unit of `ops`) for the steps the phases repeat, read off the code paths
LOAD_LAYER_OPS = 60  # open the shard, slice ~12 tensors, widen each to float32
LAYER_FORWARD_OPS = 50  # norms, q/k/v/o, rotary, attention, MLP
VOCAB_CHUNK_OPS = 28  # one 8192-row block of the head: read, widen, matmul, release
ATTEMPT_OPS = 160  # one K/V factorization of a layer and its error measurement
MEMBER_OPS = 8  # one (kv head, frequency) component visited by a RoPE slot plan
REFINE_STEP_OPS = 150  # forward, backward and Adam step of one refinement step
VOCAB_CHUNK_ROWS = 8192  # source.model.EMBED_CHUNK_ROWS
NAN_BLOCK_ELEMENTS = 1 << 20  # preflight.source_finite_problems' block


@dataclass(frozen=True)
class Work:
    """One phase's work, by kind (see the module docstring)."""

    ops: float = 0.0
    bytes: float = 0.0
    flops: float = 0.0
    lapack: float = 0.0
    host: float = 0.0
    fixed: float = 0.0
    h2d: float = 0.0  # bytes uploaded host -> device (weights that do not stay resident on the GPU)

    def __add__(self, other: Work) -> Work:
        return Work(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def scaled(self, factor: float) -> Work:
        return Work(*(getattr(self, f.name) * factor for f in fields(self)))

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


# --------------------------------------------------------------------------- sizes
@dataclass(frozen=True)
class Sizes:
    """The counts every phase's work is built from."""

    source: SourceConfig
    mla: MLAShape
    options: ConvertOptions
    device: str

    @property
    def stored(self) -> int:  # bytes per stored weight
        return dtype_bytes(self.source.torch_dtype)

    @property
    def widen(self) -> int:
        """Bytes moved per weight when a layer is loaded and used: read as stored; unless stored as float32, also the
        float32 copy written and then read again by the matmul (a float32 source is multiplied straight from its mapped
        pages).  Counting the copy once under-predicted every bf16 run's sampling (0.56-0.67) and over-predicted the one
        float32 run's (Qwen2.5-0.5B, 1.45)."""
        return self.stored + (0 if self.stored == 4 else 8)

    @property
    def attention_params(self) -> int:
        s = self.source
        return 2 * s.hidden_size * s.num_heads * s.head_dim + 2 * s.hidden_size * s.num_kv_heads * s.head_dim

    @property
    def layer_params(self) -> int:
        s = self.source
        return self.attention_params + 3 * s.hidden_size * s.intermediate_size + 2 * s.hidden_size

    @property
    def layer_bytes_held(self) -> int:
        """A loaded layer (`StreamedSourceModel.load_layer`, `widened_linear`): attention and norms in float32 (a copy, or
        a float32 source's own mapped pages; the shard is closed after loading), and the MLP either as stored (mapped
        pages) plus one widened block of rows, or, for matrices larger than one block, one block of mapped rows and its
        widened copy at a time (`StreamedRows`)."""
        s = self.source
        mlp = 3 * s.hidden_size * s.intermediate_size
        widened_matrix = s.hidden_size * s.intermediate_size * 4
        # streamed: the mapped block is released before the next one is read (on the host only: a GPU conversion keeps
        # weights resident on the device within its budget, `StreamedSourceModel._streamed`)
        if widened_matrix > WIDENED_BLOCK_BYTES and self.device == "cpu":
            mlp_held = WIDENED_BLOCK_BYTES * (self.stored / 4) + WIDENED_BLOCK_BYTES
        else:
            mlp_held = mlp * self.stored + (0 if self.stored == 4 else widened_matrix)
        return int((self.layer_params - mlp) * 4 + mlp_held)

    @property
    def table_params(self) -> int:
        return self.source.vocab_size * self.source.hidden_size

    @property
    def checkpoint_params(self) -> int:
        return sum(math.prod(shape) for shape in expected_tensor_shapes(self.source).values())

    @property
    def checkpoint_bytes(self) -> int:
        return self.checkpoint_params * self.stored

    @property
    def windows(self) -> int:
        return self.options.calibration.num_samples

    @property
    def tokens(self) -> int:
        return self.windows * self.options.calibration.seq_len

    @property
    def kept_windows(self) -> int:
        return min(self.options.calibration.error_samples, self.windows)

    @property
    def sampling_batch(self) -> int:
        """Sequences sampled at once (calibration.sample_from_model: the bf16 KV cache within SAMPLING_CACHE_BYTES)."""
        s, T = self.source, self.options.calibration.seq_len
        per_sequence = s.num_layers * 2 * s.num_kv_heads * T * s.head_dim * 2
        return max(1, min(self.windows, SAMPLING_CACHE_BYTES // per_sequence))

    @property
    def sampling_steps(self) -> int:
        return (self.options.calibration.seq_len - 1) * -(-self.windows // self.sampling_batch)

    @property
    def grids(self) -> int:
        from ..source.model import rope_inv_freq
        from .rope import grid_frame

        target, s = target_of(self.options.target), self.source
        frame, _ = grid_frame(s.rope_parameters, s.head_dim, rope_inv_freq(s.rope_parameters, s.head_dim), target.llama3_scaling)
        return len(rope_grid_candidates(s, self.mla, target.rope_offsets, frame))

    @property
    def finalists(self) -> int:
        """RoPE grids measured: every finalist (the runner-up is skipped only when its estimate is not close)."""
        return min(effort_of(self.options).rope_finalists, self.grids)

    @property
    def attempts(self) -> int:
        """Factorizations per layer: 5 with the K/V balance search, else 1."""
        search = METHOD_ALIASES[self.options.method] == "output" and effort_of(self.options).kv_balance_search
        return 5 if search else 1

    @property
    def refine_steps(self) -> int:
        return RefinePolicy.of(self.options, self.source).steps if self.kept_windows >= 2 else 0

    @property
    def refine_windows(self) -> int:
        """Calibration windows per refinement step."""
        return RefinePolicy.of(self.options, self.source).batch_windows

    @property
    def statistics_bytes_per_layer(self) -> int:
        return estimated_statistics_bytes(self.source, self.options.calibration) // self.source.num_layers

    @property
    def output_dtype(self):
        return export_dtype(self.options.dtype, self.source, serving=target_of(self.options.target).serving)


def svd_flops(rows: int, cols: int) -> float:
    """Thin SVD with singular vectors of a rows x cols matrix."""
    small, large = min(rows, cols), max(rows, cols)
    return 4.0 * small * small * large + 8.0 * small**3


def eigh_flops(n: int) -> float:
    """Symmetric eigendecomposition with eigenvectors (tridiagonalization + divide and conquer)."""
    return 9.0 * n**3


# --------------------------------------------------------------------------- work per phase
def layer_forward_flops(z: Sizes, tokens: int, windows: int, mlp: bool = True) -> float:
    """float32 FLOPs of the source layer over `tokens` tokens in `windows` windows (causal attention)."""
    s, T = z.source, z.options.calibration.seq_len
    projections = z.attention_params + (3 * s.hidden_size * s.intermediate_size if mlp else 0)
    return 2.0 * tokens * projections + 2.0 * windows * s.num_heads * T * T * s.head_dim


def statistics_work(z: Sizes, move_hidden: bool, f64: float) -> Work:
    """One layer's `layer_input_stats` over every calibration window."""
    s = z.source
    d, T, chunks = s.hidden_size, z.options.calibration.seq_len, -(-z.windows // z.options.calibration.chunk)
    f32 = layer_forward_flops(z, z.tokens, z.windows, mlp=move_hidden)
    f32 += 2.0 * z.windows * s.num_heads * T * T * s.head_dim  # attention_statistics' full score matrices
    moments = 4.0 * z.tokens * d * d  # E[x x^T] and the attention-weighted moment, float64
    activations = z.tokens * 4.0 * (12 * d + 4 * s.num_heads * s.head_dim + (3 * s.intermediate_size if move_hidden else 0))
    return Work(ops=chunks * LAYER_FORWARD_OPS + z.windows * 20, bytes=activations + chunks * 32.0 * d * d,
                flops=f32 + f64 * moments)


def prepare_work(z: Sizes, method: str, f64: float) -> Work:
    """`prepare_attention`: what one layer's conversion builds once, whatever the K/V balance (slot projections,
    the query rows, and with the output-aware method the query moments and the K/V energies)."""
    s, m = z.source, z.mla
    d, H, G, h, D = s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim, m.rope_dim
    matmul = 2.0 * H * h * d * d + 4.0 * G * h * d * d if method == "output" else 0.0  # query moments, K/V energies
    return Work(ops=MEMBER_OPS * G * (h // 2) + 16 * G + 40, flops=f64 * matmul,
                lapack=2 * G * eigh_flops(h) if method == "output" else 0.0, bytes=8.0 * (H * (h + D) * d * 3 + 4 * G * h * d))


def attempt_work(z: Sizes, rank: int, method: str, f64: float) -> Work:
    """One K/V factorization (`factorize_latent`) and the attention-output error it is measured by."""
    s, m = z.source, z.mla
    d, H, G, h, D = s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim, m.rope_dim
    rows = 2 * G * h  # stacked NoPE keys and values
    # into the whitening's eigenbasis, kept vectors back out and in again, down, gram, C down^T, least-squares up
    matmul = 2.0 * rows * d * d + 2.0 * rank * d * d * 4 + 2.0 * rank * rank * d + 2.0 * rows * d * rank + rank**3
    if method == "output":
        matmul += 2.0 * rows * h * d  # row weighting: one h x h block per kv head and role
    T, n = z.options.calibration.seq_len, z.kept_windows
    mla_params = H * (h + D) * d + (rank + D) * d + H * 2 * h * rank + d * H * h
    measured = 2.0 * n * T * mla_params + 2.0 * n * H * T * T * (2 * h + D)
    return Work(ops=ATTEMPT_OPS, flops=f64 * matmul + measured, lapack=svd_flops(rows, d),
                bytes=8.0 * (rows * d * 3 + H * (h + D) * d * 2))


def whitening_work(z: Sizes, f64: float) -> Work:
    """`Whitening.of`: damp, symmetrise and eigendecompose the d x d moment (in place; no roots are formed)."""
    d = z.source.hidden_size
    return Work(ops=12 + d // 512, lapack=eigh_flops(d), bytes=8.0 * 4 * d * d)


def load_layer_work(z: Sizes) -> Work:
    return Work(ops=LOAD_LAYER_OPS, bytes=z.layer_params * z.widen)


def phase_work(z: Sizes, f64: float, resident_bytes: int = 0) -> dict[str, Work]:
    """The work of every phase this conversion runs, in pipeline order."""
    s, calib = z.source, z.options.calibration
    L, d, V, T = s.num_layers, s.hidden_size, s.vocab_size, calib.seq_len
    work: dict[str, Work] = {}
    tensors = len(expected_tensor_shapes(s))
    work[NAN_CHECK] = Work(ops=tensors * 5 + z.checkpoint_params / NAN_BLOCK_ELEMENTS * 25, bytes=z.checkpoint_bytes * 2.0)

    if calib.data is None:
        b, steps = z.sampling_batch, z.sampling_steps
        chunks = -(-V // VOCAB_CHUNK_ROWS)
        weights = L * z.layer_params + z.table_params
        cache = L * b * 2 * s.num_kv_heads * (T / 2) * s.head_dim * (2 + 4)  # bf16 cache read and widened, mid-sequence
        per_step = Work(
            ops=L * (LOAD_LAYER_OPS + LAYER_FORWARD_OPS) + chunks * (VOCAB_CHUNK_OPS + 4) + 20,
            bytes=weights * z.widen + cache,
            flops=2.0 * b * weights + 4.0 * L * b * s.num_heads * s.head_dim * (T / 2),
            host=float(b * V),
            h2d=max(0, weights * z.stored - resident_bytes) if z.device == "cuda" else 0.0,
        )
        work[SAMPLING] = per_step.scaled(steps)
    else:
        work[READING] = Work(fixed=1.0, host=float(z.tokens))

    layer = load_layer_work(z)
    stats_pass = statistics_work(z, move_hidden=True, f64=f64)
    rope_stats = Work(ops=40, flops=f64 * 8.0 * (s.num_heads + s.num_kv_heads) * (s.head_dim // 2) * d * d)
    store = Work(ops=20, bytes=2.0 * z.statistics_bytes_per_layer)
    embed = Work(ops=-(-V // VOCAB_CHUNK_ROWS) * 4, bytes=z.tokens * d * 4.0)
    work[STATISTICS] = embed + (layer + stats_pass + rope_stats + store).scaled(L)

    G, H, h = s.num_kv_heads, s.num_heads, s.head_dim
    slots = z.mla.rope_dim // 2
    per_plan = Work(ops=30 + slots * (15 + h) + 12 * G * (h // 2) + 10 * H,
                    host=float((H * H + 3 * H) * (h // 2) * T))
    work[RANKING] = per_plan.scaled(z.grids * L)
    # what runs after the grid is chosen and before the layers start: the DeepseekV3 config (transformers),
    # the output writer and the embedding table copied into the output: it lands in the last RoPE phase
    out_bytes = dtype_bytes(z.output_dtype)
    tail = Work(fixed=1.0, ops=-(-V // VOCAB_CHUNK_ROWS) * 10, bytes=z.table_params * (z.stored + out_bytes))
    if z.grids > 1:
        full_rank = s.max_kv_lora_rank
        reference = Work(ops=30, flops=layer_forward_flops(z, z.kept_windows * T, z.kept_windows, mlp=False))
        per_finalist = prepare_work(z, "input", f64) + attempt_work(z, full_rank, "input", f64)  # the whitening is shared
        work[MEASURING] = (layer + store + reference + whitening_work(z, f64) + per_finalist.scaled(z.finalists)).scaled(L) + tail
    else:
        work[RANKING] = work[RANKING] + tail

    method = METHOD_ALIASES[z.options.method]
    per_layer = layer + store.scaled(0.5) + Work(ops=30, flops=layer_forward_flops(z, z.kept_windows * T, z.kept_windows, mlp=False))
    if method != "weight":
        per_layer = per_layer + whitening_work(z, f64)
    per_layer = per_layer + prepare_work(z, method, f64) + attempt_work(z, z.mla.kv_lora_rank, method, f64).scaled(z.attempts)
    if z.options.sequential:
        advance = Work(ops=-(-z.windows // calib.chunk) * LAYER_FORWARD_OPS, bytes=z.tokens * 4.0 * (8 * d + 3 * s.intermediate_size),
                       flops=2.0 * z.tokens * (H * (h + z.mla.rope_dim) * d + (z.mla.kv_lora_rank + z.mla.rope_dim) * d
                                               + H * 2 * h * z.mla.kv_lora_rank + d * H * h + 3 * d * s.intermediate_size)
                       + 2.0 * z.windows * H * T * T * (2 * h + z.mla.rope_dim))
        per_layer = per_layer + statistics_work(z, move_hidden=False, f64=f64) + rope_stats + advance
    if z.refine_steps:
        per_layer = per_layer + Work(ops=REFINE_STEP_OPS * z.refine_steps,
                                     flops=refine_flops(s, T, z.refine_steps, z.refine_windows))
    written = (z.layer_params - z.attention_params) + attention_output_params(s, z.mla)
    per_layer = per_layer + Work(ops=40, bytes=written * (8 + out_bytes))  # float64 results cast and written
    # the first torch.optim.Adam imports torch._dynamo (about 1 s, once per process)
    work[CONVERTING] = per_layer.scaled(L) + Work(fixed=1.0 if z.refine_steps else 0.0)

    head = 0 if s.tied_embeddings else z.table_params
    work[WRITING] = Work(fixed=1.0, ops=-(-V // VOCAB_CHUNK_ROWS) * 10 if head else 10, bytes=head * (z.stored + out_bytes))
    return work


def attention_output_params(source: SourceConfig, mla: MLAShape) -> int:
    d, H, h, D, R = source.hidden_size, source.num_heads, source.head_dim, mla.rope_dim, mla.kv_lora_rank
    return H * (h + D) * d + (R + D) * (d + 1) + R + H * 2 * h * R + d * H * h


# --------------------------------------------------------------------------- memory
def working_sets(z: Sizes) -> dict[str, float]:
    """Bytes each phase holds at its peak beyond the process's base (weights, activations, statistics)."""
    s, calib = z.source, z.options.calibration
    d, H, G, h, inter, T = s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim, s.intermediate_size, calib.seq_len
    layer = z.layer_bytes_held
    hidden = z.tokens * d * 4.0
    rope_stats = s.num_layers * ((G * h // 2) ** 2 * 16 + H * (h // 2) * 8 + H * T * 8)  # held for every layer until the export
    chunk_windows = min(calib.chunk, z.windows)
    activations = chunk_windows * T * (d * 8 * 2 + (H + 2 * G) * h * 4 * 2 + inter * 4 * 3) + H * T * T * 4 * 3
    moments = 2 * d * d * 8.0 * 2
    sets = {NAN_CHECK: NAN_BLOCK_ELEMENTS * 8.0}
    if calib.data is None:
        b = z.sampling_batch
        cache = s.num_layers * 2 * b * G * T * h * 2.0
        sets[SAMPLING] = cache + layer + VOCAB_CHUNK_ROWS * d * 4.0 * 2 + b * s.vocab_size * 4.0 * 4
    else:
        sets[READING] = z.tokens * 12.0 * 4  # the text, its tokens
    sets[STATISTICS] = layer + hidden + activations + moments + rope_stats
    rows = 2 * G * h
    # whitening: the layer's two moments (one becomes the eigenvectors in place) and eigh's 2 d^2 workspace; an attempt:
    # the eigenvectors, the stacked K/V rows, the weighted target, the SVD's copy, right vectors, left vectors and
    # workspace, the RoPE query rows
    factorization = 8.0 * max(4 * d * d, d * d + 4 * rows * d + 4 * rows * rows + H * z.mla.rope_dim * d)
    samples = z.kept_windows * T * (d + H * h * 2) * 4.0 * 2
    sets[RANKING] = rope_stats + dtype_bytes(z.output_dtype) * VOCAB_CHUNK_ROWS * d * 2.0
    if z.grids > 1:
        sets[MEASURING] = layer + factorization + samples + rope_stats
    best = 8.0 * ((z.mla.kv_lora_rank + z.mla.rope_dim) * d + H * 2 * h * z.mla.kv_lora_rank)  # the best attempt's latent
    sets[CONVERTING] = layer + factorization + samples + rope_stats + (hidden + activations + moments if z.options.sequential else 0) \
        + best
    sets[WRITING] = VOCAB_CHUNK_ROWS * d * 8.0
    return sets


# --------------------------------------------------------------------------- constants
@lru_cache(maxsize=4)
def load_constants(path: str | None = None) -> dict:
    return json.loads(Path(path or CONSTANTS_FILE).read_text())


# work kind -> the reference rate it runs at
THROUGHPUT_RATES = {"bytes": "bytes_per_second", "flops": "flops_per_second", "lapack": "lapack_flops_per_second",
                    "host": "host_elements_per_second"}


def throughput_seconds(work: Work, reference: dict) -> float:
    """Seconds the phase's throughput-bound work takes at the device class's reference rates."""
    return sum(getattr(work, kind) / reference[rate] for kind, rate in THROUGHPUT_RATES.items())


def phase_seconds(work: Work, rates: dict, reference: dict, scale: float) -> float:
    """Seconds of one phase: per-op latency + throughput work at the phase's efficiency x the reference rates + fixed.

    `scale`: CPU cores used / cores of the fitted runs; it multiplies throughput, not latency.  Weights uploaded to a
    GPU beyond its resident budget (`h2d`) go at the reference upload rate.
    """
    seconds = work.fixed * rates.get("fixed_seconds", 0.0) + work.ops * rates.get("seconds_per_op", 0.0)
    efficiency = rates.get("efficiency")
    if efficiency:
        seconds += throughput_seconds(work, reference) / (efficiency * scale)
    if work.h2d:
        seconds += work.h2d / reference["host_to_device_bytes_per_second"]
    return seconds


# --------------------------------------------------------------------------- the estimate
@dataclass
class Estimate:
    source: SourceConfig
    mla: MLAShape
    device: str  # "cpu" or "cuda"
    device_description: str
    phases: dict[str, float]  # reported phase -> predicted wall seconds, in pipeline order
    startup_seconds: float
    peak_rss_bytes: float
    peak_device_bytes: float | None
    statistics_disk_bytes: int
    output_bytes: int
    work: dict[str, Work] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def total_seconds(self) -> float:
        return sum(self.phases.values()) + self.startup_seconds

    def rows(self) -> list[tuple[str, str, str]]:
        """(phase, predicted wall time, share) rows, then the totals."""
        total = self.total_seconds
        rows = [(name, format_seconds(seconds), f"{100 * seconds / total:.0f} %") for name, seconds in self.phases.items()]
        rows.append((STARTUP + " (not a report phase)", format_seconds(self.startup_seconds), f"{100 * self.startup_seconds / total:.0f} %"))
        rows.append(("total wall time", format_seconds(total), "100 %"))
        return rows

    def resource_rows(self) -> list[tuple[str, str]]:
        rows = [("peak host memory (RSS)", human_bytes(self.peak_rss_bytes))]
        if self.peak_device_bytes is not None:
            rows.append(("peak device memory", human_bytes(self.peak_device_bytes)))
        rows += [("disk: calibration statistics (temp folder)", human_bytes(self.statistics_disk_bytes)),
                 ("disk: output folder", human_bytes(self.output_bytes))]
        return rows


def format_seconds(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.1f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def estimate(source: SourceConfig, options: ConvertOptions | None = None, device: str = "cpu", cores: int | None = None,
             sidecar_bytes: int = 0, constants: dict | None = None) -> Estimate:
    """Predict the conversion `options` would run on `source`: on `cores` CPU cores, or on the fitted CUDA device."""
    options = options or ConvertOptions()
    constants = constants or load_constants()
    kind = "cuda" if str(device).startswith("cuda") else "cpu"
    rates = constants[kind]
    # the shape and the layout `convert` would write for this target (a llama.cpp export adds an identity query path)
    mla = pick_target_shape(source, options.target, options.kv_lora_rank, options.rope_dim, options.compression,
                            options.q_lora_rank)
    z = Sizes(source, mla, options, kind)
    notes = []
    if kind == "cpu":
        cores = cores or rates["reference_cores"]
        scale = cores / rates["reference_cores"]
        describe = f"cpu, {cores} core{'s' if cores != 1 else ''}"
        resident = 0
        if cores > rates["reference_cores"]:
            notes.append(f"extrapolated: the CPU constants were fitted on {rates['reference_cores']}-core runs; {cores} cores "
                         "are assumed to multiply their throughput, which memory bandwidth caps at some count not measured "
                         "here, so the time may be well under-predicted")
    else:
        scale = 1.0
        budget = int(rates["device_memory_bytes"] * rates["resident_weight_share"])
        resident = min(z.checkpoint_bytes, budget)
        describe = f"cuda ({rates['device_name']}); source weights resident on it: {human_bytes(resident)} of {human_bytes(z.checkpoint_bytes)}"
        if resident < z.checkpoint_bytes:
            notes.append(f"{human_bytes(z.checkpoint_bytes - resident)} of weights do not fit the resident budget: each sampling "
                         f"step uploads them again at an assumed {rates['reference_rates']['host_to_device_bytes_per_second'] / 1e9:g} GB/s")
    reference = rates["reference_rates"]
    work = phase_work(z, reference["float64_matmul_cost"], resident)
    phases = {name: phase_seconds(phase, rates["phases"][name], reference, scale) for name, phase in work.items()}
    startup = rates["startup"]
    tensors = len(expected_tensor_shapes(source))
    startup_seconds = startup["fixed_seconds"] + tensors * startup["seconds_per_tensor"]

    memory = rates["memory"]
    sets = working_sets(z)
    peak_set = max(sets.values())
    if kind == "cpu":
        peak_rss = memory["base_bytes"] + memory["working_set_factor"] * peak_set
        peak_device = None
    else:
        # the host keeps the CUDA runtime and the mapped pages of one layer; the device the rest
        peak_rss = memory["base_bytes"] + memory["working_set_factor"] * z.layer_params * z.stored
        peak_device = memory["device_base_bytes"] + resident + memory["device_working_set_factor"] * peak_set
    out_dtype = z.output_dtype
    output = estimated_output_bytes(source, mla, out_dtype, options.target) + sidecar_bytes + OUTPUT_OVERHEAD_BYTES
    if MEASURING in work:
        notes.append(f"{MEASURING}: {z.finalists} finalists of {z.grids} grids assumed measured (a runner-up whose estimate is not "
                     "within 1.5x of the best is skipped)")
    if z.refine_steps and RefinePolicy.of(options, source).patience is not None:
        notes.append(f"refinement: {z.refine_steps} steps per layer assumed (early stopping can end a layer sooner)")
    if calibration_reads_text(options):
        notes.append("reading calibration text: assumes the text has num_samples x seq_len tokens")
    return Estimate(source, mla, kind, describe, phases, startup_seconds, peak_rss, peak_device,
                    estimated_statistics_bytes(source, options.calibration), output, work, notes)


def calibration_reads_text(options: ConvertOptions) -> bool:
    return options.calibration.data is not None
