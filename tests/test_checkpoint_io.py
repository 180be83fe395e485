"""Streaming checkpoint IO: the reader reads what `save_pretrained` wrote, the writer writes it back the same.

Tiny random models cover the layouts (MHA/GQA/MQA, bias, tied/untied, several shards); the shard limit is
set to a few KB so each checkpoint has many shards.  Corrupt and hostile inputs are made from real
checkpoints by editing their bytes, never by faking a library.
"""

from __future__ import annotations

import filecmp
import gc
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import mapped_files, tiny_model
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from mla_convert.errors import CheckpointError, OutputExistsError, PickleRefusedError
from mla_convert.io.config_file import read_config_json
from mla_convert.io.reader import CheckpointReader
from mla_convert.io.resolve import looks_like_hub_id, resolve_config_path, resolve_model_path
from mla_convert.io.writer import (
    CREATION_GRACE_SECONDS,
    OWNER_FILE,
    SCRATCH_LOCK,
    SIDECAR_FILES,
    CheckpointWriter,
    claim_scratch_folder,
    clean_stale_scratch_folders,
    parse_shard_size,
    partial_path_for,
)

INDEX = "model.safetensors.index.json"
VOCAB = 128


# --------------------------------------------------------------------------- helpers
def save_tokenizer(folder: Path) -> None:
    """A real fast tokenizer (word-level, VOCAB ids) so the copy has tokenizer sidecars to carry."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(VOCAB - 4)]
    backend = Tokenizer(models.WordLevel(vocab={word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    tokenizer.save_pretrained(folder)


def make_checkpoint(folder: Path, max_shard_size, **config):
    """Save a tiny model exactly as a user would (`save_pretrained`) plus a tokenizer; return the model."""
    model = tiny_model(vocab_size=VOCAB, **config)
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    save_tokenizer(folder)
    return model


def copy_checkpoint(source: Path, output: Path, order: list[str], max_shard_size, **writer_kwargs) -> Path:
    """What a conversion does with untouched tensors: read each by name, stream it into the writer."""
    with CheckpointReader(source) as reader:
        with CheckpointWriter(output, max_shard_size=max_shard_size, **writer_kwargs) as writer:
            for name in order:
                if name in reader:
                    writer.add(name, reader.get(name))
            writer.copy_sidecars(source, SIDECAR_FILES + ("config.json",))
            return writer.commit()


def shard_files(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.glob("*.safetensors"))


def assert_nothing_written(output: Path) -> None:
    assert not output.exists(), f"{output} was created"
    assert not partial_path_for(output).exists(), "a partial folder was left behind"


def logits(folder_or_model, input_ids: torch.Tensor) -> torch.Tensor:
    model = folder_or_model
    if isinstance(folder_or_model, (str, Path)):
        model = AutoModelForCausalLM.from_pretrained(folder_or_model, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids).logits


# --------------------------------------------------------------------------- round trip
ROUND_TRIP_CASES = {
    "llama-gqa-untied": (dict(family="llama", num_heads=4, num_kv_heads=2), "20KB"),
    "llama-mha-tied": (dict(family="llama", num_heads=4, num_kv_heads=4, tie_word_embeddings=True), "20KB"),
    "llama-bias-mqa": (dict(family="llama", num_heads=4, num_kv_heads=1, attention_bias=True), "12KB"),
    "qwen2-bias-gqa-tied": (dict(family="qwen2", num_heads=4, num_kv_heads=2, tie_word_embeddings=True), "12KB"),
    "qwen2-bias-mqa-untied": (dict(family="qwen2", num_heads=4, num_kv_heads=1), "30KB"),
    "mistral-gqa-untied": (dict(family="mistral", num_heads=4, num_kv_heads=2), "30KB"),
}


@pytest.mark.parametrize("case", list(ROUND_TRIP_CASES))
def test_round_trip_reproduces_save_pretrained_byte_for_byte(tmp_path, case):
    config, shard_size = ROUND_TRIP_CASES[case]
    source, output = tmp_path / "source", tmp_path / "copy"
    model = make_checkpoint(source, shard_size, **config)
    order = list(model.state_dict())  # the source's tensor order
    assert len(shard_files(source)) >= 3, "the case must exercise several shards"

    reader = CheckpointReader(source)
    expected_missing = {"lm_head.weight"} if config.get("tie_word_embeddings") else set()
    assert set(order) - set(reader.keys()) == expected_missing

    copy_checkpoint(source, output, order, shard_size)

    assert sorted(os.listdir(output)) == sorted(os.listdir(source))
    assert (output / INDEX).read_text() == (source / INDEX).read_text()
    index = json.loads((output / INDEX).read_text())
    assert sorted(set(index["weight_map"].values())) == shard_files(source)
    for name in shard_files(source) + ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]:
        assert filecmp.cmp(source / name, output / name, shallow=False), f"{name} differs"
    source_tensors = {n: t for f in shard_files(source) for n, t in load_file(source / f).items()}
    copy_tensors = {n: t for f in shard_files(output) for n, t in load_file(output / f).items()}
    assert source_tensors.keys() == copy_tensors.keys()
    for name, tensor in source_tensors.items():
        assert copy_tensors[name].dtype == tensor.dtype and copy_tensors[name].shape == tensor.shape
        assert torch.equal(copy_tensors[name].view(-1).view(torch.uint8), tensor.view(-1).view(torch.uint8)), name

    input_ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    reference = logits(model, input_ids)
    assert torch.equal(logits(output, input_ids), reference)
    assert torch.equal(logits(source, input_ids), reference)
    text = "w1 w7 w42 nonsense w99"
    assert AutoTokenizer.from_pretrained(output)(text).input_ids == AutoTokenizer.from_pretrained(source)(text).input_ids


def test_single_shard_round_trip_has_no_index(tmp_path):
    source, output = tmp_path / "source", tmp_path / "copy"
    model = make_checkpoint(source, "5GB", family="llama")
    assert shard_files(source) == ["model.safetensors"] and not (source / INDEX).exists()
    copy_checkpoint(source, output, list(model.state_dict()), "5GB")
    assert sorted(os.listdir(output)) == sorted(os.listdir(source))
    assert not (output / INDEX).exists()
    assert filecmp.cmp(source / "model.safetensors", output / "model.safetensors", shallow=False)
    input_ids = torch.arange(12).view(1, 12)
    assert torch.equal(logits(output, input_ids), logits(model, input_ids))


def test_writer_packs_shards_like_huggingface_hub(tmp_path):
    """Shard assignment equals `split_torch_state_dict_into_shards` for sizes around the limit, oversized included."""
    from huggingface_hub import split_torch_state_dict_into_shards

    generator = torch.Generator().manual_seed(0)
    limit = 1000
    for trial in range(30):
        count = int(torch.randint(1, 25, (1,), generator=generator))
        sizes = torch.randint(1, 700, (count,), generator=generator) * 4  # bytes of float32 tensors, some > limit/2
        sizes[torch.rand(count, generator=generator) < 0.2] = 1200  # larger than the limit: own shard
        state = {f"t{i}": torch.zeros(int(size) // 4) for i, size in enumerate(sizes)}
        expected = split_torch_state_dict_into_shards(state, max_shard_size=limit)
        output = tmp_path / f"trial-{trial}"
        with CheckpointWriter(output, max_shard_size=limit) as writer:
            writer.add_many(state)
            writer.commit()
        if len(expected.filename_to_tensors) == 1:
            assert shard_files(output) == ["model.safetensors"]
            continue
        index = json.loads((output / INDEX).read_text())
        assert index["weight_map"] == expected.tensor_to_filename, f"trial {trial}: sizes {sizes.tolist()}"
        assert index["metadata"]["total_size"] == expected.metadata["total_size"]
        assert shard_files(output) == sorted(expected.filename_to_tensors)


def test_parse_shard_size_reads_sizes_like_save_pretrained():
    assert parse_shard_size("20KB") == 20_000
    assert parse_shard_size("5GB") == 5_000_000_000
    assert parse_shard_size(" 1.5mb ") == 1_500_000
    assert parse_shard_size(4096) == 4096
    with pytest.raises(ValueError, match="5 parsecs"):
        parse_shard_size("5 parsecs")
    for infinite in ("1e309GB", "infGB", "nanMB"):  # an infinite size was an OverflowError traceback
        with pytest.raises(ValueError, match=f"^max_shard_size '{infinite}': expected bytes or a size like '5GB'"):
            parse_shard_size(infinite)


# --------------------------------------------------------------------------- read planning
@pytest.fixture(scope="module")
def sharded_llama(tmp_path_factory):
    """Llama GQA with 20 KB shards: layer 0's q_proj sits alone, its k/v share the next shard."""
    folder = tmp_path_factory.mktemp("sharded") / "llama"
    model = make_checkpoint(folder, "20KB", family="llama", num_heads=4, num_kv_heads=2)
    return folder, list(model.state_dict())


