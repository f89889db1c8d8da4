"""What a simulated engine's outputs read as: the synthetic tokens spell visible text (never EOS or
another special token), and an engine given no checkpoint is named after the profiled model."""

import json

import pytest

from inferlab import LLM, SamplingParams
from inferlab.plugins.executors.simulated import SYNTHETIC_TEXT
from inferlab.sim.profile import PROFILE_DIR, load_profile


def simulated(profile: str) -> LLM:
    return LLM(executor="simulated", executor_options={"profile": profile})


def test_synthetic_tokens_spell_text_and_never_a_special_token():
    with simulated("h200-qwen3-0.6b-triton") as engine:
        [out] = engine.generate(["Hello"], SamplingParams(max_tokens=40, ignore_eos=True), use_tqdm=False)
        special = set(engine.tokenizer.all_special_ids)
        assert len(out["token_ids"]) == 40 and not special & set(out["token_ids"])
        assert len(out["text"].split()) >= 5 and out["text"] in SYNTHETIC_TEXT * 10  # the text, from some word on
        assert out["text"] == engine.tokenizer.decode(out["token_ids"], skip_special_tokens=False)


def test_an_engine_without_a_checkpoint_is_named_after_the_profiled_model(tmp_path):
    with simulated("h200-qwen3-8b-triton") as engine:
        assert engine.model_path == "Qwen3-8B"
    data = json.load(open(f"{PROFILE_DIR}/h200-qwen3-0.6b-triton.json"))
    del data["model_name"]  # a profile written before profiles recorded it: named by its file
    (tmp_path / "older-profile.json").write_text(json.dumps(data))
    with simulated(str(tmp_path / "older-profile.json")) as engine:
        assert engine.model_path == "older-profile"


def test_a_profile_whose_model_name_is_not_a_string_is_refused(tmp_path):
    data = json.load(open(f"{PROFILE_DIR}/h200-qwen3-0.6b-triton.json"))
    (tmp_path / "bad.json").write_text(json.dumps({**data, "model_name": 7}))
    with pytest.raises(ValueError, match=r"bad\.json: malformed step-time profile: model_name must be a string, got 7"):
        load_profile(str(tmp_path / "bad.json"))
