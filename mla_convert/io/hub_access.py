"""Reading from the Hugging Face hub on a machine that may not reach it.

huggingface_hub retries a request that cannot connect five times, waiting 1 to 8 s between tries and logging
two warnings per try: on a machine without network, a hub id or a `datasets` spec took about 25 s and a dozen
"Retrying in 8s" lines before the one error mla-convert prints.  `hub_reads()` wraps such a read:

* a connection probe (3 s at most, once per process) to the hub endpoint (`HF_ENDPOINT`) decides whether the
  hub is reachable; when it is not, the read runs in huggingface_hub's and datasets' offline mode, so what
  their caches hold still loads and anything else fails at once;
* huggingface_hub's retry warnings are not printed (the error that follows says what failed).

The offline switch sets the two libraries' module-level flags, the values their functions read at call time
(huggingface_hub 2.x `constants.HF_HUB_OFFLINE`, datasets 3-5 `config.HF_HUB_OFFLINE`), and restores them
after the read.  A library version without those flags still works: it only retries as before.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import socket
from collections.abc import Iterator
from urllib.parse import urlsplit

PROBE_SECONDS = 3.0
RETRY_LOGGER = "huggingface_hub.utils._http"  # where the "thrown while requesting" / "Retrying in" lines come from


def hub_endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


@functools.cache
def hub_reachable(endpoint: str) -> bool:
    """Whether a TCP connection to `endpoint` opens within PROBE_SECONDS (DNS failures answer at once)."""
    parts = urlsplit(endpoint)
    if not parts.hostname:
        return True  # not a URL we can probe: let huggingface_hub decide
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname, port), timeout=PROBE_SECONDS):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def _offline_flags() -> Iterator[None]:
    """huggingface_hub and datasets in offline mode for the block (their caches still serve).  Only modules already
    imported are switched: the caller imports the library it reads with before entering (no import for nothing)."""
    import sys

    saved = []
    for module_name in ("huggingface_hub.constants", "datasets.config"):
        module = sys.modules.get(module_name)
        if module is not None and hasattr(module, "HF_HUB_OFFLINE"):
            saved.append((module, module.HF_HUB_OFFLINE))
            module.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        for module, value in saved:
            module.HF_HUB_OFFLINE = value


@contextlib.contextmanager
def hub_reads() -> Iterator[str | None]:
    """Wrap a hub download or `datasets.load_dataset`; yields None when the hub is used, else why only the cache is."""
    from huggingface_hub import constants

    retry_logger = logging.getLogger(RETRY_LOGGER)
    level = retry_logger.level
    retry_logger.setLevel(logging.ERROR)
    if constants.HF_HUB_OFFLINE:  # offline by choice: no probe
        offline = "HF_HUB_OFFLINE is set"
    else:
        offline = None if hub_reachable(hub_endpoint()) else f"the hub ({hub_endpoint()}) cannot be reached from here"
    try:
        with contextlib.nullcontext() if offline is None else _offline_flags():
            yield offline
    finally:
        retry_logger.setLevel(level)
