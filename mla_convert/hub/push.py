"""Publish a converted folder to the Hugging Face Hub.

A pushed repo is what other people download, and a broken upload cannot be taken back once someone
has fetched it, so `check_pushable` refuses anything that is not a complete mla-convert output before
a byte leaves the machine: a folder without its conversion report, a sharded checkpoint with a
missing or truncated shard, leftovers of an interrupted conversion.  `push_to_hub` then makes sure the repo gets a valid model card, and uploads with the
stock `huggingface_hub` client (`create_repo`, `create_branch`, `create_commit`) so that
authentication, retries and Xet storage are the client's, not ours.  The commit holds exactly the files the
dry run lists: the folder's files, with the card and the report's public copy (no local paths) sent from memory,
so a read-only folder can be pushed and a failed push leaves the folder as it was.

The token is never handled beyond deciding whether one exists: it is passed to `HfApi` (explicit
argument) or left for huggingface_hub to find (`HF_TOKEN`, then the login cache written by
`hf auth login`).  Nothing here prints, logs or writes it, and the upload is refused if a file in the
folder contains it (for example a command line recorded with a token in it).
"""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub.constants import SAFETENSORS_INDEX_FILE, SAFETENSORS_SINGLE_FILE
from huggingface_hub.utils import (
    DEFAULT_IGNORE_PATTERNS,
    FORBIDDEN_FOLDERS,
    HFValidationError,
    filter_repo_objects,
    validate_repo_id,
)

from ..convert.target import config_tensor_problems, export_config_problem, export_report_mismatches
from ..errors import CheckpointError, MLAConvertError
from ..io.paths import absolute_path, read_model_text, special_file_problems
from ..io.reader import read_safetensors_header
from ..io.writer import BACKUP_SUFFIX, OWNER_FILE, PARTIAL_SUFFIX
from ..units import human_bytes
from .card import (
    CARD_FILE,
    CARD_PLACEHOLDER,
    REPORT_FILE,
    CardValidationError,
    build_model_card,
    cache_report_problems,
    card_is_unedited,
    export_config,
    load_report,
    marked_card_text,
    public_report,
    validate_card,
)

# Names the checkpoint writer uses for unfinished work (`checkpoint_writer.py`; a test keeps them in sync).
_TEMP_SHARD = re.compile(r"^shard-\d+\.tmp$")
_SHARD_NAME = re.compile(r"^(?P<stem>.+)-(?P<index>\d{5})-of-(?P<total>\d{5})\.safetensors$")

# Only text-like side files are scanned for the token: weights cannot contain it by accident and
# reading gigabytes of shards for it would make every push slow.
_TOKEN_SCAN_MAX_BYTES = 64 * 1024 * 1024
_TOKEN_PATTERN = re.compile(rb"hf_[A-Za-z0-9]{30,}")


class NotPushableError(MLAConvertError):
    """The folder is incomplete or was not produced by mla-convert; nothing was uploaded."""


class HubPushError(MLAConvertError):
    """The Hub refused or failed the push (authentication, permissions, network, server-side validation)."""


@dataclass(frozen=True)
class UploadFile:
    """One file to upload: its path inside the repo (POSIX, relative to the folder) and size in bytes."""

    path: str
    size: int


