"""The Hydra config, through the compose API: every option of every group composes into engine
settings the engine accepts, plugin parameters land in `<kind>_options`, and wrong keys, types
and choices fail with Hydra's messages."""

import inspect
from dataclasses import dataclass, fields

import pytest
from hydra.core.config_store import ConfigStore
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf

from inferlab.conf import EngineSettings, JobName, compose, engine_arguments, flat_choices
from inferlab.core.config import EngineConfig
from inferlab.core.hookspecs import hookimpl
from inferlab.core.plugins import ENGINE_KINDS, KINDS, PluginRegistry, get_registry
from inferlab.plugins.schedulers.fcfs import FCFSPolicy

OPTIONS = [  # the router and kv_transfer groups' options are a cluster's (tests/plugins/test_routers.py,
    # tests/core/test_disaggregation.py)
    (kind, name)
    for kind in ENGINE_KINDS
    for name in get_registry().names(kind) + (["auto"] if kind in ("attention", "model") else [])
]


@pytest.fixture
def config_store():
    """Restores Hydra's ConfigStore after a test that stores nodes of a hand-made registry."""
    store = ConfigStore.instance()
    saved = {kind: dict(store.repo.get(kind, {})) for kind in KINDS}
    yield store
    store.repo.update(saved)


def test_defaults_are_the_engine_defaults():
    cfg = compose()
    model_path, settings = engine_arguments(cfg)
    assert model_path is None  # the embedded tiny model
    assert cfg.job.name == JobName.generate
    assert EngineConfig.from_kwargs(model_path, settings) == EngineConfig()


def test_engine_settings_mirror_engine_config():
    groups = set(KINDS) | {f"{k}_options" for k in KINDS} | {"model_path", "executor", "executor_options"}
    assert [f.name for f in fields(EngineSettings)] == [f.name for f in fields(EngineConfig) if f.name not in groups]


@pytest.mark.parametrize("kind,name", OPTIONS, ids=[f"{k}={n}" for k, n in OPTIONS])
def test_every_group_option_composes(kind, name):
    cfg = compose([f"{kind}={name}"])
    model_path, settings = engine_arguments(cfg)
    assert settings[kind] == name
    config = EngineConfig.from_kwargs(model_path, settings)
    assert getattr(config, kind) == name
    assert flat_choices(cfg)[kind] == name


@pytest.mark.parametrize("job", list(JobName))
def test_every_job_composes(job):
    assert compose([f"job={job.value}"]).job.name == job


def test_experiment_preset_sets_the_job_and_its_settings():
    cfg = compose(["experiment=prefix_ablation", "scheduler=lpm", "engine.max_num_seqs=2"])
    assert cfg.job.name == JobName.bench
    assert (cfg.bench.shared_prefix_len, cfg.bench.num_prefixes, cfg.bench.num_seqs) == (128, 8, 32)
    _, settings = engine_arguments(cfg)
    assert settings["num_kvcache_blocks"] == 64 and settings["kvcache_block_size"] == 16
    assert settings["max_num_seqs"] == 2 and settings["scheduler"] == "lpm"  # command-line overrides still win


def test_overrides_reach_engine_and_plugin_options():
    cfg = compose(
        [
            "scheduler=lpm",
            "scheduler.max_sort_waiting=7",
            "engine.max_num_seqs=3",
            "engine.device=cpu",
            "model.path=/models/qwen3",
            "bench.num_seqs=5",
            "engine.enable_prefix_caching=false",
        ]
    )
    model_path, settings = engine_arguments(cfg)
    assert model_path == "/models/qwen3"
    assert settings["scheduler"] == "lpm" and settings["scheduler_options"] == {"max_sort_waiting": 7}
    assert settings["max_num_seqs"] == 3 and settings["device"] == "cpu" and settings["enable_prefix_caching"] is False
    assert settings["model"] == "auto" and settings["model_options"] == {}
    assert cfg.bench.num_seqs == 5
    choices = flat_choices(cfg)
    assert (
        choices["scheduler.max_sort_waiting"] == 7
        and choices["engine.max_num_seqs"] == 3
        and choices["bench.num_seqs"] == 5
    )


