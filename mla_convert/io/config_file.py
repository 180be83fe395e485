"""The one reader of a model folder's `config.json`: bounded, through the regular-file opener, with errors that name
the file.  Below `source` (which parses what it returns into a typed config) so that `io` needs nothing above it."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import CheckpointError
from .paths import NotARegularFile, open_regular_file

MAX_CONFIG_BYTES = 16 * 2**20


def read_config_json(folder: str | os.PathLike) -> dict:
    """The parsed `config.json` of a model folder, with a clear error when absent, unreadable or broken."""
    path = Path(folder) / "config.json"
    try:
        with open_regular_file(path) as handle:  # bounded read: a huge or endless "config" is not a config
            data = handle.read(MAX_CONFIG_BYTES + 1)
    except NotARegularFile as error:
        raise CheckpointError(str(error)) from None
    except IsADirectoryError as error:
        raise CheckpointError(f"{path}: not a regular file") from error
    except FileNotFoundError as error:
        raise CheckpointError(f"{path}: missing (a Hugging Face model folder needs its config.json)") from error
    except OSError as error:
        raise CheckpointError(f"{path}: cannot read ({error.strerror or error})") from error
    if len(data) > MAX_CONFIG_BYTES:
        raise CheckpointError(f"{path}: larger than {MAX_CONFIG_BYTES // 2**20} MiB; not a model config")
    try:
        config = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path}: not valid JSON ({error})") from error
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return config