@dataclass(frozen=True)
class PushResult:
    """What was (or, for a dry run, would be) uploaded, and where it went."""

    repo_id: str
    files: tuple[UploadFile, ...]
    dry_run: bool
    private: bool
    revision: str | None
    commit_message: str
    card_generated: bool  # README.md was (or would be) generated from mla_convert.json
    report_public: bool = False  # mla_convert.json is (or would be) sent with its local paths reduced to names
    local_card_note: str | None = None  # why the folder's README.md could not be updated after the push
    card_has_placeholder: bool = False  # a kept README that still loads the model from "path/to/this/model"
    repo_url: str | None = None
    commit_url: str | None = None
    commit_oid: str | None = None

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def summary(self) -> str:
        """Human-readable lines for the CLI: the exact file list with sizes, then the target."""
        verb = "Would upload" if self.dry_run else "Uploaded"
        where = f"{self.repo_id}" + (f" (branch {self.revision})" if self.revision else "")
        # a dry run knows only what was asked; a push reports what the repository is (an existing one keeps its own)
        visibility = "private" if self.private else ("default visibility" if self.dry_run else "public")
        size = f"{human_bytes(self.total_bytes, digits=1)} ({self.total_bytes:,} bytes)"
        lines = [f"{verb} {len(self.files)} files, {size} to {where}, {visibility}:"]
        width = max((len(f"{f.size:,}") for f in self.files), default=1)
        for item in self.files:
            note = "  (generated from mla_convert.json)" if item.path == CARD_FILE and self.card_generated else ""
            if item.path == REPORT_FILE and self.report_public:
                note = "  (local paths reduced to their names, as in the card)"
            if item.path == CARD_FILE and self.card_has_placeholder:
                note = (f"  (kept as it is: edited or not written by mla-convert; it still loads {CARD_PLACEHOLDER}: "
                        "delete it to have the card generated with the repository id)")
            lines.append(f"  {item.size:>{width},}  {item.path}{note}")
        lines.append(f"commit message: {self.commit_message}")
        if self.commit_url:
            lines.append(f"commit: {self.commit_url}")
        if self.local_card_note:
            lines.append(f"note: {self.local_card_note}")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------- folder checks
def _folder_files(folder: Path) -> list[str]:
    """The folder's files as `upload_folder` would walk them (its default ignore rules), without those under a folder
    the Hub refuses to hold (`.git`, `.cache`: listing them made the dry run promise a commit the Hub rejects)."""
    names = sorted(p.relative_to(folder).as_posix() for p in folder.glob("**/*") if p.is_file())
    names = [name for name in names if not set(name.split("/")[:-1]) & set(FORBIDDEN_FOLDERS)]
    return list(filter_repo_objects(names, ignore_patterns=DEFAULT_IGNORE_PATTERNS))


def _read_json(path: Path) -> tuple[object | None, str | None]:
    try:
        return json.loads(read_model_text(path)), None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        return None, f"{path.name} is not valid JSON ({' '.join(str(error).split())})"


def _safetensors_header(path: Path) -> tuple[dict[str, tuple[int, ...]], str | None]:
    """Tensor names and shapes in a safetensors file, and a problem if it is truncated or corrupt (header only)."""
    try:
        header = read_safetensors_header(path)
    except CheckpointError as error:
        return {}, str(error).replace(str(path), path.name)
    return {name: tuple(info["shape"]) for name, info in header.items() if name != "__metadata__"}, None


def _dtype_problems(folder: Path) -> list[str]:
    """The loader's rule: every stored tensor is floating point (`io.hf_loading.non_floating_problems`)."""
    from ..io.hf_loading import non_floating_problems
    from ..io.reader import CheckpointReader

    with CheckpointReader(folder) as reader:
        return [problem.replace(f"{folder}/", "") for problem in non_floating_problems(reader)]


