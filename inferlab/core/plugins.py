"""The plugin registry: finds plugins through the `inferlab` entry points, collects what each
registers (each plugin with its options class), checks it against its Protocol, and builds the
selected ones."""

import dataclasses
import inspect
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

import pluggy
from omegaconf import OmegaConf

from inferlab.core import hookspecs, protocols

log = logging.getLogger("inferlab")

# kind -> (hook name, Protocol)
KINDS: dict[str, tuple[str, type]] = {
    "scheduler": ("register_schedulers", protocols.SchedulerPolicy),
    "kv_cache": ("register_kv_caches", protocols.KVCacheManager),
    "attention": ("register_attention_backends", protocols.AttentionBackend),
    "model": ("register_models", protocols.Model),
    "sampler": ("register_samplers", protocols.Sampler),
    "executor": ("register_executors", protocols.Runner),
}


class PluginError(LookupError):
    """A plugin could not be found, loaded or built."""


@dataclass(frozen=True)
class PluginEntry:
    kind: str
    name: str
    factory: Callable[..., Any]
    plugin: str  # the pluggy plugin (entry point) that registered it
    distribution: str  # "name version" of the package providing it, or "" when registered by hand
    options: type | None = None  # the dataclass of the factory's keyword options, its Hydra config node


@dataclass(frozen=True)
class PluginFailure:
    plugin: str
    distribution: str
    reason: str


def protocol_members(protocol: type) -> list[str]:
    """Names a Protocol requires: its methods, properties and annotated attributes."""
    names = set()
    for klass in protocol.__mro__:
        if (
            klass in (object, protocol.__mro__[-1])
            or not getattr(klass, "_is_protocol", False)
            or klass.__name__ == "Protocol"
        ):
            continue
        names.update(k for k in vars(klass) if not k.startswith("_"))
        names.update(k for k in getattr(klass, "__annotations__", {}) if not k.startswith("_"))
    if "__call__" in vars(protocol):
        names.add("__call__")
    return sorted(names)


def missing_members(obj: Any, protocol: type, check_attributes: bool = True) -> list[str]:
    """Protocol members obj lacks. Annotated data attributes are only checkable on instances."""
    annotations = getattr(protocol, "__annotations__", {})
    missing = []
    for name in protocol_members(protocol):
        if not check_attributes and name in annotations and name not in vars(protocol):
            continue
        if not hasattr(obj, name):
            missing.append(name)
    return missing


class PluginRegistry:
    """Everything registered under each kind, plus the plugins that failed and why."""

    def __init__(self, load_entry_points: bool = True):
        self.pm = pluggy.PluginManager("inferlab")
        self.pm.add_hookspecs(hookspecs)
        self.entries: dict[str, dict[str, PluginEntry]] = {kind: {} for kind in KINDS}
        self.failures: list[PluginFailure] = []
        self.collisions: dict[tuple[str, str], list[PluginEntry]] = {}
        self._distributions: dict[str, str] = {}
        if load_entry_points:
            for ep in entry_points(group="inferlab"):
                dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist else ""
                try:
                    module = ep.load()
                except Exception as e:  # a broken third-party plugin must not take the engine down
                    self.failures.append(
                        PluginFailure(ep.name, dist, f"import of {ep.value!r} failed: {type(e).__name__}: {e}")
                    )
                    continue
                self.register(module, ep.name, dist)

    def register(self, plugin: Any, name: str | None = None, distribution: str = "") -> None:
        """Registers a plugin object (module or instance with @hookimpl functions) and collects
        what its hooks register. Use this for plugins that are not installed as packages."""
        name = name or getattr(plugin, "__name__", None) or repr(plugin)
        if self.pm.has_plugin(name):
            raise PluginError(f"a plugin named {name!r} is already registered")
        try:
            self.pm.register(plugin, name=name)
            self.pm.check_pending()  # a misspelled hook fails loudly
        except pluggy.PluginValidationError as e:
            if self.pm.has_plugin(name):
                self.pm.unregister(name=name)
            self.failures.append(PluginFailure(name, distribution, f"invalid hook: {e}"))
            return
        self._distributions[name] = distribution
        for kind, (hook_name, _) in KINDS.items():
            for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
                if impl.plugin_name == name:
                    self._collect(kind, impl, name, distribution)

    def _collect(self, kind: str, impl, plugin_name: str, distribution: str) -> None:
        protocol = KINDS[kind][1]

        def register(entry_name: str, factory: Callable[..., Any], options: type | None = None) -> None:
            if not isinstance(entry_name, str) or not entry_name:
                raise PluginError(f"plugin {plugin_name!r} registered a {kind} with an invalid name {entry_name!r}")
            # Classes are checked now; plain factory functions when they build their object.
            missing = missing_members(factory, protocol, check_attributes=False) if inspect.isclass(factory) else []
            problem = (
                f"{kind} {entry_name!r} ({factory.__qualname__}) does not satisfy {protocol.__name__}: missing {missing}"
                if missing
                else options_problem(kind, entry_name, factory, options)
            )
            if problem:
                self.failures.append(PluginFailure(plugin_name, distribution, problem))
                return
            entry = PluginEntry(kind, entry_name, factory, plugin_name, distribution, options)
            existing = self.entries[kind].get(entry_name)
            if existing is not None:
                self.collisions.setdefault((kind, entry_name), [existing]).append(entry)
                return
            self.entries[kind][entry_name] = entry

        try:
            impl.function(register=register)
        except Exception as e:
            self.failures.append(
                PluginFailure(plugin_name, distribution, f"{impl.function.__name__} raised {type(e).__name__}: {e}")
            )

    def names(self, kind: str) -> list[str]:
        return sorted(self.entries[kind])

    def model_config_defaults(self) -> dict[str, dict]:
        """model_type -> the defaults of transformers' config class for it, as the model plugins
        declare them (ConfigDefaults on the factory), for reading config.json without transformers'
        config classes. Where two plugins declare one model_type, the first in name order counts."""
        defaults: dict[str, dict] = {}
        for name in self.names("model"):
            factory = self.entries["model"][name].factory
            if isinstance(factory, protocols.ConfigDefaults):
                for model_type, fields in factory.config_defaults.items():
                    defaults.setdefault(model_type, fields)
        return defaults

    def get(self, kind: str, name: str) -> PluginEntry:
        if kind not in KINDS:
            raise PluginError(f"unknown plugin kind {kind!r}; kinds: {sorted(KINDS)}")
        if (kind, name) in self.collisions:
            owners = ", ".join(
                f"{e.plugin} ({e.distribution or 'registered by hand'})" for e in self.collisions[kind, name]
            )
            raise PluginError(
                f"{kind} {name!r} is registered by more than one plugin: {owners}; uninstall or rename one"
            )
        entry = self.entries[kind].get(name)
        if entry is None:
            message = f"unknown {kind} {name!r}; available: {self.names(kind)}"
            related = [f for f in self.failures if f.plugin == name or f"{kind} {name!r}" in f.reason]
            for failure in related or self.failures:
                message += f"\n  plugin {failure.plugin!r} failed to load: {failure.reason}"
            raise PluginError(message)
        return entry

    def create(
        self,
        kind: str,
        name: str,
        *args,
        options: Mapping[str, Any] | None = None,
        wrap_errors: bool = True,
        **kwargs,
    ) -> Any:
        """Builds the selected plugin from the engine's arguments (args, kwargs) and the user's
        options (checked against the plugin's options class first), and checks the result
        against its Protocol. An exception of the factory becomes a PluginError naming the
        plugin, unless wrap_errors is False."""
        entry = self.get(kind, name)
        kwargs.update(validated_options(entry, options or {}))
        try:
            obj = entry.factory(*args, **kwargs)
        except (PluginError, ImportError):
            raise  # ImportError: lets attention=auto fall through to the next backend
        except Exception as e:
            if not wrap_errors:
                raise
            raise PluginError(
                f"{kind} {name!r} from plugin {entry.plugin!r} failed to build: {type(e).__name__}: {e}"
            ) from e
        protocol = KINDS[kind][1]
        missing = missing_members(obj, protocol)
        if missing:
            raise PluginError(
                f"{kind} {name!r} from plugin {entry.plugin!r} does not satisfy {protocol.__name__}: missing {missing}"
            )
        return obj


