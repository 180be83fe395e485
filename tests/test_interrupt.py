"""Interrupting a conversion: Ctrl-C (SIGINT), `kill` (SIGTERM), a closed terminal (SIGHUP), `kill -9`.

The real `mla-convert convert` runs in a subprocess on a tiny model made slow enough (8 layers, sampled
calibration, a few refinement steps per layer, 100 KB shards) that a signal can land in each phase.
After any signal:
  * nothing complete-looking is at the output path: either nothing, or (when the run had already
    finished) the full output, byte-identical to an uninterrupted run;
  * after SIGINT/SIGTERM/SIGHUP nothing is left at all: no `<out>.mla-convert-partial`, no calibration
    statistics folder (`mla-convert-stats-*`) in the temp folder, exit status 128 + signal number;
  * after SIGKILL only the clearly named leftovers (`<out>.mla-convert-partial`, a statistics folder),
    which the next run removes;
  * the next run succeeds, and its shards are byte-identical to an uninterrupted run's.
The writer-level SIGKILL test (a bare CheckpointWriter) is in tests/test_checkpoint_io.py.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from tiny_models import save_tiny_model

from mla_convert.convert import ConvertOptions, convert
from mla_convert.errors import PreflightError
from mla_convert.io.writer import BACKUP_SUFFIX, OWNER_FILE, partial_path_for
from mla_convert.options import CalibrationOptions
from mla_convert.pause import PAUSE_AT, PAUSE_FILE

ARGS = ["--calib-samples", "8", "--calib-seq-len", "40", "--refine-steps", "6", "--max-shard-size", "100KB", "--seed", "1"]
STATS_PREFIX = "mla-convert-stats-"
TIMEOUT = 240


@pytest.fixture(scope="module")
def slow_source(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("interrupt") / "src", max_shard_size="100KB", num_layers=8,
                           hidden_size=128, num_heads=8, num_kv_heads=4, head_dim=16, intermediate_size=256,
                           vocab_size=256, weight_scale=2.0)


class Run:
    """`python -m mla_convert convert` in a subprocess, its stderr collected line by line as it comes.

    `pause_at`: the phase (`"<phase>"` or `"<phase>@<layers done>"`) where the run stops and waits for the test's
    signal (`mla_convert/pause.py`), so the signal lands in that phase however loaded the machine is."""

    def __init__(self, source: Path, output: Path, scratch: Path, pause_at: str | None = None):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(scratch), "NO_COLOR": "1", "HF_HUB_OFFLINE": "1",
               "COLUMNS": "200"}
        self.marker = output.parent / f".paused-{output.name}"
        self.marker.unlink(missing_ok=True)
        if pause_at:
            env |= {PAUSE_AT: pause_at, PAUSE_FILE: str(self.marker)}
        self.output, self.scratch, self.started = output, scratch, time.monotonic()
        self.process = subprocess.Popen([sys.executable, "-m", "mla_convert", "convert", str(source), str(output), *ARGS],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.process.stderr), daemon=True)
        self._reader.start()

    def wait_for(self, condition, what: str) -> None:
        deadline = time.monotonic() + TIMEOUT
        while not condition():
            assert self.process.poll() is None, f"the run ended before {what}: {self.stderr[-2000:]}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.01)

    def paused(self) -> bool:
        """The run waits where `pause_at` asked (its pid in the marker file)."""
        try:
            return self.marker.read_text() == str(self.process.pid)
        except OSError:
            return False

    def kill(self, signum: int) -> int:
        self.process.send_signal(signum)
        return self.finish()

    def finish(self) -> int:
        code = self.process.wait(timeout=TIMEOUT)
        self._reader.join(timeout=10)
        self.marker.unlink(missing_ok=True)
        return code

    @property
    def stderr(self) -> str:
        return "".join(self.lines)

    # markers of the phases, as seen from outside
    def preflight_done(self) -> bool:
        return any(line.startswith("disk:") for line in self.lines)

    def statistics(self) -> list[Path]:
        return sorted(self.scratch.glob(STATS_PREFIX + "*"))

    def owns_partial(self) -> bool:
        """The partial folder is this run's (a SIGKILLed earlier run's stays until pre-flight removes it)."""
        try:
            return (partial_path_for(self.output) / OWNER_FILE).read_text() == str(self.process.pid)
        except OSError:
            return False

    def writing(self) -> bool:
        return self.owns_partial() and any(partial_path_for(self.output).glob("shard-*.tmp"))


def shard_digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*.safetensors"))}


def assert_clean_after_catchable_signal(run: Run, code: int, signum: int) -> None:
    assert code == 128 + signum, f"exit {code}: {run.stderr[-2000:]}"
    assert f"interrupted ({signal.Signals(signum).name})" in run.stderr, run.stderr[-2000:]
    assert "Traceback" not in run.stderr
    assert not run.output.exists(), "an interrupted run must leave nothing at the output path"
    assert not partial_path_for(run.output).exists(), "SIGINT/SIGTERM/SIGHUP must remove the partial folder"
    assert run.statistics() == [], "the calibration statistics folder leaked"


def test_each_phase_and_signal_then_the_next_run_succeeds(slow_source, tmp_path):
    """Each signal sent while the run waits in the phase named (the pause hook), not after a sleep."""
    output, scratch = tmp_path / "out", tmp_path / "temp"
    scratch.mkdir()
    partial = partial_path_for(output)

    # 1. kill -9 while shards are being written: only the clearly named leftovers remain
    run = Run(slow_source, output, scratch, pause_at="converting layers@2")
    run.wait_for(run.paused, "the writing phase")
    assert run.writing(), "precondition: two layers converted, shards being written"
    assert run.kill(signal.SIGKILL) == -signal.SIGKILL
    assert not output.exists()
    assert partial.is_dir() and (partial / OWNER_FILE).read_text() == str(run.process.pid)
    leaked = run.statistics()
    assert len(leaked) == 1, "SIGKILL cannot clean up: the statistics folder stays (until the next run)"

    # 2. the next run removes both leftovers; SIGTERM during its statistics pass leaves nothing
    run = Run(slow_source, output, scratch, pause_at="calibration statistics@1")
    run.wait_for(run.paused, "this run's statistics pass")
    assert not partial.exists(), "pre-flight removes the partial folder of the killed run"
    assert leaked[0] not in run.statistics(), "the killed run's statistics folder is removed"
    assert len(run.statistics()) == 1, "precondition: this run's statistics folder is being written"
    assert_clean_after_catchable_signal(run, run.kill(signal.SIGTERM), signal.SIGTERM)
    assert f"removed {partial.name}" in run.stderr and f"removed {leaked[0].name}" in run.stderr

    # 3. Ctrl-C while sampling calibration text (right after pre-flight)
    run = Run(slow_source, output, scratch, pause_at="sampling calibration text from the source model")
    run.wait_for(run.paused, "the sampling phase")
    assert run.preflight_done() and not run.statistics(), "precondition: past pre-flight, before the statistics pass"
    assert_clean_after_catchable_signal(run, run.kill(signal.SIGINT), signal.SIGINT)

    # 4. Ctrl-C while writing, and a closed terminal (SIGHUP) there too
    for signum in (signal.SIGINT, signal.SIGHUP):
        run = Run(slow_source, output, scratch, pause_at="converting layers@2")
        run.wait_for(run.paused, "the writing phase")
        assert run.writing(), "precondition: shards being written"
        assert_clean_after_catchable_signal(run, run.kill(signum), signum)

    # 5. the next run succeeds and leaves nothing behind but the output
    run = Run(slow_source, output, scratch)
    assert run.finish() == 0, run.stderr[-3000:]
    assert (output / "config.json").exists() and (output / "model.safetensors.index.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "temp"]
    assert list(scratch.iterdir()) == []


@pytest.mark.slow
def test_random_kills_never_leave_a_complete_looking_output(slow_source, tmp_path):
    """10 kills (SIGINT, SIGTERM, SIGKILL three each, one SIGHUP) at seeded random times over the whole run."""
    scratch = tmp_path / "temp"
    scratch.mkdir()
    reference = Run(slow_source, tmp_path / "reference", scratch)
    reference.wait_for(lambda: (tmp_path / "reference").exists(), "the reference output")
    until_commit = time.monotonic() - reference.started  # the span a signal can interrupt
    assert reference.finish() == 0, reference.stderr[-3000:]
    expected = shard_digests(tmp_path / "reference")
    assert len(expected) >= 5

    output = tmp_path / "out"
    rng = random.Random(20240607)
    signals = [signal.SIGINT, signal.SIGTERM, signal.SIGKILL] * 3 + [signal.SIGHUP]
    rng.shuffle(signals)
    landed = []
    for signum in signals:
        leftovers = sorted(scratch.glob(STATS_PREFIX + "*"))  # of SIGKILLed runs before this one
        partial_left = partial_path_for(output).exists()  # by a SIGKILLed run before this one
        run = Run(slow_source, output, scratch)
        delay = rng.uniform(0.1, 1.0) * until_commit
        while time.monotonic() - run.started < delay and run.process.poll() is None:
            time.sleep(0.01)
        phase = ("finished" if output.exists() else "writing" if run.writing()
                 else "statistics" if set(run.statistics()) - set(leftovers) else "start/sampling")
        code = run.kill(signum)
        landed.append((signal.Signals(signum).name, round(delay, 2), phase, code))
        if phase in ("start/sampling", "statistics") and delay > 0.75 * until_commit:
            # late in the reference's span and not yet writing: runs got slower than the reference (the machine is
            # shared): aim the next kills later, or none would reach the writing phase
            until_commit = delay / 0.75
        if output.exists():  # the run had committed: then the output is the complete, correct one
            assert shard_digests(output) == expected and (output / "mla_convert.json").exists(), landed[-1]
            shutil.rmtree(output)
            # runs got faster than the reference (the machine is shared): aim the next kills earlier
            until_commit = min(until_commit, 0.9 * delay)
            continue
        if signum != signal.SIGKILL and code == 128 + signum:  # the handler ran: everything of this run cleaned
            # (a SIGKILLed run's leftovers go when a later run gets as far as cleaning them, at the latest the final
            # one; a run stopped before its pre-flight leaves them as they were)
            assert not run.owns_partial() and set(run.statistics()) <= set(leftovers), landed[-1]
            assert partial_left or not partial_path_for(output).exists(), landed[-1]
    if not any(kill[2] == "writing" for kill in landed):
        # the random times all missed the writing phase (short next to sampling; a busy machine shifts every phase):
        # one more kill is aimed at it, so that each run of this test interrupts a write
        run = Run(slow_source, output, scratch)
        run.wait_for(run.writing, "the writing phase")
        code = run.kill(signal.SIGTERM)
        landed.append(("SIGTERM", round(time.monotonic() - run.started, 2), "writing (aimed)", code))
        assert code == 128 + signal.SIGTERM and not output.exists() and not run.owns_partial(), landed[-1]
    interrupted = [kill for kill in landed if kill[2] != "finished"]
    assert len(interrupted) >= 5, f"most signals must land before the output is committed: {landed}"
    assert {kill[2].split(" ")[0] for kill in interrupted} >= {"writing", "start/sampling"}, \
        f"kills must spread over the run: {landed}"

    final = Run(slow_source, output, scratch)
    assert final.finish() == 0, final.stderr[-3000:]
    assert shard_digests(output) == expected, "a run after interruptions writes exactly what an uninterrupted one does"
    assert not partial_path_for(output).exists() and list(scratch.iterdir()) == []
    print("kills:", landed)


# --------------------------------------------------------------------------- --overwrite cut short
def _state_after_kill_mid_swap(tmp_path: Path, finished_swap: bool) -> tuple[Path, Path]:
    """The folders `commit(overwrite)` leaves when killed between (or after) its two renames."""
    output = tmp_path / "out"
    backup = output.with_name(output.name + BACKUP_SUFFIX)
    backup.mkdir()
    (backup / "previous.txt").write_text("the user's previous output")
    if finished_swap:
        output.mkdir()
        (output / "new.txt").write_text("complete new output")
    else:
        partial = partial_path_for(output)
        partial.mkdir()  # complete, owner marker already removed: commit was renaming it
        (partial / "config.json").write_text("{}")
    return output, backup


def test_overwrite_killed_mid_swap_restores_the_previous_output(tmp_path):
    source = save_tiny_model(tmp_path / "src")
    output, backup = _state_after_kill_mid_swap(tmp_path, finished_swap=False)
    quick = ConvertOptions(calibration=CalibrationOptions(num_samples=2, seq_len=16))
    with pytest.raises(PreflightError, match="already exists"):
        convert(source, output, quick)  # without --overwrite: the restored previous output is kept
    assert (output / "previous.txt").read_text() == "the user's previous output"
    assert not backup.exists() and not partial_path_for(output).exists()


def test_overwrite_killed_after_swap_drops_the_old_copy(tmp_path):
    source = save_tiny_model(tmp_path / "src")
    output, backup = _state_after_kill_mid_swap(tmp_path, finished_swap=True)
    with pytest.raises(PreflightError, match="already exists"):
        convert(source, output, ConvertOptions(calibration=CalibrationOptions(num_samples=2, seq_len=16)))
    assert (output / "new.txt").exists() and not backup.exists()


def test_the_pause_hook_is_inert_unless_both_variables_are_set(monkeypatch, tmp_path):
    from mla_convert.convert.decisions import Progress
    from mla_convert.pause import PausingProgress, pausing

    plain = Progress()
    monkeypatch.delenv(PAUSE_AT, raising=False)
    monkeypatch.setenv(PAUSE_FILE, str(tmp_path / "marker"))
    assert pausing(plain) is plain
    monkeypatch.setenv(PAUSE_AT, "converting layers@3")
    monkeypatch.delenv(PAUSE_FILE)
    assert pausing(plain) is plain
    monkeypatch.setenv(PAUSE_FILE, str(tmp_path / "marker"))
    wrapped = pausing(plain)
    assert isinstance(wrapped, PausingProgress) and (wrapped.pause_phase, wrapped.pause_steps) == ("converting layers", 3)
    wrapped.phase("converting layers", 8)
    wrapped.advance(2, 8)  # before the step asked for: no pause, no marker
    assert not (tmp_path / "marker").exists()
