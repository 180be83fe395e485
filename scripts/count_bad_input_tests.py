#!/usr/bin/env python
"""Count, per command, the bad inputs the test suite tries; write the table into docs/robustness.md.

The counts come from pytest's own collection (each parametrized case is one bad input) plus the hypothesis
examples of the hostile-input sweep (`tests/test_cli_hostile.py`, SETTINGS max_examples per command).  Which
tests feed which command bad input is the RULES table below (test file, test-name pattern, command): a test
that is added under a matching name is counted without editing this script.

    python scripts/count_bad_input_tests.py                 # print the table
    python scripts/count_bad_input_tests.py --write         # and replace it in docs/robustness.md
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "robustness.md"
START, END = "<!-- bad-input-counts:start -->", "<!-- bad-input-counts:end -->"
COMMANDS = ("inspect", "convert", "eval", "generate", "push", "sweep", "finetune", "demo")
HOSTILE = "tests/test_cli_hostile.py"
# a test parametrized over commands: its case ids start with the command ("[eval-fifo-shard]")
BY_COMMAND_PARAMETER = {("tests/test_model_folder_faults.py", "test_every_command_refuses_every_folder_fault_before_any_work")}
# hostile sweep test -> command (each is run for SETTINGS["max_examples"] drawn examples)
HOSTILE_TESTS = {"test_inspect": "inspect", "test_convert": "convert", "test_eval": "eval", "test_generate": "generate",
                 "test_push_dry_run": "push", "test_sweep": "sweep", "test_finetune": "finetune",
                 "test_demo_refuses_bad_settings_before_work": "demo"}
# (file, test-name regex, command): tests that hand a command (or the code it runs first) a bad input
RULES = [
    ("tests/test_robustness.py", r"^test_bad_input$|^test_bad_input_in_a_subprocess|^test_statistics_estimate", "convert"),
    ("tests/test_robustness_property.py", r".", "convert"),
    ("tests/test_convert.py", r"impossible|refused|overwrite", "convert"),
    ("tests/test_checkpoint_io.py", r"truncat|header|index_|missing|pickle|symlink|owner|live_writer|overwrite|appearing|"
                                    r"folder_without|broken_config|duplicate|exception_inside", "convert"),
    ("tests/test_source_config.py", r"wrong_types|every_problem|read_config_json_errors|rope_is_resolved", "convert"),
    ("tests/test_interrupt.py", r".", "convert"),
    ("tests/test_determinism.py", r"thread", "convert"),
    ("tests/test_textdata.py", r"missing|empty|non_utf8|too_short|rejects|offline|neither_file_nor_folder", "convert"),
    ("tests/test_shapes_inspect.py", r"error|rejected|problem|refus", "inspect"),
    ("tests/test_inspect_export.py", r"refus|unreadable|another_conversion", "inspect"),
    ("tests/test_journey.py", r"^test_generate_.*refuse", "generate"),  # before the eval rule: first match counts
    ("tests/test_journey.py", r"refuse|never_run_code", "eval"),
    ("tests/test_perplexity.py", r"bad_settings|never_replaces|before_any_model|script_refuses|special_data_path", "eval"),
    ("tests/test_hub_push.py", r"update_card", "eval"),
    ("tests/test_runtime.py", r"bad_settings|clear_errors|refused|never_ends", "generate"),
    ("tests/test_model_folder_faults.py", r"eval_update_card|loader_refuses", "eval"),
    ("tests/test_model_folder_faults.py", r"teacher", "finetune"),
    ("tests/test_model_folder_faults.py", r"^test_generate_", "generate"),
    ("tests/test_model_folder_faults.py", r"^test_sweep_", "sweep"),
    ("tests/test_finetune_checkpoints.py", r"refused|truncated|damaged|torn|cannot|disk|planted|replaced|not_json", "finetune"),
    ("tests/test_hub_push.py", r"refuse|invalid|wrong_token|rejected|problems", "push"),
    ("tests/test_sweep.py", r"refused|user_error", "sweep"),
    ("tests/test_finetune.py", r"errors|refuses|interrupt", "finetune"),
    ("tests/test_demo.py", r"refus|problem|offline", "demo"),
]


def collected() -> list[str]:
    """pytest's node ids of the whole suite.  A collection that fails (an interpreter without pytest or the project's
    packages, a test module that does not import) is an error: it used to count every command as 0 and --write that."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'kernels'}"}
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
                          capture_output=True, text=True, cwd=REPO, env=env)
    nodes = [line.strip() for line in done.stdout.splitlines() if "::" in line]
    if done.returncode != 0 or not nodes:
        reason = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise SystemExit(f"count_bad_input_tests.py: error: pytest could not collect the suite with {sys.executable} "
                         f"(exit {done.returncode}: {reason[0]}); run it from the project's environment")
    return nodes


def hostile_examples() -> int:
    text = (REPO / HOSTILE).read_text()
    return int(re.search(r"SETTINGS = dict\(max_examples=(\d+)", text).group(1))


def count(node_ids: list[str]) -> tuple[dict[str, int], dict[str, list[str]]]:
    counts: dict[str, int] = defaultdict(int)
    tests: dict[str, set[str]] = defaultdict(set)
    examples = hostile_examples()
    for node in node_ids:
        file, _, rest = node.partition("::")
        name = rest.split("[")[0]
        if file == HOSTILE and name in HOSTILE_TESTS:
            command = HOSTILE_TESTS[name]
            counts[command] += examples
            tests[command].add(f"{Path(file).name}::{name} ({examples} examples)")
            continue
        if (file, name) in BY_COMMAND_PARAMETER:
            command = rest.split("[", 1)[1].split("-", 1)[0]
            counts[command] += 1
            tests[command].add(f"{Path(file).name}::{name}")
            continue
        for rule_file, pattern, command in RULES:
            if file == rule_file and re.search(pattern, name):
                counts[command] += 1
                tests[command].add(f"{Path(file).name}::{name}")
                break
    return dict(counts), {command: sorted(names) for command, names in tests.items()}


def render(counts: dict[str, int], tests: dict[str, list[str]]) -> str:
    lines = [START, "| command | bad inputs tested | tests |", "|---|---:|---|"]
    for command in COMMANDS:
        names = ", ".join(f"`{name}`" for name in tests.get(command, []))
        lines.append(f"| `{command}` | {counts.get(command, 0)} | {names} |")
    lines.append(END)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"replace the table in {DOC.relative_to(REPO)}")
    args = parser.parse_args(argv)
    table = render(*count(collected()))
    print(table)
    if args.write:
        text = DOC.read_text()
        head, rest = text.split(START)
        DOC.write_text(head + table + rest.split(END, 1)[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
