"""The hooks an inferlab plugin implements: one per plugin kind, read top to bottom.

A plugin is a module (or any object) with functions marked `@hookimpl`, registered through the
`inferlab` entry-point group of its distribution:

    [project.entry-points.inferlab]
    my_scheduler = "my_package.scheduler"

Each hook receives `register(name, factory, options=None)`; call it once per thing the plugin
provides. The name is what users select (`LLM(..., scheduler="name")`, `inferlab
scheduler=name`). `options`, when the plugin takes any, is a dataclass whose fields (with
defaults) are the factory's keyword options: it is the plugin's Hydra config node (`inferlab
<kind>=<name> <kind>.<field>=value`, typed and checked) and `LLM(..., <kind>_options={...})` is
checked against it the same way, __post_init__ included. The factory is called when the plugin is
selected, with the arguments listed under each hook plus the checked options as keyword
arguments, and must return an object satisfying the kind's Protocol in `inferlab.core.protocols`;
one that does not is rejected, naming what it lacks. A plugin registered without options takes
none.
"""

import pluggy

hookspec = pluggy.HookspecMarker("inferlab")
hookimpl = pluggy.HookimplMarker("inferlab")


@hookspec
def register_schedulers(register):
    """Scheduler policies. factory(**options) -> SchedulerPolicy (optionally also a
    PreemptivePolicy and a BudgetPolicy). A policy only decides; the core scheduler carries its
    decisions out. Called once when the plugin registry loads."""


@hookspec
def register_kv_caches(register):
    """KV cache managers. factory(config: EngineConfig, num_blocks: int, **options) -> KVCacheManager.
    num_blocks is what the runner allocated; the block size is config.kvcache_block_size."""


@hookspec
def register_attention_backends(register):
    """Attention backends. factory(config: EngineConfig, **options) -> AttentionBackend. Import
    heavy or optional libraries inside the factory, so that they load only when selected; raise
    ImportError when they are missing and `attention=auto` falls through to the next backend."""


@hookspec
def register_models(register):
    """Model implementations. factory(hf_config, *, backend: AttentionBackend, tp_group: TPGroup,
    dtype: torch.dtype, device: torch.device, max_model_len: int, **options) -> Model, where
    max_model_len is the longest sequence the engine will run. The factory's `architectures`
    attribute lists the HF architectures it serves, for `model=auto`."""


@hookspec
def register_samplers(register):
    """Samplers. factory(config: EngineConfig, **options) -> Sampler."""


@hookspec
def register_executors(register):
    """Executors: who runs the steps. factory(config: EngineConfig, model_path: str | None,
    registry: PluginRegistry, **options) -> Runner (optionally also AdmissionCost, OnDevice,
    SimulatedDevice). The factory opens the checkpoint (inferlab.core.checkpoint.open_checkpoint
    reads a directory, the embedded tiny model when model_path is None), so that a runner which
    needs no weights can serve a model shape from elsewhere; it selects the other plugins by name
    from the registry. `executor=name` selects one; `real` is the default."""
