"""Pushing a converted folder: the real huggingface_hub client against a local fake Hub (`fake_hub.py`).

How the client is pointed at the fake Hub: huggingface_hub reads `HF_ENDPOINT` into
`constants.ENDPOINT` once, at import, so setting the variable inside an already-running test process
would silently keep the real endpoint.  In-process tests therefore pass `endpoint=hub.url` explicitly
(`HfApi(endpoint=...)`, which every call of the upload uses); the subprocess tests set `HF_ENDPOINT`
(and `HF_TOKEN` or `HF_TOKEN_PATH`) in a fresh interpreter, which is the path a user of
`mla-convert push` takes, and lets the tests read everything the process printed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fake_hub import FakeHub
from test_model_card import make_converted_folder

from mla_convert.errors import MLAConvertError
from mla_convert.hub.card import CardValidationError, public_report, validate_card
from mla_convert.hub.push import (
    BACKUP_SUFFIX,
    OWNER_FILE,
    PARTIAL_SUFFIX,
    HubPushError,
    NotPushableError,
    UploadFile,
    check_pushable,
    push_to_hub,
)

TOKEN = "hf_testTOKENmlaConvertDoNotLeak0123456789XYZ"
REPO = "alice/stories260k-mla"


# ------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def templates(tmp_path_factory) -> dict[str, Path]:
    """One single-file and one sharded converted folder, built once; tests work on copies."""
    root = tmp_path_factory.mktemp("converted")
    return {
        "single": make_converted_folder(root / "single"),
        "sharded": make_converted_folder(root / "sharded", sharded=True),
    }


@pytest.fixture
def single(templates, tmp_path) -> Path:
    return Path(shutil.copytree(templates["single"], tmp_path / "stories260k-mla"))


@pytest.fixture
def sharded(templates, tmp_path) -> Path:
    return Path(shutil.copytree(templates["sharded"], tmp_path / "stories260k-mla"))


@pytest.fixture
def hub():
    with FakeHub(token=TOKEN) as server:
        yield server
    assert server.unexpected == [], f"the client called endpoints the fake hub does not know: {server.unexpected}"


def folder_files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def files_containing(root: Path, needle: str) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and needle.encode() in p.read_bytes()]


# --------------------------------------------------------------------------------------------- pushing
@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_push_uploads_every_file_byte_identical_with_options(layout, templates, tmp_path, hub):
    folder = Path(shutil.copytree(templates[layout], tmp_path / "out"))
    assert not (folder / "README.md").exists()

    result = push_to_hub(
        folder, REPO, private=True, revision="mla-v1", commit_message="MLA 4x", token=TOKEN, endpoint=hub.url
    )

    local = folder_files(folder)
    assert "README.md" in local  # generated from mla_convert.json, and kept in the folder after the upload
    # every file, byte for byte, nothing else; the report without the converting machine's paths
    report = json.loads(local["mla_convert.json"])
    assert report["source"]["name_or_path"].startswith("..") and "../" in report["command"]
    local["mla_convert.json"] = (json.dumps(public_report(report), indent=2) + "\n").encode()
    assert hub.files(REPO, "mla-v1") == local
    pushed = json.loads(local["mla_convert.json"])
    assert pushed["source"]["name_or_path"] == "stories260k" and "../" not in pushed["command"]
    assert "(local paths reduced to their names, as in the card)" in result.summary()
    assert hub.files(REPO, "main") == {}  # the branch, not main
    assert [(f.path, f.size) for f in result.files] == [(name, len(data)) for name, data in local.items()]

    repo = hub.repos[REPO]
    assert repo.private
    assert [(c["revision"], c["summary"]) for c in repo.commits] == [("mla-v1", "MLA 4x")]
    assert hub.endpoints() == ["POST create", "GET repo-info", "POST branch", "POST validate-yaml", "POST preupload", "POST commit"]
    assert all(r.headers.get("authorization") == f"Bearer {TOKEN}" for r in hub.requests if "validate" not in r.path)
    # What the client described before uploading matches the files (size and leading bytes).
    described = {entry["path"]: entry for entry in repo.preuploads}
    assert {p: e["size"] for p, e in described.items()} == {p: len(d) for p, d in local.items()}
    assert result.commit_url.endswith(repo.commits[0]["oid"]) and not result.dry_run


def test_pushed_repo_loads_as_stock_deepseek_v3_with_a_valid_card(sharded, tmp_path, hub):
    import torch
    from huggingface_hub import ModelCard
    from transformers import AutoModelForCausalLM

    push_to_hub(sharded, REPO, token=TOKEN, endpoint=hub.url)
    downloaded = tmp_path / "downloaded"
    for name, data in hub.files(REPO).items():
        (downloaded / name).parent.mkdir(parents=True, exist_ok=True)
        (downloaded / name).write_bytes(data)

    metadata = validate_card(ModelCard.load(downloaded / "README.md"))
    assert metadata["library_name"] == "transformers" and "mla" in metadata["tags"]
    assert hub.validated_cards == [(downloaded / "README.md").read_text()]  # the Hub-side check saw this card

    model = AutoModelForCausalLM.from_pretrained(downloaded, dtype=torch.bfloat16)
    original = AutoModelForCausalLM.from_pretrained(sharded, dtype=torch.bfloat16)
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    for (name, tensor), (_, reference) in zip(model.state_dict().items(), original.state_dict().items(), strict=True):
        assert torch.equal(tensor, reference), name


def test_default_push_targets_main_without_forcing_visibility(single, hub):
    result = push_to_hub(single, REPO, token=TOKEN, endpoint=hub.url)
    create = hub.requests[0].json()
    assert create == {"name": "stories260k-mla", "organization": "alice", "type": "model"}  # no visibility: namespace default
    assert hub.endpoints() == ["POST create", "GET repo-info", "POST validate-yaml", "POST preupload", "POST commit"]
    assert set(hub.files(REPO)) == {f.path for f in result.files}
    assert hub.repos[REPO].commits[0]["summary"] == "Upload MLA conversion of stories260k (mla-convert 0.1.0)"


def test_pushing_again_reuses_the_existing_repo_and_branch(single, hub):
    push_to_hub(single, REPO, revision="mla-v1", token=TOKEN, endpoint=hub.url)
    (single / "generation_config.json").write_text('{"max_new_tokens": 7}\n')
    push_to_hub(single, REPO, revision="mla-v1", commit_message="second", token=TOKEN, endpoint=hub.url)
    assert [c["summary"] for c in hub.repos[REPO].commits][-1] == "second"
    assert hub.files(REPO, "mla-v1")["generation_config.json"] == b'{"max_new_tokens": 7}\n'
    assert hub.endpoints()[6:9] == ["POST create", "GET repo-info", "POST branch"]  # create and branch answered 409, accepted


def test_existing_readme_is_uploaded_as_is(single, hub):
    card = "---\nlibrary_name: transformers\npipeline_tag: text-generation\ntags:\n- mla\n---\n\n# Hand-written\n"
    (single / "README.md").write_text(card)
    result = push_to_hub(single, REPO, token=TOKEN, endpoint=hub.url)
    assert not result.card_generated
    assert hub.files(REPO)["README.md"] == card.encode()


def test_the_card_convert_wrote_is_refreshed_with_the_repo_id(single, hub):
    from mla_convert.hub.card import build_model_card, load_report

    build_model_card(load_report(single)).save(single / "README.md")  # as `convert` leaves it
    assert 'from_pretrained("path/to/this/model"' in (single / "README.md").read_text()
    plan = push_to_hub(single, REPO, dry_run=True)
    result = push_to_hub(single, REPO, token=TOKEN, endpoint=hub.url)
    uploaded = hub.files(REPO)["README.md"].decode()
    assert result.card_generated and plan.files == result.files
    assert f'AutoModelForCausalLM.from_pretrained("{REPO}"' in uploaded and "path/to/this/model" not in uploaded
    assert (single / "README.md").read_text() == uploaded


def test_a_card_an_earlier_version_wrote_is_still_refreshed_but_an_edited_one_is_kept(single, hub):
    """The card was recognised as the tool's only while it equalled this version's card byte for byte: a folder
    converted before any wording change uploaded a card loading "path/to/this/model", presented as the user's."""
    from mla_convert.hub.card import build_model_card, load_report, save_card

    older = str(build_model_card(load_report(single))).replace("## Caveats", "## Caveats (older wording)")
    save_card(older, single / "README.md")  # an unedited card, in an earlier version's words
    plan = push_to_hub(single, REPO, dry_run=True)
    assert plan.card_generated and "(generated from mla_convert.json)" in plan.summary()
    (single / "README.md").write_text((single / "README.md").read_text() + "\nMy own notes.\n")  # edited: the user's
    plan = push_to_hub(single, REPO, dry_run=True)
    assert not plan.card_generated and plan.card_has_placeholder
    assert "kept as it is: edited or not written by mla-convert; it still loads path/to/this/model" in plan.summary()
    pushed = push_to_hub(single, REPO, token=TOKEN, endpoint=hub.url)
    assert "My own notes." in hub.files(REPO)["README.md"].decode() and not pushed.card_generated


