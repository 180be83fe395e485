"""The fine-tuning loop: distil the source model (teacher) into its MLA conversion (student).

Runs unchanged on one CPU process, one GPU, or many GPUs under `accelerate launch` (DDP or FSDP): the
student and its optimizer go through `accelerator.prepare`; the teacher stays outside it (frozen,
replicated, in bf16 on GPU), so checkpoints hold only what training changes.

Exact resume: a checkpoint is `accelerator.save_state` (student weights, optimizer, RNG states) plus
the LR scheduler, the data cursor (epoch + position of a seeded permutation) and the trainer history
as JSON (`checkpoint.py`: written like an export, verified and loaded without running code).  Loading
all of them puts the run in the same state as an uninterrupted one; a test checks the final weights
are bit-identical on CPU.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup

from ..convert.report import hub_dataset, source_label
from ..data.sampling import NUCLEUS_CANDIDATES, sample_from_model
from ..errors import MLAConvertError
from ..io.paths import absolute_path, command_line, model_folder_problems, real_path, within
from ..io.signals import signals_deferred
from ..io.writer import prepare_output_path
from ..units import dtype_name
from .checkpoint import (
    COMPLETE_MARKER,
    OWNER_MARKER,
    WRITE_ERRORS,
    CheckpointError,
    checkpoints_held,
    claim_root,
    complete_checkpoints,
    disk_problems,
    read_trainer_states,
    remove_partial_checkpoints,
    verify_checkpoint,
    write_checkpoint,
)
from .config import FinetuneConfig, FinetuneConfigError
from .data import WindowCursor, cached_teacher_samples, process_slice, text_fingerprint, text_windows
from .evaluate import EvalWindows, evaluate_perplexity_distributed
from .latent import LatentSite, stored_latent_sites, unfold_latent_scales
from .loss import distillation_loss
from .saving import REPORT_FILE, fp16_save_note, resolve_save_dtype, save_finetuned, write_report

SAMPLES_FILE = "teacher_samples.safetensors"
# a teacher whose log-probabilities are this close to the student's on a probe is a copy of it (fp32 and bf16 copies
# of one model differ by ~1e-2; a source and its 2x conversion by ~1)
SAME_MODEL_LOGPROB_TOLERANCE = 1e-4
LOG_FILE = "train_log.jsonl"
# attention-only training: the parameters of every layer's self_attn block (MLA projections and norms)
ATTENTION_MARKER = ".self_attn."


class FinetuneError(MLAConvertError):
    pass


# --------------------------------------------------------------------------- history
@dataclass
class TrainerState:
    """What the loop has done so far; registered for checkpointing (plain types only)."""

    step: int = 0
    tokens: int = 0
    seconds: float = 0.0
    losses: list = field(default_factory=list)  # [step, tokens, loss, kd, ce, lr]
    evals: list = field(default_factory=list)  # [step, tokens, perplexity]
    teacher_perplexity: float | None = None
    resumed_from: list = field(default_factory=list)
    settings: dict = field(default_factory=dict)  # the data-defining settings, checked on resume

    def state_dict(self) -> dict:
        return {key: getattr(self, key) for key in self.__dataclass_fields__}

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


@dataclass
class FinetuneResult:
    output: Path | None  # None when the run stopped early (stop_after, a signal) or this is not the main process
    state: TrainerState
    finetuning: dict
    checkpoint: Path | None = None
    report: dict | None = None
    interrupted_by: int | None = None  # the signal that stopped the run (its checkpoint is `checkpoint`)
    main_process: bool = True  # False in the other processes of a multi-process run: they say nothing at the end


# --------------------------------------------------------------------------- helpers
class StopOnSignal:
    """While active, Ctrl-C / SIGTERM / SIGHUP ask the training loop to stop after the current step.

    The loop then saves a checkpoint and returns, so nothing is lost; an optimizer step is never cut in half
    (a parameter update stopped midway could not be resumed exactly).  A second signal stops at once.
    """

    SIGNALS = tuple(s for s in (getattr(signal, "SIGINT", None), getattr(signal, "SIGTERM", None),
                                getattr(signal, "SIGHUP", None)) if s is not None)

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def _handler(self, signum, frame):
        if self.signum is not None:  # the second one: the user means it
            raise KeyboardInterrupt
        self.signum = signum

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)


@contextlib.contextmanager
def quiet_shared_tensor_warning():
    """accelerate warns "Removed shared tensor ..." on every checkpoint of a model with tied embeddings;
    the tie is restored on load (the exact-resume test reloads such checkpoints), so the line is noise."""
    import logging

    logger = logging.getLogger("accelerate.utils.other")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def resolve_mixed_precision(name: str) -> str:
    if name != "auto":
        return name
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return "bf16"
    return "no"


def _torch_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    from ..units import parse_dtype

    return parse_dtype(name)


def load_converted_report(folder: Path) -> dict:
    path = folder / REPORT_FILE
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise FinetuneError(f"{path}: not valid JSON ({error.msg})") from error


def teacher_path(config: FinetuneConfig, report: dict) -> str:
    """--teacher, else the conversion report's source: its hub id, or its path relative to the converted folder."""
    if config.teacher:
        return config.teacher
    source = report.get("source") or {}
    if source.get("hub_id"):
        return str(source["hub_id"])
    recorded = source.get("name_or_path")
    if not recorded:
        raise FinetuneConfigError(f"{config.model}: {REPORT_FILE} names no source model; pass --teacher")
    return str((Path(config.model) / recorded).resolve())


def _local_identity(name: str | None) -> str | None:
    """A teacher or text as a resume compares it: a local file or folder by its absolute real path (the same one
    given from another working folder, or as `./t.txt` for `t.txt`), a hub id or datasets spec as given."""
    if name is None:
        return None
    return str(real_path(name)) if absolute_path(name).exists() else name


def load_teacher(name: str, dtype: torch.dtype, device: torch.device):
    from ..io.hf_loading import load_causal_lm
    from ..io.resolve import resolve_model_path

    try:
        path = resolve_model_path(name)
    except MLAConvertError as error:
        raise FinetuneError(f"teacher {name}: {error} (pass --teacher PATH)") from error
    teacher = load_causal_lm(path, dtype=dtype, pickle_flag=False)  # finetune has no --allow-pickle to offer
    teacher.to(device).eval()
    teacher.requires_grad_(False)
    return teacher, path


TEXT_CHECK_CHARS = 64 * 1024


