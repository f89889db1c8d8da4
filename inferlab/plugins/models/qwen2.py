"""Qwen2ForCausalLM (also Qwen2.5): Llama's architecture with a bias on the q, k and v projections
(none on o_proj or the MLP)."""

from inferlab.core.hookspecs import hookimpl
from inferlab.plugins.models.decoder import Biases, DecoderForCausalLM, DecoderOptions
from inferlab.plugins.models.qwen_config import QWEN2_CONFIG_DEFAULTS


class Qwen2ForCausalLM(DecoderForCausalLM):
    architectures = ("Qwen2ForCausalLM",)
    config_defaults = {"qwen2": QWEN2_CONFIG_DEFAULTS}

    @classmethod
    def biases(cls, config) -> Biases:
        return Biases(qkv=True, o=False, mlp=False)


@hookimpl
def register_models(register):
    register("qwen2", Qwen2ForCausalLM, options=DecoderOptions)
