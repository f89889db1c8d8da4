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

Each hook lists the optional capabilities of its kind: small Protocols in `inferlab.core.protocols`
that the factory or the object it builds may also satisfy, checked with isinstance; without one,
the engine does without what it offers.
"""

import pluggy

hookspec = pluggy.HookspecMarker("inferlab")
hookimpl = pluggy.HookimplMarker("inferlab")


@hookspec
def register_schedulers(register):
    """Scheduler policies. factory(**options) -> SchedulerPolicy. A policy only decides; the core
    scheduler carries its decisions out. Called once when the plugin registry loads.
    Optional capabilities of the policy: PreemptivePolicy (a waiting request displaces a
    running one), BudgetPolicy (the step's token budget and chunk sizes), ObservingPolicy (sees each
    step's work), ReadsMetadata (the metadata fields it reads, with their types, checked when a
    request is added), PureAdmissionOrder (admission_order has no side effects, so a simulation may
    skip asking it where nothing could be admitted), FixedAdmissionOrder (its order depends on the
    waiting requests alone, so a simulation may ask it once for a run of steps)."""


@hookspec
def register_kv_caches(register):
    """KV cache managers. factory(config: EngineConfig, num_blocks: int, **options) -> KVCacheManager.
    num_blocks is what the runner allocated; the block size is config.kvcache_block_size.
    Optional capabilities of the manager: PrefixCacheStats (prefix hits in a run's
    records), PrefixCacheReset (a bench's timed pass starts with an empty prefix cache),
    CachedPrefixLookup (a router's question about a cached prefix, from the prompt's block names),
    KVCacheEvents (which block names enter and leave the cache, for a router in another process),
    BlockAligned (its decode books change only at block boundaries, so a simulation may run decode
    steps at once), UnheldPrefixBlocks (how many of a waiting request's cached blocks nobody holds,
    so that such runs go on while it could not be admitted)."""


@hookspec
def register_attention_backends(register):
    """Attention backends. factory(config: EngineConfig, **options) -> AttentionBackend. Import
    heavy or optional libraries inside the factory, so that they load only when selected; raise
    ImportError when they are missing and `attention=auto` falls through to the next backend.
    Optional capabilities of the factory: AutoPriority (`attention=auto` may choose it).
    Of the backend: PrefillGraphCapture (steps with prefill replayed from CUDA graphs), SplitDecodes
    (decode attention split over long contexts); and, for models: FusedKVStore (a model stores the
    new K and V itself), DecodesFromQKV (decode attention starts from the QKV projection)."""


@hookspec
def register_models(register):
    """Model implementations. factory(hf_config, *, backend: AttentionBackend, tp_group: TPGroup,
    dtype: torch.dtype, device: torch.device, max_model_len: int, **options) -> Model, where
    max_model_len is the longest sequence the engine will run.
    Optional capabilities of the factory: ServesArchitectures (the HF architectures it
    serves, for `model=auto`), ConfigDefaults (the defaults of transformers' config class for its
    model types, so that their config.json is read without transformers). Of the model:
    RepresentativeLayers (start-up compiles and warms over a few layers)."""


@hookspec
def register_samplers(register):
    """Samplers. factory(config: EngineConfig, **options) -> Sampler.
    Optional capabilities of the sampler: GraphCapturableSampler (decode steps' LM head
    and sampling replayed from CUDA graphs), LogprobsSampler (the logits each row was drawn from,
    for logprobs), LogitsProcessingSampler (penalties, logit_bias, min_tokens and allowed-token
    masks applied), StructuredOutputSampler (grammars compiled into TokenConstraint objects, the
    per-sequence rule a user's own constraint also implements)."""


@hookspec
def register_executors(register):
    """Executors: who runs the steps. factory(config: EngineConfig, model_path: str | None,
    registry: PluginRegistry, **options) -> Runner. The factory opens the checkpoint
    (inferlab.core.checkpoint.open_checkpoint(config, model_path, registry) reads a directory, the
    embedded tiny model when model_path is None), so that a runner which needs no weights can serve
    a model shape from elsewhere; it selects the other plugins by name from the registry.
    `executor=name` selects one; `real` is the default.
    Optional capabilities of the runner: AdmissionCost (the host's time to add a request,
    on a clock not the host's), OnDevice (the device, dtypes and attention backend a bench records
    and bounds a workload by), SimulatedDevice (modeled step times: what stood in for the device), VirtualTime (its clock is a
    simulation's own, so that a cluster runs such replicas in the order of their clocks),
    DecodeRuns (times a run of decode steps of one batch at once, for a simulated fleet),
    SharedDevice (replicas placed on one GPU queue their steps on one time-sliced device),
    SamplesLogits (its sampler, whose capabilities decide what requests may ask beyond plain
    sampling; its launch then returns a LogprobsStepHandle, whose logprobs() the engine reads),
    KVBlockStore (its KV blocks read and written as data: kv_transfer=local and distributed move
    them), KVBlockBytes (a KV block's size: kv_transfer=simulated prices moving it)."""


@hookspec
def register_routers(register):
    """Routers: which replica of a cluster serves each request (`router=name` with
    `cluster.replicas=N`, docs/cluster.md). factory(**options) -> Router. A router decides over
    read-only views (inferlab.core.routing); the cluster carries its choice out.
    Optional capabilities of the router: ObservingRouter (each routed request's end, on its replica),
    PairRouter (a disaggregated cluster's prefill and decode replica of a request, chosen together)."""


@hookspec
def register_kv_transfers(register):
    """KV transfers: how a request's KV blocks move from the replica that prefilled it to the one
    that decodes it (prefill/decode disaggregation). factory(**options) -> KVTransfer. One object
    serves every engine of a process (each attached as an endpoint); the cluster builds it, not an
    engine. A transfer reads what it needs of the engines' runners through their capabilities
    (register_executors lists them): the blocks as data, or a block's size."""
