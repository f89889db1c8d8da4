"""Qwen3ForCausalLM: the shared decoder with a per-head RMSNorm of q and k before the rotary, which
its fused Triton kernel (kernels/qk_norm_rope.py) computes together with the K/V store."""

from inferlab.core.hookspecs import hookimpl
from inferlab.plugins.models.decoder import DecoderForCausalLM, DecoderOptions
from inferlab.plugins.models.qwen_config import QWEN2_CONFIG_DEFAULTS


class Qwen3ForCausalLM(DecoderForCausalLM):
    architectures = ("Qwen3ForCausalLM",)
    # Qwen3Config's defaults (transformers 5.x): Qwen2Config's with a head_dim and attention_bias.
    config_defaults = {"qwen3": {**QWEN2_CONFIG_DEFAULTS, "head_dim": 128, "attention_bias": False}}
    qk_norm = True


@hookimpl
def register_models(register):
    register("qwen3", Qwen3ForCausalLM, options=DecoderOptions)