def _weight_problems(folder: Path, files: list[str], tensors: dict[str, tuple[int, ...]]) -> list[str]:
    """Why the safetensors files are not one complete checkpoint; fills `tensors` (name -> shape) with what they hold."""
    index_path = folder / SAFETENSORS_INDEX_FILE
    single = folder / SAFETENSORS_SINGLE_FILE
    on_disk = {name for name in files if "/" not in name and name.endswith(".safetensors")}
    problems: list[str] = []
    if not index_path.is_file():
        if not single.is_file():
            shards = sorted(name for name in on_disk if _SHARD_NAME.match(name))
            if shards:
                return [f"{shards[0]} is present but {SAFETENSORS_INDEX_FILE} is missing"]
            return [f"no weights: neither {SAFETENSORS_SINGLE_FILE} nor {SAFETENSORS_INDEX_FILE} is present"]
        found, problem = _safetensors_header(single)
        tensors.update(found)
        return [problem] if problem else []

    if single.is_file():
        problems.append(
            f"both {SAFETENSORS_SINGLE_FILE} and {SAFETENSORS_INDEX_FILE} are present; one is a leftover of another run"
        )
    index, problem = _read_json(index_path)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if problem or not isinstance(weight_map, dict) or not weight_map:
        return problems + [problem or f"{SAFETENSORS_INDEX_FILE} has no weight_map"]
    if not all(isinstance(shard, str) for shard in weight_map.values()):
        return problems + [f"{SAFETENSORS_INDEX_FILE}: weight_map values must be file names"]

    named = set(weight_map.values())
    for shard in sorted(named):
        if shard not in on_disk:
            problems.append(f"{shard} is named in {SAFETENSORS_INDEX_FILE} but missing")
    # A shard name `model-00002-of-00003` also implies its siblings 1 and 3 exist.
    for stem, total in sorted({(m["stem"], int(m["total"])) for m in map(_SHARD_NAME.match, named) if m}):
        for index_number in range(1, total + 1):
            expected = f"{stem}-{index_number:05d}-of-{total:05d}.safetensors"
            if expected in named:
                continue
            if expected in on_disk:
                problems.append(f"{expected} is not referenced by {SAFETENSORS_INDEX_FILE}")
            else:
                problems.append(f"{expected} is missing (the index names shards of {total})")
    for stray in sorted(on_disk - named - {SAFETENSORS_SINGLE_FILE}):
        if not any(stray in p for p in problems):
            problems.append(f"{stray} is not named in {SAFETENSORS_INDEX_FILE}")

    for shard in sorted(named & on_disk):
        found, problem = _safetensors_header(folder / shard)
        if problem:
            problems.append(problem)
            continue
        tensors.update(found)
        absent = sorted(name for name, where in weight_map.items() if where == shard and name not in found)
        if absent:
            problems.append(
                f"{len(absent)} tensors that {SAFETENSORS_INDEX_FILE} places in {shard} are not in it (e.g. {absent[0]})"
            )
    return problems


def check_pushable(folder: str | Path) -> list[UploadFile]:
    """Return the files to upload, or raise `NotPushableError` naming every problem found.

    Refused: a folder without `mla_convert.json` (not produced by mla-convert, so the card and the
    provenance would be missing), without a DeepseekV3 `config.json`, with a report whose KV-cache numbers are not
    what config.json caches (hand-edited or stale: the card and the report would disagree), with weights that do not form a
    complete checkpoint (a single-file model without `model.safetensors`, index entries pointing at
    shards that are missing, shards missing from a numbered series, stray or truncated shards, tensors
    absent from the shard the index names), weights that are not the tensors and shapes transformers builds for
    its config.json (files of two conversions mixed), or with traces of an unfinished conversion
    (`*.mla-convert-partial`, the writer's owner file or temporary shards).
    """
    folder = absolute_path(folder)  # `.` (run from inside the model folder) has no name to look beside
    if not folder.is_dir():
        raise NotPushableError(f"{folder}: not a folder")
    special = special_file_problems(folder, recursive=True)
    if special:  # read by the checks below or by the upload, a FIFO or device blocks the command for good
        raise NotPushableError("\n".join(f"{folder}: cannot push: {problem.replace(f'{folder}/', '')}" for problem in special))
    problems: list[str] = []
    if folder.name.endswith(PARTIAL_SUFFIX) or folder.name.endswith(BACKUP_SUFFIX):
        problems.append(f"{folder.name} is the working folder of an unfinished or interrupted conversion")
    sibling = folder.with_name(folder.name + PARTIAL_SUFFIX)
    if sibling.exists():
        problems.append(f"{sibling.name} exists beside it: a conversion into this folder is running or was interrupted")
    leftovers = sorted(
        p.relative_to(folder).as_posix()
        for p in folder.glob("**/*")
        if p.name.endswith(PARTIAL_SUFFIX) or p.name == OWNER_FILE or (p.is_file() and _TEMP_SHARD.match(p.name))
    )
    if leftovers:
        problems.append(f"leftovers of an unfinished conversion inside it: {', '.join(leftovers)}")

    files = _folder_files(folder)
    root = folder.resolve()
    leaving = [name for name in files if not (folder / name).resolve().is_relative_to(root)]
    if leaving:  # the upload reads through a link: /etc/passwd or a token file would be published under its name
        problems.append(f"links to files outside the folder, whose contents would be uploaded: {', '.join(leaving)} "
                        "(copy the files in, or remove the links)")
    if not (folder / REPORT_FILE).is_file():
        problems.append(f"{REPORT_FILE} is missing: this folder was not produced by mla-convert")
    else:
        try:
            report = load_report(folder)
            mismatches = export_report_mismatches(folder, report, REPORT_FILE)
            # the card states config.json's cache numbers; the report uploaded beside it must not state others
            problems += mismatches or cache_report_problems(report, export_config(folder), REPORT_FILE)
        except CardValidationError as error:
            problems.append(str(error).replace(str(folder / REPORT_FILE), REPORT_FILE))
    config_problem = export_config_problem(folder)
    if config_problem:
        problems.append(config_problem)
    tensors: dict[str, tuple[int, ...]] = {}
    weight_problems = _weight_problems(folder, files, tensors)
    problems += weight_problems
    if not config_problem and not weight_problems:  # complete weights: are they the model config.json describes?
        problems += config_tensor_problems(folder, tensors)
        problems += _dtype_problems(folder)
    if problems:
        raise NotPushableError("\n".join(f"{folder}: cannot push: {problem}" for problem in problems))  # a line each
    return [UploadFile(name, (folder / name).stat().st_size) for name in files]


