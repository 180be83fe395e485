"""Text sources for calibration, evaluation and fine-tuning, and how to turn them into token windows.

Every stage that needs text (calibration statistics, perplexity, fine-tuning) names it the same way: a
local file, a local folder of files, or a `datasets` spec such as `wikitext:wikitext-2-raw-v1:test`.
Keeping that in one module means a number reported by `eval` and the data a conversion was calibrated
on are read identically, and offline machines get one clear error instead of a hub traceback.

Dataset rows are joined with a blank line ("\\n\\n", blank rows kept): for WikiText that reproduces the
standard raw text used by the Hugging Face perplexity guide byte for byte, and for corpora whose rows
are documents it separates the documents.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import MLAConvertError

TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIXES = (".jsonl",)
ROW_SEPARATOR = "\n\n"  # between dataset rows, jsonl rows and files of a folder
_PATH_PREFIXES = ("/", "./", "../", "~", ".\\", "..\\")


class TextDataError(MLAConvertError):
    """A text source is missing, empty, unreadable or cannot be loaded."""


# --------------------------------------------------------------------------------------------------
# Loading text
# --------------------------------------------------------------------------------------------------


def load_text(spec: str | os.PathLike, text_column: str = "text", split: str | None = None, max_chars: int | None = None) -> str:
    """Return the text named by `spec`.

    `spec` is one of
      * a text file (`.txt`, `.md`, anything UTF-8) or a `.jsonl` file (one JSON object per line, the
        text in `text_column`);
      * a folder: its `*.txt`, `*.md` and `*.jsonl` files (recursively, hidden ones skipped), sorted by
        relative path and joined with blank lines;
      * a `datasets` spec `name:config:split`, `name::split`, `name:config` or `name` (the split then
        comes from `split`, or is the only split the dataset has), loaded with `datasets.load_dataset`.
        `name` may also be a local dataset folder (e.g. one holding `train.jsonl` / `test.jsonl`).

    `max_chars` keeps only the first that many characters (reading stops early where possible), so a
    quick run does not pay for the whole corpus.
    """
    if max_chars is not None and max_chars <= 0:
        raise TextDataError(f"max_chars must be positive, got {max_chars}")
    text_spec = os.fspath(spec)
    if not text_spec.strip():  # as a path, "" is the current folder: its text files would be read
        raise TextDataError("the text spec is empty: give a text file, a folder or a datasets spec")
    path = Path(text_spec).expanduser()
    if path.is_file():
        text = _read_file(path, text_column, max_chars)
    elif path.is_dir():
        text = _read_folder(path, text_column, max_chars)
    elif path.exists():  # /dev/null, a FIFO (reading one would wait forever), a socket
        from ..io.paths import special_kind

        raise TextDataError(f"{text_spec}: is {special_kind(path)}, not a text file or folder")
    elif ":" not in text_spec and looks_like_path(text_spec):
        raise TextDataError(f"{text_spec}: no such file or folder")
    else:
        text = _read_dataset(text_spec, text_column, split, max_chars)
    if max_chars is not None:
        text = text[:max_chars]
    if not text.strip():
        raise TextDataError(f"{text_spec}: contains no text")
    return text


def looks_like_path(spec: str) -> bool:
    """A spec meant as a local path (so a typo gives 'no such file', not a hub lookup)."""
    lowered = spec.lower()
    return spec.startswith(_PATH_PREFIXES) or lowered.endswith(TEXT_SUFFIXES + JSONL_SUFFIXES + (".json",))


def _read_file(path: Path, text_column: str, max_chars: int | None) -> str:
    if path.suffix.lower() in JSONL_SUFFIXES:
        return _read_jsonl(path, text_column, max_chars)
    try:
        # utf-8-sig: a byte-order mark (Windows editors write one) is not text; scored, it became 4 byte tokens
        if max_chars is None:
            return path.read_text(encoding="utf-8-sig")
        with path.open(encoding="utf-8-sig") as handle:
            return handle.read(max_chars)
    except UnicodeDecodeError as error:
        raise TextDataError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start})") from error
    except OSError as error:
        raise TextDataError(f"{path}: cannot read ({error.strerror or error})") from error


def _read_jsonl(path: Path, text_column: str, max_chars: int | None) -> str:
    rows: list[str] = []
    total = 0
    try:
        with path.open(encoding="utf-8-sig") as handle:
            for line_number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise TextDataError(f"{path}:{line_number}: not valid JSON ({error.msg})") from error
                if not isinstance(record, dict) or text_column not in record:
                    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                    raise TextDataError(f"{path}:{line_number}: no {text_column!r} field (has {keys}); set the text column")
                rows.append(_text_value(record[text_column], text_column, f"{path}:{line_number}"))
                total += len(rows[-1]) + len(ROW_SEPARATOR)
                if max_chars is not None and total >= max_chars:
                    break
    except UnicodeDecodeError as error:
        raise TextDataError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start})") from error
    except OSError as error:
        raise TextDataError(f"{path}: cannot read ({error.strerror or error})") from error
    return ROW_SEPARATOR.join(rows)


def folder_text_files(folder: Path) -> list[Path]:
    """The files a folder spec reads, in the order it joins them (others, e.g. a fine-tuning checkpoint's fingerprint
    of the text, must see the same ones)."""
    return sorted(
        (
            file
            for file in folder.rglob("*")
            if file.is_file()
            and file.suffix.lower() in TEXT_SUFFIXES + JSONL_SUFFIXES
            and not any(part.startswith(".") for part in file.relative_to(folder).parts)
        ),
        key=lambda file: file.relative_to(folder).as_posix(),
    )


def _read_folder(folder: Path, text_column: str, max_chars: int | None) -> str:
    files = folder_text_files(folder)
    if not files:
        raise TextDataError(f"{folder}: folder holds no *.txt, *.md or *.jsonl files")
    parts: list[str] = []
    total = 0
    for file in files:
        remaining = None if max_chars is None else max(max_chars - total, 1)
        parts.append(_read_file(file, text_column, remaining))
        total += len(parts[-1]) + len(ROW_SEPARATOR)
        if max_chars is not None and total >= max_chars:
            break
    return ROW_SEPARATOR.join(parts)


def parse_dataset_spec(spec: str, split: str | None = None) -> tuple[str, str | None, str | None]:
    """`name:config:split` -> (name, config or None, split or None); an explicit `split` fills a missing one."""
    parts = spec.split(":")
    if len(parts) > 3 or not parts[0]:
        raise TextDataError(f"{spec!r}: expected a file, a folder or a dataset spec name[:subset[:split]]")
    name, config, spec_split = (parts + [None, None])[:3]
    if split and spec_split and split != spec_split:
        raise TextDataError(f"{spec!r}: names split {spec_split!r} but split={split!r} was also given")
    return name, config or None, spec_split or split or None


def _read_dataset(spec: str, text_column: str, split: str | None, max_chars: int | None) -> str:
    name, config, split = parse_dataset_spec(spec, split)
    try:
        import datasets
    except ImportError as error:  # pragma: no cover - datasets is a declared dependency
        raise TextDataError(f"{spec!r}: loading a dataset needs the `datasets` package") from error
    from ..io.hub_access import hub_reads

    offline = None
    try:
        with hub_reads() as offline:  # offline at once (cache only) when the hub cannot be reached
            loaded = datasets.load_dataset(name, config, split=split)
    except Exception as error:  # noqa: BLE001 - any failure here means "cannot get this dataset"
        if Path(name).expanduser().is_dir():  # a local dataset folder: the hub has nothing to do with it, say why
            reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
            raise TextDataError(f"{spec!r}: the local dataset folder {name} could not be loaded ({type(error).__name__}: "
                                f"{reason})") from error
        if offline is not None:
            raise TextDataError(f"{spec!r}: not a local file, folder or cached dataset, and {offline}; pass a local "
                                "text file or folder instead") from error
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        raise TextDataError(
            f"{spec!r}: datasets.load_dataset failed ({type(error).__name__}: {reason}); "
            "the dataset name may be wrong or the Hugging Face hub unreachable (offline?): pass a local text file or folder instead"
        ) from error
    if isinstance(loaded, datasets.DatasetDict):
        if len(loaded) != 1:
            raise TextDataError(f"{spec!r}: has splits {sorted(loaded)}; name one as {name}:{config or ''}:SPLIT")
        loaded = next(iter(loaded.values()))
    if text_column not in loaded.column_names:
        raise TextDataError(f"{spec!r}: no column {text_column!r} (columns: {loaded.column_names}); set the text column")
    rows: list[str] = []
    total = 0
    for value in loaded[text_column] if max_chars is None else _iter_column(loaded, text_column):
        rows.append(_text_value(value, text_column, repr(spec)))  # blank rows are kept: they are the newlines
        total += len(rows[-1]) + len(ROW_SEPARATOR)
        if max_chars is not None and total >= max_chars:
            break
    return ROW_SEPARATOR.join(rows)


def _text_value(value, column: str, where: str) -> str:
    """A row's text; a number or a list in the text column means the wrong column was named (scoring its digits
    as text gave a perplexity of 25,000 without a word)."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise TextDataError(f"{where}: the {column!r} field holds {type(value).__name__} values, not text; set the text column")
    return value


