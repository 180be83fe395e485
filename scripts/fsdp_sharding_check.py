"""The fine-tuning student sharded over several processes with torch's FSDP2: does sharded training agree with plain training?

Why this exists: the recipe's multi-GPU path is accelerate's FSDP2
(`recipes/configs/accelerate/fsdp_{4,8}gpu.yaml`), but accelerate turns an FSDP config into plain multi-process
(DDP) training on a CPU, and this project has had no machine with several GPUs, so no run of the recipe has split a
parameter across processes. This script does that part with torch itself (`torch.distributed.fsdp.fully_shard`, any
backend: gloo on CPUs, nccl on GPUs), on the recipe's own pieces: the converted folder loaded as the trainer loads
it, latents unfolded (`finetune.latent`), the trainer's parameter selection (`train`: attention or all), its loss
(`finetune.loss.distillation_loss` against the source model), AdamW with the trainer's parameter groups and gradient
clipping, its save (`finetune.saving.save_finetuned`, from the gathered full state dict, taken as accelerate's
`get_state_dict` takes it under FSDP2), and its evaluation (`finetune.evaluate.evaluate_perplexity_distributed`:
windows spread over the processes). The units are the ones the shipped FSDP2 config asks accelerate for: one per
`DeepseekV3DecoderLayer` (wrapped for activation checkpointing, as the config asks), one for the embedding, final
norm and (tied) head, and the root. It does not run accelerate itself (its `prepare`, `save_state`), which
`scripts/device_finetune_check.py` covers on one GPU.  `--mixed-precision bf16` shards with the FSDP2 policy
accelerate sets for the config's `mixed_precision: bf16` (bf16 parameter copies, gradients reduced in bf16); such a
run is judged by what it learns against the fp32 reference (see TOLERANCES), since bf16 rounding alone moves the
weights apart.

Each step takes the same global batch of text windows; each process trains on its contiguous slice of it (the
trainer's `process_slice`), so a run on N processes must reproduce a run on one, up to the order of float sums.
`--resume-at K` also writes a sharded checkpoint (torch.distributed.checkpoint: weights and optimizer state) after K
steps, builds a fresh sharded student from the untrained folder, loads the checkpoint into it and trains on: the
final weights must not care.

    python scripts/fsdp_sharding_check.py --model MLA --teacher SOURCE --text FILE --out DIR --no-shard
    torchrun --standalone --nproc_per_node 2 scripts/fsdp_sharding_check.py --model MLA --teacher SOURCE \\
        --text FILE --out DIR2 --resume-at 4
    python scripts/fsdp_sharding_check.py --compare DIR DIR2
    torchrun --standalone --nproc_per_node 2 scripts/fsdp_sharding_check.py ... --out DIR3 --mixed-precision bf16
    python scripts/fsdp_sharding_check.py --compare DIR DIR3

Writes DIR/result.json (losses per step, units, parameters, the saved folder's logit check) and the trained folder
DIR/model; `--compare` judges two such folders (exit status 1 when they differ beyond what the sharded run's
precision allows).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a file (torchrun) from any folder
    sys.path.insert(0, str(REPO))

from mla_convert.finetune.config import FinetuneConfig  # noqa: E402
from mla_convert.finetune.data import process_slice, text_windows  # noqa: E402
from mla_convert.finetune.evaluate import EvalWindows, evaluate_perplexity_distributed  # noqa: E402
from mla_convert.finetune.latent import stored_latent_sites, unfold_latent_scales  # noqa: E402
from mla_convert.finetune.loss import distillation_loss  # noqa: E402
from mla_convert.finetune.saving import save_finetuned  # noqa: E402
from mla_convert.finetune.trainer import (  # noqa: E402
    load_converted_report,
    load_tokenizer,
    optimizer_groups,
    trainable_names,
)
from mla_convert.io.hf_loading import load_causal_lm  # noqa: E402

RESULT_FILE = "result.json"
RECIPE = FinetuneConfig()  # the recipe's defaults: AdamW betas and weight decay, clipping, the loss's weights


@dataclass(frozen=True)
class Tolerances:
    """What `--compare` requires of a sharded run against the one-process fp32 reference."""

    loss: float | None  # per step, relative; None: not compared
    weight_agreement: float | None  # the largest weight gap as a fraction of the largest movement; None: not compared
    perplexity: float  # relative, after training
    logits: float  # the saved folder reloaded against the trained model, as a fraction of the largest logit
    must_learn: bool  # the sharded run's own perplexity must fall by more than `perplexity` (what shows it trained)


# fp32: float sums in another order (gradients reduce-scattered in halves, clipping norms summed per shard) change the
# gradients by rounding, and Adam's normalised steps lift that to weight differences that grow with the learning
# rate, so the weights are judged against how far training moved them.  Measured (2 processes against 1, resumed
# halfway; relative to each tensor's largest entry), defaults (8 steps, lr 3e-4): stories260K 2x 2.9e-7 apart, moved
# 6.8e-3; SmolLM2-135M 2x 4.6e-6 apart, moved 1.4e-2.  Divergent training amplifies the rounding (SmolLM2 at lr 3e-3,
# 3 steps: loss 0.3 -> 10, runs 1.9e-3 apart), so judge sharding at a learning rate that trains.
# bf16 (FSDP2 computing with bf16 parameter copies): bf16 rounds gradients at ~4e-3, so Adam's first, sign-like
# steps differ wherever a gradient is near zero, and the runs drift apart step by step whatever the sharding
# (SmolLM2 2x, defaults: per-step losses up to 16 % from the fp32 run's; a 1-process bf16 run ends at perplexity 58.2
# where the 2-process one ends at 53.6 and fp32 at 52.3).  So bf16 runs are judged as scripts/device_finetune_check.py
# judges accelerate's bf16 run against fp32: they must learn, and reach the fp32 run's held-out perplexity within 3 %;
# the fp32 reload of the trained weights may differ by bf16's rounding of the logits.  Measured against the fp32
# unsharded run, 2 processes: stories260K 2x 6.818 -> 6.355 (fp32: 6.833 -> 6.383); SmolLM2 2x 65.52 -> 53.64
# (fp32: 65.10 -> 52.31, 2.5 % below); reload 0.39 / 1.94 off the largest logits 21 / 34.
TOLERANCES = {
    "no": Tolerances(loss=1e-5, weight_agreement=1e-2, perplexity=1e-4, logits=1e-4, must_learn=False),
    "bf16": Tolerances(loss=None, weight_agreement=None, perplexity=0.03, logits=0.1, must_learn=True),
}
MIN_MOVEMENT = 1e-4  # a run that moved its weights less than this shows nothing
EVAL_WINDOWS = 3  # odd, so that on 2 processes one runs the evaluation's padding forward


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="converted MLA folder (mla-convert convert)")
    parser.add_argument("--teacher", type=Path, help="the source model folder (distillation target)")
    parser.add_argument("--text", type=Path, help="plain-text file the training windows are cut from")
    parser.add_argument("--out", type=Path, help="folder for result.json and the trained model (must not exist)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--windows-per-step", type=int, default=4, help="global batch (a multiple of the processes)")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--train", choices=("attention", "all"), default="attention")
    parser.add_argument("--resume-at", type=int, default=0, help="checkpoint after this many steps and resume (0: no)")
    parser.add_argument("--no-shard", action="store_true", help="plain model, one process: the fp32 reference run")
    parser.add_argument("--mixed-precision", choices=("no", "bf16"), default="no",
                        help="bf16: FSDP2 computes with bf16 copies of the parameters and reduces gradients in bf16, as "
                             "accelerate's FSDP2 does for mixed_precision bf16 (its reference: the fp32 --no-shard run)")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("REFERENCE", "SHARDED"),
                        help="judge two --out folders instead of training")
    args = parser.parse_args(argv)
    if args.compare is None and None in (args.model, args.teacher, args.text, args.out):
        parser.error("--model, --teacher, --text and --out are required unless --compare is given")
    return args


def build_student(folder: Path, train: str, device: torch.device):
    """The student as the trainer builds it: fp32, latents unfolded, only the `train` parameters trainable."""
    student = load_causal_lm(folder, dtype=torch.float32, pickle_flag=False).to(device)
    sites = unfold_latent_scales(student, stored_latent_sites(load_converted_report(folder)))
    trained = set(trainable_names(student, train))
    for name, parameter in student.named_parameters():
        parameter.requires_grad_(name in trained)
    return student, sites


def shard(student, mesh, mixed_precision: str = "no") -> list[str]:
    """FSDP2 units as the shipped accelerate config asks for them; returns their names, outermost last.

    Each decoder layer is first wrapped for activation checkpointing (the config's `fsdp_activation_checkpointing`),
    which puts `_checkpoint_wrapped_module` into its parameters' names: the gathered state dict must still carry the
    folder's names, or the save's latent folding and its name check would miss them.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    policy = MixedPrecisionPolicy()  # fp32: parameters as stored, gradients reduced in fp32
    if mixed_precision == "bf16":  # accelerate 1.16's FSDP2 policy for mixed_precision bf16: both dtypes bf16
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    layers = student.model.layers
    units = []
    for index, layer in enumerate(layers):
        if not isinstance(layer, DeepseekV3DecoderLayer):
            raise SystemExit(f"model.layers.{index} is a {type(layer).__name__}, not a DeepseekV3DecoderLayer")
        layers[index] = checkpoint_wrapper(layer, preserve_rng_state=False)
        fully_shard(layers[index], mesh=mesh, mp_policy=policy)
        units.append(f"model.layers.{index} (activation checkpointing)")
    # the embedding, the final norm and the head in one unit kept gathered between forward and backward (a tied head
    # shares the embedding's parameter, which two units must not both hold)
    ends = [student.get_input_embeddings(), student.model.norm, student.get_output_embeddings()]
    fully_shard(list(dict.fromkeys(ends)), mesh=mesh, reshard_after_forward=False, mp_policy=policy)
    units.append("embedding, norm, head")
    fully_shard(student, mesh=mesh, mp_policy=policy)
    units.append("root")
    return units


def make_optimizer(student, lr: float) -> torch.optim.Optimizer:
    """AdamW with the trainer's parameter groups, betas and weight decay (the recipe's defaults)."""
    return torch.optim.AdamW(optimizer_groups(student, RECIPE.weight_decay), lr=lr,
                             betas=(RECIPE.adam_beta1, RECIPE.adam_beta2))


def checkpoint(student, optimizer, folder: Path, load: bool) -> None:
    """Save or load the sharded weights and optimizer state (each process writes / reads its own shards)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(student, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    if not load:
        dcp.save(state, checkpoint_id=str(folder))
        return
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(student, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def train(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.no_shard and world > 1:
        raise SystemExit("--no-shard is the one-process reference: run it without torchrun")
    if args.no_shard and args.mixed_precision != "no":
        raise SystemExit("--mixed-precision bf16 is FSDP2's parameter casting and needs sharding (torchrun); its "
                         "reference is the fp32 --no-shard run")
    if args.windows_per_step % world:
        raise SystemExit(f"--windows-per-step {args.windows_per_step} is not a multiple of the {world} processes")
    if not 0 <= args.resume_at < args.steps:
        raise SystemExit(f"--resume-at {args.resume_at}: must be below --steps {args.steps}")
    if args.out.exists():  # (checked by every process before they meet; process 0 creates it after)
        raise SystemExit(f"--out {args.out}: exists; name a new folder")
    cuda = torch.cuda.is_available()
    rank = 0
    mesh = None
    if not args.no_shard:
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("nccl" if cuda else "gloo")
        rank = dist.get_rank()
        mesh = init_device_mesh("cuda" if cuda else "cpu", (world,))
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=False)
    torch.manual_seed(0)

    tokenizer = load_tokenizer(args.model)
    if tokenizer is None:
        raise SystemExit(f"{args.model}: no tokenizer")
    # the first windows of the text, tokenised as the trainer tokenises its `data`
    windows = text_windows(tokenizer, str(args.text), args.seq_len)[: args.steps * args.windows_per_step]
    if windows.shape[0] < args.steps * args.windows_per_step:
        raise SystemExit(f"{args.text}: {windows.shape[0]} windows of {args.seq_len} tokens, the run needs "
                         f"{args.steps * args.windows_per_step}")
    teacher = load_causal_lm(args.teacher, dtype=torch.float32, pickle_flag=False).to(device).eval()

    def fresh():
        student, sites = build_student(args.model, args.train, device)
        units = shard(student, mesh, args.mixed_precision) if mesh is not None else []
        return student, sites, units, make_optimizer(student, args.lr)

    # the trainer's evaluation, windows spread over the processes: with an odd count one process runs a padding
    # forward, without which the others would wait forever in the shards' all-gather
    evaluation = EvalWindows.from_text(tokenizer, str(args.text), args.seq_len, EVAL_WINDOWS)

    def reduce(total: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(total)
        return total

    def perplexity(model) -> float:
        return evaluate_perplexity_distributed(model, evaluation, device, rank, world, reduce if mesh is not None else None)

    student, sites, units, optimizer = fresh()
    perplexity_before = perplexity(student)
    losses = []
    for step in range(args.steps):
        if args.resume_at and step == args.resume_at:  # stop, write the shards, start over from the folder, load
            folder = args.out / "checkpoint"
            checkpoint(student, optimizer, folder, load=False)
            del student, optimizer
            student, sites, units, optimizer = fresh()
            checkpoint(student, optimizer, folder, load=True)
        draw = torch.arange(step * args.windows_per_step, (step + 1) * args.windows_per_step)
        batch = windows[process_slice(draw, rank, world)].to(device)  # (windows_per_step / world, seq_len)
        with torch.no_grad():
            teacher_logits = teacher(input_ids=batch, use_cache=False).logits
        logits = student(input_ids=batch, use_cache=False).logits
        loss = distillation_loss(logits, teacher_logits, batch, RECIPE.kd_weight, RECIPE.ce_weight,
                                 RECIPE.temperature).total
        loss.backward()  # FSDP2 reduce-scatters the mean gradient of all processes
        torch.nn.utils.clip_grad_norm_([p for p in student.parameters() if p.requires_grad], RECIPE.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        if mesh is not None:
            dist.all_reduce(mean)
            mean /= world
        losses.append(mean.item())
        tokens_per_step = batch.numel() * world  # what the processes trained on together

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    perplexity_after = perplexity(student)
    probe = windows[:1].to(device)  # (1, seq_len)
    with torch.no_grad():  # every process takes part: the forward gathers the shards
        trained_logits = student(input_ids=probe, use_cache=False).logits.float().cpu()
    full = get_model_state_dict(student, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        report = load_converted_report(args.model)
        path = save_finetuned({name: tensor.detach().cpu() for name, tensor in full.items()}, sites, args.model,
                              args.out / "model", report, {"sharding_check": True})
        saved = load_causal_lm(path, pickle_flag=False).eval()
        with torch.no_grad():
            saved_logits = saved(input_ids=probe.cpu(), use_cache=False).logits.float()
        trainable = [p for p in student.parameters() if p.requires_grad]
        result = {
            "model": str(args.model.resolve()), "world_size": world, "sharded": mesh is not None,
            "backend": dist.get_backend() if mesh else None, "torch": torch.__version__, "units": units,
            "mixed_precision": args.mixed_precision, "train": args.train, "steps": args.steps,
            "resume_at": args.resume_at or None, "tokens_per_step": tokens_per_step, "losses": losses,
            "perplexity_before": perplexity_before, "perplexity": perplexity_after,
            "perplexity_windows": len(evaluation.windows),
            "trainable_parameters": sum(p.numel() for p in trainable),
            "frozen_parameters": sum(p.numel() for p in student.parameters() if not p.requires_grad),
            "saved_vs_trained_max_logit_difference": (saved_logits - trained_logits).abs().max().item(),
            "max_logit": trained_logits.abs().max().item(),
        }
        (args.out / RESULT_FILE).write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result))
    if mesh is not None:
        dist.barrier()
        dist.destroy_process_group()


def relative_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over max |a|: the stored latent norms' gains are ~1e3-1e4, the projections ~1."""
    return ((a.float() - b.float()).abs().max() / a.float().abs().max().clamp_min(1e-30)).item()


def compare(reference: Path, sharded: Path) -> list[str]:
    """What differs between the runs beyond the sharded run's precision allows (empty: they agree); prints what was
    measured."""
    from safetensors.torch import load_file

    def weights(folder: Path) -> dict[str, torch.Tensor]:
        tensors = {}
        for shard_file in sorted(folder.glob("*.safetensors")):
            tensors.update(load_file(shard_file))
        return tensors

    runs = [json.loads((folder / RESULT_FILE).read_text()) for folder in (reference, sharded)]
    precisions = [run.get("mixed_precision", "no") for run in runs]
    tolerance = TOLERANCES[precisions[1]]
    problems = []
    if runs[0]["world_size"] != 1 or not runs[1]["sharded"] or runs[1]["world_size"] < 2:
        problems.append("expected a one-process reference and a sharded run on several processes")
    loss_gap = max(abs(b / a - 1) for a, b in zip(runs[0]["losses"], runs[1]["losses"], strict=True))
    ref_weights, sharded_weights = weights(reference / "model"), weights(sharded / "model")
    untrained = weights(Path(runs[0]["model"]))
    if ref_weights.keys() != sharded_weights.keys():
        problems.append(f"saved tensors differ: {sorted(ref_weights.keys() ^ sharded_weights.keys())[:4]}")
    common = sorted(ref_weights.keys() & sharded_weights.keys())
    weight_gap = max(relative_gap(ref_weights[name], sharded_weights[name]) for name in common)
    # how far training moved the weights: the gap only means something against it
    moved = max(relative_gap(untrained[name], ref_weights[name]) for name in common if name in untrained)
    perplexity_gap = abs(runs[1]["perplexity"] / runs[0]["perplexity"] - 1)
    print(f"losses: {runs[0]['losses']} (reference, {precisions[0]} mixed precision) vs {runs[1]['losses']} (sharded, "
          f"{runs[1]['world_size']} processes, {precisions[1]} mixed precision): max relative difference {loss_gap:.3g}")
    print(f"saved weights, max |difference| / max |weight| per tensor: {weight_gap:.3g} between the runs, "
          f"{moved:.3g} from the untrained folder; saved-vs-trained logits: "
          f"{runs[0]['saved_vs_trained_max_logit_difference']:.3g} / {runs[1]['saved_vs_trained_max_logit_difference']:.3g}")
    print(f"perplexity ({runs[0]['perplexity_windows']} windows, spread over the processes) before -> after training: "
          f"{runs[0]['perplexity_before']:.6g} -> {runs[0]['perplexity']:.6g} (reference), "
          f"{runs[1]['perplexity_before']:.6g} -> {runs[1]['perplexity']:.6g} (sharded)")
    if tolerance.loss is not None and loss_gap > tolerance.loss:
        problems.append(f"losses differ by {loss_gap:.3g} (relative, > {tolerance.loss})")
    learned = 1 - runs[1]["perplexity"] / runs[1]["perplexity_before"]
    if tolerance.must_learn and not learned > tolerance.perplexity:
        problems.append(f"the sharded run's perplexity fell by {learned:.3g} only (<= {tolerance.perplexity}): it did "
                        "not learn")
    if perplexity_gap > tolerance.perplexity:
        problems.append(f"perplexities differ by {perplexity_gap:.3g} (relative, > {tolerance.perplexity})")
    if not moved >= MIN_MOVEMENT:
        problems.append(f"training moved the weights by only {moved:.3g} of their size: the comparison shows nothing")
    elif tolerance.weight_agreement is not None and weight_gap > tolerance.weight_agreement * moved:
        problems.append(f"trained weights differ by {weight_gap:.3g} of their size, {weight_gap / moved:.3g} of what "
                        f"training moved them (> {tolerance.weight_agreement})")
    for run, precision, folder in zip(runs, precisions, (reference, sharded), strict=True):
        allowed = TOLERANCES[precision].logits * max(1.0, run["max_logit"])
        if run["saved_vs_trained_max_logit_difference"] > allowed:
            problems.append(f"{folder}: the saved folder's logits are off by {run['saved_vs_trained_max_logit_difference']:.3g}")
    return problems


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.compare:
        problems = compare(*args.compare)
        for problem in problems:
            print(f"FAIL: {problem}")
        print("sharded training agrees with the reference" if not problems else "")
        return 1 if problems else 0
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