def _files_containing(folder: Path, files: list[UploadFile], found: Callable[[bytes], object]) -> list[str]:
    """Paths of the side files (not weights, not huge) whose bytes satisfy `found`."""
    hits = []
    for item in files:
        if item.path.endswith(".safetensors") or item.size > _TOKEN_SCAN_MAX_BYTES:
            continue
        if found((folder / item.path).read_bytes()):
            hits.append(item.path)
    return hits


# ---------------------------------------------------------------------------------------------- push
def _card_for(folder: Path, repo_id: str) -> tuple[str, bool]:
    """The README.md text to upload and whether it is (re)generated from `mla_convert.json`.

    A missing README is generated for `repo_id`.  The card mla-convert wrote has placeholder paths in its
    loading snippets (the repo was not known then); while the README is still that card, unedited (its mark,
    whichever version wrote it), it is regenerated with the repo id.  Any other README is the user's: kept as it
    is, but validated.
    """
    readme = folder / CARD_FILE
    report, config = load_report(folder), export_config(folder)
    if readme.is_file():
        text = read_model_text(readme)
        if not card_is_unedited(text) and text != str(build_model_card(report, config=config)):
            validate_card(text, ours=False)  # the user's card: only what the Hub would refuse is refused
            return text, False
    card = build_model_card(report, repo_id=repo_id, config=config)
    validate_card(card)
    return marked_card_text(card), True  # still the tool's own card after the push (a later update may regenerate it)


# Branch names git's check-ref-format accepts (the Hub stores each revision as a git branch); the dry run says so
# before the upload would fail on it.
_GIT_BRANCH_NAME = re.compile(r"(?!-)(?!/)(?!.*\.\.)(?!.*//)(?!.*@\{)(?!.*(?:\.lock|/|\.)$)(?!.*/\.)(?!\.)[^\x00-\x20\x7f~^:?*\[\\]+")


def _default_commit_message(folder: Path) -> str:
    try:
        report = load_report(folder)
    except CardValidationError:
        report = {}
    source = report.get("source") if isinstance(report.get("source"), dict) else {}
    # A Hub id names the source exactly; a local path is reduced to its folder name (no home paths in commits).
    name = source.get("hub_id") or (Path(str(source["name_or_path"])).name if source.get("name_or_path") else None)
    version = report.get("mla_convert_version")
    return "Upload MLA conversion" + (f" of {name}" if name else "") + (f" (mla-convert {version})" if version else "")