def _iter_column(dataset, column: str, batch: int = 1024):
    """Rows of one column in batches, so `max_chars` does not materialise a huge column."""
    for start in range(0, len(dataset), batch):
        yield from dataset[start : start + batch][column]


# --------------------------------------------------------------------------------------------------
# Tokenizing
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenizedText:
    """Token ids of a text plus, per token, the character offset where it ends in that text.

    The offsets let an evaluation say exactly which text its scored tokens cover (for bits per byte and
    word perplexity); they are None when the tokenizer cannot report offsets.
    """

    ids: torch.Tensor  # (num_tokens,) int64
    char_ends: list[int] | None  # len num_tokens; a prepended BOS ends at 0
    text: str

    def __len__(self) -> int:
        return int(self.ids.numel())

    def _char_end(self, token: int) -> int:
        """Where token `token` ends in the text; the last token ends where the text does."""
        return len(self.text) if token >= len(self) - 1 else self.char_ends[token]

    def covered_text(self, first: int, stop: int) -> tuple[int, str] | None:
        """(start offset, text) of what tokens [first, stop) cover; None if the offsets are unknown.

        Token i covers the text from the end of token i - 1 (the start, for i = 0) to its own end, so
        consecutive tokens partition the text: whitespace a tokenizer leaves between tokens belongs to
        the token after it, and the text's tail to its last token.
        """
        if self.char_ends is None:
            return None
        if stop <= first:
            return 0, ""
        start = 0 if first == 0 else self._char_end(first - 1)
        return start, self.text[start : self._char_end(stop - 1)]

    def covered_statistics(self, token_ranges: list[tuple[int, int]]) -> tuple[int | None, int | None]:
        """(UTF-8 bytes, words) of the text that the tokens in `token_ranges` cover (None, None if unknown).

        A word counts where its first character lies, so a word split between a counted and an uncounted
        token is counted once or not at all, never twice.
        """
        num_bytes = num_words = 0
        for first, stop in token_ranges:
            covered = self.covered_text(first, stop)
            if covered is None:
                return None, None
            start, stretch = covered
            num_bytes += len(stretch.encode("utf-8"))
            num_words += len(stretch.split())
            if start > 0 and stretch and not stretch[0].isspace() and not self.text[start - 1].isspace():
                num_words -= 1  # the stretch starts inside a word: it counts where it began
        return num_bytes, num_words


