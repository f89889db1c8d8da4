"""Tensor-parallel group as the model's layers see it: a rank, a size and two collectives."""

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """rank/size of this process within its tensor-parallel group; `group` is the torch.distributed
    process group (None when size is 1, where the collectives are no-ops)."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenates every rank's x along dim (same shape on every rank)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """x as rank `src` holds it, on every rank (in place)."""
        if self.size > 1:
            options = dist.BroadcastOptions()
            options.rootRank = src
            self.group.broadcast([x], options).wait()
        return x

    def split(self, total: int, what: str) -> int:
        """This rank's share of `total` units of `what`; they must divide evenly."""
        if total % self.size:
            raise ValueError(f"{what} ({total}) is not divisible by tensor_parallel_size ({self.size})")
        return total // self.size


SINGLE = TPGroup()
