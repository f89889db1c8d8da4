"""`inferlab` (also `python -m inferlab`): the Hydra app.

    inferlab                                   complete a few prompts on the embedded tiny model
    inferlab model.path=DIR scheduler=lpm      any plugin choice or setting, as Hydra overrides
    inferlab job=bench bench.num_seqs=64       nano-vllm's bench.py workload -> result.json
    inferlab cluster.replicas=4 router=kv_aware   any job on four engines behind a router
    inferlab -m job=bench scheduler=fcfs,lpm   a sweep: one result.json per run

Plugins installed in the environment are options of their kind's group, with their own
parameters (`scheduler.<param>=...`); `inferlab-plugins` lists them.

A mistake in the settings (one Hydra cannot compose, or one the engine refuses), the model path
or the prompts prints its message alone, on one line, and exits with status 2 (HYDRA_FULL_ERROR=1
shows the traceback too); requests that fail (too large for the KV cache, say) are printed with
why, and the exit status is 1; Ctrl-C exits with 130. In a sweep (-m) a job that fails writes its
error into its directory (error.txt) and the sweep goes on; the command then exits with status 1.
"""

import gc
import os
import re
import sys
import time
import traceback

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

import inferlab
from inferlab.conf import AUTO_CHOICE_KINDS, JobName, cluster_arguments, engine_arguments, store_configs
from inferlab.core.plugins import KINDS, PluginRegistry, get_registry
from inferlab.core.sampling_params import SamplingParams
from inferlab.core.scheduler import PolicyError, SchedulerStallError
from inferlab.core.workers import TensorParallelError
from inferlab.experiment.records import resolved_plugins

JOB_ERROR_FILE = "error.txt"  # in a sweep job's directory: why it failed (its first line), then the traceback


class RequestsFailed(RuntimeError):
    """Some of the generate job's requests were answered with an error (each printed with why)."""


class SweepFailures(Callback):
    """Hydra callback (config.yaml): at the end of a sweep, the jobs that wrote an error.txt. It
    runs in the process that launched the sweep, whichever launcher ran the jobs."""

    failed: list[str] = []  # the failed jobs' directories, of the latest sweep

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        root = str(config.hydra.sweep.dir)
        found = []
        for directory, subdirs, files in os.walk(root):
            subdirs[:] = [d for d in subdirs if not d.startswith(".")]
            if JOB_ERROR_FILE in files:
                found.append(directory)
        SweepFailures.failed = sorted(found)


def main() -> None:
    registry = get_registry()
    store_configs(registry)
    explain_unknown_choices(sys.argv[1:], registry)
    refuse_config_errors(sys.argv[1:])
    SweepFailures.failed = []
    run()
    if SweepFailures.failed:
        print(f"inferlab: {len(SweepFailures.failed)} job(s) of the sweep failed:", file=sys.stderr)
        for directory in SweepFailures.failed:
            with open(os.path.join(directory, JOB_ERROR_FILE)) as f:
                print(f"  {directory}: {f.readline().strip()}", file=sys.stderr)
        sys.exit(1)


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
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            record_job_failure(e)  # the sweep goes on; main() exits non-zero at its end
            return
        if isinstance(e, RequestsFailed):
            print(f"inferlab: {e}", file=sys.stderr)
            sys.exit(1)
        if os.environ.get("HYDRA_FULL_ERROR") == "1" or not is_user_error(e):
            raise
        print(f"inferlab: {e}", file=sys.stderr)  # the user's settings, path or prompts: a message, not a traceback
        sys.exit(2)
    finally:
        # A sweep runs its jobs one after another in this process: this job's engine and workload
        # hold reference cycles that only a full collection frees, and the next job's must not
        # stack on them (a sweep over the whole Mooncake trace grew by its prompts every job).
        gc.collect()