def schedule_text(warmup_steps: int, max_steps: int, min_lr_ratio: float) -> str:
    """The learning-rate schedule as the steps see it (transformers' cosine with a floor, stepped after each step):
    step s trains at the rate of schedule position s - 1, so step 1 of a warmup trains at lr 0 and the floor is the
    rate after the last step."""
    decay = f"cosine decay to {min_lr_ratio:g} x lr, the rate after step {max_steps}"
    if warmup_steps == 0:
        return f"no warmup; {decay}"
    return f"linear warmup from 0 (step 1 trains at lr 0) to lr at step {warmup_steps + 1}; then {decay}"


def _same_source(a: str, b: str) -> bool:
    """Whether texts `a` and `b` overlap: the same file, or one inside the folder the other reads."""
    pa, pb = real_path(a), real_path(b)
    if pa.exists() and pb.exists():
        return pa == pb or pb.is_relative_to(pa) or pa.is_relative_to(pb)
    return a == b


def load_tokenizer(folder: Path):
    """The folder's tokenizer, or None when it has none (tiny test models, weights-only folders)."""
    from ..io.hf_loading import ModelLoadError
    from ..io.hf_loading import load_tokenizer as load

    try:
        return load(folder)
    except ModelLoadError:
        return None


# `train: auto` trains every parameter up to this many: on stories260K 8x it closed 85 % of the gap where the attention
# alone closed 77 % (same 300 steps, data and rate; BENCHMARKS.md, 'Quality levers'), but every trained parameter carries 16 bytes of fp32
# weight, gradient and AdamW moments (an 8B model: 128 GB), so larger models train their attention alone
AUTO_TRAIN_ALL_MAX_PARAMETERS = 2_000_000_000


def train_scope(model, train: str) -> str:
    """`train` with "auto" resolved for this model: "all" or "attention"."""
    if train != "auto":
        return train
    count = sum(parameter.numel() for parameter in model.parameters())
    return "all" if count <= AUTO_TRAIN_ALL_MAX_PARAMETERS else "attention"


def trainable_names(model, train: str) -> list[str]:
    names = [name for name, _ in model.named_parameters()]
    if train_scope(model, train) == "all":
        return names
    return [name for name in names if ATTENTION_MARKER in name]


def optimizer_groups(model, weight_decay: float) -> list[dict]:
    """AdamW parameter groups of the trainable parameters: matrices decay, vectors (norm gains, biases) do not; empty
    groups are left out (no group at all: nothing is trainable)."""
    decay, no_decay = [], []
    for parameter in model.parameters():
        if parameter.requires_grad:
            (decay if parameter.dim() >= 2 else no_decay).append(parameter)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


# the last steps' mean loss this many times the first steps': the run made the model worse, not better
LOSS_RISE_FACTOR = 1.5
# ... over windows of at least this many steps; shorter windows (a run under 6 steps) need a rise batch noise does not
# give: one micro-batch's loss is noisy (stories260K, 2 windows of 64 tokens a step: 0.119 at step 1, 0.210 at step 6,
# 0.077 between, while the held-out perplexity improved 6.60 -> 6.48), while a ruinous rate multiplies it (lr 1e4:
# 0.24 -> 9.4 in 3 steps)
LOSS_WINDOW_STEPS = 3
LOSS_RISE_FACTOR_SHORT = 3.0


