"""`inferlab` (also `python -m inferlab`): the Hydra app.

    inferlab                                   complete a few prompts on the embedded tiny model
    inferlab model.path=DIR scheduler=lpm      any plugin choice or setting, as Hydra overrides
    inferlab job=bench bench.num_seqs=64       nano-vllm's bench.py workload -> result.json
    inferlab -m job=bench scheduler=fcfs,lpm   a sweep: one result.json per run

Plugins installed in the environment are options of their kind's group, with their own
parameters (`scheduler.<param>=...`); `inferlab-plugins` lists them.

A mistake in the settings, the model path or the prompts prints its message alone and exits with
status 2 (HYDRA_FULL_ERROR=1 shows the traceback too); requests that fail (too large for the KV
cache, say) are printed with why, and the exit status is 1; Ctrl-C exits with 130.
"""

import gc
import os
import re
import sys
import time

import hydra
from omegaconf import DictConfig

import inferlab
from inferlab.conf import AUTO_CHOICE_KINDS, JobName, engine_arguments, store_configs
from inferlab.core.plugins import KINDS, PluginRegistry, get_registry
from inferlab.core.sampling_params import SamplingParams
from inferlab.core.scheduler import PolicyError, SchedulerStallError
from inferlab.core.workers import TensorParallelError
from inferlab.experiment.records import resolved_plugins


def main() -> None:
    registry = get_registry()
    store_configs(registry)
    explain_unknown_choices(sys.argv[1:], registry)
    run()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def run(cfg: DictConfig) -> None:
    try:
        if cfg.job.name == JobName.profile:
            from inferlab.experiment.profile_job import run_profile_job

            run_profile_job(cfg)
        elif cfg.job.name == JobName.bench:
            from inferlab.experiment.bench import run_bench

            run_bench(cfg)  # checks the bench settings before it builds anything
        elif cfg.job.name == JobName.serve:
            from inferlab.server import run_serve

            run_serve(cfg)
        else:
            generate(cfg)
    except KeyboardInterrupt:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print("inferlab: interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as e:
        if os.environ.get("HYDRA_FULL_ERROR") == "1" or not is_user_error(e):
            raise
        print(f"inferlab: {e}", file=sys.stderr)  # the user's settings, path or prompts: a message, not a traceback
        sys.exit(2)
    finally:
        # A sweep runs its jobs one after another in this process: this job's engine and workload
        # hold reference cycles that only a full collection frees, and the next job's must not
        # stack on them (a sweep over the whole Mooncake trace grew by its prompts every job).
        gc.collect()


def is_user_error(error: Exception) -> bool:
    """Errors whose message says what to change (bad settings, paths, prompts, checkpoints, plugin
    names), and failures the engine explains itself (a tensor-parallel rank, a scheduler policy)."""
    explained = (ValueError, TypeError, OSError, LookupError, PolicyError, SchedulerStallError, TensorParallelError)
    return isinstance(error, explained)


def generate(cfg: DictConfig) -> None:
    model_path, settings = engine_arguments(cfg)
    job = cfg.generate
    params = SamplingParams(temperature=job.temperature, max_tokens=job.max_tokens, ignore_eos=job.ignore_eos)
    prompts = list(job.prompts)
    with inferlab.LLM(model_path, **settings) as llm:
        plugins = resolved_plugins(llm)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=job.use_tqdm)
        elapsed = time.perf_counter() - start
        stats = llm.stats
    print(" ".join(f"{kind}={name}" for kind, name in plugins.items()))
    for prompt, out in zip(prompts, outputs):
        print(
            f"{prompt!r} -> error: {out['error']}"
            if out["finish_reason"] == "error"
            else f"{prompt!r} -> {out['text']!r}"
        )
    tokens = sum(len(o["token_ids"]) for o in outputs)
    prefill = stats.num_prefill_tokens / stats.prefill_seconds if stats.prefill_seconds else 0.0
    decode = stats.num_decode_tokens / stats.decode_seconds if stats.decode_seconds else 0.0
    print(
        f"{tokens} tokens in {elapsed:.2f} s: {tokens / elapsed:.0f} tok/s "
        f"(prefill {prefill:.0f} tok/s, decode {decode:.0f} tok/s)"
    )
    failed = sum(o["finish_reason"] == "error" for o in outputs)
    if failed:
        print(f"inferlab: {failed} of {len(outputs)} requests failed", file=sys.stderr)
        sys.exit(1)


def explain_unknown_choices(args: list[str], registry: PluginRegistry) -> None:
    """Hydra says an unknown `scheduler=x` is not an option; when plugins failed to load, say
    which, since one of them is likely the plugin that was meant."""
    if not registry.failures:
        return
    for arg in args:
        match = re.fullmatch(r"([a-z_]+)=(.+)", arg)
        if not match or match[1] not in KINDS:
            continue
        kind = match[1]
        known = set(registry.names(kind)) | ({"auto"} if kind in AUTO_CHOICE_KINDS else set())
        for name in match[2].split(","):  # a sweep lists several
            if name not in known:
                print(
                    f"inferlab: no {kind} named {name!r} is registered; plugins that failed to load:", file=sys.stderr
                )
                for failure in registry.failures:
                    print(
                        f"  {failure.plugin!r} ({failure.distribution or 'registered by hand'}): {failure.reason}",
                        file=sys.stderr,
                    )