def record_job_failure(error: Exception) -> None:
    """A sweep job's failure: its message on stderr and in error.txt in the job's directory (with
    the traceback below it), so that the report lists the job and why."""
    hydra_config = HydraConfig.get()
    message = (
        str(error) if is_user_error(error) or isinstance(error, RequestsFailed) else f"{type(error).__name__}: {error}"
    )
    first_line = message.splitlines()[0] if message else type(error).__name__
    print(
        f"inferlab: job {hydra_config.job.num} ({' '.join(hydra_config.overrides.task)}) failed: {first_line}",
        file=sys.stderr,
    )
    directory = hydra_config.runtime.output_dir
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, JOB_ERROR_FILE), "w") as f:
        f.write(first_line + "\n\n" + "".join(traceback.format_exception(error)))


def is_user_error(error: Exception) -> bool:
    """Errors whose message says what to change (bad settings, paths, prompts, checkpoints, plugin
    names), and failures the engine explains itself (a tensor-parallel rank, a scheduler policy)."""
    explained = (ValueError, TypeError, OSError, LookupError, PolicyError, SchedulerStallError, TensorParallelError)
    return isinstance(error, explained)


def generate(cfg: DictConfig) -> None:
    model_path, settings = engine_arguments(cfg)
    cluster = cluster_arguments(cfg)
    job = cfg.generate
    params = SamplingParams(temperature=job.temperature, max_tokens=job.max_tokens, ignore_eos=job.ignore_eos)
    prompts = list(job.prompts)
    llm = inferlab.Cluster(model_path, **cluster, **settings) if cluster else inferlab.LLM(model_path, **settings)
    with llm:
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
        raise RequestsFailed(f"{failed} of {len(outputs)} requests failed")


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


def refuse_config_errors(args: list[str]) -> None:
    """Composes the config of the command line's first job, and of one job for each other value
    a sweep gives a setting (the rest as in the first), before any runs, and prints the first
    that Hydra cannot compose as one line (the override and why), exiting with status 2: Hydra's
    own report spans several lines with a hint, and a sweep used to meet it only at that job.
    HYDRA_FULL_ERROR=1 leaves it to Hydra. store_configs must have run."""
    from hydra import compose, initialize_config_module
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        return
    parsed = get_args_parser().parse_known_args(args)[0]
    if parsed.help or parsed.hydra_help or parsed.cfg or parsed.info or parsed.shell_completion or parsed.config_name:
        return
    overrides = [o for o in parsed.overrides if not o.lstrip("+~").startswith("hydra")]
    try:
        swept = []
        for override in OverridesParser.create().parse_overrides(overrides):
            key = override.get_key_element()
            values = list(override.sweep_string_iterator()) if override.is_sweep_override() else [None]
            swept.append([override.input_line if value is None else f"{key}={value}" for value in values])
        first = [values[0] for values in swept]
        jobs = [first] + [
            first[:i] + [value] + first[i + 1 :] for i, values in enumerate(swept) for value in values[1:]
        ]
        with initialize_config_module("inferlab.conf", version_base="1.3"):
            for job in jobs[:MAX_JOBS_CHECKED]:
                compose("config", overrides=job)
    except (HydraException, OmegaConfBaseException) as e:
        print(f"inferlab: {one_line(e)}", file=sys.stderr)
        sys.exit(2)


MAX_JOBS_CHECKED = 16  # composing one takes a fraction of a second


def one_line(error: Exception) -> str:
    """Hydra's message, then its OmegaConf cause after a colon, on one line and without hints:
    "Available options in 'scheduler':" followed by its list becomes "...: fcfs, lpm, priority"."""
    parts = []
    for text in (str(error), str(error.__cause__ or "")):
        segments: list[str] = []
        listing = False
        for line in text.split("Config search path:")[0].splitlines():
            line = line.strip().rstrip(".")
            if line.startswith("object_type=") and segments:  # the config node: a plugin's options class, say
                segments[-1] += f" ({line.removeprefix('object_type=')})"
                continue
            if not line or line.startswith(("full_key:", "reference_type=", "To append")):
                continue
            if listing and " " not in line:
                segments[-1] += (" " if segments[-1].endswith(":") else ", ") + line
                continue
            listing = line.endswith(":")
            segments.append(line)
        if segments:
            parts.append("; ".join(segments))
    return ": ".join(parts)
