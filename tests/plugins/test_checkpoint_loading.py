"""Checkpoints that would load wrong fail at load instead, with an error naming the file and the
tensor or field: weights of a non-floating dtype, a tensor held twice, NaN or infinite weights,
a broken index, a directory named like a weights file, a broken safetensors header. float64
weights are cast to the model's dtype like any other floating dtype."""

import json
import os
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from inferlab import LLM, SamplingParams
from inferlab.plugins.models.checkpoint import CheckpointError

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = [5, 17, 33, 2, 9]
SETTINGS = dict(kvcache_block_size=16, num_kvcache_blocks=8)
O_PROJ = "model.layers.0.self_attn.o_proj.weight"


@pytest.fixture
def copy(checkpoint, tmp_path):
    """A copy of a tiny single-file checkpoint: (its directory, its weights file, the tensors)."""
    path = tmp_path / "model"
    shutil.copytree(checkpoint("gqa2-tied"), path)
    weights = path / "model.safetensors"
    return path, weights, load_file(weights)


def save(tensors, file):
    save_file(tensors, file, metadata={"format": "pt"})


def tokens(path, **settings):
    return LLM(str(path), **{**SETTINGS, **settings}).generate([PROMPT], GREEDY, use_tqdm=False)[0]["token_ids"]


@pytest.mark.parametrize("dtype", [torch.bool, torch.int32, torch.int64, torch.uint8, torch.float8_e4m3fn])
def test_a_non_floating_or_scaled_dtype_is_refused(copy, dtype):
    path, weights, tensors = copy
    save({**tensors, O_PROJ: tensors[O_PROJ].to(dtype)}, weights)
    name = str(dtype).replace("torch.", "")
    message = (
        rf"weight file '{weights}': tensor '{O_PROJ}' has dtype {name}; weights must be one of "
        r"\['float16', 'bfloat16', 'float32', 'float64'\]"
    )
    with pytest.raises(CheckpointError, match=message):
        LLM(str(path), **SETTINGS)


def test_float64_weights_are_cast_like_the_others(copy, checkpoint):
    path, weights, tensors = copy
    save({name: tensor.double() for name, tensor in tensors.items()}, weights)
    assert tokens(path) == tokens(checkpoint("gqa2-tied"))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_or_infinite_weights_are_refused(copy, bad):
    path, weights, tensors = copy
    broken = tensors[O_PROJ].clone()
    broken[3, 5] = broken[7, 1] = bad
    save({**tensors, O_PROJ: broken}, weights)
    with pytest.raises(
        CheckpointError, match=rf"weight file '{weights}': tensor '{O_PROJ}' has 2 NaN or infinite values"
    ):
        LLM(str(path), **SETTINGS)


def test_a_value_that_overflows_the_model_dtype_is_refused(copy):
    """70000 is a float32 but no float16: the cast would make it infinite."""
    path, weights, tensors = copy
    broken = tensors[O_PROJ].clone()
    broken[0, 0] = 70000.0
    save({**tensors, O_PROJ: broken}, weights)
    with pytest.raises(CheckpointError, match=rf"tensor '{O_PROJ}' has 1 NaN or infinite values \(in float16"):
        LLM(str(path), dtype="float16", **SETTINGS)


def test_a_tensor_in_a_stray_second_file_is_an_error_naming_both(copy):
    path, weights, tensors = copy
    stray = path / "zz-stray.safetensors"
    save({O_PROJ: torch.zeros_like(tensors[O_PROJ])}, stray)
    with pytest.raises(
        CheckpointError,
        match=rf"tensor '{O_PROJ}' of '{stray}' is in the checkpoint twice: '{O_PROJ}' of '{weights}' gives the same weight",
    ):
        LLM(str(path), **SETTINGS)


def test_two_names_for_one_weight_are_an_error(copy):
    path, weights, tensors = copy
    save({**tensors, O_PROJ.removeprefix("model."): tensors[O_PROJ].clone()}, weights)
    with pytest.raises(CheckpointError, match="is in the checkpoint twice"):
        LLM(str(path), **SETTINGS)


@pytest.fixture
def sharded(tmp_path):
    from inferlab.tiny_model import make_checkpoint

    path = make_checkpoint(str(tmp_path / "sharded"), max_shard_size="40KB")
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        index = json.load(f)
    return path, index


def test_with_an_index_only_its_files_are_read(sharded):
    """As transformers reads them: a file the index does not list (Mistral's repositories carry a
    consolidated.safetensors beside the shards) is left alone."""
    path, index = sharded
    expected = tokens(path)
    name = next(iter(index["weight_map"]))
    save({name: torch.zeros(3), "unknown.weight": torch.zeros(2)}, os.path.join(path, "consolidated.safetensors"))
    assert tokens(path) == expected