def test_update_card_refuses_to_replace_an_edited_card_before_evaluating(single):
    """`eval --update-card` regenerated README.md and the user's notes in it were gone without a word."""
    from mla_convert.hub.card import build_model_card, card_update_problems, load_report, save_card

    save_card(build_model_card(load_report(single)), single / "README.md")
    assert card_update_problems(single, "src") == []
    (single / "README.md").write_text((single / "README.md").read_text() + "\nMy own notes.\n")
    problems = card_update_problems(single, "src")
    assert len(problems) == 1 and "has text mla-convert did not write" in problems[0]
    assert "My own notes." in (single / "README.md").read_text()


# ---------------------------------------------------------------------------------------------- dry run
def test_dry_run_makes_no_request_writes_nothing_and_lists_exact_files(sharded, hub):
    before = folder_files(sharded)
    plan = push_to_hub(sharded, REPO, private=True, revision="v2", dry_run=True, token=TOKEN, endpoint=hub.url)

    assert hub.requests == []
    assert folder_files(sharded) == before  # README.md not written by a dry run
    expected = sorted([*before, "README.md"])
    assert [f.path for f in plan.files] == expected
    assert all(f.size == len(before[f.path]) for f in plan.files if f.path not in ("README.md", "mla_convert.json"))
    summary = plan.summary()
    assert summary.startswith(f"Would upload {len(expected)} files")
    for item in plan.files:
        assert f"{item.size:,}  {item.path}" in summary
    assert "alice/stories260k-mla (branch v2), private" in summary

    # The real push then uploads exactly that list, with those sizes.
    pushed = push_to_hub(sharded, REPO, private=True, revision="v2", token=TOKEN, endpoint=hub.url)
    assert pushed.files == plan.files
    assert {p: len(d) for p, d in hub.files(REPO, "v2").items()} == {f.path: f.size for f in plan.files}


