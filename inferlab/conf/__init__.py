"""Hydra configs: the typed schema of an inferlab run and one config group per plugin kind.

Every registered plugin becomes an option of its kind's group (`scheduler=lpm`), typed by the
options class its package registered with it (`scheduler.max_sort_waiting=64`),
plus `name` (and, for models, `path`). `engine` mirrors EngineConfig's settings; `job` picks
what the command does; `generate`, `bench` and `serve` hold each job's settings.

    cfg = compose(["scheduler=lpm", "engine.max_num_seqs=8"])   # the CLI's config, from Python
    model_path, settings = engine_arguments(cfg)               # LLM(model_path, **settings)
"""

import types
import typing
from dataclasses import MISSING as NO_DEFAULT
from dataclasses import dataclass, field, fields, make_dataclass
from enum import Enum
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf

from inferlab.conf.bench import BenchConfig, validate_bench
from inferlab.conf.cluster import ClusterConfig, validate_cluster
from inferlab.core.config import EngineConfig
from inferlab.core.plugins import ENGINE_KINDS, KINDS, PluginRegistry, get_registry

# Kinds whose `auto` is resolved where they are built: the engine's (the device's best attention
# backend, the checkpoint's model) and a disaggregated cluster's (the transfer its replicas can use).
AUTO_CHOICE_KINDS = ("attention", "model", "kv_transfer")
PLUGIN_FIELDS = {"model_path", *KINDS, *(f"{kind}_options" for kind in KINDS)}
PROMPTS = ["Hello, world! How are you today?", "The quick brown fox", "Once upon a time,"]


def _omegaconf_type(hint: Any) -> Any:
    """OmegaConf types only plain value types (and their optional forms)."""
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        inner = [a for a in args if a is not type(None)]
        return _omegaconf_type(inner[0]) | None if len(inner) == 1 else Any
    return hint if hint in (int, float, bool, str) else Any


def _engine_settings_class() -> type:
    """EngineConfig's settings, less the plugin choices (the groups) and the model path (model.path)."""
    hints = typing.get_type_hints(EngineConfig)
    specs = []
    for f in fields(EngineConfig):
        if f.name in PLUGIN_FIELDS:
            continue
        default = field(default=f.default) if f.default is not NO_DEFAULT else field(default_factory=f.default_factory)
        specs.append((f.name, _omegaconf_type(hints[f.name]), default))
    return make_dataclass("EngineSettings", specs)


EngineSettings = _engine_settings_class()


class JobName(Enum):
    generate = "generate"
    bench = "bench"
    profile = "profile"  # measure step times on a GPU for the simulated executor (inferlab.experiment.profile_job)
    serve = "serve"


@dataclass
class JobConfig:
    name: JobName = JobName.generate


@dataclass
class GenerateConfig:
    """`inferlab` (job=generate): complete these prompts and print the text and the throughput."""

    prompts: list[str] = field(default_factory=lambda: list(PROMPTS))
    max_tokens: int = 32
    temperature: float = 0.6
    ignore_eos: bool = False
    use_tqdm: bool = True


# job=profile's default grid (inferlab.experiment.profile_job)
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 384, 512)
# Contexts reach what long-context traces bring (Mooncake's conversations average 14k tokens):
# attention over them, not the weights, then sets a step's time. Profile with a max_model_len
# that admits them; compositions longer than it, or than the KV cache holds, are skipped.
DECODE_CONTEXTS = (128, 512, 1024, 2048, 8192, 16384)
PREFILL_TOKENS = (16, 64, 256, 1024, 4096, 8192, 16384)


@dataclass
class ProfileConfig:
    """`inferlab job=profile`: where to write the profile and how long to time each step."""

    out: str = "profile.json"
    repeats: int = 10  # steps read per composition (repeats - 1 intervals timed), after 3 untimed ones
    decode_batches: list[int] = field(default_factory=lambda: list(DECODE_BATCHES))
    decode_contexts: list[int] = field(default_factory=lambda: list(DECODE_CONTEXTS))
    prefill_tokens: list[int] = field(default_factory=lambda: list(PREFILL_TOKENS))
    commit: str | None = None  # recorded in the profile (default: the checkout's)

    def __post_init__(self):
        if not isinstance(self.repeats, int) or self.repeats < 2:
            raise ValueError(
                f"profile.repeats must be a whole number >= 2 (steps timed a composition), got {self.repeats!r}"
            )


@dataclass
class ServeConfig:
    """`inferlab job=serve`: the engine behind an OpenAI-compatible HTTP server (docs/serving.md)."""

    host: str = "127.0.0.1"  # loopback only; 0.0.0.0 to listen on every interface
    port: int = 8000  # 0: any free port (the address is printed)
    api_key: str | None = None  # the bearer token /v1/ requires; None: $INFERLAB_API_KEY, or none
    model_name: str | None = None  # the name clients send as `model`; None: the checkpoint directory's name
    max_queued_requests: int | None = 1024  # requests waiting for admission; past it, 429; None: no limit
    max_n: int = 16  # the most choices (n) one request may ask for; more: 400
    # after SIGINT/SIGTERM the server is gone within this long: streams may finish until shortly before, then are
    # aborted; a second signal stops at once
    shutdown_timeout_s: float = 10.0
    # A request body larger than this gets 413 before it is read; None: sized from the engine's max_model_len
    # (64 bytes a token, room for a prompt as JSON text or token ids, plus 64 KiB for the other fields).
    max_body_bytes: int | None = None
    max_connections: int = 512  # open at once; one more gets 503 and is closed (each holds a file descriptor)
    # a request's headers must arrive within this of the connection opening (or of its first byte); else 408
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0  # its body within this, once the headers are in; else 408
    keep_alive_timeout_s: float = 5.0  # an idle kept-alive connection is closed after this (uvicorn's)
    log_level: str = "info"  # uvicorn's
    # Python's GIL switch interval while serving (its default is 5 ms): the longest the engine's
    # thread waits for the GIL while the event loop is busy streaming; None leaves it as it is.
    gil_switch_interval_s: float | None = 0.001


