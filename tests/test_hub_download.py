"""Converting a hub id: only the files a conversion reads are downloaded, and only when they fit the disk.

The real huggingface_hub client talks to `tests/fake_hub.py` (`HF_ENDPOINT`); each run is a `python -m mla_convert`
process, because huggingface_hub reads `HF_ENDPOINT` and `HF_HOME` into constants when it is imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fake_hub import FakeHub
from tiny_models import save_tiny_tokenizer, tiny_model

from mla_convert.io.resolve import hub_files_to_fetch

REPO = Path(__file__).resolve().parents[1]
QUICK = ["-c", "2", "--effort", "fast", "--calib-samples", "2", "--calib-seq-len", "16", "-q"]


def folder_files(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir()) if path.is_file()}


@pytest.fixture(scope="module")
def mistral_style(tmp_path_factory) -> dict[str, bytes]:
    """A tiny model laid out as Mistral's hub repositories are: sharded safetensors with their index, and beside them
    `consolidated.safetensors`, the same weights for mistral-inference (transformers never reads it)."""
    root = tmp_path_factory.mktemp("hub-repo")
    model = tiny_model(num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64)
    model.save_pretrained(root / "sharded", max_shard_size="100KB")
    model.save_pretrained(root / "single")
    files = folder_files(save_tiny_tokenizer(root / "sharded"))
    files["consolidated.safetensors"] = (root / "single" / "model.safetensors").read_bytes()
    files["README.md"] = b"# a tiny model\n"
    return files


def run_cli(hub: FakeHub | str, home: Path, *args: str) -> subprocess.CompletedProcess:
    endpoint = hub if isinstance(hub, str) else hub.url
    env = {**os.environ, "HF_ENDPOINT": endpoint, "HF_HOME": str(home), "HF_HUB_DISABLE_TELEMETRY": "1",
           "PYTHONPATH": f"{REPO}:{REPO / 'kernels'}", "OMP_NUM_THREADS": "1", "NO_COLOR": "1", "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "mla_convert", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def run_convert(hub: FakeHub | str, home: Path, *args: str) -> subprocess.CompletedProcess:
    return run_cli(hub, home, "convert", *args, *QUICK)


def test_only_the_weights_transformers_loads_are_downloaded(mistral_style, tmp_path):
    """`*.safetensors` fetched `consolidated.safetensors` too: for Mistral-7B-v0.3 that is 14.5 GB more, twice the
    download, for a file the conversion never reads.  Now the index's shards, config and tokenizer files only."""
    shards = sorted(name for name in mistral_style if name.startswith("model-"))
    assert len(shards) > 1 and "model.safetensors.index.json" in mistral_style
    with FakeHub() as hub:
        hub.add_model("someone/tiny-mistral", mistral_style)
        done = run_convert(hub, tmp_path / "hf", "someone/tiny-mistral", str(tmp_path / "mla"))
        assert done.returncode == 0, done.stderr
        fetched = hub.downloaded()
    assert sorted(fetched) == sorted(["model.safetensors.index.json", *shards, "config.json", "generation_config.json",
                                      "tokenizer.json", "tokenizer_config.json"])
    report = json.loads((tmp_path / "mla" / "mla_convert.json").read_text())
    assert report["source"]["hub_id"] == "someone/tiny-mistral"
    # without the hub, the cache still serves what was downloaded (nothing listens on port 9)
    done = run_convert("http://127.0.0.1:9", tmp_path / "hf", "someone/tiny-mistral", str(tmp_path / "offline"))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "offline" / "model.safetensors").read_bytes() == (tmp_path / "mla" / "model.safetensors").read_bytes()