def test_dry_run_needs_no_token(single, monkeypatch, tmp_path, hub):
    import huggingface_hub.constants

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    plan = push_to_hub(single, REPO, dry_run=True, endpoint=hub.url)
    assert plan.dry_run and hub.requests == []
    with pytest.raises(HubPushError, match="not logged in"):
        push_to_hub(single, REPO, endpoint=hub.url)
    assert hub.requests == []


# ---------------------------------------------------------------------------------------------- token
def test_token_is_sent_but_never_printed_logged_or_written(single, tmp_path, hub, capfd, caplog):
    from huggingface_hub.utils import logging as hub_logging

    previous = hub_logging.get_verbosity()
    hub_logging.set_verbosity_debug()
    try:
        with caplog.at_level("DEBUG"):
            result = push_to_hub(single, REPO, private=True, revision="v1", token=TOKEN, endpoint=hub.url)
            print(result.summary(), repr(result))
    finally:
        hub_logging.set_verbosity(previous)

    assert any(r.headers.get("authorization") == f"Bearer {TOKEN}" for r in hub.requests)  # it did arrive
    out, err = capfd.readouterr()
    assert "stories260k-mla" in out  # the output was captured...
    assert TOKEN not in out and TOKEN not in err  # ...and holds no token
    assert TOKEN not in caplog.text and TOKEN not in "\n".join(hub.log)
    assert files_containing(tmp_path, TOKEN) == []
    assert all(TOKEN.encode() not in data for data in hub.files(REPO, "v1").values())


PUSH_SCRIPT = (
    "import sys\n"
    "from mla_convert.hub.push import push_to_hub\n"
    "result = push_to_hub(sys.argv[1], sys.argv[2], private=True, revision='from-env')\n"
    "print(result.summary())\n"
)


