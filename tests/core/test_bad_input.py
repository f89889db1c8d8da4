"""Every bad input gets an exception that says what was wrong and what is allowed, and the same
engine keeps serving the next request."""

import json
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from inferlab import LLM, SamplingParams
from inferlab.core.plugins import PluginError

OK = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint("gqa2-tied"), kvcache_block_size=16, num_kvcache_blocks=8, max_model_len=64)


@pytest.fixture(scope="module")
def reference(llm):
    return llm.generate([[5, 6, 7]], OK, use_tqdm=False)


def still_works(llm, reference):
    assert llm.generate([[5, 6, 7]], OK, use_tqdm=False) == reference
    assert llm.is_finished() and llm.kv_manager.num_free_blocks == llm.kv_manager.num_blocks


@pytest.mark.parametrize(
    "prompt, match",
    [
        ("", "prompt is empty"),
        ([], "prompt is empty"),
        ([1] * 65, "65 tokens, more than max_model_len=64"),
        ([5, 10**6], r"outside the vocabulary: ids must be in \[0, "),
        ([5, -1], "outside the vocabulary"),
        ([[1, 2]], "string or a list of token ids .*; got a list holding list"),
        ([1, True], "string or a list of token ids .*; got a list holding bool"),  # a bool is no token id
        ([1, 2.0], "string or a list of token ids .*; got a list holding float 2.0"),
        ([np.float64(1)], "got a list holding float64"),
        (np.array([1.0, 2.0]), "string or a list of token ids .*; got a 1-D NumPy array of float64"),
        (np.array([[1, 2]]), "got a 2-D NumPy array of int64"),
        (np.array(5), "got a 0-D NumPy array"),
        (np.array([True, False]), "got a 1-D NumPy array of bool"),
        (torch.tensor([1.0]), "got a 1-D torch tensor of torch.float32"),
        (torch.tensor([True]), "got a 1-D torch tensor of torch.bool"),
        (np.array([], dtype=np.int64), "prompt is empty"),
        (np.array([5, 10**6]), "outside the vocabulary"),
        ({1, 2}, "string or a list of token ids .*; got set"),
        (b"bytes", "got bytes"),
    ],
)
def test_bad_prompts(llm, reference, prompt, match):
    with pytest.raises((ValueError, TypeError), match=match):
        llm.generate([[1, 2, 3], prompt], OK, use_tqdm=False)
    with pytest.raises((ValueError, TypeError), match=match):
        llm.add_request(prompt, OK)
    still_works(llm, reference)


@pytest.mark.parametrize(
    "prompt",
    [
        np.array([5, 6, 7]),
        np.array([5, 6, 7], dtype=np.int32),
        np.array([5, 6, 7], dtype=np.uint16),
        torch.tensor([5, 6, 7]),
        torch.tensor([5, 6, 7], dtype=torch.int32),
        [np.int64(5), np.int64(6), np.int64(7)],
        (5, 6, 7),
        [5, np.int32(6), 7],
    ],
    ids=["np-int64", "np-int32", "np-uint16", "torch-int64", "torch-int32", "list-of-np.int64", "tuple", "mixed"],
)
def test_integer_arrays_are_token_ids(llm, reference, prompt):
    """What people pass as token ids: NumPy arrays, torch tensors, lists of NumPy integers."""
    assert llm.generate(prompt, OK, use_tqdm=False) == reference  # one prompt
    assert llm.generate([prompt, [5, 6, 7]], OK, use_tqdm=False) == reference * 2
    request_id = llm.add_request(prompt, OK)
    assert llm.requests[request_id].token_ids == [5, 6, 7]
    while not llm.is_finished():
        llm.step()
    still_works(llm, reference)


@pytest.mark.parametrize("arrival_time", ["now", float("nan"), float("inf"), True])
def test_an_arrival_time_that_is_not_a_number(llm, reference, arrival_time):
    """Policies compare arrival times every step: one that is not a number would fail them all."""
    with pytest.raises(TypeError, match="arrival_time must be a finite number of seconds"):
        llm.add_request([5, 6, 7], OK, arrival_time=arrival_time)
    still_works(llm, reference)


def test_a_2d_array_of_prompts_is_refused(llm, reference):
    with pytest.raises(TypeError, match="prompts as a 2-D array are ambiguous .*padding"):
        llm.generate(np.array([[5, 6, 7], [1, 2, 3]]), OK, use_tqdm=False)
    with pytest.raises(TypeError, match="prompts must be one prompt or a list of prompts"):
        llm.generate(5, OK, use_tqdm=False)
    still_works(llm, reference)


