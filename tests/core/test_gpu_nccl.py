"""On one CUDA GPU: the tensor-parallel process group as the engine builds it, with the NCCL backend
and a single rank (tests/core/test_gpu_tp.py runs two ranks on two GPUs; CPU tests cover two ranks)."""

import pytest
import torch
import torch.distributed as dist

from inferlab.core.parallel import TPGroup
from inferlab.core.workers import make_group

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_nccl_group_with_one_rank():
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    group = make_group("nccl", store, 0, 1)
    x = torch.arange(8, dtype=torch.bfloat16, device="cuda")
    dist.all_reduce(x, group=group)
    assert x.tolist() == list(range(8))
    parts = [torch.empty(4, device="cuda")]
    dist.all_gather(parts, torch.full((4,), 3.0, device="cuda"), group=group)
    assert parts[0].tolist() == [3.0] * 4
    tp = TPGroup(rank=0, size=1, group=group)
    assert tp.all_reduce(x) is x and tp.split(16, "heads") == 16
    torch.cuda.synchronize()
