"""Qwen3ForCausalLM: the shared decoder with a per-head RMSNorm of q and k before the rotary, which
its fused Triton kernel (kernels/qk_norm_rope.py) computes together with the K/V store."""

from inferlab.core.hookspecs import hookimpl
from inferlab.plugins.models.decoder import DecoderForCausalLM, DecoderOptions


class Qwen3ForCausalLM(DecoderForCausalLM):
    architectures = ("Qwen3ForCausalLM",)
    qk_norm = True


@hookimpl
def register_models(register):
    register("qwen3", Qwen3ForCausalLM, options=DecoderOptions)