def _describe_http_error(error: Exception, repo_id: str) -> str:
    response = getattr(error, "response", None)
    status = getattr(response, "status_code", None)
    server = getattr(error, "server_message", None) or ""
    detail = " ".join(str(server or error).split())
    if status == 401:
        return (
            f"push to {repo_id} refused: not authenticated (HTTP 401); "
            f"log in with `hf auth login` or set HF_TOKEN ({detail})"
        )
    if status == 403:
        return (
            f"push to {repo_id} refused: your token cannot write to this repo "
            f"(HTTP 403; a write token is needed) ({detail})"
        )
    return f"push to {repo_id} failed" + (f" (HTTP {status})" if status else "") + f": {detail}"


def _transport_errors() -> tuple[type[BaseException], ...]:
    """Connection-level failures of the HTTP client huggingface_hub uses (httpx2 in 2.x, httpx in 1.x)."""
    classes: list[type[BaseException]] = [OSError]
    for module_name in ("httpx2", "httpx"):
        try:
            classes.append(importlib.import_module(module_name).TransportError)
        except (ImportError, AttributeError):
            continue
    return tuple(classes)


NOT_LOGGED_IN = "not logged in to the Hugging Face Hub: run `hf auth login` or set HF_TOKEN"


def push_setting_problems(repo_id: str, revision: str | None = None, need_token: bool = False) -> list[str]:
    """What would refuse a push of any folder to `repo_id`, found without the network.

    `convert --push-to-hub` asks this before converting, so that a typo in the repo id (or a missing
    token) does not surface only after a conversion of minutes or hours.
    """
    from huggingface_hub import get_token

    problems = []
    # The namespace is required, not left for the Hub to fill in: the card's loading snippets name the
    # repo, and the dry run must show the exact bytes of that card without asking the Hub who we are.
    try:
        validate_repo_id(repo_id)
        if repo_id.count("/") != 1:
            raise HFValidationError("no namespace")
    except HFValidationError:
        problems.append(f"invalid repo id {repo_id!r}: use 'namespace/name' (your user or organisation, then the model name)")
    if revision is not None and not revision.strip():
        problems.append("--revision: must not be empty")
    elif revision is not None and not _GIT_BRANCH_NAME.fullmatch(revision):
        problems.append(f"--revision {revision!r}: not a branch name git accepts (no spaces, '..', '~^:?*[\\', "
                        "leading '-' or '/', trailing '/', '.' or '.lock')")
    if need_token and not get_token():
        problems.append(NOT_LOGGED_IN)
    return problems