def test_a_tensor_in_two_shards_of_an_index_is_an_error_naming_both(sharded):
    path, index = sharded
    files = sorted(set(index["weight_map"].values()))
    first, second = os.path.join(path, files[0]), os.path.join(path, files[1])
    name = next(n for n, f in index["weight_map"].items() if f == files[0])
    save({**load_file(second), name: load_file(first)[name]}, second)
    with pytest.raises(
        CheckpointError, match=rf"tensor '{name}' of '{second}' is in the checkpoint twice: .* of '{first}'"
    ):
        LLM(path, **SETTINGS)


@pytest.mark.parametrize(
    "content,match",
    [
        ('{"weight_map": {"a": "b.safetensors",}}', r" is not valid JSON: Expecting property name .*line 1 column 38"),
        ('{"metadata": {}}', r" has no 'weight_map' object \(tensor name -> file name\); got NoneType"),
        ('["model.safetensors"]', r" has no 'weight_map' object"),
        (
            '{"weight_map": {"a": 3}}',
            r": 'weight_map' must map tensor names to file names in the directory; got \{'a': 3\}",
        ),
        ('{"weight_map": {"a": "../x.safetensors"}}', r": 'weight_map' must map tensor names to file names"),
    ],
)
def test_a_broken_index_is_named(sharded, content, match):
    path, _ = sharded
    index = os.path.join(path, "model.safetensors.index.json")
    with open(index, "w") as f:
        f.write(content)
    with pytest.raises(CheckpointError, match=rf"index file '{index}'{match}"):
        LLM(path, **SETTINGS)


def test_a_directory_named_like_a_weights_file_is_named(copy, sharded):
    path, _, _ = copy
    os.mkdir(path / "extra.safetensors")
    with pytest.raises(CheckpointError, match=rf"weight file '{path / 'extra.safetensors'}' is not a file"):
        LLM(str(path), **SETTINGS)
    path, index = sharded  # listed in the index, a directory in place of a shard
    victim = os.path.join(path, sorted(set(index["weight_map"].values()))[0])
    os.remove(victim)
    os.mkdir(victim)
    with pytest.raises(CheckpointError, match=rf"weight file '{victim}' is not a file \(a directory\?\)"):
        LLM(path, **SETTINGS)


def header_and_data(file):
    raw = file.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def with_header(header, data):
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def edit_entry(name, **fields):
    def edit(raw_header, data):
        header = json.loads(json.dumps(raw_header))
        header[name].update(fields)
        for key, value in fields.items():
            if value is None:
                del header[name][key]
        return with_header(header, data)

    return edit


@pytest.mark.parametrize(
    "corrupt,match",
    [
        (lambda header, data: b"\x01\x02", "the file has 2 bytes, fewer than the 8 of the header's length"),
        (
            lambda header, data: struct.pack("<Q", 10**9) + data,
            r"the header's length says 1000000000 bytes, but only \d+ follow it",
        ),
        (
            lambda header, data: struct.pack("<Q", 9) + b'{"a": 1,}' + data,
            r"the header is not valid JSON: Expecting property name",
        ),
        (
            lambda header, data: with_header(header, data[:-4]),
            r"tensor '[\w.]+': data_offsets \[\d+, \d+\] fall outside the file's \d+ bytes of data",
        ),
        (edit_entry(O_PROJ, dtype="F33"), rf"tensor '{O_PROJ}': dtype 'F33' is not a safetensors dtype"),
        (
            edit_entry(O_PROJ, shape=[64, 65]),
            rf"tensor '{O_PROJ}': data_offsets \[\d+, \d+\] span 16384 bytes, but shape \[64, 65\] of F32 needs 16640",
        ),
        (edit_entry(O_PROJ, shape=None), rf"tensor '{O_PROJ}': header entry lacks \['shape'\]"),
        (edit_entry(O_PROJ, data_offsets=[0]), rf"tensor '{O_PROJ}': data_offsets \[0\] is not \[begin, end\]"),
    ],
    ids=["tiny", "length", "json", "truncated", "dtype", "shape", "no-shape", "offsets"],
)
def test_a_broken_safetensors_header_names_the_file_and_the_tensor(copy, corrupt, match):
    path, weights, _ = copy
    weights.write_bytes(corrupt(*header_and_data(weights)))
    with pytest.raises(CheckpointError, match=rf"weight file '{weights}' is not a readable safetensors file: {match}"):
        LLM(str(path), **SETTINGS)


def test_a_shape_that_does_not_fit_names_the_file(copy):
    path, weights, tensors = copy
    save({**tensors, O_PROJ: tensors[O_PROJ][:, :8].contiguous()}, weights)
    with pytest.raises(
        CheckpointError, match=rf"weight file '{weights}': tensor '{O_PROJ}': checkpoint shard has shape \(64, 8\)"
    ):
        LLM(str(path), **SETTINGS)