@pytest.mark.parametrize("source", ["HF_TOKEN", "login cache"])
def test_token_from_the_standard_places_in_a_fresh_process(source, single, tmp_path, hub):
    home = tmp_path / "hf_home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE_"))}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(home), HF_HUB_VERBOSITY="debug", HF_HUB_DISABLE_TELEMETRY="1")
    token_file = home / "token"
    if source == "HF_TOKEN":
        env["HF_TOKEN"] = TOKEN
    else:
        token_file.write_text(TOKEN)  # what `hf auth login` leaves behind

    done = subprocess.run(
        [sys.executable, "-c", PUSH_SCRIPT, str(single), REPO],
        env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Uploaded" in done.stdout and "README.md" in done.stdout
    assert hub.requests and all(r.headers.get("authorization") == f"Bearer {TOKEN}" for r in hub.requests)
    assert hub.repos[REPO].private and set(hub.files(REPO, "from-env")) == set(folder_files(single))
    assert TOKEN not in done.stdout and TOKEN not in done.stderr
    written = [p for p in files_containing(tmp_path, TOKEN) if Path(p) != token_file]
    assert written == []


@pytest.mark.parametrize("where", ["mla_convert.json", "generation_config.json"])
def test_refuses_a_folder_that_contains_the_token(where, single, hub):
    path = single / where
    data = json.loads(path.read_text())
    data["command" if where == "mla_convert.json" else "note"] = f"mla-convert convert x y --token {TOKEN}"
    path.write_text(json.dumps(data))
    with pytest.raises(NotPushableError, match="token"):
        push_to_hub(single, REPO, token=TOKEN, endpoint=hub.url)
    assert hub.requests == []


def test_refuses_a_folder_that_contains_an_unusual_token_verbatim(single, hub):
    odd = "my-private-gateway-token-42"
    (single / "notes.txt").write_text(f"pushed with {odd}\n")
    with pytest.raises(NotPushableError, match="notes.txt contains your Hugging Face token"):
        push_to_hub(single, REPO, token=odd, endpoint=hub.url)
    assert hub.requests == []


def test_dry_run_refuses_a_file_holding_the_token_as_the_push_does(single, monkeypatch, hub):
    """`push --dry-run` listed notes.txt holding the value of HF_TOKEN as "Would upload" while the real push refused
    it (found by the runtime/push probe): the dry run scans for the token whenever one is available."""
    from typer.testing import CliRunner

    from mla_convert.cli import app

    odd = "my-private-gateway-token-42"
    (single / "notes.txt").write_text(f"pushed with {odd}\n")
    monkeypatch.setenv("HF_TOKEN", odd)
    result = CliRunner().invoke(app, ["push", str(single), REPO, "--dry-run"])
    assert result.exit_code != 0, result.output
    assert f"error: {single}: notes.txt contains your Hugging Face token; remove it before pushing" in \
        " ".join(result.output.split()), result.output
    assert "Would upload" not in result.output
    with pytest.raises(NotPushableError, match="notes.txt contains your Hugging Face token"):
        push_to_hub(single, REPO, dry_run=True, token=odd, endpoint=hub.url)
    (single / "notes.txt").unlink()
    assert push_to_hub(single, REPO, dry_run=True, endpoint=hub.url).dry_run
    assert hub.requests == []


# ----------------------------------------------------------------------------------- Hub-side failures
def test_wrong_token_becomes_one_clear_line(single, hub):
    with pytest.raises(HubPushError) as caught:
        push_to_hub(single, REPO, token="hf_wrongTOKENabcdefghijklmnopqrstuvwxyz0123", endpoint=hub.url)
    message = str(caught.value)
    assert "not authenticated (HTTP 401)" in message and "\n" not in message
    assert "hf_wrongTOKEN" not in message
    assert hub.endpoints() == ["POST create", "GET repo-info"]  # after a 401, create_repo asks whether the repo exists
    assert hub.repos == {}


def test_a_failed_push_leaves_the_folder_as_it_was(single, hub):
    """The card was written into the folder before the upload: a refused push had already rewritten README.md (and a
    read-only folder crashed with a traceback).  The card and the public report are now sent from memory."""
    before = folder_files(single)
    with pytest.raises(HubPushError, match="HTTP 401"):
        push_to_hub(single, REPO, token="hf_wrongTOKENabcdefghijklmnopqrstuvwxyz0123", endpoint=hub.url)
    assert folder_files(single) == before


def test_private_on_an_existing_public_repo_is_refused_before_uploading(single, hub):
    """The summary said "private" while the existing public repository stayed public."""
    first = push_to_hub(single, REPO, token=TOKEN, endpoint=hub.url)
    assert "alice/stories260k-mla, public:" in first.summary() and not first.private
    with pytest.raises(HubPushError, match="--private: alice/stories260k-mla already exists and is public"):
        push_to_hub(single, REPO, private=True, token=TOKEN, endpoint=hub.url)
    assert len(hub.repos[REPO].commits) == 1 and not hub.repos[REPO].private


def test_files_under_folders_the_hub_refuses_are_not_listed_or_sent(single, hub):
    """A dry run listed .cache/x/y; the real push then failed on it ("cannot update files under a '.cache/' folder")."""
    (single / ".cache" / "x").mkdir(parents=True)
    (single / ".cache" / "x" / "y").write_text("d")
    plan = push_to_hub(single, REPO, dry_run=True)
    assert not [item for item in plan.files if item.path.startswith(".cache/")]
    pushed = push_to_hub(single, REPO, token=TOKEN, endpoint=hub.url)
    assert pushed.files == plan.files and ".cache/x/y" not in hub.files(REPO)


def test_a_link_to_a_file_outside_the_folder_is_refused(single, tmp_path, hub):
    """A link to /etc/passwd inside the folder was listed by the dry run and its target's contents would have been
    uploaded under the link's name.  Links within the folder are files of the model like any other."""
    secret = tmp_path / "secret.txt"
    secret.write_text("not for the hub")
    (single / "extra.txt").symlink_to(secret)
    (single / "notes").mkdir()
    (single / "notes" / "config-link.json").symlink_to(single / "config.json")
    for dry_run in (True, False):
        with pytest.raises(NotPushableError, match=r"links to files outside the folder, whose contents would be uploaded: "
                                               r"extra\.txt \(copy"):
            push_to_hub(single, REPO, dry_run=dry_run, token=TOKEN, endpoint=hub.url)
    assert REPO not in hub.repos
    (single / "extra.txt").unlink()
    plan = push_to_hub(single, REPO, dry_run=True)
    assert "notes/config-link.json" in [item.path for item in plan.files]


def test_an_empty_commit_message_is_refused(single, hub):
    with pytest.raises(HubPushError, match="--commit-message: must not be empty"):
        push_to_hub(single, REPO, commit_message=" ", token=TOKEN, endpoint=hub.url)
    assert hub.requests == []


def test_unreachable_hub_becomes_one_clear_line(single):
    import socket

    with socket.socket() as sock:  # a port that was free a moment ago: nothing listens there
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(HubPushError, match=f"cannot reach the Hub at http://127.0.0.1:{port}"):
        push_to_hub(single, REPO, token=TOKEN, endpoint=f"http://127.0.0.1:{port}")


def test_card_rejected_by_the_hub_is_reported(single):
    with FakeHub(token=TOKEN, reject_yaml=True) as server:
        with pytest.raises(HubPushError, match="rejected by the test"):
            push_to_hub(single, REPO, token=TOKEN, endpoint=server.url)
        assert "POST commit" not in server.endpoints()


def test_invalid_existing_readme_is_refused_before_any_request(single, hub):
    (single / "README.md").write_text("---\nlibrary_name: [oops\n---\n# x\n")
    with pytest.raises(CardValidationError, match="not valid YAML"):
        push_to_hub(single, REPO, token=TOKEN, endpoint=hub.url)
    assert hub.requests == []


@pytest.mark.parametrize("edit, hub_warning", [
    (lambda text: text.replace("\n- mla\n", "\n- my-tag\n"), None),  # was "tags must include 'mla'"
    (lambda text: text.replace("pipeline_tag: text-generation", "pipeline_tag: text2text-generation"), None),
    # no metadata at all: was "no YAML metadata block"; the Hub takes it with a warning, which the client passes on
    (lambda text: text.split("---", 2)[2].lstrip(), "empty or missing yaml metadata"),
])
def test_a_card_the_user_edited_is_uploaded_as_it_is_if_the_hub_takes_it(edit, hub_warning, single, hub):
    import contextlib

    assert push_to_hub(single, REPO, token=TOKEN, endpoint=hub.url).card_generated  # writes the card into the folder
    (single / "README.md").write_text(edit((single / "README.md").read_text()))
    mine = (single / "README.md").read_bytes()
    with pytest.warns(UserWarning, match=hub_warning) if hub_warning else contextlib.nullcontext():
        result = push_to_hub(single, REPO, token=TOKEN, endpoint=hub.url)
    assert not result.card_generated and hub.files(REPO)["README.md"] == mine


# ---------------------------------------------------------------------------------------- refusals
def _drop(name):
    return lambda folder: (folder / name).unlink()


def _write(name, text):
    return lambda folder: (folder / name).write_text(text)


def _truncate(name):
    def apply(folder):
        data = (folder / name).read_bytes()
        (folder / name).write_bytes(data[: len(data) - 100])

    return apply


def _edit_index(edit):
    def apply(folder):
        path = folder / "model.safetensors.index.json"
        index = json.loads(path.read_text())
        edit(index["weight_map"])
        path.write_text(json.dumps(index))

    return apply


def _first_tensor_of(shard):
    def edit(weight_map):
        name = next(k for k, v in weight_map.items() if v == shard)
        weight_map["model.not_a_tensor"] = weight_map.pop(name)

    return edit


def _point_one_entry_elsewhere(weight_map):
    weight_map[next(iter(weight_map))] = "extra-weights.safetensors"


def _forget_shard_2(weight_map):
    for name in [k for k, v in weight_map.items() if v == "model-00002-of-00003.safetensors"]:
        del weight_map[name]


def _mkdir(relative):
    return lambda folder: (folder / relative).mkdir()


def _config_of_another_conversion(folder):
    """config.json (and with it the weights) copied in from a 4x conversion; the report still says 12 + 4."""
    config = json.loads((folder / "config.json").read_text())
    config.update(kv_lora_rank=10, qk_rope_head_dim=6)
    (folder / "config.json").write_text(json.dumps(config))


def _edit_report_cache(**changes):
    """mla_convert.json's cache section edited by hand (or left from another run); config.json and the weights as they were."""
    def damage(folder):
        report = json.loads((folder / "mla_convert.json").read_text())
        report["cache"].update(changes)
        (folder / "mla_convert.json").write_text(json.dumps(report))

    return damage


def _edit_config(**changes):
    """config.json of another conversion whose facts the report does not record: the weights no longer fit it."""
    def damage(folder):
        config = json.loads((folder / "config.json").read_text())
        config.update(changes)
        (folder / "config.json").write_text(json.dumps(config))

    return damage


# used to pass: transformers loads such a folder with a warning and the missing projections initialised at random
QUERY_PATH_OF_ANOTHER_CONVERSION = (_edit_config(q_lora_rank=16), "tensors config.json needs are not in the weights "
                                    "(e.g. model.layers.0.self_attn.q_a_layernorm.weight); transformers would "
                                    "initialise them at random")  # (and, on a line of its own: 5 tensors in the weights ...)
OTHER_SHAPES = (_edit_config(intermediate_size=100), "15 tensors have other shapes than config.json implies (e.g. "
                "model.layers.0.mlp.down_proj.weight: [64, 172], config: [64, 100])")

INDEX = "model.safetensors.index.json"
SHARD_1, SHARD_2, SHARD_3 = (f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3))
LEFTOVERS = "leftovers of an unfinished conversion inside it"