def loss_rise(losses: list) -> str | None:
    """What to tell the user when the training loss rose (a learning rate far too high: the loss stays finite and the
    model is saved ruined, e.g. lr 1e4 on stories260K: loss 0.24 -> 9.4, perplexity 9057), else None.
    `losses`: rows [step, tokens, loss, ...]; the mean of the last tenth of the steps (at least 3, at most half) against
    the mean of the first.  Only a run without an evaluation before and after is judged by it (`run_warning`), so it
    says what was measured, not that the model is worse."""
    count = min(max(LOSS_WINDOW_STEPS, len(losses) // 10), len(losses) // 2)
    if count < 1:
        return None
    first = sum(row[2] for row in losses[:count]) / count
    last = sum(row[2] for row in losses[-count:]) / count
    factor = LOSS_RISE_FACTOR if count >= LOSS_WINDOW_STEPS else LOSS_RISE_FACTOR_SHORT
    if not last > factor * first:
        return None
    steps = ("step 1", "the last step") if count == 1 else (f"the first {count} steps", f"the last {count} steps")
    return (f"the training loss rose from {first:.4g} ({steps[0]}) to {last:.4g} ({steps[1]}); per-step losses are "
            "noisy, and no evaluation measured the model both before and after this run (--eval-data does, at the end "
            "of a complete run): if it is worse, lower the learning rate")


def perplexity_rise(before: float, after: float) -> str | None:
    """What to tell the user when the evaluation perplexity rose over the run, else None (it is measured on the same
    windows before and after: no noise to allow for)."""
    if not after > before:
        return None
    return (f"the evaluation perplexity rose from {before:.4f} (before training) to {after:.4f}: the run made the model "
            "worse on the evaluation text; lower the learning rate, or train on text closer to it")


def run_warning(losses: list, before: float | None, after: float | None) -> str | None:
    """The warning of a run that made its model worse, else None.  A perplexity measured before and after decides
    when there is one: the per-step training losses are single batches, and their noise once read as "the run made
    the model worse" while the held-out perplexity improved."""
    if before is not None and after is not None:
        return perplexity_rise(before, after)
    return loss_rise(losses)


def downsample(rows: list, count: int = 20) -> list:
    if len(rows) <= count:
        return list(rows)
    picks = sorted({round(i * (len(rows) - 1) / (count - 1)) for i in range(count)})
    return [rows[i] for i in picks]


# Settings that change which batches the run sees: a resume with different values cannot be exact.
DATA_SETTINGS = ("data", "text_column", "split", "max_chars", "seq_len", "seed", "teacher_samples", "sample_temperature",
                 "sample_top_p", "sample_batch_size", "micro_batch_size", "grad_accum", "max_steps", "train")
# ... and those that change what a step does with them.  The optimizer and the schedule come back from the
# checkpoint with the values they were made with, so a new --lr would be ignored while the report recorded it.
# The teacher is checked as it resolves (`TEACHER_SETTING`: --teacher, else the report's source; its dtype on this
# device).
TRAINING_SETTINGS = ("lr", "min_lr_ratio", "warmup_steps", "weight_decay", "adam_beta1", "adam_beta2", "max_grad_norm",
                     "kd_weight", "ce_weight", "temperature", "mixed_precision")
# ... and the windows the perplexities are measured on: the report compares the step-0 number with the last one
EVAL_SETTINGS = ("eval_data", "eval_context", "eval_windows")
RESUME_SETTINGS = DATA_SETTINGS + TRAINING_SETTINGS + EVAL_SETTINGS
TEACHER_SETTING = "teacher"
STUDENT_SETTING = "student_config_sha256"  # the converted model's config.json: a 2x checkpoint cannot resume an 8x run
# the settings that name a local file or folder (or a hub spec): recorded and compared as `_local_identity`
TEXT_SETTINGS = ("data", "eval_data")
PATH_SETTINGS = TEXT_SETTINGS + (TEACHER_SETTING,)
TEXT_NAMES = {"data": "training text", "eval_data": "evaluation text"}


def fingerprint_key(setting: str) -> str:
    """Where a checkpoint records the content of the local text `setting` names (`data_sha256`)."""
    return f"{setting}_sha256"


def _changed_setting(key: str, saved: dict, expected: dict) -> str:
    """One setting a checkpoint was made with otherwise, as the refusal names it."""
    if key == STUDENT_SETTING:
        return "the converted model (config.json)"
    text = next((name for name in TEXT_SETTINGS if key == fingerprint_key(name)), None)
    if text is not None:
        return (f"{TEXT_NAMES[text]} ({expected.get(text)} was edited since the checkpoint: its sha256 differs; "
                "restore the text it was made with)")
    return f"{key} ({saved[key]!r}, now {expected[key]!r})"


# --------------------------------------------------------------------------- the run
class Finetuner:
    """One fine-tuning run; `run()` trains (or resumes), evaluates and saves."""

    def __init__(self, config: FinetuneConfig, log=None, command: str | None = None):
        config.validate()
        self.config = config
        self._log = log
        self.command = command if command is not None else command_line()
        self.started = time.time()
        self._written_output: Path | None = None  # the output folder while its report is still being finished

    # ----------------------------------------------------------------- logging
    def log(self, text: str) -> None:
        if self.accelerator.is_main_process:
            if self._log is not None:
                self._log(text)
            elif getattr(self, "_bar", None) is not None and not self._bar.disable:
                self._bar.write(text, file=sys.stderr)  # above the progress bar, which is redrawn below it
            else:
                print(text, file=sys.stderr, flush=True)

    def _append_log(self, record: dict) -> None:
        if self.accelerator.is_main_process:
            with open(self.checkpoint_root / LOG_FILE, "a") as handle:
                handle.write(json.dumps(record) + "\n")

    # ----------------------------------------------------------------- setup
    def setup(self) -> None:
        from accelerate import Accelerator
        from accelerate.utils import set_seed

        from ..io.hf_loading import load_causal_lm, load_config

        config = self.config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if config.mixed_precision == "fp16" and not torch.cuda.is_available():  # accelerate keeps fp32 on the CPU
            raise FinetuneConfigError("mixed_precision fp16: acts only on a GPU (on the CPU it trains in fp32 and would "
                                      "be reported as fp16); use bf16 or no")
        self.accelerator = accelerator = Accelerator(mixed_precision=resolve_mixed_precision(config.mixed_precision))
        launched = int(os.environ.get("WORLD_SIZE", "1") or 1)
        if launched > 1 and accelerator.num_processes == 1:  # each worker would train the whole run alone
            raise FinetuneConfigError(
                f"the launcher started {launched} processes (WORLD_SIZE), but accelerate joined none of them into one "
                "run: each would train alone and all would write the same output. On the CPU, set ACCELERATE_USE_CPU=1 "
                "(accelerate runs several CPU processes only then); on GPUs, launch with `accelerate launch` and a "
                "config of num_processes > 1")
        set_seed(config.seed)
        self.device = accelerator.device
        self.converted = Path(config.model)
        found = model_folder_problems(self.converted, "--model")  # a FIFO among its files: named, not read
        if not found and not (self.converted / "config.json").is_file():
            found = [f"{self.converted}: not a model folder (no config.json)"]
        if found:
            raise FinetuneConfigError("\n".join(found))
        # the output is checked as `convert` checks its own (a file, a foreign folder or a link need --force too),
        # so that a run is not refused only at the save, after training
        self.output = prepare_output_path(config.output, config.overwrite, config.force)
        self.checkpoint_root = config.checkpoint_path
        if accelerator.is_main_process:
            try:  # (the config's checks name the usual reasons first: a file, a broken link, a file above it)
                problems = claim_root(self.checkpoint_root)
            except OSError as error:
                raise FinetuneConfigError(f"checkpoint_dir {self.checkpoint_root}: cannot be created "
                                          f"({error.strerror or error})") from error
            if problems:
                raise FinetuneConfigError("\n".join(problems))
            for name in remove_partial_checkpoints(self.checkpoint_root):
                self.log(f"removed {self.checkpoint_root / name}, left behind by a checkpoint that was not finished")
        accelerator.wait_for_everyone()
        self.report = load_converted_report(self.converted)
        converted_config = load_config(self.converted)
        if converted_config.model_type != "deepseek_v3":  # before the teacher is looked for (it said "pass --teacher")
            raise FinetuneConfigError(f"{self.converted}: a {converted_config.model_type} model; fine-tuning expects a "
                                      "folder written by mla-convert convert (DeepseekV3)")
        positions = converted_config.max_position_embeddings
        windows = ("seq_len", "eval_context") if config.eval_data else ("seq_len",)
        too_long = [f"{name} {getattr(config, name)}" for name in windows if getattr(config, name) > positions]
        if too_long:  # positions the model never trained on; sampling that much teacher text also takes hours
            raise FinetuneConfigError(f"{', '.join(too_long)}: longer than the model's max_position_embeddings ({positions})")
        # the texts, read as the run will read them (the first 64K characters), before any model loads or the teacher
        # samples: a missing file or a wrong column is named before both loads and minutes of sampling
        from ..data.textdata import load_text

        if config.data:
            load_text(config.data, text_column=config.text_column, split=config.split,
                      max_chars=min(config.max_chars or TEXT_CHECK_CHARS, TEXT_CHECK_CHARS))
        if config.eval_data:
            load_text(config.eval_data, max_chars=TEXT_CHECK_CHARS)
        # what a checkpoint of this run records, and the checkpoint to resume from (or the refusal to start over
        # earlier checkpoints): decided before any model loads or the teacher samples text
        self.teacher_name = teacher_path(config, self.report) if config.needs_teacher else None
        self._refuse_output_over_inputs()
        if self.teacher_name:
            self._refuse_an_incompatible_teacher()
        settings = {key: getattr(config, key) for key in RESUME_SETTINGS} | {
            key: _local_identity(getattr(config, key)) for key in TEXT_SETTINGS} | {
            fingerprint_key(key): text_fingerprint(getattr(config, key)) for key in TEXT_SETTINGS} | {
            TEACHER_SETTING: _local_identity(self.teacher_name),
            "teacher_dtype": str(_torch_dtype(config.teacher_dtype, self.device)) if self.teacher_name else None,
            "num_processes": accelerator.num_processes,
            STUDENT_SETTING: hashlib.sha256((self.converted / "config.json").read_bytes()).hexdigest()}
        self.resume_from = self._checkpoint_to_resume(settings)

        # --- student: stock DeepseekV3, latents unfolded to a trainable scale
        student = load_causal_lm(self.converted, dtype=torch.float32, pickle_flag=False)
        self.sites: list[LatentSite] = unfold_latent_scales(student, stored_latent_sites(self.report))
        self.scope = train_scope(student, config.train)  # what "auto" means for this model
        self.trained = trainable_names(student, self.scope)
        trained = set(self.trained)
        for name, parameter in student.named_parameters():
            parameter.requires_grad_(name in trained)
        if config.gradient_checkpointing:
            student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            student.config.use_cache = False
        self.tokenizer = load_tokenizer(self.converted)
        self._refuse_what_the_disk_cannot_hold(student, converted_config)

        # --- teacher
        self.teacher = None
        if config.needs_teacher:
            teacher_dtype = _torch_dtype(config.teacher_dtype, self.device)
            self.teacher, teacher_folder = load_teacher(self.teacher_name, teacher_dtype, self.device)
            if self.teacher.config.vocab_size != student.config.vocab_size:
                raise FinetuneError(f"teacher vocabulary ({self.teacher.config.vocab_size}) differs from the student's ({student.config.vocab_size})")
            if self.tokenizer is None:
                self.tokenizer = load_tokenizer(teacher_folder)
            if config.distills:
                self._refuse_a_teacher_that_is_the_student(student)

        # --- data
        if config.data and config.eval_data and _same_source(config.data, config.eval_data):
            self.log(f"warning: the training text {config.data} is also the evaluation text: the perplexity is not held out")
        self.windows, self.data_description, self.data_on_console = self._training_windows()
        self.global_micro = config.micro_batch_size * accelerator.num_processes
        self.cursor = WindowCursor(self.windows.shape[0], config.seed)
        self.eval_data = None
        if config.eval_data:
            if self.tokenizer is None:
                raise FinetuneError("evaluation needs a tokenizer; none found in the converted folder or the teacher")
            self.eval_data = EvalWindows.from_text(self.tokenizer, config.eval_data, config.eval_context, config.eval_windows,
                                                   label=self._label(config.eval_data))
            shortfall = self.eval_data.shortfall_note(config.eval_windows)
            if shortfall:
                self.log(f"note: {shortfall}")

        # --- optimizer, schedule
        groups = optimizer_groups(student, config.weight_decay)
        if not groups:
            raise FinetuneError(f"train={config.train!r} selects no parameters of this model")
        optimizer = torch.optim.AdamW(groups, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2))
        self.scheduler = get_cosine_with_min_lr_schedule_with_warmup(
            optimizer, config.warmup_steps, config.max_steps, min_lr_rate=config.min_lr_ratio)
        self.student, self.optimizer = accelerator.prepare(student, optimizer)
        self.state = TrainerState(settings=settings)

    def _refuse_an_incompatible_teacher(self) -> None:
        """The rule `eval --baseline` applies to two models, before either loads: the teacher must not be the model
        being trained (a loss of 0 from the first step), and both must read the same tokenizer's ids (a teacher with
        another tokenizer was distilled from anyway: its distribution over other words)."""
        from ..eval.checks import load_tokenizers, model_facts, tokenizer_problems

        problems: list[str] = []
        student = model_facts(self.converted, None, False, problems, flag="--model", pickle_flag=False)
        teacher = model_facts(self.teacher_name, None, False, problems, flag="--teacher", pickle_flag=False)
        if student is not None and teacher is not None:
            if real_path(student.path) == real_path(teacher.path):
                problems.append(f"--teacher {self.teacher_name}: is the model being trained; distilling a model into "
                                "itself trains on a loss of 0. Give the source model (leave --teacher out: the one "
                                f"{REPORT_FILE} names)")
            else:
                tokenizers = load_tokenizers([student, teacher])
                if tokenizers:  # (weights-only folders: the vocabulary sizes are compared once both load)
                    problems += tokenizer_problems(
                        [student, teacher], tokenizers, flags=("--model", "--teacher"),
                        consequence="the student learns the teacher's next-token distribution, id for id, so both "
                                    "must read the same tokenizer's ids")
        if problems:
            raise FinetuneConfigError("\n".join(problems))

    def _refuse_a_teacher_that_is_the_student(self, student) -> None:
        """A teacher folder that is a copy of the student computes the same distribution: refused like the student
        itself (one forward over a few ids; a source and its conversion differ far beyond the bound)."""
        vocab = student.config.vocab_size
        probe = torch.arange(min(16, vocab)).view(1, -1)  # (1, <= 16)
        with torch.no_grad():
            mine = torch.log_softmax(student(input_ids=probe, use_cache=False).logits.float(), dim=-1)
            theirs = torch.log_softmax(self.teacher(input_ids=probe.to(self.device), use_cache=False).logits.float().cpu(),
                                       dim=-1)
        if (mine - theirs).abs().max().item() <= SAME_MODEL_LOGPROB_TOLERANCE:
            raise FinetuneConfigError(f"--teacher {self.teacher_name}: computes the same next-token distribution as the "
                                      f"model being trained (within {SAME_MODEL_LOGPROB_TOLERANCE:g} in log-probability): "
                                      "a copy of it; distillation would train on a loss of 0. Give the source model")

    def _refuse_what_the_disk_cannot_hold(self, student, converted_config) -> None:
        """Checkpoints and the output, sized from the student, against the free space where they go: a full disk used
        to be found at the save, after the last step, with the trained weights lost."""
        if not self.accelerator.is_main_process:
            return
        config = self.config
        parameters = list(student.parameters())
        weights = sum(p.numel() * p.element_size() for p in parameters)  # fp32: what save_state writes
        adam = sum(2 * p.numel() * 4 for p in parameters if p.requires_grad)  # exp_avg + exp_avg_sq
        held = checkpoints_held(config.max_steps, config.checkpoint_every, config.keep_checkpoints)
        saved = sum(p.numel() for p in parameters) * resolve_save_dtype(config.save_dtype, converted_config).itemsize
        problems = disk_problems([
            (self.checkpoint_root, held * (weights + adam), f"{held} checkpoint(s)"),
            (self.output.parent, saved, "the output")])
        if problems:
            raise FinetuneConfigError("\n".join(problems))

    def _refuse_output_over_inputs(self) -> None:
        """With overwrite, the output is deleted at the save: it must not be (or contain) the model, the teacher or a
        text the run reads (`convert` refuses the same for its source; finetune replaced its own input)."""
        config = self.config
        if not (config.overwrite and self.output.exists()):
            return
        output = real_path(self.output)
        inputs = {"the converted model": self.converted, "the teacher": self.teacher_name, "the training text": config.data,
                  "the evaluation text": config.eval_data}
        for what, name in inputs.items():
            if not name or not Path(name).exists():  # (a hub id or dataset spec is not a local path)
                continue
            path = real_path(name)
            if within(path, output):
                raise FinetuneConfigError(f"{self.output}: is {what} ({name}) or contains it; --overwrite would delete it. "
                                          "Choose another output path")

    def _label(self, name: str) -> str:
        """A model, text or dataset as the output's report names it: a local path relative to the output folder
        (as `convert` records its source), anything else as given."""
        return source_label(str(name), self.output)[0]

    def _training_windows(self) -> tuple[torch.Tensor, str, str]:
        """The windows and what they are, twice: for the report (a local text named relative to the output folder)
        and for the console (the text as the user gave it)."""
        config, accelerator = self.config, self.accelerator
        if config.data:
            if self.tokenizer is None:
                raise FinetuneError("training on text needs a tokenizer; none found in the converted folder or the teacher")
            windows = text_windows(self.tokenizer, config.data, config.seq_len, config.text_column, config.split, config.max_chars)
            what = f"({windows.shape[0]} windows of {config.seq_len} tokens)"
            return windows, f"{self._label(config.data)} {what}", f"{config.data} {what}"
        path = self.checkpoint_root / SAMPLES_FILE
        description = {"teacher": self.teacher_name, "num": config.teacher_samples, "seq_len": config.seq_len,
                       "seed": config.seed, "temperature": config.sample_temperature, "top_p": config.sample_top_p,
                       "batch_size": config.sample_batch_size, "nucleus_candidates": NUCLEUS_CANDIDATES,
                       "kv_cache": "static"}

        def make() -> torch.Tensor:
            self.log(f"sampling {config.teacher_samples} x {config.seq_len} tokens from the teacher ...")
            began = time.time()
            ids = sample_from_model(self.teacher, config.teacher_samples, config.seq_len, config.seed,
                                    config.sample_temperature, config.sample_top_p, config.sample_batch_size, self.device,
                                    static_cache=True)
            self.log(f"sampled in {time.time() - began:.1f} s")
            return ids

        if accelerator.is_main_process:
            windows = cached_teacher_samples(path, make, description)
        accelerator.wait_for_everyone()
        if not accelerator.is_main_process:
            windows = cached_teacher_samples(path, make, description)
        text = (f"{config.teacher_samples} x {config.seq_len} tokens sampled from the teacher "
                f"(temperature {config.sample_temperature}, top-p {config.sample_top_p}, seed {config.seed})")
        return windows, text, text

    # ----------------------------------------------------------------- pieces
    def evaluate(self, model=None) -> float:
        accelerator = self.accelerator
        model = self.student if model is None else model
        context = accelerator.autocast() if model is self.teacher else contextlib.nullcontext()
        with context:
            return evaluate_perplexity_distributed(
                model, self.eval_data, self.device, accelerator.process_index, accelerator.num_processes,
                reduce=(lambda t: accelerator.reduce(t, "sum")) if accelerator.num_processes > 1 else None,
                batch_size=self.config.eval_batch_size)

    def _record_eval(self) -> None:
        if self.eval_data is None:
            return
        perplexity = self.evaluate()
        self.state.evals.append([self.state.step, self.state.tokens, perplexity])
        self.log(f"eval step {self.state.step}: perplexity {perplexity:.4f} ({self.state.tokens:,} tokens trained)")
        self._append_log({"step": self.state.step, "tokens": self.state.tokens, "eval_perplexity": perplexity})

    def training_states(self) -> dict:
        """What a checkpoint holds besides accelerate's tensors: plain JSON (nothing of it is unpickled on resume)."""
        return {"scheduler": self.scheduler.state_dict(), "cursor": self.cursor.state_dict(),
                "trainer": self.state.state_dict()}

    def save_checkpoint(self) -> Path:
        accelerator = self.accelerator
        self.state.seconds += time.time() - self.started
        self.started = time.time()
        with quiet_shared_tensor_warning():  # the settings in the marker are checked before a resume loads anything
            folder = write_checkpoint(accelerator, self.checkpoint_root, self.state.step, self.training_states(),
                                      {"step": self.state.step, "tokens": self.state.tokens,
                                       "settings": self.state.settings})
        if accelerator.is_main_process:
            for old in complete_checkpoints(self.checkpoint_root)[: -self.config.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)
        accelerator.wait_for_everyone()
        self.log(f"checkpoint {folder}")
        return folder

    def _checkpoint_to_resume(self, settings: dict) -> Path | None:
        """The checkpoint `resume` names (None: start fresh), checked against this run's settings from its marker;
        a fresh start over an earlier run's checkpoints is refused (they would be mixed with this run's, and
        `--resume auto` would later pick whichever is newest)."""
        config = self.config
        found = complete_checkpoints(self.checkpoint_root)
        if not config.resume:
            if found:
                raise FinetuneConfigError(f"{self.checkpoint_root}: holds checkpoints of an earlier run (latest "
                                          f"{found[-1].name}); continue it with --resume auto, or give another "
                                          "--checkpoint-dir")
            return None
        if config.resume == "auto":
            if not found:
                self.log(f"resume=auto: no checkpoint in {self.checkpoint_root}; starting fresh")
                return None
            folder, marker = self._latest_sound_checkpoint(found)
        else:
            folder = Path(config.resume)
            if not folder.is_dir():
                raise FinetuneConfigError(f"resume {folder}: no such checkpoint folder")
            if not (folder / COMPLETE_MARKER).is_file():
                raise FinetuneConfigError(f"{folder}: not a complete checkpoint (no {COMPLETE_MARKER})")
            marker = verify_checkpoint(folder)
        self._check_resume_settings(folder, marker.get("settings") or {}, settings)  # before loading: shapes may differ
        step = marker.get("step")
        if config.stop_after is not None and isinstance(step, int) and config.stop_after <= step < config.max_steps:
            # (the loop checks stop_after after each step: it trained one more step, and checkpointed it)
            raise FinetuneConfigError(f"stop_after {config.stop_after}: {folder} is at step {step} already; give a "
                                      "later stop_after, or none to train to max_steps")
        return folder

    def _latest_sound_checkpoint(self, found: list[Path]) -> tuple[Path, dict]:
        """`--resume auto`: the newest checkpoint that verifies; a damaged newer one is named and passed over (the
        run then trains its steps again), and none that verifies stops the run."""
        problems = []
        for folder in reversed(found):
            try:
                marker = verify_checkpoint(folder)
            except CheckpointError as error:
                problems.append(str(error))
                continue
            for problem in problems:
                self.log(f"warning: {problem}; resuming from the earlier {folder.name} instead")
            return folder, marker
        raise CheckpointError("no checkpoint in {} can be resumed:\n{}".format(self.checkpoint_root, "\n".join(problems)))

    def maybe_resume(self) -> None:
        folder = self.resume_from
        if folder is None:
            if self.accelerator.is_main_process:  # a fresh run's log starts empty
                (self.checkpoint_root / LOG_FILE).unlink(missing_ok=True)
            return
        expected = dict(self.state.settings)
        # accelerate's tensors (weights_only=True; the files were verified as plain data), then the JSON states
        self.accelerator.load_state(str(folder), load_kwargs={"weights_only": True})
        states = read_trainer_states(folder)
        self.scheduler.load_state_dict(states["scheduler"])
        self.cursor.load_state_dict(states["cursor"])
        self.state.load_state_dict(states["trainer"])
        self._check_resume_settings(folder, self.state.settings, expected)
        self.state.settings = expected
        self.state.resumed_from.append(str(folder))
        self.started = time.time()
        self._truncate_log(self.state.step)
        self.log(f"resumed from {folder} at step {self.state.step}")

    @staticmethod
    def _check_resume_settings(folder: Path, saved: dict, expected: dict) -> None:
        """Refuse a checkpoint made with other settings (those it does not record, from older versions, pass).  Paths
        are compared as the files they name: older checkpoints recorded them as typed, relative to the working folder."""
        saved = {key: _local_identity(value) if key in PATH_SETTINGS and isinstance(value, str) else value
                 for key, value in saved.items()}
        changed = sorted(key for key in expected if key in saved and saved[key] != expected[key])
        changed = [key for key in changed  # another text: that it has other content is no news
                   if not any(key == fingerprint_key(text) and text in changed for text in TEXT_SETTINGS)]
        if changed:
            names = [_changed_setting(key, saved, expected) for key in changed]
            raise FinetuneConfigError(f"{folder}: the checkpoint was made with a different {', '.join(names)}; "
                                      "a resume continues the same run, so give the same settings (or start a new "
                                      "run in another checkpoint_dir)")

    def _truncate_log(self, step: int) -> None:
        """Drop the log records of steps after `step`: they are trained again now, and logged again."""
        path = self.checkpoint_root / LOG_FILE
        if not self.accelerator.is_main_process or not path.is_file():
            return
        kept = []
        for line in path.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:  # a line a crash cut short: the steps it logged are trained and logged again
                continue
            if isinstance(record, dict) and record.get("step", 0) <= step:
                kept.append(line)
        path.write_text("".join(line + "\n" for line in kept))

    def train_step(self) -> tuple[float, float, float]:
        """One optimizer step over grad_accum micro-batches; returns mean (loss, kd, ce) across processes."""
        config, accelerator = self.config, self.accelerator
        totals = torch.zeros(3, dtype=torch.float64)
        for micro in range(config.grad_accum):
            indices = process_slice(self.cursor.draw(self.global_micro), accelerator.process_index, accelerator.num_processes)
            batch = self.windows[indices].to(self.device)  # (micro_batch, seq_len)
            sync = micro == config.grad_accum - 1
            with contextlib.nullcontext() if sync else accelerator.no_sync(self.student):
                teacher_logits = None
                if config.distills:
                    with torch.no_grad(), accelerator.autocast():
                        teacher_logits = self.teacher(input_ids=batch, use_cache=False).logits
                student_logits = self.student(input_ids=batch, use_cache=False).logits
                parts = distillation_loss(student_logits, teacher_logits, batch, config.kd_weight, config.ce_weight,
                                          config.temperature)
                accelerator.backward(parts.total / config.grad_accum)
            totals += torch.tensor([parts.total.item(), parts.kd, parts.ce], dtype=torch.float64)
            del teacher_logits, student_logits, parts
        if config.max_grad_norm > 0:
            accelerator.clip_grad_norm_([p for p in self.student.parameters() if p.requires_grad], config.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        totals /= config.grad_accum
        if accelerator.num_processes > 1:
            totals = accelerator.reduce(totals.to(self.device), "mean").cpu()
        return tuple(totals.tolist())

    def _agreed_stop(self, stop: StopOnSignal) -> int | None:
        """The signal every process stops on after this step (None: go on), the same on every rank.

        Why: a signal reaches the processes at different moments (one rank only, when a scheduler or a user signals
        one worker; torchrun forwards Ctrl-C to each).  A rank that stopped alone entered the checkpoint's barrier
        while the others ran the next step's collectives: the run hung with an incomplete checkpoint (2 of 10
        Ctrl-Cs to a 2-process CPU run; every time one worker was signalled).  Any rank's signal stops them all.
        """
        if self.accelerator.num_processes == 1:
            return stop.signum
        mine = torch.tensor([stop.signum or 0], dtype=torch.int64, device=self.device)
        agreed = int(self.accelerator.gather(mine).max().item())  # (processes,) -> the one signal, 0: none
        return agreed or None

    # ----------------------------------------------------------------- main
    def run(self) -> FinetuneResult:
        created = not self.config.checkpoint_path.exists()
        try:
            self.setup()
            self.maybe_resume()
        except BaseException:
            if created:  # a refused run leaves no empty checkpoint folder behind (teacher samples already drawn stay)
                with contextlib.suppress(OSError):
                    root = self.config.checkpoint_path
                    if [path.name for path in root.iterdir()] == [OWNER_MARKER]:
                        (root / OWNER_MARKER).unlink()
                    root.rmdir()
            raise
        config, state, accelerator = self.config, self.state, self.accelerator
        scope = self.scope if config.train == self.scope else f"{config.train}: {self.scope}"
        self.log(f"training {len(self.trained)} tensors ({scope}) on {self.data_on_console}; "
                 f"{accelerator.num_processes} process(es), mixed precision {accelerator.mixed_precision}")
        if note := fp16_save_note(config.save_dtype, self.converted):
            self.log(note)
        if state.step == 0 and not state.evals and self.eval_data is not None:
            if config.eval_teacher and self.teacher is not None:
                state.teacher_perplexity = self.evaluate(self.teacher)
                self.log(f"teacher perplexity {state.teacher_perplexity:.4f}")
            self._record_eval()
        windows_per_step = self.global_micro * config.grad_accum
        if windows_per_step > self.windows.shape[0]:
            self.log(f"note: each optimizer step takes {windows_per_step} windows and the data holds "
                     f"{self.windows.shape[0]}: windows repeat within a step")
        tokens_per_step = windows_per_step * config.seq_len
        self.student.train()
        interval_start, interval_tokens = time.time(), 0
        with StopOnSignal() as stop, self._progress_bar() as bar:
            result = self._train_loop(stop, bar, tokens_per_step, interval_start, interval_tokens)
        if result is not None:
            return result
        return self._evaluate_and_save()

    def _evaluate_and_save(self) -> FinetuneResult:
        """The final evaluation and the save.  Interrupted (Ctrl-C, kill), the trained state is kept as a checkpoint
        at the last step, so `--resume auto` goes straight back to this point instead of losing the run."""
        from ..errors import TerminatedBySignal

        def terminate(signum, frame):
            raise TerminatedBySignal(signum)

        previous = {}
        if threading.current_thread() is threading.main_thread():
            previous = {signum: signal.signal(signum, terminate) for signum in StopOnSignal.SIGNALS
                        if signum != signal.SIGINT}  # SIGINT already raises KeyboardInterrupt
        try:
            try:
                if not (self.state.evals and self.state.evals[-1][0] == self.state.step):  # not when resumed after it
                    self._record_eval()
                return self.finish()
            except KeyboardInterrupt as interrupt:
                with signals_deferred():
                    folder = self.save_checkpoint()
                    # an output already in place but not finished (its report lacks the save check) would block the
                    # resume, which writes it again from the checkpoint
                    if self._written_output is not None and self.accelerator.is_main_process:
                        shutil.rmtree(self._written_output, ignore_errors=True)
                return FinetuneResult(None, self.state, self.finetuning_section(), checkpoint=folder,
                                      interrupted_by=getattr(interrupt, "signum", signal.SIGINT))
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    @contextlib.contextmanager
    def _progress_bar(self):
        """A bar with an ETA over the optimizer steps (terminal, main process); log lines print above it."""
        from tqdm.auto import tqdm

        bar = tqdm(total=self.config.max_steps, initial=self.state.step, unit="step", desc="fine-tuning",
                   disable=None if self.accelerator.is_main_process else True, dynamic_ncols=True)
        self._bar = bar
        try:
            yield bar
        finally:
            self._bar = None
            bar.close()

    def _train_loop(self, stop: StopOnSignal, bar, tokens_per_step: int, interval_start: float,
                    interval_tokens: int) -> FinetuneResult | None:
        """The optimizer steps; returns a result when the run stops early (stop_after or a signal), else None."""
        config, state = self.config, self.state
        while state.step < config.max_steps:
            lr = self.scheduler.get_last_lr()[0]
            loss, kd, ce = self.train_step()
            if not math.isfinite(loss):
                raise FinetuneError(f"step {state.step + 1}: loss is {loss}; lower the learning rate")
            state.step += 1
            state.tokens += tokens_per_step
            interval_tokens += tokens_per_step
            state.losses.append([state.step, state.tokens, loss, kd, ce, lr])
            if state.step % config.log_every == 0 or state.step == config.max_steps:
                rate = interval_tokens / max(time.time() - interval_start, 1e-9)
                self.log(f"step {state.step}/{config.max_steps} loss {loss:.4f} (kd {kd:.4f}, ce {ce:.4f}) lr {lr:.3g} "
                         f"{rate:,.0f} tok/s")
                self._append_log({"step": state.step, "tokens": state.tokens, "loss": loss, "kd": kd, "ce": ce, "lr": lr})
                interval_start, interval_tokens = time.time(), 0
            if config.eval_every and state.step % config.eval_every == 0 and state.step < config.max_steps:
                self._record_eval()
                self.student.train()
            saved = None
            if config.checkpoint_every and state.step % config.checkpoint_every == 0 and state.step < config.max_steps:
                saved = self.save_checkpoint()
            bar.update(1)
            # a stop on a checkpoint step keeps that checkpoint (writing it twice would rewrite a complete one)
            signum = self._agreed_stop(stop)
            if signum is not None and state.step >= config.max_steps:  # (it was ignored without a word)
                self.log(f"note: {signal.Signals(signum).name} came during the last step: the run finishes (final "
                         "evaluation and save) instead of stopping with a checkpoint")
            if signum is not None and state.step < config.max_steps:
                folder = saved or self.save_checkpoint()
                return FinetuneResult(None, state, self.finetuning_section(), checkpoint=folder, interrupted_by=signum)
            if config.stop_after is not None and state.step >= config.stop_after and state.step < config.max_steps:
                folder = saved or self.save_checkpoint()
                return FinetuneResult(None, state, self.finetuning_section(), checkpoint=folder)
        return None

    # ----------------------------------------------------------------- the end
    def finetuning_section(self, save_check: dict | None = None) -> dict:
        config, state = self.config, self.state
        seconds = state.seconds + (time.time() - self.started)
        losses = state.losses
        before, after = self._perplexities()
        section = {
            "recipe": "recipes/finetune_mla.py",
            "command": self.command or None,
            "teacher": self._label(self.teacher_name) if self.teacher_name else None,
            "data": self.data_description,
            # the card's `datasets:` lists what a model was trained on: the evaluation text is not one of them
            "datasets": [name for name in (hub_dataset(config.data),) if name],
            "trained": self.scope,
            "trained_tensors": len(self.trained),
            "steps": state.step,
            "tokens": state.tokens,
            "seq_len": config.seq_len,
            "batch_windows_per_step": self.global_micro * config.grad_accum,
            "lr": config.lr,
            "schedule": schedule_text(config.warmup_steps, config.max_steps, config.min_lr_ratio),
            "lr_last_step": losses[-1][5] if losses else None,  # the cosine reaches its floor only after the last step
            "optimizer": f"AdamW betas ({config.adam_beta1}, {config.adam_beta2}), weight decay {config.weight_decay}, clip {config.max_grad_norm}",
            "loss": f"{config.kd_weight:g} x KL(teacher || student) at T={config.temperature:g} + {config.ce_weight:g} x next-token CE",
            "loss_first": losses[0][2] if losses else None,
            "loss_last": losses[-1][2] if losses else None,
            "loss_min": min(row[2] for row in losses) if losses else None,
            "loss_curve": [[row[0], round(row[2], 5)] for row in downsample(losses)],
            "eval_data": self.eval_data.description if self.eval_data is not None else None,
            # the console warned at the start; the report and the card must say it too
            "eval_held_out": (None if self.eval_data is None or not config.data
                              else not _same_source(config.data, config.eval_data)),
            "perplexity_teacher": state.teacher_perplexity,
            "perplexity_before": before,
            "perplexity_after": after,
            "perplexity_curve": [[row[1], round(row[2], 5)] for row in state.evals],
            "mixed_precision": self.accelerator.mixed_precision,
            "processes": self.accelerator.num_processes,
            # what accelerate ran (an FSDP config on the CPU runs as MULTI_CPU, i.e. DDP: the report says so)
            "distributed": str(self.accelerator.distributed_type.value),
            "device": str(self.device),
            "seconds": round(seconds, 1),
            "resumed": len(state.resumed_from),
        }
        if save_check is not None:
            section.update(save_check)
        worse = run_warning(losses, before, after)
        if worse:
            section["warning"] = worse
        return section

    def _perplexities(self) -> tuple[float | None, float | None]:
        """The evaluation perplexity before training and after its last step (None: not measured)."""
        state = self.state
        before = state.evals[0][2] if state.evals and state.evals[0][0] == 0 else None
        after = state.evals[-1][2] if state.evals and state.evals[-1][0] == state.step and state.step > 0 else None
        return before, after

    def finish(self) -> FinetuneResult:
        accelerator, config = self.accelerator, self.config
        worse = run_warning(self.state.losses, *self._perplexities())  # (the report and the card say the same)
        if worse:
            self.log(f"warning: {worse}")
        probe = self._probe_ids()
        unwrapped = accelerator.unwrap_model(self.student)
        unwrapped.eval()
        with torch.no_grad():
            reference = self.student(input_ids=probe.to(self.device), use_cache=False).logits.float().cpu()  # (1, P, vocab)
        state_dict = accelerator.get_state_dict(self.student)
        path, report = None, None
        if accelerator.is_main_process:
            try:
                path = save_finetuned(
                    {k: v.detach().cpu() for k, v in state_dict.items()}, self.sites, self.converted, self.output,
                    self.report, self.finetuning_section(), config.save_dtype, config.max_shard_size, config.overwrite,
                    config.force)
            except WRITE_ERRORS as error:  # (a full disk: safetensors reports it in its own error type)
                raise FinetuneError(self._save_failure(error)) from None
            self._written_output = path
            save_check = self._verify_saved(path, probe, reference) if config.verify_save else None
            report = json.loads((path / REPORT_FILE).read_text())
            curve = {key: report["finetuning"][key] for key in ("curve_png", "saved_dtype")
                     if key in report.get("finetuning", {})}
            report["finetuning"] = self.finetuning_section(save_check) | curve
            write_report(path, report)
            self._written_output = None  # finished: an interrupt from here on changes nothing
            self.log(f"saved {path}")
        accelerator.wait_for_everyone()
        return FinetuneResult(path, self.state, report["finetuning"] if report else self.finetuning_section(), report=report)

    def _save_failure(self, error: BaseException) -> str:
        """The message for an output that could not be written (a full disk): the trained state is kept as a
        checkpoint where one can be written, so freeing space and resuming loses nothing."""
        reason = getattr(error, "strerror", None) or str(error).splitlines()[0]
        kept = "no checkpoint could be kept"
        if self.accelerator.num_processes == 1:  # (several processes would have to write it together)
            try:
                kept = f"the trained state is kept as the checkpoint {self.save_checkpoint()}"
            except CheckpointError as failure:
                kept = f"no checkpoint could be kept either ({failure})"
        return (f"the fine-tuned model could not be written to {self.output} ({reason}); {kept}; free space and run "
                "the same command with --resume auto")

    def _probe_ids(self) -> torch.Tensor:
        """A short fixed input for the saved-vs-trained logit check: (1, <= 64) token ids."""
        source = self.eval_data.ids if self.eval_data is not None else self.windows[0]
        return source[: min(64, source.numel())].view(1, -1)

    def _verify_saved(self, path: Path, probe: torch.Tensor, reference: torch.Tensor) -> dict:
        """Reload the saved folder with stock transformers and compare its logits with the trained model's."""
        from ..io.hf_loading import load_causal_lm

        saved = load_causal_lm(path, pickle_flag=False).to(self.device).eval()
        with torch.no_grad():
            logits = saved(input_ids=probe.to(self.device), use_cache=False).logits.float().cpu()
        saved_dtype, trained_dtype = (dtype_name(next(model.parameters()).dtype) for model in (saved, self.student))
        del saved
        difference = (logits - reference).abs().max().item()
        scale = reference.abs().max().item()
        # a bf16 save of fp32 training differs by its rounding (SmolLM2 4x: ~1 in logits of ~30), which is not a defect
        rounding = f"; saved in {saved_dtype}, trained in {trained_dtype}" if saved_dtype != trained_dtype else ""
        self.log(f"saved model vs trained model: max |logit difference| {difference:.3g} (max |logit| {scale:.3g}"
                 f"{rounding})")
        if not scale > 0:  # (the comparison then proves nothing)
            self.log("warning: every logit of the trained model is zero on the check's input: training destroyed it")
        return {"save_check_max_logit_difference": difference, "save_check_max_logit": scale}


def run_finetune(config: FinetuneConfig, log=None, command: str | None = None) -> FinetuneResult:
    """Fine-tune `config.model` and save it to `config.output` (see `Finetuner`).

    `log` receives progress lines (default: stderr); `command` is recorded in the report (default: argv).
    """
    finetuner = Finetuner(config, log, command)
    result = finetuner.run()
    result.main_process = finetuner.accelerator.is_main_process
    return result
