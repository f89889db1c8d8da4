"""Inputs that used to load or run and then go wrong, now refused where they come in, naming the
culprit: a config.json whose rms_norm_eps is negative or whose rope_theta is not positive (the
model produced token 0 for ever), and a prompt tensor on the meta device (no values to read)."""

import json
import shutil

import pytest
import torch

from inferlab import LLM


def model_with(checkpoint, tmp_path, shape="gqa2-tied", **changes):
    target = tmp_path / "model"
    shutil.copytree(checkpoint(shape), target)
    fields = json.loads((target / "config.json").read_text())
    fields.update(changes)
    fields = {key: value for key, value in fields.items() if value is not None}
    (target / "config.json").write_text(json.dumps(fields))
    return str(target)


@pytest.mark.parametrize(
    "shape, changes, message",
    [
        ("gqa2-tied", {"rms_norm_eps": -1e-6}, "rms_norm_eps must be a finite number >= 0, got -1e-06"),
        ("gqa2-tied", {"rms_norm_eps": float("nan")}, "rms_norm_eps must be a finite number >= 0, got nan"),
        (
            "gqa2-tied",
            {"rope_parameters": {"rope_theta": 0, "rope_type": "default"}},
            "rope_theta must be a finite number > 0, got 0",
        ),
        # as transformers 4 wrote it: rope_theta beside the other fields
        (
            "gqa2-tied",
            {"rope_parameters": None, "rope_theta": -10000.0},
            "rope_theta must be a finite number > 0, got -10000.0",
        ),
        (
            "llama-gqa-llama3",
            {"rope_parameters": None, "rope_scaling": None, "rope_theta": 0.0},
            "rope_theta must be a finite number > 0, got 0.0",
        ),
    ],
    ids=["negative-eps", "nan-eps", "zero-theta", "negative-theta-v4", "llama-zero-theta-v4"],
)
def test_norm_and_rotary_settings_that_cannot_work_are_refused_at_load(checkpoint, tmp_path, shape, changes, message):
    path = model_with(checkpoint, tmp_path, shape, **changes)
    with pytest.raises(ValueError, match=rf"config.json: {message}"):
        LLM(path, device="cpu")


def test_a_prompt_on_the_meta_device_is_a_value_error_naming_it(checkpoint):
    with LLM(checkpoint(), device="cpu") as llm:
        prompt = torch.empty(3, dtype=torch.long, device="meta")
        with pytest.raises(ValueError, match="prompt 1: a prompt on the meta device holds no token ids"):
            llm.generate([[1, 2], prompt], use_tqdm=False)
        with pytest.raises(ValueError, match="a prompt on the meta device holds no token ids"):
            llm.add_request(prompt)
        assert not llm.requests
