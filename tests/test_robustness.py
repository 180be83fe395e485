"""Bad input: every row of the table in docs/robustness.md is one test here.

Each case damages a fresh copy of a real (tiny, sharded) checkpoint, or the options, or the output
location, runs the real `mla-convert convert` command (in process through typer's runner; a few also
in a subprocess) or, where the fault must be injected mid-run, the `convert()` API, and asserts
  * exit status 2 with only `error: ...` lines on stderr (no traceback),
  * those lines equal, word for word, the message column of the doc table (temp paths written `<tmp>`),
  * nothing was written: the case folder (source included) is byte-for-byte as before, no output, no
    partial folder, and the temp folder holds no calibration statistics.

The table is generated from these tests: `MLA_CONVERT_WRITE_ROBUSTNESS_DOC=1 pytest tests/test_robustness.py`
rewrites it from the messages the runs produce; without the variable the tests compare against it.

Reader-level variants of the corrupt/hostile inputs (shorter-than-header shards, absolute index paths,
Hugging Face cache symlinks, malicious pickles, legacy pickles) are in tests/test_checkpoint_io.py; the
rows here are the end-to-end counterpart, through pre-flight and the CLI.
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_checkpoint_io import save_tokenizer
from tiny_models import tiny_config, tiny_model
from typer.testing import CliRunner

from mla_convert.cli import app
from mla_convert.convert import ConvertOptions, Progress, convert
from mla_convert.errors import MLAConvertError, PreflightError
from mla_convert.io.writer import OWNER_FILE, partial_path_for
from mla_convert.options import CalibrationOptions

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "robustness.md"
TABLE_START, TABLE_END = "<!-- robustness-table:start -->", "<!-- robustness-table:end -->"
WRITE_DOC = os.environ.get("MLA_CONVERT_WRITE_ROBUSTNESS_DOC", "") not in ("", "0")
INDEX = "model.safetensors.index.json"
QUICK = ["--calib-samples", "2", "--calib-seq-len", "16", "-q"]
K_PROJ = "model.layers.1.self_attn.k_proj.weight"


# --------------------------------------------------------------------------- the workspace of one case
@dataclass
class Workspace:
    root: Path  # <tmp>: everything the case creates lives here
    src: Path  # the source model folder
    out: Path  # the output path given to the converter
    scratch: Path  # the temp folder (TMPDIR) for this run: calibration statistics would go here
    ignore: set = field(default_factory=set)  # paths (relative to root) the test itself changes during the run
    cleanups: list = field(default_factory=list)

    def shard_of(self, name: str) -> Path:
        return self.src / json.loads((self.src / INDEX).read_text())["weight_map"][name]

    def edit_config(self, **changes) -> None:
        config = json.loads((self.src / "config.json").read_text())
        for key, value in changes.items():
            if value is DELETE:
                config.pop(key, None)
            else:
                config[key] = value
        (self.src / "config.json").write_text(json.dumps(config, indent=2))

    def edit_tensor(self, name: str, edit: Callable[[torch.Tensor], torch.Tensor | None]) -> Path:
        """Rewrite the shard holding `name` with `edit(tensor)` (None: drop the tensor, and its index entry)."""
        shard = self.shard_of(name)
        tensors = load_file(shard)
        new = edit(tensors[name].clone())
        if new is None:
            del tensors[name]
            index = json.loads((self.src / INDEX).read_text())
            del index["weight_map"][name]
            (self.src / INDEX).write_text(json.dumps(index))
        else:
            tensors[name] = new
        save_file(tensors, str(shard), metadata={"format": "pt"})
        return shard

    def mount_tmpfs(self, relative: str, size: str, read_only: bool = False) -> Path:
        """A genuinely small (or read-only) file system at root/relative; skips where mounting is not allowed."""
        mount_point = self.root / relative
        mount_point.mkdir(parents=True)
        options = f"size={size}" + (",ro" if read_only else "")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount_point)], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"mounting a tmpfs needs root (mount said: {done.stderr.strip()})")
        self.cleanups.append(lambda: subprocess.run(["umount", "-l", str(mount_point)], check=False))
        return mount_point


DELETE = object()


@dataclass(frozen=True)
class Case:
    id: str
    bad_input: str  # the table's "bad input" column
    how: str  # how the test makes it
    setup: Callable  # (Workspace) -> extra CLI args; for `api` cases, a callable that runs convert()
    fragments: tuple[str, ...]  # words the message must contain, whatever the doc says
    api: bool = False


CASES: dict[str, Case] = {}


def case(case_id: str, bad_input: str, how: str, *fragments: str, api: bool = False):
    def register(setup):
        assert case_id not in CASES, case_id
        CASES[case_id] = Case(case_id, bad_input, how, setup, fragments, api)
        return setup

    return register


def largest_shard(folder: Path) -> Path:
    return max(folder.glob("*.safetensors"), key=lambda path: (path.stat().st_size, path.name))


def rewrite_header(shard: Path, edit: Callable[[dict], None]) -> None:
    """Edit a safetensors header in place, keeping its length (padding with spaces, which the format allows)."""
    data = shard.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    edit(header)
    raw = json.dumps(header, separators=(",", ":")).encode()
    assert len(raw) <= length, "the edit must not lengthen the header"
    shard.write_bytes(data[:8] + raw.ljust(length, b" ") + data[8 + length :])


# --------------------------------------------------------------------------- A. damaged or hostile checkpoints
@case("truncated-shard", "truncated shard (interrupted download)", "a shard cut to half its size",
      "truncated", ".safetensors")
def _(ws):
    shard = largest_shard(ws.src)
    os.truncate(shard, shard.stat().st_size // 2)
    return []


@case("header-not-json", "shard header is not JSON", "header bytes overwritten with 0xFF", "not valid JSON")
def _(ws):
    shard = largest_shard(ws.src)
    data = bytearray(shard.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    data[8 : 8 + length] = b"{" + b"\xff" * (length - 1)
    shard.write_bytes(bytes(data))
    return []


@case("header-size-mismatch", "header shape disagrees with the stored bytes",
      "model.norm.weight's header shape edited from [64] to [32]", "needs 128 bytes")
def _(ws):
    rewrite_header(ws.shard_of("model.norm.weight"), lambda header: header["model.norm.weight"].__setitem__("shape", [32]))
    return []


@case("index-missing-shard", "index points at a missing shard", "the largest shard deleted", "missing from the folder")
def _(ws):
    largest_shard(ws.src).unlink()
    return []


@case("index-path-traversal", "path traversal in the index's weight_map",
      "weight_map entry `../outside.safetensors` (a real shard placed there)", "outside the model folder")
def _(ws):
    shutil.copyfile(largest_shard(ws.src), ws.root / "outside.safetensors")
    index = json.loads((ws.src / INDEX).read_text())
    index["weight_map"]["model.norm.weight"] = "../outside.safetensors"
    (ws.src / INDEX).write_text(json.dumps(index))
    return []


@case("unprefixed-names", "tensors named as a base model saves them (no `model.` prefix)",
      "every `model.` prefix dropped from the shard headers and the index", "without the 'model.' prefix",
      "save_pretrained it again")
def _(ws):
    def unprefixed(name: str) -> str:
        return name.removeprefix("model.")

    for shard in ws.src.glob("*.safetensors"):
        rewrite_header(shard, lambda header: [header.__setitem__(unprefixed(key), header.pop(key)) for key in list(header)])
    index = json.loads((ws.src / INDEX).read_text())
    index["weight_map"] = {unprefixed(name): file for name, file in index["weight_map"].items()}
    (ws.src / INDEX).write_text(json.dumps(index))
    return []


@case("shard-symlink-out", "shard symlinked from outside the model folder",
      "a shard moved out and replaced by a symlink to it", "symlink pointing outside")
def _(ws):
    shard = largest_shard(ws.src)
    (ws.root / "elsewhere").mkdir()
    shutil.move(shard, ws.root / "elsewhere" / shard.name)
    shard.symlink_to(ws.root / "elsewhere" / shard.name)
    return []


@case("duplicate-tensor", "a weight stored twice, in two indexed shards",
      "a zeroed copy of layer 1's k_proj added to another shard (the index still names the first)",
      "as well as in", "remove the stray copy")
def _(ws):
    home = ws.shard_of(K_PROJ)
    other = next(shard for shard in sorted(ws.src.glob("model-*.safetensors")) if shard != home)
    tensors = load_file(other)
    tensors[K_PROJ] = torch.zeros_like(load_file(home)[K_PROJ])  # transformers may load this copy
    save_file(tensors, str(other), metadata={"format": "pt"})
    return []


@case("int-tensor", "dtype mismatch: an integer tensor where a weight should be",
      "layer 1's k_proj stored as int32", "int32", "floating-point")
def _(ws):
    ws.edit_tensor(K_PROJ, lambda t: (t * 1000).to(torch.int32))
    return []


@case("wrong-shape-tensor", "a weight with the wrong shape", "layer 1's k_proj cut to 16 of its 32 rows",
      "has shape [16, 64], expected [32, 64]")
def _(ws):
    ws.edit_tensor(K_PROJ, lambda t: t[:16].clone())
    return []


@case("missing-tensor", "a weight missing from the checkpoint", "layer 1's k_proj removed from its shard and the index",
      "is missing")
def _(ws):
    ws.edit_tensor(K_PROJ, lambda t: None)
    return []


@case("nan-in-k-proj", "NaN in a source weight (k_proj)", "one NaN written into layer 1's k_proj",
      "NaN/Inf", K_PROJ)
def _(ws):
    def poison(tensor):
        tensor[3, 5] = float("nan")
        return tensor

    ws.edit_tensor(K_PROJ, poison)
    return []


@case("bit-rot", "bit rot inside a shard", "64 bytes in the middle of the largest shard's data set to 0xFF (NaN patterns)",
      "NaN/Inf", "damaged")
def _(ws):
    shard = largest_shard(ws.src)
    data = bytearray(shard.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    middle = 8 + length + (len(data) - 8 - length) // 2
    middle -= middle % 4
    data[middle : middle + 64] = b"\xff" * 64
    shard.write_bytes(bytes(data))
    return []


@case("pickle-only", "pickled-only checkpoint (pytorch_model.bin) without --allow-pickle",
      "the safetensors files replaced by `torch.save(state_dict)`", "--allow-pickle")
def _(ws):
    state = {}
    for shard in ws.src.glob("*.safetensors"):
        state.update(load_file(shard))
        shard.unlink()
    (ws.src / INDEX).unlink()
    torch.save(state, ws.src / "pytorch_model.bin")
    return []


@case("no-weights", "a folder without weights", "every *.safetensors file and the index deleted", "no weights found")
def _(ws):
    for shard in ws.src.glob("*.safetensors"):
        shard.unlink()
    (ws.src / INDEX).unlink()
    return []


@case("zero-input-norm", "a layer whose attention input is identically zero",
      "layer 1's input_layernorm weight set to zeros (finite, but nothing to calibrate on)", "identically zero", "layer 1")
def _(ws):
    ws.edit_tensor("model.layers.1.input_layernorm.weight", torch.zeros_like)
    return []


@case("overflowing-logits", "finite weights whose logits overflow (calibration text sampled from the model)",
      "model.norm.weight set to 3e38 and token 5's embedding (and head) row to ones: every weight finite, the logits "
      "NaN/Inf", "sampling calibration text from the source model", "not finite")
def _(ws):
    ws.edit_tensor("model.norm.weight", lambda weight: torch.full_like(weight, 3e38))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in json.loads((ws.src / INDEX).read_text())["weight_map"]:
            ws.edit_tensor(name, lambda weight: weight.index_fill(0, torch.tensor([5]), 1.0))
    return []


# --------------------------------------------------------------------------- B. config.json
@case("missing-config", "missing config.json", "config.json deleted", "config.json: missing")
def _(ws):
    (ws.src / "config.json").unlink()
    return []


@case("bad-json-config", "config.json is not valid JSON", "config.json set to `{not json`", "not valid JSON")
def _(ws):
    (ws.src / "config.json").write_text("{not json")
    return []


@case("unknown-architecture", "unknown architecture", "architectures = [GPT2LMHeadModel]", "unsupported architecture")
def _(ws):
    ws.edit_config(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    return []


@case("heads-not-dividing", "heads do not divide hidden size; kv heads do not divide heads",
      "num_attention_heads 6, num_key_value_heads 4, no head_dim", "does not divide")
def _(ws):
    ws.edit_config(num_attention_heads=6, num_key_value_heads=4, head_dim=DELETE)
    return []


@case("odd-head-dim", "odd head_dim", "head_dim 15", "is odd")
def _(ws):
    ws.edit_config(head_dim=15)
    return []


@case("string-field", "a config field of the wrong type", 'num_key_value_heads = "2" (a string)', "num_key_value_heads")
def _(ws):
    ws.edit_config(num_key_value_heads="2")
    return []


@case("gelu-activation", "an MLP activation other than silu", "hidden_act gelu", "hidden_act")
def _(ws):
    ws.edit_config(hidden_act="gelu")
    return []


@case("mlp-bias", "mlp_bias model", "a real LlamaForCausalLM built with mlp_bias=True", "mlp_bias")
def _(ws):
    from transformers import LlamaForCausalLM

    config = tiny_config(vocab_size=128)
    config.mlp_bias = True
    shutil.rmtree(ws.src)
    LlamaForCausalLM(config).save_pretrained(ws.src)
    return []


@case("rope-yarn", "unsupported rope_type yarn", "rope_parameters {rope_type: yarn, factor 4}", "RoPE type 'yarn'", "is not supported")
def _(ws):
    ws.edit_config(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                    "original_max_position_embeddings": 128})
    return []


@case("rope-dynamic", "unsupported rope_type dynamic (old `rope_scaling` key)", "rope_scaling {type: dynamic, factor 2}",
      "RoPE type 'dynamic'", "is not supported")
def _(ws):
    ws.edit_config(rope_parameters=DELETE, rope_theta=10000.0, rope_scaling={"type": "dynamic", "factor": 2.0})
    return []


@case("rope-llama3-incomplete", "llama3 RoPE parameters incomplete", "rope_parameters {rope_type: llama3, factor 8} only",
      "low_freq_factor", "high_freq_factor")
def _(ws):
    ws.edit_config(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0})
    return []


@case("rope-linear-llama-cpp", "a linear-RoPE source with `--target llama.cpp`, whose DeepSeek path llama.cpp computes "
      "wrongly (measured)", "rope_parameters {rope_type: linear, factor 4}; --target llama.cpp",
      "this source's RoPE linear", "measured 2026-12-03", "--target transformers")
def _(ws):
    ws.edit_config(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0})
    return ["--target", "llama.cpp"]


@case("layers-mismatch", "config promises more layers than the checkpoint holds", "num_hidden_layers 4 (checkpoint: 2)",
      "num_hidden_layers is 4", "more tensor problems")
def _(ws):
    ws.edit_config(num_hidden_layers=4)
    return []


# --------------------------------------------------------------------------- C. options
@case("rank-too-large", "kv_lora_rank larger than feasible", "-r 1000 (at most 64 here)", "larger than the source allows")
def _(ws):
    return ["-r", "1000", "-d", "8"]


@case("rope-dim-odd", "odd rope_dim", "-d 7", "must be even")
def _(ws):
    return ["-r", "16", "-d", "7"]


@case("rope-dim-too-large", "rope_dim larger than head_dim", "-d 32 (head_dim 16)", "larger than the source head_dim")
def _(ws):
    return ["-r", "16", "-d", "32"]


@case("compression-below-1", "compression ratio below 1", "-c 0.5", "at least 1")
def _(ws):
    return ["-c", "0.5"]


@case("fp16-export", "fp16 export", "--dtype fp16", "fp16")
def _(ws):
    return ["--dtype", "fp16"]


@case("bad-method", "unknown method", "--method pca", "choose one of")
def _(ws):
    return ["--method", "pca"]


@case("bad-target", "unknown --target (a misspelling: vLLM)", "--target vLLM", "--target 'vLLM'", "choose one of")
def _(ws):
    return ["--target", "vLLM"]


@case("all-at-once", "several bad options together", "-r 0 -d 7 --calib-samples 0 --max-shard-size 5parsecs --device banana",
      "--kv-lora-rank 0", "--rope-dim 7", "--calib-samples 0", "--max-shard-size", "--device")
def _(ws):
    return ["-r", "0", "-d", "7", "--calib-samples", "0", "--max-shard-size", "5parsecs", "--device", "banana"]


@case("calib-seq-len-1", "calibration windows of one token", "--calib-seq-len 1", "--calib-seq-len 1")
def _(ws):
    return ["--calib-seq-len", "1"]


@case("calib-seq-len-past-positions", "calibration windows longer than the source was trained on",
      "--calib-seq-len max_position_embeddings + 1", "longer than the source's max_position_embeddings")
def _(ws):
    return ["--calib-seq-len", str(json.loads((ws.src / "config.json").read_text())["max_position_embeddings"] + 1)]


@case("card-metadata", "model card metadata the Hub would refuse", "--license 'Not A License' --base-model ./my-llama",
      "--license 'Not A License': not a Hub license id", "--base-model './my-llama': not a Hub model id")
def _(ws):
    return ["--license", "Not A License", "--base-model", "./my-llama"]


@case("revision-on-local-folder", "--revision with a local source (it would be ignored)", "--revision v2",
      "--revision v2:", "is a local folder")
def _(ws):
    return ["--revision", "v2"]


# --------------------------------------------------------------------------- D. calibration text
@case("calib-text-missing", "calibration text file missing", "--calib-data <tmp>/nowhere.txt", "no such file")
def _(ws):
    return ["--calib-data", str(ws.root / "nowhere.txt")]


@case("calib-text-special", "calibration text is neither a file nor a folder", "--calib-data /dev/null",
      "is a character device")
def _(ws):
    return ["--calib-data", "/dev/null"]


@case("calib-text-empty", "zero-length calibration text", "--calib-data on an empty file", "contains no text")
def _(ws):
    (ws.root / "empty.txt").write_text("")
    return ["--calib-data", str(ws.root / "empty.txt")]


@case("calib-text-too-short", "calibration text shorter than one window", "3 words, --calib-seq-len 16",
      "has 3 tokens")
def _(ws):
    (ws.root / "short.txt").write_text("w1 w2 w3")
    return ["--calib-data", str(ws.root / "short.txt")]


@case("calib-no-tokenizer", "--calib-data for a source without a tokenizer", "tokenizer files deleted", "needs the source model's tokenizer")
def _(ws):
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (ws.src / name).unlink(missing_ok=True)
    (ws.root / "text.txt").write_text("w1 w2 w3 " * 50)
    return ["--calib-data", str(ws.root / "text.txt")]


@case("tokenizer-custom-code", "tokenizer that exists only as custom code (trust_remote_code bait)",
      "tokenizer_config.json with auto_map to `evil.py`, which would create a file if run", "never runs code")
def _(ws):
    config = json.loads((ws.src / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="EvilTokenizer", auto_map={"AutoTokenizer": ["evil.EvilTokenizer", "evil.EvilTokenizer"]})
    (ws.src / "tokenizer_config.json").write_text(json.dumps(config))
    (ws.src / "evil.py").write_text(
        f"open({str(ws.root / 'PWNED')!r}, 'w').write('custom code ran')\n"
        "from transformers import PreTrainedTokenizerFast\nclass EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    (ws.root / "text.txt").write_text("w1 w2 w3 " * 50)
    return ["--calib-data", str(ws.root / "text.txt")]  # the snapshot check fails if PWNED appears


# --------------------------------------------------------------------------- E. source and output locations
@case("source-missing", "source folder that does not exist", "<tmp>/no/such/model", "no such folder")
def _(ws):
    ws.src = ws.root / "no" / "such" / "model"
    return []


@case("brackets-in-path", "a path with [brackets] (rich markup syntax) in a message", "source folder `model-[v2]` without config.json",
      "model-[v2]/config.json")
def _(ws):
    renamed = ws.root / "model-[v2]"
    ws.src.rename(renamed)
    ws.src = renamed
    (ws.src / "config.json").unlink()
    return []


@case("empty-config", "config.json that names no architecture", "config.json set to `{}`", "no 'architectures'")
def _(ws):
    (ws.src / "config.json").write_text("{}")
    return []


@case("output-exists", "existing output", "the output folder exists (holding a file)", "already exists")
def _(ws):
    ws.out.mkdir()
    (ws.out / "keep.txt").write_text("mine")
    return []


@case("source-and-output-together", "a broken source and an existing output at once",
      "pickled-only source without --allow-pickle, and the output folder exists", "--allow-pickle", "already exists")
def _(ws):
    CASES["pickle-only"].setup(ws)
    CASES["output-exists"].setup(ws)
    return []


@case("flags-source-and-output-together", "a flag that cannot act, a broken source and an existing output at once",
      "--force without --overwrite, a pickled-only source, and the output folder exists", "--force: acts only with",
      "--allow-pickle", "already exists")
def _(ws):
    CASES["source-and-output-together"].setup(ws)
    return ["--force"]


@case("output-is-file", "output path is a file, with --overwrite", "the output path is a regular file", "is a file")
def _(ws):
    ws.out.write_text("a file, not a model")
    return ["--overwrite"]


@case("overwrite-source", "--overwrite onto the source folder itself", "output path = source folder, --overwrite",
      "would delete the source")
def _(ws):
    ws.out = ws.src
    return ["--overwrite"]


@case("output-parent-missing", "output parent folder missing", "<tmp>/no/such/out", "parent folder does not exist")
def _(ws):
    ws.out = ws.root / "no" / "such" / "out"
    return []


@case("live-partial", "another run is writing the same output", "`out.mla-convert-partial` owned by a live process",
      "another mla-convert process")
def _(ws):
    partial = partial_path_for(ws.out)
    partial.mkdir()
    # a live writer holds the flock of its owner file (what CheckpointWriter does), here in another process
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from mla_convert.io.writer import claim_owner_file; "
                               "h = claim_owner_file(__import__('pathlib').Path(sys.argv[1])); print('held', flush=True); "
                               "time.sleep(120)", str(partial / OWNER_FILE)], stdout=subprocess.PIPE, text=True)
    ws.cleanups.append(lambda: (holder.kill(), holder.wait()))
    assert holder.stdout.readline().strip() == "held"
    return []


@case("read-only-output-dir", "read-only output folder", "output inside a read-only tmpfs (chmod 555 when not root)",
      "not writable")
def _(ws):
    if os.geteuid() == 0:  # root writes through chmod, so use a file system that is mounted read-only
        ws.out = ws.mount_tmpfs("readonly", "64k", read_only=True) / "out"
    else:
        (ws.root / "readonly").mkdir()
        os.chmod(ws.root / "readonly", 0o555)
        ws.cleanups.append(lambda: os.chmod(ws.root / "readonly", 0o755))
        ws.out = ws.root / "readonly" / "out"
    return []


@case("full-disk", "full disk (pre-flight)", "output on a 64 KiB tmpfs (the tiny model needs ~0.6 MiB)", "free, the output needs about")
def _(ws):
    ws.out = ws.mount_tmpfs("disk", "64k") / "out"
    return []


class ActWhen(Progress):
    """A progress callback that runs `act()` once, when phase `when` starts."""

    def __init__(self, when: str, act: Callable[[], None]):
        super().__init__()
        self.when, self.act = when, act

    def phase(self, name, total=None):
        if name == self.when:
            self.act()


def quick_convert_with(ws, progress: Progress):
    return lambda: convert(ws.src, ws.out, ConvertOptions(calibration=CalibrationOptions(num_samples=2, seq_len=16),
                                                          max_shard_size="20KB"), progress)


def fill_disk(disk: Path) -> None:
    """Take all free space of `disk` with a filler file written until ENOSPC."""
    filler = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)  # unbuffered: nothing left to flush
    try:
        while True:
            os.write(filler, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(filler)


@case("disk-fills-while-writing", "disk fills up while writing",
      "output on a 2 MiB tmpfs that passes pre-flight; when layer conversion starts, a filler file takes all free space "
      "(convert() API with a progress callback)", "No space left on device", "nothing was written", api=True)
def _(ws):
    disk = ws.mount_tmpfs("disk", "2m")
    ws.out = disk / "out"
    ws.ignore.update({"disk", "disk/filler"})  # the filler, and the folder whose entries the run changes


    return quick_convert_with(ws, ActWhen("converting layers", lambda: fill_disk(disk)))


@case("temp-fills-while-calibrating", "the temp folder fills up while the calibration statistics are written",
      "TMPDIR on a 4 MiB tmpfs that passes pre-flight; when the statistics phase starts, a filler file takes all free "
      "space (convert() API with a progress callback)", "temp folder is full", "removed mla-convert-stats-",
      "Set TMPDIR", api=True)
def _(ws):
    disk = ws.mount_tmpfs("tempdisk", "4m")
    ws.scratch = disk / "tmp"  # the statistics folder goes here; the filler beside it
    ws.scratch.mkdir()
    ws.monkeypatch.setattr(tempfile, "tempdir", str(ws.scratch))
    ws.ignore.update({"tempdisk", "tempdisk/filler", "tempdisk/tmp"})


    return quick_convert_with(ws, ActWhen("calibration statistics", lambda: fill_disk(disk)))


@case("output-larger-than-disk", "output and statistics larger than the free disk",
      "a header-only (sparse) Llama of 1200 layers, hidden 16384 (~7 TiB)", "the output needs about", "set TMPDIR")
def _(ws):
    shutil.rmtree(ws.src)
    write_sparse_llama(ws.src, layers=1200, layers_per_shard=100)
    return []


@case("shard-truncated-mid-run", "a shard cut short while the conversion reads it",
      "when layer conversion starts, the shard holding layer 1's k_proj is truncated to half (convert() API with a "
      "progress callback)",
      "changed size from", "nothing was written", api=True)
def _(ws):
    shard = ws.shard_of(K_PROJ)
    ws.ignore.add(shard.relative_to(ws.root).as_posix())
    return quick_convert_with(ws, ActWhen("converting layers", lambda: os.truncate(shard, shard.stat().st_size // 2)))


@case("shard-rewritten-after-scan", "a shard rewritten in place after the NaN/Inf scan passed",
      "when layer conversion starts, the shard holding layer 1's k_proj is overwritten in place with the same bytes "
      "but NaN in k_proj (same size; convert() API with a progress callback)",
      "was rewritten", "nothing was written", api=True)
def _(ws):
    shard = ws.shard_of(K_PROJ)
    ws.ignore.add(shard.relative_to(ws.root).as_posix())
    tensors = load_file(shard)
    tensors[K_PROJ] = torch.full_like(tensors[K_PROJ], float("nan"))
    poisoned = ws.root / "poisoned.safetensors"
    save_file(tensors, str(poisoned), metadata={"format": "pt"})
    payload = poisoned.read_bytes()
    poisoned.unlink()
    assert len(payload) == shard.stat().st_size

    def rewrite():
        time.sleep(0.01)  # a modification time the shard did not have (coarse-clock file systems)
        with open(shard, "r+b") as handle:  # the same file (inode), the same size: only the bytes and the time change
            handle.write(payload)

    return quick_convert_with(ws, ActWhen("converting layers", rewrite))


@case("nan-in-result", "NaN in the conversion result",
      "fault injection: the project's `assemble_attention` returns a NaN in kv_b_proj (convert() API)",
      "layer 0, step 'factorization'", "kv_b_proj.weight", "refusing to write", api=True)
def _(ws):
    import mla_convert.convert.decisions as convert_module

    real = convert_module.assemble_attention

    def poisoned(*args, **kwargs):
        weights, report = real(*args, **kwargs)
        weights["kv_b_proj.weight"] = weights["kv_b_proj.weight"].clone()
        weights["kv_b_proj.weight"][0, 0] = float("nan")
        return weights, report

    ws.monkeypatch.setattr(convert_module, "assemble_attention", poisoned)
    return lambda: convert(ws.src, ws.out, ConvertOptions(calibration=CalibrationOptions(num_samples=2, seq_len=16),
                                                          rope_finalists=1, kv_balance_search=False))


def write_sparse_llama(folder: Path, layers: int, layers_per_shard: int) -> None:
    """A Llama checkpoint whose shards are sparse files: real headers, no data (pre-flight reads only headers)."""
    hidden, heads, kv_heads, head_dim, inter, vocab = 16384, 128, 8, 128, 53248, 128256
    folder.mkdir(parents=True)
    config = tiny_config(vocab_size=vocab, hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                         intermediate_size=inter, num_layers=layers).to_dict()
    config["dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(config))
    shapes = {"model.embed_tokens.weight": [vocab, hidden]}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": [heads * head_dim, hidden], p + "self_attn.k_proj.weight": [kv_heads * head_dim, hidden],
            p + "self_attn.v_proj.weight": [kv_heads * head_dim, hidden], p + "self_attn.o_proj.weight": [hidden, heads * head_dim],
            p + "mlp.gate_proj.weight": [inter, hidden], p + "mlp.up_proj.weight": [inter, hidden],
            p + "mlp.down_proj.weight": [hidden, inter], p + "input_layernorm.weight": [hidden],
            p + "post_attention_layernorm.weight": [hidden],
        })
    shapes.update({"model.norm.weight": [hidden], "lm_head.weight": [vocab, hidden]})
    names = list(shapes)
    count = -(-layers // layers_per_shard)
    per_shard = -(-len(names) // count)
    weight_map = {}
    for number in range(count):
        file = f"model-{number + 1:05d}-of-{count:05d}.safetensors"
        header, offset = {}, 0
        for name in names[number * per_shard : (number + 1) * per_shard]:
            size = 2
            for dim in shapes[name]:
                size *= dim
            header[name] = {"dtype": "BF16", "shape": shapes[name], "data_offsets": [offset, offset + size]}
            offset += size
            weight_map[name] = file
        raw = json.dumps(header).encode()
        with open(folder / file, "wb") as handle:
            handle.write(struct.pack("<Q", len(raw)) + raw)
            handle.truncate(8 + len(raw) + offset)  # sparse: no blocks are allocated for the data
    (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


# --------------------------------------------------------------------------- running a case
@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    """A real tiny Llama (2 layers, GQA 4/2, head_dim 16) with a tokenizer, saved in 20 KB shards."""
    folder = tmp_path_factory.mktemp("template") / "model"
    tiny_model(vocab_size=128).save_pretrained(folder, max_shard_size="20KB")
    save_tokenizer(folder)
    return folder


@pytest.fixture
def workspace(template, tmp_path, monkeypatch):
    root, scratch = tmp_path / "case", tmp_path / "temp"
    root.mkdir()
    scratch.mkdir()
    shutil.copytree(template, root / "model")
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where StatsStore and the scratch cleaner look
    monkeypatch.setenv("TMPDIR", str(scratch))
    ws = Workspace(root, root / "model", root / "out", scratch)
    ws.monkeypatch = monkeypatch
    # the convert command installs SIGTERM/SIGHUP handlers; give pytest its own back afterwards
    import signal

    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGHUP)}
    yield ws
    for signum, handler in handlers.items():
        signal.signal(signum, handler)
    for cleanup in reversed(ws.cleanups):
        cleanup()


def snapshot(root: Path, ignore: set) -> dict[str, tuple]:
    """Every path under root with its type, size and modification time (symlinks not followed)."""
    state = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            relative = path.relative_to(root).as_posix()
            if relative in ignore:
                continue
            info = path.lstat()
            state[relative] = (path.is_symlink(), path.is_dir(), info.st_size if not path.is_dir() else 0, info.st_mtime_ns)
    return state


def normalize(line: str, ws: Workspace) -> str:
    """Make a message comparable across runs: temp paths, PIDs and free-space figures are per machine."""
    line = line.replace(str(ws.scratch), "<temp>").replace(str(ws.root), "<tmp>")
    line = re.sub(r"pid \d+", "pid <pid>", line)
    line = re.sub(r"mla-convert-stats-\w+", "mla-convert-stats-<id>", line)
    # transformers prints sets of missing keys, whose order follows per-process string hashing
    line = re.sub(r"\{('[^{}']*'(?:, '[^{}']*')*)\}", lambda m: "{" + ", ".join(sorted(m.group(1).split(", "))) + "}", line)
    return re.sub(r"\d+(\.\d+)? (B|KiB|MiB|GiB|TiB) free", "<free> free", line)


def cli_args(ws: Workspace, extra: list[str]) -> list[str]:
    return ["convert", str(ws.src), str(ws.out), *QUICK, *extra]


def run_case(case_: Case, ws: Workspace) -> list[str]:
    """Run one case; return the normalized stderr lines after checking exit status and that nothing was written."""
    prepared = case_.setup(ws)
    before = snapshot(ws.root, ws.ignore)
    if case_.api:
        with pytest.raises(MLAConvertError) as caught:
            prepared()
        lines = [f"error: {line}" for line in str(caught.value).splitlines()]
    else:
        result = CliRunner().invoke(app, cli_args(ws, prepared))
        assert result.exit_code == 2, f"exit {result.exit_code}: {result.output}\n{result.exception!r}"
        assert isinstance(result.exception, SystemExit), "not a clean user error"
        assert result.stdout == "", "nothing but errors is printed"
        lines = result.stderr.splitlines()
    assert lines and all(line.startswith("error: ") for line in lines), lines
    assert "Traceback" not in "\n".join(lines)
    assert snapshot(ws.root, ws.ignore) == before, "the run changed files (output, partial folder or source)"
    assert list(ws.scratch.iterdir()) == [], "calibration statistics left in the temp folder"
    message = "\n".join(lines)
    for fragment in case_.fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return [normalize(line, ws) for line in lines]


# --------------------------------------------------------------------------- the doc table
def render_cell(lines: list[str]) -> str:
    return "<br>".join(f"`{line}`".replace("|", "\\|") for line in lines)


def parse_cell(cell: str) -> list[str]:
    return [part.strip().strip("`").replace("\\|", "|") for part in cell.split("<br>")]


def doc_rows() -> dict[str, list[str]]:
    text = DOC.read_text() if DOC.exists() else ""
    if TABLE_START not in text:
        return {}
    table = text.split(TABLE_START)[1].split(TABLE_END)[0]
    rows = {}
    for line in table.strip().splitlines()[2:]:
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        rows[cells[1].strip("`")] = parse_cell(cells[4])
    return rows


RECORDED: dict[str, list[str]] = {}


def write_doc_table() -> None:
    existing = doc_rows()
    lines = ["| # | case | bad input | how the test makes it | what the user sees (stderr; exit status 2) |",
             "|---|---|---|---|---|"]
    for number, case_ in enumerate(CASES.values(), start=1):
        message = RECORDED.get(case_.id) or existing.get(case_.id) or ["(not run yet)"]
        how = case_.how.replace("|", "\\|")
        lines.append(f"| {number} | `{case_.id}` | {case_.bad_input} | {how} | {render_cell(message)} |")
    text = DOC.read_text()
    head, rest = text.split(TABLE_START)
    tail = rest.split(TABLE_END)[1]
    DOC.write_text(head + TABLE_START + "\n" + "\n".join(lines) + "\n" + TABLE_END + tail)


@pytest.fixture(scope="module", autouse=True)
def doc_writer():
    yield
    if WRITE_DOC and RECORDED:
        write_doc_table()


@pytest.mark.parametrize("case_id", list(CASES))
def test_bad_input(case_id, workspace):
    lines = run_case(CASES[case_id], workspace)
    if WRITE_DOC:
        RECORDED[case_id] = lines
        return
    documented = doc_rows().get(case_id)
    assert documented is not None, f"{case_id} has no row in {DOC}; regenerate with MLA_CONVERT_WRITE_ROBUSTNESS_DOC=1"
    if case_id == "read-only-output-dir" and os.geteuid() != 0:  # the doc shows root's read-only mount
        documented = [line.replace(" (read-only file system)", "") for line in documented]
    assert lines == documented, f"the message changed; regenerate the doc table if intended:\n{lines}\n!=\n{documented}"


def test_doc_table_lists_exactly_the_cases():
    assert list(doc_rows()) == list(CASES), "docs/robustness.md is out of sync with the cases"
    assert len(CASES) >= 20


SUBPROCESS_CASES = ("truncated-shard", "heads-not-dividing", "all-at-once")


@pytest.mark.parametrize("case_id", SUBPROCESS_CASES)
def test_bad_input_in_a_real_process(case_id, workspace):
    """The same rows through `python -m mla_convert`: exit 2, the same lines, no traceback, nothing written."""
    ws = workspace
    extra = CASES[case_id].setup(ws)
    before = snapshot(ws.root, ws.ignore)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(ws.scratch), "NO_COLOR": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "mla_convert", *cli_args(ws, extra)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
    lines = [normalize(line, ws) for line in done.stderr.splitlines()]
    assert lines == doc_rows()[case_id]
    assert snapshot(ws.root, ws.ignore) == before
    assert list(ws.scratch.iterdir()) == []


# --------------------------------------------------------------------------- what a good run shows
def test_successful_run_shows_the_disk_estimate_and_it_is_close(workspace):
    ws = workspace
    result = CliRunner().invoke(app, ["convert", str(ws.src), str(ws.out), "--calib-samples", "2", "--calib-seq-len", "16",
                                      "--max-shard-size", "20KB"])
    assert result.exit_code == 0, result.output
    estimate = re.search(r"disk: the output needs about ([\d.]+) (KiB|MiB)", result.stderr)
    assert estimate, result.stderr
    estimated = float(estimate.group(1)) * {"KiB": 1024, "MiB": 1024**2}[estimate.group(2)]
    written = sum(path.stat().st_size for path in ws.out.iterdir())
    assert written <= estimated, "the estimate must not be lower than what is written"
    assert written >= 0.5 * estimated
    assert list(ws.scratch.iterdir()) == [], "statistics folder removed after a successful run"


@pytest.mark.parametrize("flip_one_bit", [False, True], ids=["identical-copy", "one-bit-apart"])
def test_a_tensor_stored_twice_is_refused_only_when_the_copies_differ(workspace, flip_one_bit):
    """A re-sharded checkpoint may repeat a tensor: byte-identical copies are one model (they were refused too)."""
    ws = workspace
    home = ws.shard_of(K_PROJ)
    other = next(shard for shard in sorted(ws.src.glob("model-*.safetensors")) if shard != home)
    tensors, copy = load_file(other), load_file(home)[K_PROJ].clone()
    if flip_one_bit:
        copy.view(torch.int32 if copy.element_size() == 4 else torch.int16)[0, 0] ^= 1
    tensors[K_PROJ] = copy
    save_file(tensors, str(other), metadata={"format": "pt"})
    result = CliRunner().invoke(app, ["convert", str(ws.src), str(ws.out), *QUICK])
    assert (result.exit_code, "remove the stray copy" in result.stderr) == ((2, True) if flip_one_bit else (0, False)), \
        result.stderr


def test_output_and_statistics_on_one_disk_must_fit_there_together(workspace):
    """Each fits the disk alone, both do not: pre-flight says so.  (It checked them one at a time, and a
    Llama-3-8B-width conversion here, with /tmp and the output on one nearly full disk, passed pre-flight and
    failed with ENOSPC writing its first shard, 12 minutes in.)"""
    from mla_convert.convert.pipeline import Converter
    from mla_convert.convert.preflight import storage_needs

    ws = workspace
    options = ConvertOptions(calibration=CalibrationOptions(num_samples=2, seq_len=16))
    with Converter(ws.src, options) as converter:
        mla, dtype = converter.preflight(ws.root / "probe", options)  # on the large disk: no problem
        needed, statistics = storage_needs(converter.config, mla, dtype, ws.src, options.calibration)
        size = 4096 * math.ceil(1.05 * (needed + statistics / 2) / 4096)
        assert 1.05 * needed < size and 1.05 * statistics < size < 1.05 * (needed + statistics)
        disk = ws.mount_tmpfs("disk", str(size))
        ws.monkeypatch.setattr(tempfile, "tempdir", str(disk))
        with pytest.raises(PreflightError) as error:
            converter.preflight(disk / "out", options)
        ws.monkeypatch.setattr(tempfile, "tempdir", str(ws.root))  # another disk for the statistics: no problem
        converter.preflight(disk / "out", options)
    assert "share this disk" in str(error.value) and "set TMPDIR to a folder on another disk" in str(error.value)
    assert list(disk.iterdir()) == []


@pytest.mark.parametrize("samples, seq_len", [(2, 16), (6, 40)])
def test_statistics_estimate_covers_what_calibration_writes(template, samples, seq_len):
    """Pre-flight's estimate of the temp folder's statistics (both d x d fp64 moments included) against the bytes
    the statistics pass really writes: never lower, and not wildly higher."""
    from mla_convert.convert.pipeline import Converter
    from mla_convert.convert.preflight import estimated_statistics_bytes

    options = ConvertOptions(calibration=CalibrationOptions(num_samples=samples, seq_len=seq_len))
    with Converter(template, options) as converter:
        converter.calibrate()
        written = sum(path.stat().st_size for path in converter.store.path.iterdir())
        estimate = estimated_statistics_bytes(converter.config, options.calibration)
    assert written <= estimate <= 1.25 * written, (written, estimate)


# --------------------------------------------------------------------------- security
def test_the_package_never_trusts_remote_code():
    """No call in mla_convert passes trust_remote_code other than a literal False."""
    offenders = []
    for path in (REPO / "mla_convert").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.keyword) and node.arg == "trust_remote_code":
                if not (isinstance(node.value, ast.Constant) and node.value.value is False):
                    offenders.append(f"{path.relative_to(REPO)}:{node.value.lineno}")
            if isinstance(node, ast.Dict):
                for key in node.keys:
                    if isinstance(key, ast.Constant) and key.value == "trust_remote_code":
                        offenders.append(f"{path.relative_to(REPO)}:{key.lineno}")
    assert offenders == []


def test_pickled_checkpoint_converts_only_when_allowed_and_like_safetensors(template, tmp_path):
    """With --allow-pickle a pickled copy converts to byte-identical shards (weights_only loading: see
    test_checkpoint_io.py for the malicious-pickle cases); without it the pickle-only row refuses it."""
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    state = {}
    for shard in sorted(template.glob("*.safetensors")):
        state.update(load_file(shard))
    torch.save(state, pickled / "pytorch_model.bin")
    for name in ("config.json", "generation_config.json"):
        shutil.copyfile(template / name, pickled / name)
    options = dict(calibration=CalibrationOptions(num_samples=2, seq_len=16), rope_finalists=1,
                   kv_balance_search=False)
    messages = {name: MessageLog() for name in ("from-safetensors", "from-pickle")}
    # --allow-pickle on a safetensors folder converts the same, and says that the flag did nothing
    convert(template, tmp_path / "from-safetensors", ConvertOptions(**options, allow_pickle=True),
            progress=messages["from-safetensors"])
    convert(pickled, tmp_path / "from-pickle", ConvertOptions(**options, allow_pickle=True), progress=messages["from-pickle"])
    a = (tmp_path / "from-safetensors" / "model.safetensors").read_bytes()
    b = (tmp_path / "from-pickle" / "model.safetensors").read_bytes()
    assert a == b
    unneeded = [line for line in messages["from-safetensors"].lines if "--allow-pickle" in line]
    assert unneeded == [f"note: --allow-pickle has no effect: {template} holds safetensors weights, which are read (as "
                        "transformers reads them when a folder holds both)"]
    assert not [line for line in messages["from-pickle"].lines if "--allow-pickle" in line]


class MessageLog(Progress):
    """The messages a conversion gives its progress callbacks."""

    def __init__(self):
        self.lines: list[str] = []

    def message(self, text: str) -> None:
        self.lines.append(text)


def test_a_shard_cut_short_under_an_open_reader_is_named_not_a_bus_error(tmp_path):
    """Class "sources that change under the tool": the reader holds a shard open (one layer's tensors are read from it
    in turn) and the file is truncated between two reads.  Read through a memory map, the second read touched pages
    past the new end and the process died of SIGBUS with no message; positioned reads name the file.  In a
    subprocess, so that the old failure kills a child, not the test run."""
    save_file({"a": torch.ones(256, 1024), "b": torch.ones(256, 1024)}, str(tmp_path / "model.safetensors"))
    script = (
        "import os, sys\n"
        "from mla_convert.errors import CheckpointError\n"
        "from mla_convert.io.reader import CheckpointReader\n"
        "reader = CheckpointReader(sys.argv[1])\n"
        "assert float(reader.get('a').sum()) == 256 * 1024  # the shard is open now\n"
        "os.truncate(os.path.join(sys.argv[1], 'model.safetensors'), 4096)\n"
        "try:\n"
        "    reader.get('b')\n"
        "except CheckpointError as error:\n"
        "    print(error)\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"exit {done.returncode} (SIGBUS is {-signal.SIGBUS}): {done.stderr[-2000:]}"
    assert "model.safetensors: changed size from 2,097," in done.stdout and "nothing was written" in done.stdout, done.stdout
