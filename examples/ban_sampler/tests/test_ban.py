"""The ban sampler: the conformance suite (one import), told which tokens it bans."""

import torch

from inferlab.testing import SamplerSuite

BANNED = [1, 5]  # the two likeliest tokens of the suite's designed distribution, among others


class TestBan(SamplerSuite):
    sampler = "ban"
    sampler_options = {"token_ids": BANNED}

    def expected_logits(self, logits):
        return logits.index_fill(-1, torch.tensor(BANNED, device=logits.device), float("-inf"))