def test_layer_straddling_two_shards_opens_each_shard_once(sharded_llama):
    folder, _ = sharded_llama
    q, k, v = (f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv")
    reader = CheckpointReader(folder)
    assert reader.files_opened == 0, "opening the reader must not open shards"
    assert reader.weight_map[q] != reader.weight_map[k] == reader.weight_map[v], "precondition: q/k/v straddle two shards"

    plan = reader.plan([k, q, v])
    assert plan == [(reader.weight_map[q], [q]), (reader.weight_map[k], [k, v])]

    tensors = reader.get_many([k, q, v])
    assert reader.files_opened == 2
    assert list(tensors) == [k, q, v], "results come back in the order asked for"
    for name in (q, k, v):
        assert torch.equal(tensors[name], load_file(folder / reader.weight_map[name])[name])

    # The k/v shard is still open: a plan starts there, and reading the layer again costs one open (q's).
    assert reader.plan([q, k, v])[0] == (reader.weight_map[k], [k, v])
    reader.get_many([q, k, v])
    assert reader.files_opened == 3


def test_iter_tensors_opens_each_shard_once(sharded_llama):
    folder, _ = sharded_llama
    reader = CheckpointReader(folder)
    seen = dict(reader.iter_tensors())
    assert reader.files_opened == len(reader.files) == len(shard_files(folder))
    assert seen.keys() == set(reader.keys())


def test_reader_holds_at_most_one_shard_mapped(sharded_llama):
    folder, order = sharded_llama
    reader = CheckpointReader(folder)
    names = [n for n in order if n in reader]
    files_touched = set()
    for name in names:
        tensor = reader.get(name)
        files_touched.add(reader.weight_map[name])
        del tensor  # the last reference: its mapping goes unless the reader still holds the shard
        assert len(mapped_files(folder)) <= 1, f"more than one shard mapped: {mapped_files(folder)}"
    assert len(files_touched) >= 3
    reader.close()
    gc.collect()
    assert mapped_files(folder) == set()


def test_tensor_infos_come_from_headers(sharded_llama):
    folder, _ = sharded_llama
    reader = CheckpointReader(folder)
    infos = reader.tensor_infos()
    assert reader.files_opened == 0, "headers are read without opening shards for tensor data"
    embed = infos["model.embed_tokens.weight"]
    assert embed.shape == (VOCAB, 64) and embed.dtype == torch.float32 and embed.nbytes == VOCAB * 64 * 4
    assert reader.total_bytes() == json.loads((folder / INDEX).read_text())["metadata"]["total_size"]


def test_missing_tensor_name_is_a_checkpoint_error(sharded_llama):
    folder, _ = sharded_llama
    with pytest.raises(CheckpointError, match="model.layers.9.self_attn.q_proj.weight"):
        CheckpointReader(folder).get_many(["model.norm.weight", "model.layers.9.self_attn.q_proj.weight"])


def test_folds_change_every_read_of_a_tensor_whole_by_rows_and_by_row_view(sharded_llama, tmp_path):
    """How Granite's multipliers and adjacent-pair RoPE reach every consumer (source/folds.py): the reader reorders
    and scales the stored tensor however it is read; other tensors, and a name the checkpoint lacks, are untouched."""
    from mla_convert.io.reader import Fold, row_view_name

    folder, _ = sharded_llama
    q, k, embed = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight", "model.embed_tokens.weight"
    stored = {name: load_file(folder / CheckpointReader(folder).weight_map[name])[name] for name in (q, k, embed)}
    order = torch.randperm(stored[q].shape[0])
    reader = CheckpointReader(folder)
    reader.fold({q: Fold(scale=0.5, row_order=order), embed: Fold(scale=3.0), "model.layers.99.mlp.down_proj.weight": Fold(2.0)})
    folded_q = stored[q][order] * 0.5
    assert torch.equal(reader.get(q), folded_q)
    assert torch.equal(reader.get_rows(q, 3, 7), folded_q[3:7])
    assert torch.equal(reader.get(row_view_name(q, 16, 32)), folded_q[16:32])
    assert torch.equal(reader.get_rows(row_view_name(q, 16, 32), 2, 4), folded_q[18:20])
    assert torch.equal(reader.get_rows(embed, 5, 9), stored[embed][5:9] * 3.0)
    assert torch.equal(reader.get(k), stored[k])
    assert dict(reader.iter_tensors())[embed].equal(stored[embed] * 3.0)

    # a bf16 checkpoint: the product is taken in fp32 and rounded once to bf16
    half = tmp_path / "bf16"
    tiny_model(vocab_size=VOCAB, num_heads=4, num_kv_heads=2).to(torch.bfloat16).save_pretrained(half)
    reader = CheckpointReader(half)
    raw = reader.get(q)
    reader.fold({q: Fold(scale=0.22)})
    assert reader.get(q).dtype == torch.bfloat16
    assert torch.equal(reader.get(q), (raw.float() * 0.22).to(torch.bfloat16))


# --------------------------------------------------------------------------- streaming writer
def test_exception_inside_writer_leaves_nothing(tmp_path):
    output = tmp_path / "out"
    with pytest.raises(RuntimeError, match="boom"):
        with CheckpointWriter(output, max_shard_size=4096) as writer:
            for i in range(6):
                writer.add(f"t{i}", torch.full((512,), float(i)))  # 2 KiB each: a shard every 2 tensors
            assert len(list(writer.partial.glob("shard-*"))) >= 2, "precondition: shards were already on disk"
            raise RuntimeError("boom")
    assert_nothing_written(output)
    assert os.listdir(tmp_path) == []


SLOW_WRITER = r"""
import sys, time, torch
from mla_convert.io.writer import CheckpointWriter
writer = CheckpointWriter(sys.argv[1], max_shard_size=4096)
for i in range(100_000):
    writer.add(f"t{i}", torch.full((512,), float(i)))  # 2 KiB each: a shard file every 2 tensors
    time.sleep(0.01)
writer.commit()
"""


def test_kill_9_mid_write_leaves_only_the_partial_folder_and_next_run_recovers(tmp_path):
    output = tmp_path / "out"
    partial = partial_path_for(output)
    child = subprocess.Popen([sys.executable, "-c", SLOW_WRITER, str(output)], stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while len(list(partial.glob("shard-*"))) < 3:
            assert child.poll() is None, f"writer exited early: {child.stderr.read().decode()[-2000:]}"
            assert time.monotonic() < deadline, "the writer never produced shards"
            time.sleep(0.05)
        assert (partial / OWNER_FILE).read_text() == str(child.pid)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert child.returncode == -signal.SIGKILL
    assert not output.exists(), "a killed run must not leave anything at the output path"
    assert partial.is_dir() and list(partial.glob("shard-*"))

    with CheckpointWriter(output, max_shard_size=4096) as writer:
        assert writer.cleanup_message is not None and partial.name in writer.cleanup_message
        writer.add("fresh", torch.arange(10, dtype=torch.float32))
        writer.commit()
    assert not partial.exists()
    assert sorted(os.listdir(output)) == ["model.safetensors"]
    assert CheckpointReader(output).keys() == ["fresh"]
    assert torch.equal(CheckpointReader(output).get("fresh"), torch.arange(10, dtype=torch.float32))


def test_partial_folder_of_a_live_writer_is_left_alone(tmp_path):
    """A live writer holds the flock of its owner file: a second writer refuses, naming its pid."""
    output = tmp_path / "out"
    first = CheckpointWriter(output)
    try:
        with pytest.raises(OutputExistsError, match=f"pid {os.getpid()}"):
            CheckpointWriter(output)
        assert (first.partial / OWNER_FILE).exists()
    finally:
        first.abort()


@pytest.mark.parametrize("owner", ["99999999999999999999", "1", "not a pid", ""])
def test_partial_folder_whose_owner_is_gone_is_removed_whatever_its_pid_file_says(tmp_path, owner):
    """Liveness is the lock, not the pid: a huge pid (once an OverflowError) or the pid of an unrelated live
    process (pid 1) in a folder nobody holds is a leftover, cleaned by the next run."""
    output = tmp_path / "out"
    partial = partial_path_for(output)
    partial.mkdir()
    (partial / OWNER_FILE).write_text(owner)
    with CheckpointWriter(output) as writer:
        assert "left behind by an interrupted run" in writer.cleanup_message
        writer.add("w", torch.ones(3))
        writer.commit()
    assert (output / "model.safetensors").exists()


def _killed_while_creating_scratch(parent: Path, prefix: str, step: str) -> Path:
    """The folder a run leaves when SIGKILL lands right after `step` of creating its scratch folder."""
    script = f"""
import os, signal, tempfile
from pathlib import Path
folder = tempfile.mkdtemp(prefix={prefix!r}, dir={str(parent)!r})
if {step!r} == "lock opened":
    open(Path(folder) / {SCRATCH_LOCK!r}, "w").close()
os.kill(os.getpid(), signal.SIGKILL)
"""
    assert subprocess.run([sys.executable, "-c", script]).returncode == -signal.SIGKILL
    (folder,) = parent.glob(prefix + "*")
    return folder


@pytest.mark.parametrize("prefix", ["mla-convert-stats-", "mla-convert-sweep-"])
@pytest.mark.parametrize("step", ["folder made", "lock opened"])
def test_scratch_folder_of_a_run_killed_while_creating_it_is_removed_once_old(tmp_path, prefix, step):
    """A SIGKILL between making the scratch folder and writing the pid into its lock left a folder the cleaner never
    judged (no lock file, or an empty one means "being created"): it stayed in the temp folder forever. Such a folder
    holds nothing, so once it is older than any creation takes it is removed; a young one is left to its owner."""
    folder = _killed_while_creating_scratch(tmp_path, prefix, step)
    assert clean_stale_scratch_folders(tmp_path) == [] and folder.exists()  # as young as a folder being created
    old = time.time() - CREATION_GRACE_SECONDS - 60
    os.utime(folder, (old, old))
    assert clean_stale_scratch_folders(tmp_path) == [folder.name] and not folder.exists()


def test_old_scratch_folders_that_hold_data_or_a_live_lock_are_kept(tmp_path):
    """Age alone never removes a folder: one without a lock that holds a file is not known to be ours, one whose lock a
    live run holds is in use."""
    unlocked = tmp_path / "mla-convert-stats-unlocked"
    unlocked.mkdir()
    (unlocked / "stats.safetensors").write_bytes(b"x")
    live = tmp_path / "mla-convert-sweep-live"
    live.mkdir()
    handle = claim_scratch_folder(live)
    try:
        old = time.time() - CREATION_GRACE_SECONDS - 60
        for folder in (unlocked, live):
            os.utime(folder, (old, old))
        assert clean_stale_scratch_folders(tmp_path) == []
        assert (unlocked / "stats.safetensors").exists() and (live / SCRATCH_LOCK).exists()
    finally:
        handle.close()
    assert clean_stale_scratch_folders(tmp_path) == [live.name]  # its owner gone, the lock names a pid: a leftover


def test_existing_output_refused_without_overwrite_and_replaced_with_it(tmp_path):
    output = tmp_path / "out"
    output.mkdir()
    (output / "old-result.txt").write_text("keep me unless told otherwise")
    with pytest.raises(OutputExistsError, match="--overwrite"):
        CheckpointWriter(output)
    assert os.listdir(output) == ["old-result.txt"]
    assert not partial_path_for(output).exists()
    # --overwrite replaces only an earlier mla-convert output: a folder of other files needs --force too
    with pytest.raises(OutputExistsError, match="not an earlier mla-convert output"):
        CheckpointWriter(output, overwrite=True)
    assert os.listdir(output) == ["old-result.txt"]

    with CheckpointWriter(output, overwrite=True, force=True) as writer:
        writer.add("w", torch.ones(3))
        writer.write_json("config.json", {"answer": 42})
        assert (output / "old-result.txt").exists(), "the old output stays until the new one is complete"
        writer.commit()
    assert sorted(os.listdir(output)) == ["config.json", "model.safetensors"]
    assert json.loads((output / "config.json").read_text()) == {"answer": 42}
    assert sorted(os.listdir(tmp_path)) == ["out"], "no backup or partial folder left beside the output"


def test_output_appearing_during_the_run_is_not_clobbered_and_the_result_is_kept(tmp_path):
    """Inside the writer's `with` block, as the pipeline uses it: the result survives and the message says where."""
    output = tmp_path / "out"
    with pytest.raises(OutputExistsError, match="kept in") as caught:
        with CheckpointWriter(output) as writer:
            writer.add("w", torch.ones(3))
            output.mkdir()  # someone else created it meanwhile
            writer.commit()
    assert os.listdir(output) == []
    kept = Path(str(caught.value).rsplit("kept in ", 1)[1])
    assert kept.name == "out.mla-convert-result" and (kept / "model.safetensors").exists(), "the finished result is kept"
    assert not partial_path_for(output).exists()


def test_overwrite_onto_a_symlink_needs_force_and_replaces_the_link_not_its_target(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "precious.txt").write_text("not ours")
    output = tmp_path / "out"
    output.symlink_to(target)
    with pytest.raises(OutputExistsError, match="is a symlink"):
        CheckpointWriter(output, overwrite=True)
    with CheckpointWriter(output, overwrite=True, force=True) as writer:
        writer.add("w", torch.ones(3))
        writer.commit()
    assert not output.is_symlink() and (output / "model.safetensors").exists()
    assert os.listdir(target) == ["precious.txt"], "the link's target is untouched"
    assert sorted(os.listdir(tmp_path)) == ["elsewhere", "out"]


def test_writer_rejects_duplicate_tensor_names(tmp_path):
    output = tmp_path / "out"
    with pytest.raises(ValueError, match="written twice"):
        with CheckpointWriter(output, max_shard_size=16) as writer:
            writer.add("a", torch.ones(8))  # larger than the limit: flushed at once
            writer.add("a", torch.ones(8))
    assert_nothing_written(output)


# --------------------------------------------------------------------------- corrupt and hostile input
@pytest.fixture(scope="module")
def template_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("template") / "model"
    model = make_checkpoint(folder, "20KB", family="llama", num_heads=4, num_kv_heads=2)
    return folder, list(model.state_dict())


@pytest.fixture
def checkpoint(template_checkpoint, tmp_path):
    """A fresh copy of a valid sharded checkpoint, to be damaged by the test."""
    template, order = template_checkpoint
    folder = tmp_path / "model"
    shutil.copytree(template, folder)
    return folder, order


def largest_shard(folder: Path) -> Path:
    return max(folder.glob("*.safetensors"), key=lambda path: path.stat().st_size)


def edit_index(folder: Path, edit) -> None:
    index = json.loads((folder / INDEX).read_text())
    edit(index["weight_map"])
    (folder / INDEX).write_text(json.dumps(index))


def assert_copy_fails(folder: Path, order: list[str], tmp_path: Path, *fragments: str) -> CheckpointError:
    output = tmp_path / "out"
    with pytest.raises(CheckpointError) as caught:
        copy_checkpoint(folder, output, order, "20KB")
    message = str(caught.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert "\n" not in message, "user errors are one line"
    assert_nothing_written(output)
    return caught.value


def test_truncated_shard(checkpoint, tmp_path):
    folder, order = checkpoint
    shard = largest_shard(folder)
    os.truncate(shard, shard.stat().st_size // 2)
    assert_copy_fails(folder, order, tmp_path, str(shard), "truncated")


def test_shard_shorter_than_its_header_length(checkpoint, tmp_path):
    folder, order = checkpoint
    shard = largest_shard(folder)
    os.truncate(shard, 5)
    assert_copy_fails(folder, order, tmp_path, str(shard), "8-byte header length")


def test_header_that_is_not_json(checkpoint, tmp_path):
    folder, order = checkpoint
    shard = largest_shard(folder)
    data = bytearray(shard.read_bytes())
    (header_len,) = struct.unpack("<Q", data[:8])
    data[8 : 8 + header_len] = b"{" + b"\xff" * (header_len - 1)
    shard.write_bytes(bytes(data))
    assert_copy_fails(folder, order, tmp_path, str(shard), "not valid JSON")


def test_header_length_larger_than_the_file(checkpoint, tmp_path):
    folder, order = checkpoint
    shard = largest_shard(folder)
    data = bytearray(shard.read_bytes())
    data[:8] = struct.pack("<Q", len(data) + 1000)
    shard.write_bytes(bytes(data))
    assert_copy_fails(folder, order, tmp_path, str(shard), "exceeds the file size")


def test_a_folder_with_both_a_single_file_and_an_index_is_read_as_transformers_loads_it(tmp_path):
    """The index was read first; transformers loads model.safetensors first: another model was converted."""
    folder = tmp_path / "both"
    make_checkpoint(folder, "40KB", seed=0)
    assert (folder / INDEX).exists()
    other = tiny_model(vocab_size=VOCAB, seed=1)
    other.save_pretrained(tmp_path / "other")
    shutil.copy(tmp_path / "other" / "model.safetensors", folder / "model.safetensors")
    loaded = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    with CheckpointReader(folder) as reader:
        assert reader.ignored_index == (INDEX, "model.safetensors") and set(reader.files) == {"model.safetensors"}
        for name in ("model.embed_tokens.weight", "model.layers.1.self_attn.k_proj.weight"):
            assert torch.equal(reader.get(name), loaded[name])
            assert torch.equal(reader.get(name), other.state_dict()[name])


def test_index_names_a_missing_shard(checkpoint, tmp_path):
    folder, order = checkpoint
    shard = largest_shard(folder)
    shard.unlink()
    assert_copy_fails(folder, order, tmp_path, INDEX, shard.name, "missing")


def test_index_lists_a_tensor_its_shard_does_not_hold(checkpoint, tmp_path):
    folder, order = checkpoint
    other = sorted(f for f in shard_files(folder) if f != largest_shard(folder).name)[0]
    edit_index(folder, lambda weight_map: weight_map.__setitem__("model.norm.weight", other))
    with pytest.raises(CheckpointError, match=f"{other}.*does not hold"):
        CheckpointReader(folder).tensor_infos()
    assert_copy_fails(folder, order, tmp_path, other, "model.norm.weight")


@pytest.mark.parametrize("target", ["../../etc/x", "../outside.safetensors", "sub/../../outside.safetensors"])
def test_index_with_path_traversal(checkpoint, tmp_path, target):
    folder, order = checkpoint
    shutil.copyfile(largest_shard(folder), tmp_path / "outside.safetensors")  # a real, readable file out there
    edit_index(folder, lambda weight_map: weight_map.__setitem__("model.norm.weight", target))
    assert_copy_fails(folder, order, tmp_path, target, "outside the model folder")


@pytest.mark.parametrize("absolute", ["/etc/passwd", "INSIDE"])
def test_index_with_absolute_path(checkpoint, tmp_path, absolute):
    folder, order = checkpoint
    if absolute == "INSIDE":  # absolute even though it points into the folder: still refused
        absolute = str(largest_shard(folder).resolve())
    edit_index(folder, lambda weight_map: weight_map.__setitem__("model.norm.weight", absolute))
    assert_copy_fails(folder, order, tmp_path, absolute, "absolute path")


def test_shard_symlinked_from_outside_the_folder(checkpoint, tmp_path):
    folder, order = checkpoint
    shard = largest_shard(folder)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.move(shard, elsewhere / shard.name)
    shard.symlink_to(elsewhere / shard.name)
    assert_copy_fails(folder, order, tmp_path, shard.name, "symlink", "outside the model folder")


def test_single_file_symlinked_from_outside_the_folder(tmp_path):
    folder = tmp_path / "model"
    make_checkpoint(folder, "5GB", family="llama")
    elsewhere = tmp_path / "elsewhere.safetensors"
    shutil.move(folder / "model.safetensors", elsewhere)
    (folder / "model.safetensors").symlink_to(elsewhere)
    with pytest.raises(CheckpointError, match="symlink pointing outside"):
        CheckpointReader(folder)


def test_symlinks_into_the_hugging_face_cache_blobs_are_read(template_checkpoint, tmp_path):
    """`snapshot_download` folders are symlinks into `../../blobs`; those are the model, not an escape."""
    template, order = template_checkpoint
    repo = tmp_path / "hub" / "models--someone--tiny"
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for number, path in enumerate(sorted(template.iterdir())):
        blob = repo / "blobs" / f"{number:040x}"
        shutil.copyfile(path, blob)
        (snapshot / path.name).symlink_to(Path("../../blobs") / blob.name)
    reader = CheckpointReader(snapshot)
    for name in reader.keys():
        assert torch.equal(reader.get(name), CheckpointReader(template).get(name))
    copy_checkpoint(snapshot, tmp_path / "copy", order, "20KB")
    assert (tmp_path / "copy" / INDEX).read_text() == (template / INDEX).read_text()

    # A link from the snapshot to anywhere but the repo's blobs is still refused.
    shard = largest_shard(snapshot)
    shard.unlink()
    stray = tmp_path / "stray.safetensors"
    shutil.copyfile(largest_shard(template), stray)
    shard.symlink_to(stray)
    with pytest.raises(CheckpointError, match="symlink pointing outside"):
        CheckpointReader(snapshot)


def test_missing_or_broken_config(checkpoint):
    folder, _ = checkpoint
    assert read_config_json(folder)["architectures"] == ["LlamaForCausalLM"]
    (folder / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json: not valid JSON"):
        read_config_json(folder)
    (folder / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json: missing"):
        read_config_json(folder)


def test_folder_without_weights(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=f"{folder}: no weights found"):
        CheckpointReader(folder)
    with pytest.raises(CheckpointError, match="no such model folder"):
        CheckpointReader(tmp_path / "nowhere")


# --------------------------------------------------------------------------- pickle
class NotATensor:
    def __init__(self):
        self.payload = [1, 2, 3]


class RunsCode:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def tiny_state():
    return tiny_model(family="qwen2", vocab_size=VOCAB).state_dict()


def pickle_folder(folder: Path, payload, legacy: bool = False) -> Path:
    folder.mkdir()
    torch.save(payload, folder / "pytorch_model.bin", _use_new_zipfile_serialization=not legacy)
    return folder


def test_pickle_refused_unless_allowed(tmp_path, tiny_state):
    folder = pickle_folder(tmp_path / "model", tiny_state)
    with pytest.raises(PickleRefusedError, match="--allow-pickle"):
        CheckpointReader(folder)
    reader = CheckpointReader(folder, allow_pickle=True)
    assert reader.format == "pickle"
    assert reader.keys() == list(tiny_state)
    for name, tensor in tiny_state.items():
        assert torch.equal(reader.get(name), tensor), name
    assert reader.tensor_infos()["model.layers.0.self_attn.q_proj.bias"].shape == (64,)


def test_folds_apply_to_pickled_weights_as_to_safetensors(tmp_path, tiny_state):
    """A Granite or Helium stored as .bin is read as the Llama it equals, like one stored as safetensors."""
    from mla_convert.io.reader import Fold

    reader = CheckpointReader(pickle_folder(tmp_path / "model", tiny_state), allow_pickle=True)
    q, bias = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.bias"
    order = torch.randperm(64)
    reader.fold({q: Fold(scale=2.0, row_order=order), bias: Fold(row_order=order)})
    assert torch.equal(reader.get(q), tiny_state[q][order] * 2.0)
    assert torch.equal(reader.get_rows(bias, 8, 12), tiny_state[bias][order][8:12])


def test_legacy_pickle_format_is_read(tmp_path, tiny_state):
    """Pre-1.6 (non-zip) .bin files cannot be memory-mapped; they must still load."""
    folder = pickle_folder(tmp_path / "model", tiny_state, legacy=True)
    reader = CheckpointReader(folder, allow_pickle=True)
    assert torch.equal(reader.get("model.embed_tokens.weight"), tiny_state["model.embed_tokens.weight"])


def test_sharded_pickle_is_read_shard_by_shard(tmp_path, tiny_state):
    folder = tmp_path / "model"
    folder.mkdir()
    names = list(tiny_state)
    halves = {"pytorch_model-00001-of-00002.bin": names[: len(names) // 2], "pytorch_model-00002-of-00002.bin": names[len(names) // 2 :]}
    for file, part in halves.items():
        torch.save({name: tiny_state[name] for name in part}, folder / file)
    weight_map = {name: file for file, part in halves.items() for name in part}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(PickleRefusedError):
        CheckpointReader(folder)
    reader = CheckpointReader(folder, allow_pickle=True)
    loaded = reader.get_many(reversed(names))
    assert reader.files_opened == 2
    assert all(torch.equal(loaded[name], tiny_state[name]) for name in names)


@pytest.mark.parametrize("kind", ["code", "object"])
def test_pickle_with_non_tensor_objects_is_refused_even_when_allowed(tmp_path, tiny_state, kind):
    marker = tmp_path / "pwned"
    intruder = RunsCode(marker) if kind == "code" else NotATensor()
    folder = pickle_folder(tmp_path / "model", {**tiny_state, "extra": intruder})
    with pytest.raises(CheckpointError, match="pytorch_model.bin: refused") as caught:
        CheckpointReader(folder, allow_pickle=True)
    assert "\n" not in str(caught.value)
    assert ("system" in str(caught.value)) if kind == "code" else ("NotATensor" in str(caught.value))
    assert not marker.exists(), "unpickling ran code"


def test_pickle_that_is_not_a_flat_state_dict_is_refused(tmp_path, tiny_state):
    folder = pickle_folder(tmp_path / "model", {"state_dict": dict(tiny_state), "epoch": 3})
    with pytest.raises(CheckpointError, match="'state_dict' is a dict, not a tensor"):
        CheckpointReader(folder, allow_pickle=True)


# --------------------------------------------------------------------------- resolving what the user typed
def test_resolve_local_paths(tmp_path, sharded_llama):
    folder, _ = sharded_llama
    assert resolve_model_path(folder) == folder
    assert resolve_config_path(str(folder)) == folder
    with pytest.raises(CheckpointError, match="is a file"):
        resolve_model_path(folder / "config.json")
    with pytest.raises(CheckpointError, match="no such folder, and not a Hugging Face hub id"):
        resolve_model_path(tmp_path / "no" / "such" / "model")
    assert looks_like_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct") and looks_like_hub_id("gpt2")
    assert not looks_like_hub_id("./model") and not looks_like_hub_id("a/b/c") and not looks_like_hub_id("~/m")


# --------------------------------------------------------------------------- the benchmark's synthetic source
def test_synthetic_checkpoint_is_laid_out_like_save_pretrained(tmp_path):
    """bench_io.py's source must look like a real checkpoint, or its numbers say nothing about real ones."""
    import importlib.util

    from transformers import LlamaForCausalLM

    script = Path(__file__).resolve().parents[1] / "scripts" / "make_synthetic_checkpoint.py"
    spec = importlib.util.spec_from_file_location("make_synthetic_checkpoint", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    shape = dict(hidden=64, heads=4, kv_heads=2, intermediate=96, layers=3, vocab=VOCAB)
    module.make_synthetic_checkpoint(tmp_path / "synthetic", max_shard_size="20KB", quiet=True, **shape)
    config = module.llama_config(64, 4, 2, 96, 3, VOCAB)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "real", max_shard_size="20KB")
    assert (tmp_path / "synthetic" / INDEX).read_text() == (tmp_path / "real" / INDEX).read_text()
    assert shard_files(tmp_path / "synthetic") == shard_files(tmp_path / "real")
    assert read_config_json(tmp_path / "synthetic") == read_config_json(tmp_path / "real")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "synthetic")
    assert type(model) is LlamaForCausalLM and model.dtype == torch.bfloat16
    stored = CheckpointReader(tmp_path / "synthetic").get("model.layers.2.mlp.down_proj.weight")
    assert torch.equal(model.model.layers[2].mlp.down_proj.weight.detach(), stored)
    assert float(stored.float().std()) == pytest.approx(0.02, rel=0.2)


def test_synthetic_checkpoint_sizes_and_bad_shapes(tmp_path):
    """--layers 0 used to fall back to a layer search that never ended for narrow models; bad shapes left a
    half-written folder (and a FileExistsError on the next run)."""
    import importlib.util

    script = Path(__file__).resolve().parents[1] / "scripts" / "make_synthetic_checkpoint.py"
    spec = importlib.util.spec_from_file_location("make_synthetic_checkpoint", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    dims = (64, 4, 2, 64)

    def size(layers: int) -> int:
        return module.checkpoint_bytes(module.tensor_shapes(module.llama_config(*dims, layers, VOCAB)))

    for layers in (1, 2, 7):  # the fewest layers that reach a size, as counting up one by one finds it
        assert module.layers_for_size(size(layers), *dims, VOCAB) == layers
        assert module.layers_for_size(size(layers) + 1, *dims, VOCAB) == layers + 1
    assert module.layers_for_size(10 * 2**30, *dims, VOCAB) > 10_000  # at once, however many
    for kwargs, message in [(dict(layers=0), "--layers 0: must be at least 1"),
                            (dict(heads=5), "not a multiple of --heads 5"),
                            (dict(max_shard_size="bogus"), "--max-shard-size 'bogus'")]:
        shape = dict(hidden=64, heads=4, kv_heads=2, intermediate=64, layers=2, vocab=VOCAB) | kwargs
        with pytest.raises(ValueError, match=re.escape(message)):
            module.make_synthetic_checkpoint(tmp_path / "synthetic", quiet=True, **shape)
        assert not (tmp_path / "synthetic").exists()


def test_bench_io_never_deletes_a_work_folder_it_did_not_make(tmp_path):
    """`bench_io.py --workdir DIR` used to rmtree DIR whatever it held."""
    import importlib.util

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_io.py"
    spec = importlib.util.spec_from_file_location("bench_io", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.txt").write_text("mine")
    with pytest.raises(SystemExit, match="not a folder this benchmark made"):
        module.main(["--workdir", str(precious), "--no-markdown"])
    assert (precious / "thesis.txt").read_text() == "mine"