def options_problem(kind: str, name: str, factory: Callable[..., Any], options: Any) -> str | None:
    """Why an options class cannot serve as the plugin's options, or None when it can: it must be a
    dataclass OmegaConf can type (it is the plugin's Hydra config node) whose fields the factory
    accepts as keywords."""
    if options is None:
        return None
    if not (isinstance(options, type) and dataclasses.is_dataclass(options)):
        return f"the options of {kind} {name!r} must be a dataclass type, got {options!r}"
    try:
        OmegaConf.structured(options)
    except Exception as e:
        first_line = str(e).splitlines()[0]
        return f"the options class {options.__qualname__} of {kind} {name!r} is not a valid Hydra structured config: {first_line}"
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return None  # a builtin or C factory: nothing to check against
    if any(p.kind == p.VAR_KEYWORD for p in parameters.values()):
        return None
    unknown = sorted({f.name for f in dataclasses.fields(options)} - set(parameters))
    if unknown:
        return (
            f"the options class {options.__qualname__} of {kind} {name!r} has fields {unknown} that its factory "
            f"{getattr(factory, '__qualname__', factory)!r} does not accept"
        )
    return None


def validated_options(entry: PluginEntry, options: Mapping[str, Any]) -> dict[str, Any]:
    """The user's options for a plugin, checked as the command line checks them (the options
    class typed through OmegaConf, then built, so its __post_init__ checks run too), as keyword
    arguments for its factory."""
    what = f"{entry.kind} {entry.name!r}"
    if not isinstance(options, Mapping):
        raise PluginError(f"{entry.kind}_options must be a dict of {what}'s options, got {type(options).__name__}")
    if entry.options is None:
        if options:
            raise PluginError(f"{what} takes no options, got {sorted(options)}")
        return {}
    allowed = ", ".join(
        f"{f.name}={f.default!r}" if f.default is not dataclasses.MISSING else f.name
        for f in dataclasses.fields(entry.options)
    )
    try:
        node = OmegaConf.merge(OmegaConf.structured(entry.options), dict(options))
        built = OmegaConf.to_object(node)
    except Exception as e:
        reason = str(e).splitlines()[0]
        raise PluginError(f"bad options for {what}: {reason}; its options (with defaults): {allowed}") from None
    return {f.name: getattr(built, f.name) for f in dataclasses.fields(entry.options)}


_default: PluginRegistry | None = None


def get_registry() -> PluginRegistry:
    """The process-wide registry of installed plugins, loaded on first use."""
    global _default
    if _default is None:
        _default = PluginRegistry()
    return _default
