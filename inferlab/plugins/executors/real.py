"""The `real` and `tensor_parallel` executors: the model computed on this machine's devices, in
this process or, under tensor parallelism, over one worker process per further rank."""

from inferlab.core.checkpoint import open_checkpoint
from inferlab.core.hookspecs import hookimpl
from inferlab.core.model_runner import ModelRunner
from inferlab.core.workers import TensorParallelRunner


def real(config, model_path, registry):
    """One device; with tensor_parallel_size > 1 the tensor-parallel runner, so that setting the
    size alone (the default executor) runs it."""
    if config.tensor_parallel_size > 1:
        return tensor_parallel(config, model_path, registry)
    return ModelRunner(config, open_checkpoint(config, model_path, registry), registry)


def tensor_parallel(config, model_path, registry):
    """Rank 0 here, ranks 1..tensor_parallel_size-1 in worker processes (inferlab.core.workers)."""
    return TensorParallelRunner(config, open_checkpoint(config, model_path, registry), registry)


@hookimpl
def register_executors(register):
    register("real", real)
    register("tensor_parallel", tensor_parallel)
