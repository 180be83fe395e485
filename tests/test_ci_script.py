"""CI (`.ci/run`) runs README's two commands as written: a README change that CI does not follow would let CI pass
on commands no user types."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    """The one-line commands of README's "Try it" section, in order (install + demo, install + tests)."""
    section = (REPO / "README.md").read_text().split("## Try it", 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", section, re.S)]


def test_ci_runs_every_step_of_the_readmes_two_commands_in_order():
    commands = readme_commands()
    assert len(commands) == 2 and commands[0].endswith("mla-convert demo") and commands[1].endswith("pytest"), commands
    ci_lines = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    position = -1
    for command in commands:
        for step in (part.strip() for part in command.split("&&")):
            # `mla-convert demo` is piped into a log there (its output is checked); every other step is a line as is
            as_run = {step, step + ' 2>&1 | tee "$demo_log"'} if step == "mla-convert demo" else {step}
            found = [i for i, line in enumerate(ci_lines) if i > position and line in as_run]
            assert found, f"README step {step!r} is not run by .ci/run after line {position + 1}"
            position = found[0]
