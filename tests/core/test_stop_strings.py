"""Stop strings: one implementation (inferlab.core.text) for the library and the server, which
checks the text decoded since the last point where it was known, so a stop string is found however
many tokens spell it; and a bound on each request's stop work (count and total length)."""

from dataclasses import dataclass, field

import pytest
import torch

from inferlab import LLM, SamplingParams
from inferlab.core import scheduler as core_scheduler
from inferlab.core import text as core_text
from inferlab.core.plugins import PluginRegistry
from inferlab.core.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS
from inferlab.server import app as server_app

PROMPT = [370]  # "Hello" in the embedded model's byte-level tokenizer


@dataclass
class ScriptOptions:
    script: list[int] = field(default_factory=list)


class Scripted:
    """A sampler that emits a fixed list of tokens, whatever the logits: token i of the output is
    script[i] (then the script's last token)."""

    def __init__(self, config, script):
        self.script = script

    def __call__(self, logits, params):
        index = (params.steps - len(PROMPT)).clamp(0, len(self.script) - 1)
        return torch.tensor(self.script, device=logits.device)[index]


def scripted_engine(plugin_module, script: list[int]) -> LLM:
    registry = PluginRegistry()
    registry.register(
        plugin_module(
            "scripted", register_samplers=lambda register: register("scripted", Scripted, options=ScriptOptions)
        )
    )
    return LLM(registry=registry, sampler="scripted", sampler_options={"script": script}, device="cpu")


def test_a_stop_string_spelled_by_many_tokens_stops_the_request(plugin_module):
    with LLM(device="cpu") as llm:
        tokenizer = llm.tokenizer
    text = "X€жก한"
    script = tokenizer.encode(text) + tokenizer.encode(" and more text after it")
    assert len(tokenizer.encode("€жก한")) > len("€жก한") + 4  # more tokens than the old window looked back
    with scripted_engine(plugin_module, script) as llm:
        params = SamplingParams(max_tokens=20, stop=["€жก한"])
        out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    assert out["finish_reason"] == "stop"  # was "length", after 20 tokens
    assert out["token_ids"] == tokenizer.encode(text) and out["text"] == "X"


def test_a_stop_string_the_last_token_completes_stops_rather_than_length(plugin_module):
    with LLM(device="cpu") as llm:
        script = llm.tokenizer.encode("abc")
    with scripted_engine(plugin_module, script) as llm:
        out = llm.generate([PROMPT], SamplingParams(max_tokens=3, stop=["bc"]), use_tqdm=False)[0]
    assert (out["finish_reason"], out["text"], len(out["token_ids"])) == ("stop", "a", 3)


def test_the_library_and_the_server_share_one_stop_string_implementation():
    assert core_scheduler.TextStream is core_text.TextStream is server_app.TextStream


def test_stop_work_per_request_is_bounded():
    SamplingParams(stop=["x" * 32] * MAX_STOP_STRINGS)  # at the limits
    with pytest.raises(ValueError, match=f"stop must hold at most {MAX_STOP_STRINGS} strings .* got 33 strings"):
        SamplingParams(stop=["x"] * (MAX_STOP_STRINGS + 1))
    with pytest.raises(ValueError, match=f"at most {MAX_STOP_CHARS} characters in all, got 1 strings of 1025"):
        SamplingParams(stop=["x" * (MAX_STOP_CHARS + 1)])
    with pytest.raises(ValueError, match=r"got \['', .*\.\.\. \(\d+ characters\)"):  # a huge bad list, quoted short
        SamplingParams(stop=[""] * 10_000)


def test_the_longest_tail_that_may_begin_a_stop_string_is_held_back():
    stops = core_text.StopStrings(["ab" * 500, "xyz", "yzq"])
    emitted, stopped = stops.push("a" * 2000)
    assert not stopped and emitted == "a" * 1999 and stops.held == "a"
    assert stops.push("bab")[0] == "" and stops.held == "abab"
    assert stops.push("xy") == ("abab", False) and stops.held == "xy"  # "xy" may begin "xyz"; "y" alone "yzq"
    assert stops.push("zq") == ("", True)