# case: (damage done to a complete folder, text the refusal must contain)
SINGLE_CASES = {
    "no report": (_drop("mla_convert.json"), "mla_convert.json is missing: this folder was not produced by mla-convert"),
    "broken report": (_write("mla_convert.json", "{oops"), "mla_convert.json: cannot be read as JSON"),
    "no config": (_drop("config.json"), "config.json is missing"),
    # used to pass, and the card stated the report's shape and ratio for other weights
    "config of another conversion": (_config_of_another_conversion, "config.json and mla_convert.json describe different "
                                     "models (kv_lora_rank 10 (the report: 12), qk_rope_head_dim 6 (the report: 4))"),
    "not deepseek": (_write("config.json", '{"model_type": "llama"}'), "describes a 'llama' model"),
    # used to pass, and the card said "32x smaller" (the report's ratio) of weights that cache 12 + 4 of 64 values
    "report with another ratio": (_edit_report_cache(ratio=32.0, mla_bytes_per_token=20), "cannot push: mla_convert.json "
                                  "states other KV-cache numbers than config.json (kv_lora_rank 12 + qk_rope_head_dim 4, "
                                  "5 layers) gives: cache.ratio 32, not 4; cache.mla_bytes_per_token 20, not 160; the "
                                  "report was edited or is another conversion's: convert again, or correct its cache section"),
    "report with another dtype": (_edit_report_cache(dtype="float32"), "gives: cache.source_bytes_per_token 640, not 1,280; "
                                  "cache.mla_bytes_per_token 160, not 320; dtype float32, not config.json's bfloat16"),
    "no weights": (_drop("model.safetensors"), f"no weights: neither model.safetensors nor {INDEX}"),
    "truncated": (_truncate("model.safetensors"), "cannot push: model.safetensors: truncated or corrupt safetensors file"),
    "partial file inside": (_write("model.safetensors.mla-convert-partial", ""), f"{LEFTOVERS}: model.safetensors.mla"),
    "owner file": (_write(OWNER_FILE, "123"), f"{LEFTOVERS}: .mla-convert-owner"),
    "temp shard": (_write("shard-00000.tmp", "x"), f"{LEFTOVERS}: shard-00000.tmp"),
    "stray index": (
        _write(INDEX, '{"weight_map": {"a": "model.safetensors"}}'),
        f"both model.safetensors and {INDEX} are present",
    ),
    "query path of another conversion": QUERY_PATH_OF_ANOTHER_CONVERSION,
    "other shapes": OTHER_SHAPES,
}