def test_a_download_larger_than_the_free_disk_is_refused_before_it_starts(mistral_style, tmp_path):
    """The hub cache on a 64 KiB file system: the repository's weights (~0.6 MiB) cannot fit, which is said before any
    weight is fetched (huggingface_hub only warns, then fails part way).  Needs root to mount a small tmpfs."""
    home = tmp_path / "hf"
    home.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(home)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"mounting a tmpfs needs root (mount said: {mounted.stderr.strip()})")
    try:
        with FakeHub() as hub:
            hub.add_model("someone/tiny-mistral", mistral_style)
            done = run_convert(hub, home, "someone/tiny-mistral", str(tmp_path / "mla"))
            fetched = hub.downloaded()
    finally:
        subprocess.run(["umount", "-l", str(home)], check=False)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: someone/tiny-mistral: downloading it needs "), done.stderr
    assert f"in {home / 'hub'}, which has " in lines[0] and "point HF_HUB_CACHE (or HF_HOME) at a larger disk" in lines[0]
    assert fetched == ["model.safetensors.index.json"]  # the index names the shards; no weight was fetched
    assert not (tmp_path / "mla").exists()


def test_inspect_estimate_of_a_hub_id_says_how_much_is_downloaded_first(mistral_style, tmp_path):
    """The estimate's disk rows count the output and the statistics; a hub id is downloaded before either, which
    `--estimate` did not mention.  It says how much (what is not cached yet), and when the hub is out of reach."""
    from mla_convert.units import human_bytes

    home = tmp_path / "hf"
    read = ["model.safetensors.index.json", *(name for name in mistral_style if name.startswith("model-")),
            "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    estimate = ("inspect", "someone/tiny-mistral", "--estimate", "--cpu-cores", "2")
    with FakeHub() as hub:
        hub.add_model("someone/tiny-mistral", mistral_style)
        before = run_cli(hub, home, *estimate)
        assert before.returncode == 0, before.stderr
        # config.json was fetched to read the shape, the index to name the shards: the rest is still to come
        still = [name for name in read if name not in ("config.json", "model.safetensors.index.json")]
        assert (f"note: someone/tiny-mistral is downloaded first: {human_bytes(sum(len(mistral_style[n]) for n in still))} "
                f"in {len(still)} files not yet in the hub cache ({home / 'hub'})") in before.stdout, before.stdout
        assert run_convert(hub, home, "someone/tiny-mistral", str(tmp_path / "mla")).returncode == 0
        after = run_cli(hub, home, *estimate)
    assert f"note: someone/tiny-mistral: the {len(read)} files a conversion reads are in the hub cache already" in after.stdout
    offline = run_cli("http://127.0.0.1:9", home, *estimate)
    assert offline.returncode == 0, offline.stderr
    assert "note: the hub cannot be reached, so the size of someone/tiny-mistral's download is unknown" in offline.stdout


@pytest.mark.parametrize("files, allow_pickle, expected", [
    # one file is read before an index, as transformers does; other copies are never fetched
    (["model.safetensors", "model.safetensors.index.json", "model-00001-of-00001.safetensors", "config.json"], False,
     ["model.safetensors", "config.json"]),
    (["consolidated.safetensors", "model.safetensors.index.json", "a.safetensors", "b.safetensors", "config.json",
      "original/tokenizer.json", "tokenizer.json"], False,
     ["model.safetensors.index.json", "a.safetensors", "b.safetensors", "config.json", "tokenizer.json"]),
    # pickles only with allow_pickle, and never when safetensors are there
    (["pytorch_model.bin", "config.json"], False, ["config.json"]),
    (["pytorch_model.bin", "config.json"], True, ["pytorch_model.bin", "config.json"]),
    (["pytorch_model.bin", "model.safetensors", "config.json"], True, ["model.safetensors", "config.json"]),
])
def test_the_files_chosen_are_those_transformers_loads(files, allow_pickle, expected):
    index = {"weight_map": {"x": "a.safetensors", "y": "b.safetensors", "z": "a.safetensors", "bad": 3}}
    assert hub_files_to_fetch(files, allow_pickle, lambda name: index) == expected
