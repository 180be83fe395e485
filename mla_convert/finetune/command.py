"""`mla-convert finetune` and `recipes/finetune_mla.py`: parse the settings, train, say what happened in one line."""

from __future__ import annotations

import sys

from ..errors import MLAConvertError


def main(argv: list[str] | None = None, prog: str = "mla-convert finetune") -> int:
    """Run a fine-tuning from command-line words (YAML via --config, flags win); returns the exit status."""
    from .config import parse_config
    from .trainer import run_finetune

    args = list(sys.argv[1:] if argv is None else argv)
    from ..io.paths import not_utf8_problem

    undecodable = [problem for arg in args if (problem := not_utf8_problem("argument", arg)) is not None]
    if undecodable:  # the rule of every command (cli.undecodable_arguments): refused before anything is read
        for problem in undecodable:
            print(f"error: {problem}", file=sys.stderr)
        return 2
    positional = []  # MODEL OUTPUT before the flags, as the usage line says (the recipe script takes them too)
    while args and not args[0].startswith("-") and len(positional) < 2:
        positional.append(args.pop(0))
    twice = [flag for flag, _ in zip(("--model", "--output"), positional)
             if any(arg == flag or arg.startswith(flag + "=") for arg in args)]
    if twice:  # argparse keeps the last one: the positional was silently overridden
        print(f"error: {', '.join(twice)}: given both as a positional argument and as a flag; give it once", file=sys.stderr)
        return 2
    for flag, value in zip(("--model", "--output"), positional):
        args = [flag, value, *args]
    try:
        notes: list[str] = []
        config = parse_config(args, prog=prog, notes=notes)
        for note in notes:  # recipe keys this run cannot use (e.g. the sampling settings when --data gives the text)
            print(f"note: {note}", file=sys.stderr)
        result = run_finetune(config)
    except MLAConvertError as error:
        for line in str(error).splitlines():
            print(f"error: {line}", file=sys.stderr)
        return 2
    if result.interrupted_by is not None:
        import signal

        name = signal.Signals(result.interrupted_by).name
        if result.main_process:  # (every process stops on the same step with the same checkpoint: one line says it)
            print(f"interrupted ({name}) at step {result.state.step}: checkpoint {result.checkpoint}; "
                  f"resume with the same command and --resume auto", file=sys.stderr)
        return 128 + result.interrupted_by
    if not result.main_process:
        return 0
    if result.output is not None:
        section = result.finetuning
        before, after = section.get("perplexity_before"), section.get("perplexity_after")
        summary = f"saved {result.output}: {section['steps']} steps, {section['tokens']:,} tokens"
        if before is not None and after is not None:
            summary += f"; perplexity {before:.4f} -> {after:.4f}"
        print(summary)
    elif result.checkpoint is not None:
        print(f"stopped at step {result.state.step}; resume with --resume auto (checkpoint {result.checkpoint})")
    return 0
