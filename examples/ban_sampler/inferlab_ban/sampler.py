"""A sampler plugin: the default sampler, except that the banned token ids are never picked.
The same hook as a scheduler plugin, for another kind: `inferlab sampler=ban 'sampler.token_ids=[1,2]'`
or `LLM(..., sampler="ban", sampler_options={"token_ids": [1, 2]})`."""

from dataclasses import dataclass, field

import torch

from inferlab.core.hookspecs import hookimpl
from inferlab.plugins.samplers.default_sampler import DefaultSampler


@dataclass
class BanOptions:
    token_ids: list[int] = field(default_factory=list)


class BanSampler:
    def __init__(self, config, token_ids):
        self.token_ids = torch.tensor(list(token_ids), dtype=torch.int64)
        self.inner = DefaultSampler(config)

    def __call__(self, logits: torch.Tensor, params) -> torch.Tensor:
        if len(self.token_ids):
            logits = logits.index_fill(-1, self.token_ids.to(logits.device), float("-inf"))
        return self.inner(logits, params)


@hookimpl
def register_samplers(register):
    register("ban", BanSampler, options=BanOptions)