def test_builtin_backend_and_model_options_are_typed_overrides():
    # the ablation knobs of our own plugins: triton's decode tiling, the model's kernel switches
    cfg = compose(
        [
            "attention=triton",
            "attention.decode_block_n=64",
            "attention.decode_num_stages=2",
            "model=qwen3",
            "model.triton_kernels=false",
            "model.torch_compile=true",
            "model.split_k_tokens=0",
            "model.triton_gemm_tokens=16",
            "model.gemv_fused=false",
        ]
    )
    _, settings = engine_arguments(cfg)
    options = settings["attention_options"]
    assert options["decode_block_n"] == 64 and options["decode_num_stages"] == 2
    assert options["block_m"] is None  # left to the backend's own default
    assert settings["model_options"] == {
        "torch_compile": True,
        "triton_kernels": False,
        "split_k_tokens": 0,
        "triton_gemm_tokens": 16,
        "gemv_decode": True,
        "gemv_fused": False,
        "gemv_preload": True,
    }
    from inferlab.plugins.attention.triton_backend import TritonBackend, TritonOptions

    # the node's defaults are the factory's: one source for both
    defaults = {k: v.default for k, v in inspect.signature(TritonBackend).parameters.items() if k != "config"}
    assert defaults == {f.name: f.default for f in fields(TritonOptions)}


@pytest.mark.parametrize(
    "overrides,error,message",
    [
        (
            ["attention=triton", "attention.decode_num_warps=many"],
            ConfigCompositionException,
            "Value 'many' of type 'str' could not be converted to Integer",
        ),
        (
            ["model=qwen3", "model.triton_kernels=maybe"],
            ConfigCompositionException,
            "Value 'maybe' is not a valid bool",
        ),
        (["scheduler.bogus=1"], ConfigCompositionException, "Key 'bogus' not in 'FcfsSchedulerConfig'"),
        (
            ["scheduler=lpm", "scheduler.max_sort_waiting=many"],
            ConfigCompositionException,
            "Value 'many' of type 'str' could not be converted to Integer",
        ),
        (["engine.max_num_seqs=lots"], ConfigCompositionException, "could not be converted to Integer"),
        (["engine.max_num_seq=8"], ConfigCompositionException, "Key 'max_num_seq' not in 'EngineSettings'"),
        (["bench.num_seqs=1.5"], ConfigCompositionException, "could not be converted to Integer"),
        (
            ["job.name=train"],
            ConfigCompositionException,
            r"Invalid value 'train', expected one of \[generate, bench, profile, serve\]",
        ),
        (["typo=1"], ConfigCompositionException, "Could not override 'typo'"),
        (
            ["scheduler=nope"],
            MissingConfigException,
            r"Could not find 'scheduler/nope'(.|\n)*Available options in 'scheduler'",
        ),
        (["attention=nope"], MissingConfigException, "Could not find 'attention/nope'"),
        (["job=train"], MissingConfigException, "Could not find 'job/train'"),
    ],
)
def test_wrong_keys_types_and_choices_fail_with_hydras_message(overrides, error, message):
    with pytest.raises(error) as info:
        compose(overrides)
    text = str(info.value) + "\n" + str(info.value.__cause__ or "")
    assert __import__("re").search(message, text), text


def test_a_plugins_config_node_becomes_a_typed_option(config_store):
    @dataclass
    class RoundRobinOptions:
        quantum: int = 4
        label: str = "rr"

    class RoundRobin(FCFSPolicy):
        def __init__(self, quantum=4, label="rr"):
            self.quantum = quantum

    class Plugin:
        @hookimpl
        def register_schedulers(self, register):
            register("rr", RoundRobin, options=RoundRobinOptions)

    registry = PluginRegistry()
    registry.register(Plugin(), "rr_plugin", "rr-dist 1.0")
    cfg = compose(["scheduler=rr", "scheduler.quantum=9"], registry=registry)
    assert OmegaConf.to_container(cfg.scheduler) == {"quantum": 9, "label": "rr", "name": "rr"}
    assert engine_arguments(cfg)[1]["scheduler_options"] == {"quantum": 9, "label": "rr"}
    with pytest.raises(ConfigCompositionException) as info:
        compose(["scheduler=rr", "scheduler.quantum=fast"], registry=registry)
    assert "object_type=RoundRobinOptions" in str(info.value.__cause__)