SHARDED_CASES = {
    "shard missing": (_drop(SHARD_2), f"{SHARD_2} is named in {INDEX} but missing"),
    "entry points at absent file": (
        _edit_index(_point_one_entry_elsewhere),
        f"extra-weights.safetensors is named in {INDEX} but missing",
    ),
    "index forgets a shard": (_edit_index(_forget_shard_2), f"{SHARD_2} is not referenced by {INDEX}"),
    "tensor not in its shard": (
        _edit_index(_first_tensor_of(SHARD_3)),
        f"1 tensors that {INDEX} places in {SHARD_3} are not in it (e.g. model.not_a_tensor)",
    ),
    "no index": (_drop(INDEX), f"{SHARD_1} is present but {INDEX} is missing"),
    "truncated shard": (_truncate(SHARD_1), f"cannot push: {SHARD_1}: truncated or corrupt safetensors file"),
    "stray shard": (_write("model-extra.safetensors", ""), f"model-extra.safetensors is not named in {INDEX}"),
    "partial dir inside": (_mkdir("out.mla-convert-partial"), f"{LEFTOVERS}: out.mla-convert-partial"),
    "query path of another conversion": QUERY_PATH_OF_ANOTHER_CONVERSION,
}


@pytest.mark.parametrize("case", sorted(SINGLE_CASES))
def test_refuses_incomplete_single_file_folders(case, single, hub):
    damage, message = SINGLE_CASES[case]
    check_pushable(single)  # complete before the damage
    damage(single)
    with pytest.raises(NotPushableError) as caught:
        check_pushable(single)
    assert message in str(caught.value)
    assert case not in ("truncated",) or "the data section holds" in str(caught.value)
    with pytest.raises(NotPushableError):
        push_to_hub(single, REPO, token=TOKEN, endpoint=hub.url)
    assert hub.requests == []