def tokenizer_adds_bos(tokenizer) -> bool:
    """Whether `tokenizer(text)` puts a BOS token in front (Llama-2 style) - probed, not assumed."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    without = tokenizer("a", add_special_tokens=False)["input_ids"]
    return len(with_special) > len(without) and with_special[0] == bos


def tokenize_with_offsets(tokenizer, text: str) -> TokenizedText:
    """Tokenize a whole text in one call: one BOS in front if the tokenizer adds one, nothing else.

    One call (not chunks) so that the ids are exactly what the tokenizer gives for the text - chunking
    would change merges and SentencePiece word-boundary prefixes at every chunk start.  `verbose=False`
    silences the "longer than the model's maximum length" warning, which is about feeding the model,
    not about tokenizing; nothing is truncated.
    """
    if not text:
        raise TextDataError("cannot tokenize an empty text")
    char_ends: list[int] | None
    try:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        char_ends = [end for _, end in encoded["offset_mapping"]]
    except (NotImplementedError, ValueError, TypeError):  # tokenizers without offset support
        encoded = tokenizer(text, add_special_tokens=False, verbose=False)
        char_ends = None
    ids = list(encoded["input_ids"])
    if not ids:
        raise TextDataError("the tokenizer produced no tokens for this text")
    if tokenizer_adds_bos(tokenizer):
        ids = [tokenizer.bos_token_id] + ids
        char_ends = None if char_ends is None else [0] + char_ends
    return TokenizedText(torch.tensor(ids, dtype=torch.long), char_ends, text)


def tokenize_text(tokenizer, text: str) -> torch.Tensor:
    """1-D LongTensor of the ids of `text` (see `tokenize_with_offsets` for the rules)."""
    return tokenize_with_offsets(tokenizer, text).ids


def pack_windows(ids: torch.Tensor, seq_len: int, num: int, stride: int | None = None) -> torch.Tensor:
    """The first `num` full windows of `seq_len` tokens, `stride` apart (default: no overlap).

    Returns (n, seq_len) with n = min(num, windows that fit); calibration wants whole windows only, so
    a ragged tail is dropped rather than padded.
    """
    stride = seq_len if stride is None else stride
    if seq_len <= 0 or num <= 0 or stride <= 0:
        raise TextDataError(f"seq_len, num and stride must be positive (got {seq_len}, {num}, {stride})")
    ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)  # (num_tokens,)
    if ids.numel() < seq_len:
        raise TextDataError(f"text has {ids.numel()} tokens, fewer than one window of {seq_len}; use more text or a shorter window")
    windows = ids.unfold(0, seq_len, stride)  # (available, seq_len) view
    return windows[:num].clone()  # (n, seq_len)
