"""Engine tests (issue 13): vLLM and llama.cpp run our exports; marker `engine`.

NOT part of the default `pytest` run: without MLA_CONVERT_ENGINES=1 this folder's test files are not
even collected (collect_ignore_glob below), so the default run neither imports nor reports them.
Run them with

    MLA_CONVERT_ENGINES=1 pytest tests/engines -m engine

after `scripts/check_engines.sh --install-only` has put the engines into their cached venvs
(~/.cache/mla-convert-engines/{vllm,llamacpp}); a missing engine venv is a skip with the reason.
"""

from __future__ import annotations

import os

ENABLED = os.environ.get("MLA_CONVERT_ENGINES", "") not in ("", "0", "false")

collect_ignore_glob = [] if ENABLED else ["test_*.py"]


def pytest_configure(config):
    config.addinivalue_line("markers", "engine: runs a serving engine (vLLM / llama.cpp) from its cached venv; needs MLA_CONVERT_ENGINES=1")