def test_request_that_can_never_fit_the_cache(llm, reference):
    """An error, never a hang: raised by add_request (and generate with raise_on_error), answered as
    an error result by generate while the other requests complete."""
    tiny = LLM(llm.model_path, kvcache_block_size=16, num_kvcache_blocks=2, max_model_len=64)
    message = r"needs up to 3 KV blocks .* whole cache has 2: it could never be served"
    with pytest.raises(ValueError, match=message):
        tiny.add_request([1] * 30, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match=message):
        tiny.generate([[1] * 30], SamplingParams(max_tokens=10), use_tqdm=False, raise_on_error=True)
    failed, served = tiny.generate(
        [[1] * 30, [1] * 10], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), use_tqdm=False
    )
    assert (
        failed["finish_reason"] == "error" and failed["token_ids"] == [] and "could never be served" in failed["error"]
    )
    assert len(served["token_ids"]) == 5
    still_works(llm, reference)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_tokens=0), r"max_tokens must be an integer in \[1, 2\*\*63 - 1\], got 0"),
        (dict(max_tokens=2**63), r"max_tokens must be an integer in \[1, 2\*\*63 - 1\]"),
        (dict(max_tokens=5.0), "max_tokens must be an integer"),
        (dict(temperature=-0.1), r"temperature must be a number in \[0, 2\*\*126\]"),
        (dict(temperature=float("nan")), r"temperature must be a number in \[0, 2\*\*126\]"),
        (dict(temperature=float("inf")), r"temperature must be a number in \[0, 2\*\*126\]"),
        (dict(temperature="0.5"), r"temperature must be a number in \[0, 2\*\*126\]"),
        (dict(temperature=2.0**127), r"temperature must be a number in \[0, 2\*\*126\]"),
        (dict(top_p=0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(top_p=float("nan")), r"top_p must be in \(0, 1\]"),
        (dict(top_k=0), r"top_k must be -1 \(disabled\) or an integer in \[1, 2\*\*31 - 1\]"),
        (dict(top_k=-2), "top_k must be -1"),
        (
            dict(top_k=2**63),
            r"top_k must be -1 \(disabled\) or an integer in \[1, 2\*\*31 - 1\], got 9223372036854775808",
        ),
        (dict(top_k=True), "top_k must be -1"),
        (dict(min_p=-0.1), r"min_p must be in \[0, 1\]"),
        (dict(min_p=1.1), r"min_p must be in \[0, 1\]"),
        (dict(seed=-1), r"seed must be None or an integer in \[0, 2\*\*32 - 1\], got -1"),
        (dict(seed=2**32), r"seed must be None or an integer in \[0, 2\*\*32 - 1\]"),
        (dict(seed=2**64), r"seed must be None or an integer in \[0, 2\*\*32 - 1\]"),
        (dict(seed=1.5), "seed must be None or an integer"),
        (dict(ignore_eos="no"), "ignore_eos must be True or False"),
        (dict(stop=[""]), "stop must be a non-empty string or a list of them"),
        (dict(stop=7), "stop must be a non-empty string or a list of them"),
        (dict(stop_token_ids=[-1]), r"stop_token_ids must be token ids, each an integer in \[0, 2\*\*63 - 1\]"),
        (dict(stop_token_ids=[2**63]), "stop_token_ids must be token ids"),
        (dict(stop_token_ids=3), "stop_token_ids must be a list of token ids"),
    ],
)
def test_bad_sampling_params(kwargs, match):
    """Every field is bounded where it is built, with the allowed range in the message: nothing
    that passes can overflow the runner's int64 and float32 tensors."""
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_sampling_params_are_immutable_and_normalized():
    import dataclasses

    import numpy as np

    params = SamplingParams(
        temperature=np.float32(0.5), max_tokens=np.int64(3), seed=2**32 - 1, stop="\n", top_k=2**31 - 1
    )
    assert params.stop == ("\n",) and params.stop_token_ids == () and type(params.max_tokens) is int
    assert type(params.temperature) is float and params.seed == 2**32 - 1
    for name, value in [("top_p", 0), ("stop", ["x"]), ("max_tokens", 10)]:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(params, name, value)
    with pytest.raises(AttributeError):
        params.stop.append("x")
    assert dataclasses.replace(params, top_p=0.5).top_p == 0.5  # a changed copy is checked again
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        dataclasses.replace(params, top_p=0)
    assert hash(params) == hash(
        SamplingParams(temperature=0.5, max_tokens=3, seed=2**32 - 1, stop=["\n"], top_k=2**31 - 1)
    )


def test_mismatched_sampling_params_list(llm, reference):
    with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
        llm.generate([[1], [2], [3]], [OK, OK], use_tqdm=False)
    still_works(llm, reference)


@pytest.mark.parametrize("kind", ["scheduler", "kv_cache", "attention", "model", "sampler"])
def test_unknown_plugin_lists_available(checkpoint, kind):
    with pytest.raises(PluginError, match=rf"unknown {kind} 'nope'; available: \[.+\]"):
        LLM(checkpoint("gqa2-tied"), **{kind: "nope"})


