"""Errors a user can act on.

Every error the tool raises on bad input derives from `MLAConvertError`; the CLI prints its message as
one line (no traceback) and exits with status 2.  Anything else escaping is a bug in mla-convert.
"""

from __future__ import annotations


class MLAConvertError(Exception):
    """Base class: the message alone tells the user what is wrong and what to do."""


class UnsupportedArchitectureError(MLAConvertError):
    pass


class CheckpointError(MLAConvertError):
    """A checkpoint is missing, incomplete, corrupt or unsafe to read."""


class PickleRefusedError(CheckpointError):
    pass


class InvalidShapeError(MLAConvertError):
    """A requested MLA shape cannot be built from the source model."""


class OutputExistsError(MLAConvertError):
    pass


class PreflightError(MLAConvertError):
    """Several problems found before any heavy work; one line each."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class NonFiniteError(MLAConvertError):
    """NaN or Inf in source weights or in a conversion result."""


class ConversionError(MLAConvertError):
    """The conversion math cannot handle this layer (degenerate statistics); names the layer and the step."""


class OutputWriteError(MLAConvertError):
    """The output could not be written (disk full, read-only file system); the partial output is removed."""


class TerminatedBySignal(KeyboardInterrupt):
    """`kill` (SIGTERM) or a closed terminal (SIGHUP), raised like Ctrl-C so the same cleanup runs.

    Deliberately not an `MLAConvertError`: it is not a user error, and must unwind every `with` block.
    """

    def __init__(self, signum: int):
        import signal

        self.signum = int(signum)
        super().__init__(signal.Signals(self.signum).name)
