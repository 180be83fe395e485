"""Text sources and tokenization: files, folders, local `datasets` folders, clear errors, no lost tokens."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys

import pytest
import torch

from mla_convert.data.textdata import (
    load_text,
    pack_windows,
    parse_dataset_spec,
    tokenize_text,
    tokenize_with_offsets,
    tokenizer_adds_bos,
)
from mla_convert.errors import MLAConvertError


def write_jsonl(path, rows, column="text"):
    path.write_text("".join(json.dumps({column: row, "id": i}) + "\n" for i, row in enumerate(rows)), encoding="utf-8")


# ---------------------------------------------------------------------------------------- files/folders


def test_load_text_file_is_read_verbatim(tmp_path):
    content = "first line\n\nsecond, with ünïcode €\n"
    path = tmp_path / "a.txt"
    path.write_text(content, encoding="utf-8")
    assert load_text(str(path)) == content
    assert load_text(path, max_chars=5) == "first"


def test_load_jsonl_uses_the_text_column_and_keeps_blank_rows(tmp_path):
    path = tmp_path / "rows.jsonl"
    write_jsonl(path, ["alpha", "", "gamma"], column="body")
    assert load_text(str(path), text_column="body") == "alpha\n\n\n\ngamma"
    with pytest.raises(MLAConvertError, match="no 'text' field"):
        load_text(str(path))


def test_load_folder_sorted_joined_with_blank_lines_hidden_and_other_files_skipped(tmp_path):
    (tmp_path / "b.txt").write_text("bee", encoding="utf-8")
    (tmp_path / "a.md").write_text("ay", encoding="utf-8")
    (tmp_path / "sub").mkdir()
    write_jsonl(tmp_path / "sub" / "c.jsonl", ["cee1", "cee2"])
    (tmp_path / ".hidden.txt").write_text("secret", encoding="utf-8")
    (tmp_path / "data.bin").write_bytes(b"\x00\x01")
    assert load_text(str(tmp_path)) == "ay\n\nbee\n\ncee1\n\ncee2"
    assert load_text(str(tmp_path), max_chars=6) == "ay\n\nbe"


@pytest.mark.parametrize("spec", ["./nope.txt", "/definitely/not/here", "missing.jsonl", "~/no-such-file.md"])
def test_missing_local_path_says_so(spec, tmp_path):
    with pytest.raises(MLAConvertError, match="no such file or folder"):
        load_text(spec)


def test_a_path_that_is_neither_file_nor_folder_says_what_it_is(tmp_path, monkeypatch):
    """`/dev/null` (and a FIFO) was "no such file or folder", though it exists; a FIFO with a bare name was looked up
    as a datasets name."""
    with pytest.raises(MLAConvertError, match="^/dev/null: is a character device, not a text file or folder$"):
        load_text("/dev/null")
    os.mkfifo(tmp_path / "pipe.txt")
    os.mkfifo(tmp_path / "pipe")
    monkeypatch.chdir(tmp_path)
    for spec in (str(tmp_path / "pipe.txt"), "pipe"):
        with pytest.raises(MLAConvertError, match=f"^{re.escape(spec)}: is a FIFO, not a text file or folder$"):
            load_text(spec)


def test_empty_inputs_are_errors(tmp_path):
    blank = tmp_path / "blank.txt"
    blank.write_text("  \n\n ", encoding="utf-8")
    with pytest.raises(MLAConvertError, match="contains no text"):
        load_text(str(blank))
    empty_folder = tmp_path / "empty"
    empty_folder.mkdir()
    with pytest.raises(MLAConvertError, match=r"no \*\.txt"):
        load_text(str(empty_folder))


def test_an_empty_spec_is_refused_not_read_as_the_current_folder(tmp_path, monkeypatch):
    """`load_text("")` read every .txt/.md of the working folder (the repository's README, BENCHMARKS ...)."""
    from mla_convert.eval.checks import text_option_problems

    (tmp_path / "notes.md").write_text("these are not evaluation text", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    for spec in ("", "  "):
        with pytest.raises(MLAConvertError, match="empty"):
            load_text(spec)
        assert text_option_problems(spec) == ["--data: must not be empty (a text file, a folder or a datasets spec)"]


def test_a_byte_order_mark_is_not_text(tmp_path):
    """A BOM was scored as text: four byte-fallback tokens in front of the first word (perplexity 3224 vs 3.14)."""
    for name, content in (("bom.txt", "Once upon a time."), ("bom.jsonl", json.dumps({"text": "Once upon a time."}) + "\n")):
        path = tmp_path / name
        path.write_bytes(b"\xef\xbb\xbf" + content.encode("utf-8"))
        assert load_text(str(path)) == "Once upon a time."
        assert load_text(str(path), max_chars=4) == "Once"


def test_non_utf8_file_is_a_clear_error(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(MLAConvertError, match="not UTF-8"):
        load_text(str(path))


# ---------------------------------------------------------------------------------------- datasets specs


@pytest.mark.parametrize(
    "spec, split, expected",
    [
        ("wikitext:wikitext-2-raw-v1:test", None, ("wikitext", "wikitext-2-raw-v1", "test")),
        ("wikitext::test", None, ("wikitext", None, "test")),
        ("wikitext:wikitext-2-raw-v1", "train", ("wikitext", "wikitext-2-raw-v1", "train")),
        ("roneneldan/TinyStories", None, ("roneneldan/TinyStories", None, None)),
    ],
)
def test_parse_dataset_spec(spec, split, expected):
    assert parse_dataset_spec(spec, split) == expected


def test_parse_dataset_spec_rejects_conflicts_and_garbage():
    with pytest.raises(MLAConvertError, match="also given"):
        parse_dataset_spec("a:b:test", "train")
    with pytest.raises(MLAConvertError):
        parse_dataset_spec("a:b:c:d")


def test_local_datasets_folder_rows_join_like_the_raw_wikitext(tmp_path):
    """Rows as the HF `wikitext` dataset has them (lines with their newline, blank rows empty) join to
    the raw text with blank lines kept - the layout of ../shared/data/wikitext-2-raw-test.txt."""
    folder = tmp_path / "ds"
    folder.mkdir()
    write_jsonl(folder / "test.jsonl", ["", " = Title = \n", "", " Body text . \n", ""])
    write_jsonl(folder / "train.jsonl", ["other"])
    assert load_text(f"{folder}::test") == "\n\n = Title = \n\n\n\n\n Body text . \n\n\n"
    assert load_text(f"{folder}", split=None) != load_text(f"{folder}::test")  # a bare folder reads its files
    with pytest.raises(MLAConvertError, match=r"has splits \['test', 'train'\]"):
        load_text(f"{folder}:")
    with pytest.raises(MLAConvertError, match="no column 'body'"):
        load_text(f"{folder}::test", text_column="body")


def test_a_column_that_is_not_text_is_an_error(tmp_path):
    """Naming a number column scored its digits as text (perplexity 25,000 and exit 0)."""
    path = tmp_path / "rows.jsonl"
    path.write_text('{"id": 1, "text": "alpha"}\n{"id": 2, "text": "beta"}\n')
    assert load_text(str(path)) == "alpha\n\nbeta"
    with pytest.raises(MLAConvertError, match=r"rows.jsonl:1: the 'id' field holds int values, not text"):
        load_text(str(path), text_column="id")
    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / "test.jsonl").write_text(path.read_text())
    with pytest.raises(MLAConvertError, match="the 'id' field holds int values, not text"):
        load_text(f"{folder}::test", text_column="id")


def test_unknown_dataset_offline_is_one_clear_line():
    """Run in a subprocess with the hub switched off, as on an offline machine (no retries, fast)."""
    code = (
        "from mla_convert.data.textdata import load_text\n"
        "from mla_convert.errors import MLAConvertError\n"
        "try:\n    load_text('no-such-dataset-for-mla-convert:cfg:test')\n"
        "except MLAConvertError as e:\n    print('ERROR:' + str(e))\n"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    lines = [line for line in done.stdout.splitlines() if line.startswith("ERROR:")]
    assert len(lines) == 1, done.stdout + done.stderr
    message = lines[0]
    assert "no-such-dataset-for-mla-convert" in message and "HF_HUB_OFFLINE is set" in message
    assert "cached dataset" in message and "local text file" in message


def test_a_local_dataset_folder_that_cannot_be_loaded_says_why(tmp_path):
    """`folder::validation` with only train and test splits said "not a local file, folder or cached dataset, and the
    hub cannot be reached" (offline), dropping what datasets said: the split is unknown, and which ones there are."""
    folder = tmp_path / "ds"
    folder.mkdir()
    write_jsonl(folder / "test.jsonl", ["a test row"])
    write_jsonl(folder / "train.jsonl", ["a train row"])
    code = (
        "import sys\n"
        "from mla_convert.data.textdata import load_text\n"
        "from mla_convert.errors import MLAConvertError\n"
        "try:\n    load_text(sys.argv[1] + '::validation')\n"
        "except MLAConvertError as e:\n    print('ERROR:' + str(e))\n"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    done = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True, env=env, timeout=120)
    (message,) = [line for line in done.stdout.splitlines() if line.startswith("ERROR:")] or [done.stdout + done.stderr]
    assert f"the local dataset folder {folder} could not be loaded" in message, message
    assert "validation" in message and "'train'" in message and "'test'" in message, message
    assert "hub" not in message


def test_a_hub_that_cannot_be_reached_is_one_line_without_retries(tmp_path):
    """Without network, huggingface_hub retried five times (about 25 s, a dozen 'Retrying in 8s' lines) before the
    error; a connection probe now switches the read to the cache at once."""
    code = (
        "from mla_convert.data.textdata import load_text\n"
        "from mla_convert.io.resolve import resolve_model_path\n"
        "from mla_convert.errors import MLAConvertError\n"
        "for read in (lambda: load_text('mla-convert-test/no-such-dataset:cfg:test'), "
        "lambda: resolve_model_path('mla-convert-test/no-such-model')):\n"
        "    try:\n        read()\n"
        "    except MLAConvertError as e:\n        print('ERROR:' + str(e))\n"
    )
    # port 9 (discard) on this machine: nothing listens, the connection is refused at once, as without network
    env = {key: value for key, value in os.environ.items() if not key.endswith("_OFFLINE")}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf"))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    errors = [line for line in done.stdout.splitlines() if line.startswith("ERROR:")]
    assert len(errors) == 2, done.stdout + done.stderr
    assert "cannot be reached" in errors[0] and "http://127.0.0.1:9" in errors[0]
    assert "the hub cannot be reached" in errors[1]
    assert "Retrying" not in done.stderr and "thrown while requesting" not in done.stderr, done.stderr


# ---------------------------------------------------------------------------------------- tokenizing


@pytest.fixture(scope="module")
def stories_tokenizer(stories260k):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(stories260k)


@pytest.mark.real_model
def test_long_text_tokenized_whole_one_bos_no_warning(stories_tokenizer, tinystories_text):
    text = tinystories_text.read_text(encoding="utf-8")
    tokenizer = stories_tokenizer
    assert tokenizer_adds_bos(tokenizer)
    saved = tokenizer.model_max_length
    tokenizer.model_max_length = 256  # far below the text's length: the warning's trigger
    records: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Collect(level=logging.WARNING)
    logging.getLogger("transformers").addHandler(handler)
    try:
        ids = tokenize_text(tokenizer, text)
    finally:
        logging.getLogger("transformers").removeHandler(handler)
        tokenizer.model_max_length = saved
    assert not [r for r in records if "longer than the specified maximum" in r.getMessage()]
    reference = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids.dtype == torch.long and ids.dim() == 1
    assert ids.numel() == len(reference) + 1 > 256
    assert ids[0].item() == tokenizer.bos_token_id
    assert (ids == tokenizer.bos_token_id).sum().item() == 1
    assert ids[1:].tolist() == reference


@pytest.mark.real_model
def test_offsets_locate_the_text_span(stories_tokenizer):
    text = "Once upon a time, a café owner saw a 🐱. The end."
    tokenized = tokenize_with_offsets(stories_tokenizer, text)
    assert tokenized.covered_text(0, len(tokenized)) == (0, text)
    ends = tokenized.char_ends
    assert ends[0] == 0  # the BOS covers no text
    assert ends == sorted(ends) and ends[-1] == len(text)
    # the first real token ends where the word "Once" ends; the next owns the space before "upon"
    assert tokenized.covered_text(0, 2) == (0, "Once")
    assert tokenized.covered_text(2, 3)[1].startswith(" ")
    # consecutive stretches partition the text
    assert "".join(tokenized.covered_text(i, i + 1)[1] for i in range(len(tokenized))) == text


@pytest.mark.real_model
def test_tokenizer_without_bos_gets_none(smollm2):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    text = "The quick brown fox. " * 50
    assert not tokenizer_adds_bos(tokenizer)
    assert tokenize_text(tokenizer, text).tolist() == tokenizer(text, add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------------------------------- windows


def test_pack_windows_non_overlapping_strided_and_bounded():
    ids = torch.arange(100)
    windows = pack_windows(ids, seq_len=16, num=3)
    assert windows.shape == (3, 16)
    assert windows[1].tolist() == list(range(16, 32))
    strided = pack_windows(ids, seq_len=16, num=4, stride=8)
    assert [row[0].item() for row in strided] == [0, 8, 16, 24]
    everything = pack_windows(ids, seq_len=16, num=1000)
    assert everything.shape == (6, 16)  # only whole windows: 6 * 16 = 96 <= 100
    everything[0, 0] = -1
    assert ids[0].item() == 0  # a copy, not a view into the caller's ids


def test_pack_windows_too_short_is_an_error():
    with pytest.raises(MLAConvertError, match="fewer than one window"):
        pack_windows(torch.arange(10), seq_len=16, num=1)
    with pytest.raises(MLAConvertError):
        pack_windows(torch.arange(10), seq_len=4, num=0)