def push_to_hub(
    folder: str | Path,
    repo_id: str,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
    dry_run: bool = False,
    token: str | None = None,
    endpoint: str | None = None,
) -> PushResult:
    """Upload a converted folder to `repo_id` on the Hub (creating the repo and branch if needed).

    `dry_run=True` makes no network call and writes nothing: it checks the folder and the card and
    returns exactly the files and sizes the real push would upload.  Without `private`, the repo gets
    the namespace's default visibility (nothing is made public against an organisation's default);
    an existing repo's visibility is left unchanged, so `private` on an existing public repo is refused before
    anything is uploaded, and the result reports the repository's actual visibility.  `endpoint` overrides the Hub URL (default: the
    `HF_ENDPOINT` huggingface_hub read at import); the token is the explicit argument or, if None,
    whatever huggingface_hub finds (`HF_TOKEN`, then the `hf auth login` cache).
    """
    folder = absolute_path(folder)
    problems = push_setting_problems(repo_id, revision)
    if commit_message is not None and not commit_message.strip():  # it fell back to the default message unsaid
        problems.append("--commit-message: must not be empty (leave it out for the default message)")
    if problems:
        raise HubPushError("\n".join(problems))

    files = check_pushable(folder)
    card_text, generated = _card_for(folder, repo_id)
    report = load_report(folder)
    public = public_report(report)
    in_memory = {CARD_FILE: card_text} if generated else {}
    if public != report:
        in_memory[REPORT_FILE] = json.dumps(public, indent=2) + "\n"
    sizes = {path: len(text.encode("utf-8")) for path, text in in_memory.items()}
    files = sorted([UploadFile(item.path, sizes.pop(item.path, item.size)) for item in files]
                   + [UploadFile(path, size) for path, size in sizes.items()], key=lambda f: f.path)
    # The files mla-convert writes from user input are checked for anything shaped like a token, even
    # in a dry run (the card generator redacts them, a hand-edited card or report may not).
    token_like = [CARD_FILE] if _TOKEN_PATTERN.search(card_text.encode("utf-8")) else []
    token_like += _files_containing(folder, [f for f in files if f.path == REPORT_FILE], _TOKEN_PATTERN.search)
    if token_like:
        raise NotPushableError(
            f"{folder}: {', '.join(token_like)} contains what looks like a Hugging Face token; remove it first"
        )
    message = commit_message or _default_commit_message(folder)
    plan = dict(
        repo_id=repo_id,
        files=tuple(files),
        private=private,
        revision=revision,
        commit_message=message,
        card_generated=generated,
        card_has_placeholder=not generated and CARD_PLACEHOLDER in card_text,
        report_public=REPORT_FILE in in_memory,
    )
    from huggingface_hub import get_token

    # The dry run scans for the token too whenever one is available: it listed a file holding it as "Would upload"
    # while the real push refused it.  (Without a token it has nothing to look for, and needs none.)
    resolved = token or get_token()
    if resolved:
        secret = resolved.encode("utf-8")
        leaking = _files_containing(folder, [item for item in files if item.path not in in_memory],
                                    lambda data: secret in data)
        leaking += [path for path, text in in_memory.items() if secret in text.encode("utf-8")]
        if leaking:
            raise NotPushableError(f"{folder}: {', '.join(leaking)} contains your Hugging Face token; remove it before pushing")
    if dry_run:
        return PushResult(dry_run=True, **plan)

    from huggingface_hub import CommitOperationAdd, HfApi
    from huggingface_hub.errors import HfHubHTTPError

    if not resolved:
        raise HubPushError(NOT_LOGGED_IN)

    # Exactly the checked list, so the upload can never differ from what dry-run shows.
    operations = [CommitOperationAdd(path_in_repo=item.path, path_or_fileobj=in_memory[item.path].encode("utf-8")
                                     if item.path in in_memory else str(folder / item.path)) for item in files]
    api = HfApi(endpoint=endpoint, token=resolved)
    try:
        repo_url = api.create_repo(repo_id, private=True if private else None, exist_ok=True, repo_type="model")
        is_private = bool(api.repo_info(repo_id, repo_type="model").private)  # what the repository is, not what was asked
        if private and not is_private:
            raise HubPushError(f"--private: {repo_id} already exists and is public; push does not change a repository's "
                               "visibility (change it in the repository's settings on the Hub, or push without --private)")
        if revision and revision != "main" and not revision.startswith("refs/"):
            api.create_branch(repo_id, branch=revision, exist_ok=True, repo_type="model")
        info = api.create_commit(repo_id=repo_id, operations=operations, commit_message=message, revision=revision,
                                 repo_type="model")
    except HfHubHTTPError as error:
        raise HubPushError(_describe_http_error(error, repo_id)) from error
    except ValueError as error:  # the Hub's validate-yaml rejected the card, or a malformed server answer
        raise HubPushError(f"push to {repo_id} failed: {' '.join(str(error).split())}") from error
    except _transport_errors() as error:
        raise HubPushError(f"cannot reach the Hub at {api.endpoint}: {' '.join(str(error).split())}") from error
    plan["private"] = is_private
    local_card_note = None
    if generated:  # the folder's card names the repository now, as the pushed one does
        try:
            (folder / CARD_FILE).write_text(card_text, encoding="utf-8", newline="")
        except OSError as error:
            local_card_note = f"the folder's {CARD_FILE} was not updated with the repository id ({error.strerror or error})"
    return PushResult(
        dry_run=False,
        local_card_note=local_card_note,
        repo_url=str(repo_url),
        commit_url=getattr(info, "commit_url", None),
        commit_oid=getattr(info, "oid", None),
        **plan,
    )
