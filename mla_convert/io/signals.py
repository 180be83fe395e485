"""Holding Ctrl-C / kill while a step that must not be cut in half runs."""

from __future__ import annotations

import contextlib
import signal

INTERRUPTING_SIGNALS = {signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", signal.SIGTERM)}


@contextlib.contextmanager
def signals_deferred():
    """Block SIGINT/SIGTERM/SIGHUP until the block ends; they stay pending and are delivered right after.

    Used around safetensors reads (safetensors builds tensors through Python callbacks; a KeyboardInterrupt
    raised inside one is swallowed by its Rust side and resurfaces as an unrelated TypeError that reads as
    a corrupt checkpoint) and around removing a partial output (half-removed folders are worse than either).
    """
    try:
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, INTERRUPTING_SIGNALS)
    except (AttributeError, OSError, ValueError):  # no pthread_sigmask (Windows), or not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