@pytest.mark.parametrize("case", sorted(SHARDED_CASES))
def test_refuses_incomplete_sharded_folders(case, sharded, hub):
    damage, message = SHARDED_CASES[case]
    assert len(list(sharded.glob("model-*-of-00003.safetensors"))) == 3
    check_pushable(sharded)
    damage(sharded)
    with pytest.raises(NotPushableError) as caught:
        check_pushable(sharded)
    assert message in str(caught.value)
    assert case not in ("truncated shard",) or "the data section holds" in str(caught.value)
    with pytest.raises(NotPushableError):
        push_to_hub(sharded, REPO, token=TOKEN, endpoint=hub.url)
    assert hub.requests == []


def test_refuses_an_unfinished_conversion_folder_and_its_target(single, tmp_path):
    partial = single.with_name(single.name + PARTIAL_SUFFIX)
    partial.mkdir()
    with pytest.raises(NotPushableError, match="conversion into this folder is running or was interrupted"):
        check_pushable(single)
    shutil.rmtree(partial)
    for suffix in (PARTIAL_SUFFIX, BACKUP_SUFFIX):
        moved = single.rename(single.with_name("out" + suffix))
        with pytest.raises(NotPushableError, match="working folder of an unfinished or interrupted conversion"):
            check_pushable(moved)
        single = moved.rename(tmp_path / "stories260k-mla")
    with pytest.raises(NotPushableError, match="not a folder"):
        check_pushable(tmp_path / "nowhere")


