"""Training windows: packed text or text sampled from the teacher, served in a resumable order.

All windows live in one (num_windows, seq_len) tensor.  The order is a seeded permutation per epoch,
so the whole data stream is a pure function of (seed, epoch, position): the `WindowCursor` that
holds those two numbers is all a checkpoint needs to continue with exactly the next batch, on any
number of processes (each process takes its own slice of every global batch).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..errors import MLAConvertError


class FinetuneDataError(MLAConvertError):
    """Training text is missing or too short for the requested windows."""


# --------------------------------------------------------------------------- text
CHUNK_CHARS = 1 << 20  # texts longer than this are tokenised in line-aligned pieces of about this size


def text_chunks(text: str, chunk_chars: int = CHUNK_CHARS) -> list[str]:
    """`text` cut after newlines into pieces of about `chunk_chars` (one piece if it is shorter)."""
    pieces, start = [], 0
    while start < len(text):
        end = min(start + chunk_chars, len(text))
        if end < len(text):
            newline = text.rfind("\n", start, end)
            end = newline + 1 if newline > start else end
        pieces.append(text[start:end])
        start = end
    return pieces


def tokenize_long_text(tokenizer, text: str, chunk_chars: int = CHUNK_CHARS, batch: int = 16) -> torch.Tensor:
    """Token ids of a possibly huge training text: (num_tokens,) int64.

    A text up to `chunk_chars` is tokenised exactly as `textdata.tokenize_text` does (one call, one BOS in
    front if the tokenizer adds one).  A longer one (a corpus) is cut after newlines and tokenised piece by
    piece, without character offsets, so memory stays at one batch of pieces: merges never span a
    newline in practice, and training windows do not need the exactness evaluation does.
    """
    from ..data.textdata import tokenize_text, tokenizer_adds_bos

    if len(text) <= chunk_chars:
        return tokenize_text(tokenizer, text)
    parts = []
    if tokenizer_adds_bos(tokenizer):
        parts.append(torch.tensor([tokenizer.bos_token_id], dtype=torch.long))
    pieces = text_chunks(text, chunk_chars)
    for first in range(0, len(pieces), batch):
        encoded = tokenizer(pieces[first : first + batch], add_special_tokens=False, verbose=False)["input_ids"]
        parts.extend(torch.tensor(ids, dtype=torch.long) for ids in encoded)
    return torch.cat(parts)


def text_windows(tokenizer, spec: str, seq_len: int, text_column: str = "text", split: str | None = None,
                 max_chars: int | None = None) -> torch.Tensor:
    """Non-overlapping `seq_len` windows of a tokenised text: (num_windows, seq_len) int64."""
    from ..data.textdata import load_text, pack_windows

    text = load_text(spec, text_column=text_column, split=split, max_chars=max_chars)
    ids = tokenize_long_text(tokenizer, text)  # (num_tokens,)
    del text
    if ids.numel() < seq_len:
        raise FinetuneDataError(f"{spec}: {ids.numel()} tokens, fewer than one window of seq_len {seq_len}")
    return pack_windows(ids, seq_len, ids.numel() // seq_len)  # (num_windows, seq_len)


def text_fingerprint(spec: str | None) -> str | None:
    """sha256 of the local text `spec` names: a file's bytes, or a folder's text files (each with its relative path);
    None for no text or a datasets spec.  Why: a checkpoint records the text by its path, and a text edited in place
    keeps its path, so a resume trained on other text than the run it claimed to continue.  The whole file counts,
    also past max_chars (an edit there is refused too: simpler than hashing what a reader kept)."""
    from ..data.textdata import folder_text_files

    if spec is None or not Path(spec).expanduser().exists():
        return None
    path = Path(spec).expanduser()
    files = [path] if path.is_file() else folder_text_files(path)
    digest = hashlib.sha256()
    for file in files:
        if file != path:
            digest.update(file.relative_to(path).as_posix().encode() + b"\0")
        with file.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        digest.update(b"\0")
    return digest.hexdigest()


# --------------------------------------------------------------------------- teacher samples
def cached_teacher_samples(path: Path, make: Callable[[], torch.Tensor], description: dict) -> torch.Tensor:
    """Load samples from `path` if they were made with the same settings, else make and store them.

    Sampling is deterministic, but storing the ids makes a resumed run independent of the sampling code
    path (and saves the time on a big teacher).
    """
    meta = {key: str(value) for key, value in description.items()}
    if path.is_file():
        from safetensors import safe_open

        with safe_open(str(path), "pt") as handle:
            if handle.metadata() == meta:
                return load_file(str(path))["ids"]
    ids = make()
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    save_file({"ids": ids.contiguous()}, str(temporary), metadata=meta)
    temporary.replace(path)
    return ids


# --------------------------------------------------------------------------- order
class WindowCursor:
    """Where the data stream stands: epoch and position in that epoch's permutation.

    `global_batch` windows are taken per draw (micro batch x processes); a draw that runs past the end of
    an epoch takes the rest from the next epoch's permutation, so no window is skipped or repeated
    within an epoch and the stream never depends on the batch layout of an earlier run.
    """

    def __init__(self, num_windows: int, seed: int = 0):
        if num_windows < 1:
            raise FinetuneDataError("no training windows")
        self.num_windows = num_windows
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self.windows_served = 0
        self._order: torch.Tensor | None = None
        self._order_epoch = -1

    def _permutation(self, epoch: int) -> torch.Tensor:
        if self._order_epoch != epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._order = torch.randperm(self.num_windows, generator=generator)
            self._order_epoch = epoch
        return self._order

    def draw(self, count: int) -> torch.Tensor:
        """The next `count` window indices (int64)."""
        taken = []
        while count > 0:
            order = self._permutation(self.epoch)
            take = min(count, self.num_windows - self.position)
            taken.append(order[self.position : self.position + take])
            self.position += take
            count -= take
            self.windows_served += take
            if self.position == self.num_windows:
                self.epoch += 1
                self.position = 0
        return torch.cat(taken)

    def state_dict(self) -> dict:
        return {"num_windows": self.num_windows, "seed": self.seed, "epoch": self.epoch, "position": self.position,
                "windows_served": self.windows_served}

    def load_state_dict(self, state: dict) -> None:
        if state["num_windows"] != self.num_windows or state["seed"] != self.seed:
            raise FinetuneDataError(
                f"checkpoint data cursor is for {state['num_windows']} windows (seed {state['seed']}), this run has "
                f"{self.num_windows} (seed {self.seed}): resume with the same data, seq_len and seed"
            )
        self.epoch, self.position, self.windows_served = state["epoch"], state["position"], state["windows_served"]


def process_slice(indices: torch.Tensor, process_index: int, num_processes: int) -> torch.Tensor:
    """This process's share of a global draw: contiguous equal slices (the draw is a multiple of the count)."""
    per = indices.numel() // num_processes
    return indices[process_index * per : (process_index + 1) * per]