def test_unknown_setting():
    with pytest.raises(TypeError, match=r"unknown engine setting\(s\) \['max_num_seq'\]; allowed:"):
        LLM(max_num_seq=3)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_num_seqs=0), "max_num_seqs must be a positive integer"),
        (dict(gpu_memory_utilization=1.5), r"gpu_memory_utilization must be in \(0, 1\]"),
        (dict(kvcache_block_size=24), "block size must be a power of two >= 16, got 24"),
        (dict(dtype="float8"), "dtype must be one of"),
        (dict(graph_prefill_tokens=-1), r"graph_prefill_tokens must be >= 0 \(0: steps with prefill run eagerly;"),
        (dict(graph_prefill_tokens=1.5), "graph_prefill_tokens must be a whole number of tokens or None, got 1.5"),
        (dict(gpu_memory_utilization="0.5"), r"gpu_memory_utilization must be in \(0, 1\], got '0.5'"),
        # a string repeated itself 2**30 times here before failing on its int()
        (dict(cpu_kv_cache_gib="1"), "cpu_kv_cache_gib must be a positive number of GiB, got '1'"),
        (dict(cpu_kv_cache_gib=-1), "cpu_kv_cache_gib must be a positive number of GiB, got -1"),
        (dict(cpu_kv_cache_gib=float("nan")), "cpu_kv_cache_gib must be a positive number of GiB, got nan"),
        # "false" counted as true
        (dict(enable_prefix_caching="false"), "enable_prefix_caching must be True or False, got 'false'"),
        (dict(enforce_eager="no"), "enforce_eager must be True or False, got 'no'"),
        (dict(compile_at_start=0), "compile_at_start must be True or False, got 0"),
        (dict(overlap_scheduling="no"), r"overlap_scheduling must be True, False or None \(on where"),
        (dict(seed="x"), "seed must be an integer >= 0, got 'x'"),
        (dict(seed=-5), "seed must be an integer >= 0, got -5"),
    ],
)
def test_bad_settings(checkpoint, kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        LLM(checkpoint("gqa2-tied"), **kwargs)


def test_missing_model_directory(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match=f"model directory '{missing}' does not exist"):
        LLM(str(missing))


def copy_checkpoint(checkpoint, tmp_path, name="copy"):
    target = tmp_path / name
    shutil.copytree(checkpoint("gqa2-tied"), target)
    return target


def test_missing_config(checkpoint, tmp_path):
    path = copy_checkpoint(checkpoint, tmp_path)
    os.remove(path / "config.json")
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        LLM(str(path))


def test_missing_weights(checkpoint, tmp_path):
    path = copy_checkpoint(checkpoint, tmp_path)
    for f in path.glob("*.safetensors"):
        os.remove(f)
    with pytest.raises(FileNotFoundError, match=rf"no \*.safetensors weight files in '{path}'"):
        LLM(str(path))


def test_missing_shard_of_sharded_checkpoint(tmp_path):
    from inferlab.tiny_model import make_checkpoint

    path = make_checkpoint(str(tmp_path / "sharded"), max_shard_size="40KB")
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        victim = sorted(set(json.load(f)["weight_map"].values()))[-1]
    os.remove(os.path.join(path, victim))
    with pytest.raises(FileNotFoundError, match=f"weight files listed in .* are missing: \\['{victim}'\\]"):
        LLM(path)


def test_tensors_that_do_not_match(checkpoint, tmp_path):
    path = copy_checkpoint(checkpoint, tmp_path)
    weights_file = next(path.glob("*.safetensors"))
    original = load_file(weights_file)

    def broken(**changes):
        weights = dict(original)
        for name, value in changes.items():
            if value is None:
                del weights[name]
            else:
                weights[name] = value
        save_file(weights, weights_file, metadata={"format": "pt"})
        return str(path)

    o_proj = "model.layers.0.self_attn.o_proj.weight"
    with pytest.raises(ValueError, match=rf"{o_proj}.*shape \(64, 8\), the model expects \(64, 64\)"):
        LLM(broken(**{o_proj: original[o_proj][:, :8].contiguous()}))
    with pytest.raises(ValueError, match=r"tensors the model does not know: \['model.extra.weight'\]"):
        LLM(broken(**{"model.extra.weight": original["model.norm.weight"].clone()}))
    with pytest.raises(ValueError, match=r"lacks tensors the model needs: \['model.layers.1.mlp.up_proj.weight'\]"):
        LLM(broken(**{"model.layers.1.mlp.up_proj.weight": None}))
    with pytest.raises(
        ValueError, match=r"lacks tensors the model needs: \['model.layers.0.self_attn.k_proj.weight'\]"
    ):
        LLM(broken(**{"model.layers.0.self_attn.k_proj.weight": None}))
