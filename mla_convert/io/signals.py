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


class TimeLimitExceeded(Exception):
    """A bounded block ran past its time (see `time_limit`)."""


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise `TimeLimitExceeded` inside the block once it has run `seconds` (wall clock): for work whose length a
    model folder decides (its Jinja chat template), which must not hang a command.  SIGALRM interrupts Python code
    between bytecodes, which is where a template's loops run; off the main thread (no signal delivery) the block runs
    unbounded."""
    import threading

    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(signum, frame):
        raise TimeLimitExceeded(f"did not finish within {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