@dataclass
class InferlabConfig:
    model: Any = MISSING
    scheduler: Any = MISSING
    kv_cache: Any = MISSING
    attention: Any = MISSING
    sampler: Any = MISSING
    executor: Any = MISSING
    router: Any = MISSING
    kv_transfer: Any = MISSING
    engine: EngineSettings = field(default_factory=EngineSettings)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    job: JobConfig = MISSING
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)


def plugin_node_class(kind: str, name: str, options: type | None = None) -> type:
    """The config node of one group option: the plugin's options dataclass plus `name` (and the
    checkpoint `path` for models)."""
    extra = [("name", str, field(default=name))]
    if kind == "model":
        extra.append(("path", str | None, field(default=None)))
    if options is None:
        class_name = "".join(part.capitalize() for part in f"{name}_{kind}".replace("-", "_").split("_")) + "Config"
        return make_dataclass(class_name, extra)
    node = make_dataclass(options.__name__, extra, bases=(options,), frozen=options.__dataclass_params__.frozen)
    node.__module__ = options.__module__  # errors then name the plugin's own class
    return node


def store_configs(registry: PluginRegistry | None = None) -> None:
    """Puts the schema and one option per registered plugin into Hydra's ConfigStore. Call it
    before composing (the `inferlab` command does)."""
    from hydra.core.config_store import ConfigStore

    registry = registry or get_registry()
    store = ConfigStore.instance()
    store.store(name="inferlab_schema", node=InferlabConfig)
    for job in JobName:
        store.store(group="job", name=job.value, node=JobConfig(name=job))
    for kind in KINDS:
        names = registry.names(kind) + (["auto"] if kind in AUTO_CHOICE_KINDS else [])
        for name in names:
            entry = registry.entries[kind].get(name)
            store.store(group=kind, name=name, node=plugin_node_class(kind, name, entry.options if entry else None))


def compose(overrides: list[str] = (), registry: PluginRegistry | None = None) -> DictConfig:
    """The config `inferlab <overrides>` would run, built with Hydra's compose API. Raises
    inferlab.experiment.workload.BenchConfigError for bench settings that cannot run (job=bench)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    store_configs(registry)
    with initialize_config_module("inferlab.conf", version_base="1.3"):
        cfg = hydra_compose("config", overrides=list(overrides))
    if cfg.job.name == JobName.bench:
        validate_bench(cfg.bench)  # settings that cannot run fail here, before any model loads
    validate_cluster(cfg.cluster)
    return cfg


def engine_arguments(cfg: DictConfig) -> tuple[str | None, dict]:
    """(model_path, settings) such that LLM(model_path, **settings) is the engine cfg describes
    (each replica, for a cluster)."""
    settings = OmegaConf.to_container(cfg.engine, resolve=True)
    model_path = None
    for kind in ENGINE_KINDS:
        options = OmegaConf.to_container(cfg[kind], resolve=True)
        settings[kind] = options.pop("name")
        if kind == "model":
            model_path = options.pop("path")
        settings[f"{kind}_options"] = options
    return model_path, settings


def cluster_arguments(cfg: DictConfig) -> dict | None:
    """The keyword arguments Cluster takes besides the engine's (replicas, router and its options,
    backend, gpus_per_replica, ray_address; with prefill/decode roles, prefill_replicas,
    decode_replicas and the kv_transfer with its options), or None when cfg describes today's single
    engine (one replica, local)."""
    cluster = OmegaConf.to_container(cfg.cluster, resolve=True)
    roles = cluster["prefill_replicas"] is not None
    if not roles:  # colocated: the arguments a cluster without roles always took
        del cluster["prefill_replicas"], cluster["decode_replicas"]
    if cluster["replicas"] == 1 and cluster["backend"] == "local" and not roles:
        return None
    router = OmegaConf.to_container(cfg.router, resolve=True)
    arguments = {**cluster, "router": router.pop("name"), "router_options": router}
    if roles:
        transfer = OmegaConf.to_container(cfg.kv_transfer, resolve=True)
        arguments.update(kv_transfer=transfer.pop("name"), kv_transfer_options=transfer)
    return arguments


def flat_choices(cfg: DictConfig) -> dict[str, Any]:
    """What a run asked for, as the override keys a user types: {"scheduler": "lpm",
    "scheduler.max_sort_waiting": 1024, "engine.max_num_seqs": 512, "bench.num_seqs": 256, ...}."""
    choices = {}
    for kind in KINDS:
        node = OmegaConf.to_container(cfg[kind], resolve=True)
        choices[kind] = node.pop("name")
        choices.update({f"{kind}.{key}": value for key, value in node.items()})
    for section in ("engine", "cluster", "bench"):
        node = OmegaConf.to_container(cfg[section], resolve=True)
        choices.update({f"{section}.{key}": value for key, value in node.items()})
    return choices
