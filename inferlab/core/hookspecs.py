"""The hooks an inferlab plugin implements: one per plugin kind, read top to bottom.

A plugin is a module (or any object) with functions marked `@hookimpl`, registered through the
`inferlab` entry-point group of its distribution:

    [project.entry-points.inferlab]
    my_scheduler = "my_package.scheduler"

Each hook receives `register(name, factory)`; call it once per thing the plugin provides. The
name is what users select (`LLM(..., scheduler="name")`, `inferlab scheduler=name`). The factory
is called when that plugin is selected, with the arguments listed under each hook plus the user's
options for it as keyword arguments, and must return an object satisfying the kind's Protocol in
`inferlab.core.protocols`; one that does not is rejected, naming what it lacks.

The last hook, `register_config_nodes`, describes the options a plugin's factory takes, so that
Hydra (`inferlab <kind>=<name> <kind>.<option>=...`) can type and check them.
"""

import pluggy

hookspec = pluggy.HookspecMarker("inferlab")
hookimpl = pluggy.HookimplMarker("inferlab")


@hookspec
def register_schedulers(register):
    """Schedulers. factory(config: EngineConfig, kv_cache: KVCacheManager, **options) -> Scheduler.
    Called once when the plugin registry loads."""


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
    dtype: torch.dtype, device: torch.device, **options) -> Model. The factory's `architectures`
    attribute lists the HF architectures it serves, for `model=auto`."""


@hookspec
def register_samplers(register):
    """Samplers. factory(config: EngineConfig, **options) -> Sampler."""


@hookspec
def register_config_nodes(register):
    """The plugin's parameters, for Hydra. Call register(kind, name, node) for each plugin that
    takes options: kind is one of scheduler, kv_cache, attention, model, sampler; name the name the
    plugin was registered under; node a dataclass type whose fields (with defaults) are the
    keyword options its factory accepts. `inferlab <kind>=<name> <kind>.<field>=value` then works,
    typed and checked, and the values reach the factory as `<kind>_options`. A plugin without a
    node is still selectable on the command line; it then takes no options there."""
