"""A place where a test can ask a running command to stop and wait: for interruption tests that must hit one phase.

`MLA_CONVERT_PAUSE_AT="<phase>"` (or `"<phase>@<n>"`: once the phase reports n steps done) makes the command, when it
gets there, write its process id to the file `MLA_CONVERT_PAUSE_FILE` names and wait there for a signal, as long as
`PAUSE_SECONDS` at most.  A SIGINT/SIGTERM/SIGHUP then interrupts it inside that phase, exactly as a user's would.

Why: watched from outside (the output folder polled, sleeps between polls), a short phase can start and end between
two polls on a loaded machine.  A command that waits where asked is hit there every time.  With the variable unset (every real run) nothing here runs.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from .convert.decisions import ForwardingProgress, Progress

PAUSE_AT, PAUSE_FILE = "MLA_CONVERT_PAUSE_AT", "MLA_CONVERT_PAUSE_FILE"
PAUSE_SECONDS = 300  # a test that never sends its signal does not hang its run for good


class PausingProgress(ForwardingProgress):
    """Passes every callback on, and waits at the point `MLA_CONVERT_PAUSE_AT` names (once)."""

    def __init__(self, inner: Progress, phase: str, steps: int | None, marker: Path):
        super().__init__(inner)
        self.pause_phase, self.pause_steps, self.marker = phase, steps, marker
        self.current: str | None = None
        self.paused = False

    def phase(self, name: str, total: int | None = None) -> None:
        super().phase(name, total)
        self.current = name
        if self.pause_steps is None:
            self._pause_if(name == self.pause_phase)

    def advance(self, done: int, total: int | None = None) -> None:
        super().advance(done, total)
        self._pause_if(self.current == self.pause_phase and self.pause_steps is not None and done >= self.pause_steps)

    def _pause_if(self, here: bool) -> None:
        if not here or self.paused:
            return
        self.paused = True
        written = self.marker.with_name(self.marker.name + ".tmp")
        written.write_text(str(os.getpid()))
        os.replace(written, self.marker)  # whole or absent: the test reads the pid as soon as the name appears
        deadline = time.monotonic() + PAUSE_SECONDS
        while time.monotonic() < deadline:
            time.sleep(0.05)  # Python runs signal handlers between these sleeps


def pausing(progress: Progress) -> Progress:
    """`progress`, made to pause where the environment asks (itself when nothing is asked)."""
    where = os.environ.get(PAUSE_AT)
    marker = os.environ.get(PAUSE_FILE)
    if not where or not marker:
        return progress
    phase, _, steps = where.partition("@")
    return PausingProgress(progress, phase, int(steps) if steps else None, Path(marker))