def test_all_problems_are_reported_together_one_line_each(single):
    """(They were joined on one line by "; ", where every other command prints one `error:` line per problem.)"""
    (single / "config.json").unlink()
    (single / "mla_convert.json").unlink()
    with pytest.raises(NotPushableError) as caught:
        check_pushable(single)
    lines = str(caught.value).splitlines()
    assert len(lines) == 2 and all(line.startswith(f"{single}: cannot push: ") for line in lines), lines
    assert any("mla_convert.json is missing" in line for line in lines) and any("config.json is missing" in line for line in lines)
    assert isinstance(caught.value, MLAConvertError)


def test_check_pushable_lists_files_with_sizes_and_skips_git_metadata(single):
    (single / ".git").mkdir()
    (single / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    files = check_pushable(single)
    assert files == [UploadFile(p.name, p.stat().st_size) for p in sorted(single.iterdir()) if p.is_file()]


@pytest.mark.parametrize("repo_id", ["alice/nested/repo", "stories260k-mla", "alice/bad name"])
def test_invalid_or_bare_repo_id_is_refused(repo_id, single, hub):
    with pytest.raises(HubPushError, match="use 'namespace/name'"):
        push_to_hub(single, repo_id, token=TOKEN, endpoint=hub.url, dry_run=repo_id.startswith("s"))
    assert hub.requests == []


@pytest.mark.parametrize("revision, message", [
    ("", "--revision: must not be empty"),
    ("mla v1", "--revision 'mla v1': not a branch name git accepts"),
    ("../main", "--revision '../main': not a branch name"),
    ("-f", "--revision '-f': not a branch name"),
])
def test_a_revision_git_would_refuse_is_refused_before_any_request(revision, message, single, hub):
    """The dry run used to list the upload for `--revision 'a b'`, which the Hub's git cannot create."""
    with pytest.raises(HubPushError, match=re.escape(message)):
        push_to_hub(single, REPO, revision=revision, token=TOKEN, endpoint=hub.url, dry_run=True)
    assert hub.requests == []
    assert push_to_hub(single, REPO, revision="release/v1.0", token=TOKEN, endpoint=hub.url, dry_run=True).dry_run


def test_unfinished_work_names_match_the_checkpoint_writer():
    from mla_convert.io import writer as checkpoint_writer

    assert PARTIAL_SUFFIX == checkpoint_writer.PARTIAL_SUFFIX
    assert OWNER_FILE == checkpoint_writer.OWNER_FILE


# ------------------------------------------------------------------------------ convert --push-to-hub
@pytest.mark.parametrize("flags, message", [
    (["--push-to-hub", "alice/bad name"], "--push-to-hub: invalid repo id 'alice/bad name'"),
    (["--push-to-hub", "alice/tiny-mla"], "--push-to-hub: not logged in"),
    (["--private"], "--private: acts only with --push-to-hub"),
    (["-q", "-v"], "--quiet and --verbose: choose one"),
])
def test_convert_refuses_push_settings_before_converting(flags, message, tmp_path, monkeypatch):
    """A bad repo id or a missing token used to surface only after the whole conversion."""
    import huggingface_hub.constants
    from tiny_models import save_tiny_model
    from typer.testing import CliRunner

    from mla_convert import cli

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    source = save_tiny_model(tmp_path / "src", num_layers=1)
    output = tmp_path / "out"
    result = CliRunner().invoke(cli.app, ["convert", str(source), str(output), "-c", "2", *flags])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()) and "Traceback" not in result.output
    assert not output.exists()


def test_convert_quiet_push_prints_the_output_path_and_the_commit_url(tmp_path, hub):
    """`-q` promises errors and the output path only; with --push-to-hub it also printed the whole upload summary."""
    from tiny_models import save_tiny_model

    source = save_tiny_model(tmp_path / "src", num_layers=1)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE_"))}
    env.update(HF_ENDPOINT=hub.url, HF_TOKEN=TOKEN, HF_HOME=str(tmp_path / "hf_home"), HF_HUB_DISABLE_TELEMETRY="1")
    done = subprocess.run([sys.executable, "-m", "mla_convert", "convert", str(source), str(tmp_path / "out"), "-c", "2",
                           "--effort", "fast", "--calib-samples", "2", "--calib-seq-len", "32", "--calib-error-samples", "1",
                           "-q", "--push-to-hub", "alice/tiny-mla"],
                          env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    [commit] = hub.repos["alice/tiny-mla"].commits
    assert done.stdout.splitlines() == [str(tmp_path / "out"), f"{hub.url}/alice/tiny-mla/commit/{commit['oid']}"]
