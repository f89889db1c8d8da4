"""inferlab: a small, fast LLM inference engine built from swappable plugins."""

from inferlab.cluster import Cluster
from inferlab.core.engine import LLMEngine
from inferlab.core.sampling_params import SamplingParams

__version__ = "0.1.0"


class LLM(LLMEngine):
    """The user-facing engine, as in nano-vllm: LLM(model_path, **settings).generate(...)."""


__all__ = ["LLM", "Cluster", "LLMEngine", "SamplingParams", "__version__"]
