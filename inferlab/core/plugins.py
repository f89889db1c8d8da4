"""The plugin registry: finds plugins through the `inferlab` entry points, collects what each
registers (each plugin with its options class), checks it against its Protocol, and builds the
selected ones."""

import dataclasses
import inspect
import logging
import re
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
    "router": ("register_routers", protocols.Router),
    "kv_transfer": ("register_kv_transfers", protocols.KVTransfer),
}
# The kinds an engine is built from: a router chooses between engines and a KV transfer serves the
# engines of a process together, so a cluster holds them.
ENGINE_KINDS = tuple(kind for kind in KINDS if kind not in ("router", "kv_transfer"))


class PluginError(LookupError):
    """A plugin could not be found, loaded or built."""


BUILTIN_PACKAGE = "inferlab"  # the package whose plugins keep their names when another registers the same


@dataclass(frozen=True)
class PluginEntry:
    kind: str
    name: str  # what users select: the name it registered, or package:name when it collides (see package)
    factory: Callable[..., Any]
    plugin: str  # the pluggy plugin (entry point) that registered it
    distribution: str  # "name version" of the package providing it, or "" when registered by hand
    options: type | None = None  # the dataclass of the factory's keyword options, its Hydra config node
    # The package a qualified name `package:name` names: the distribution's name as pip shows it, in
    # lower case with each run of "-", "_" and "." written "-" (PEP 503), e.g. "inferlab-edf"; for a
    # plugin registered by hand, the name it was registered under.
    package: str = ""
    qualified_only: bool = False  # it collides with another plugin's name: selected as package:name only


def package_name(distribution: str, plugin: str) -> str:
    """The package a plugin's qualified names use (PluginEntry.package)."""
    if not distribution:
        return plugin
    return re.sub(r"[-_.]+", "-", distribution.split(" ", 1)[0]).lower()


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
            # the built-in entry points first, so that theirs are the names another package's collide with
            for ep in sorted(entry_points(group="inferlab"), key=lambda ep: not _is_builtin(ep)):
                dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist else ""
                try:
                    module = ep.load()
                except Exception as e:  # a broken third-party plugin must not take the engine down
                    self.failures.append(
                        PluginFailure(ep.name, dist, f"import of {ep.value!r} failed: {type(e).__name__}: {e}")
                    )
                    continue
                # an entry point named like another package's registers under its qualified name
                name = ep.name if not self.pm.has_plugin(ep.name) else f"{package_name(dist, ep.name)}:{ep.name}"
                self.register(module, name, dist)

    def register(self, plugin: Any, name: str | None = None, distribution: str = "") -> None:
        """Registers a plugin object (module or instance with @hookimpl functions) and collects
        what its hooks register. Use this for plugins that are not installed as packages."""
        name = name or getattr(plugin, "__name__", None) or repr(plugin)
        if self.pm.has_plugin(name):
            owner = self._distributions.get(name) or "registered by hand"
            raise PluginError(
                f"a plugin named {name!r} is already registered ({owner}); register this one under another name"
            )
        try:
            self.pm.register(plugin, name=name)
            self.pm.check_pending()  # a misspelled hook fails loudly
        except (pluggy.PluginValidationError, ValueError) as e:  # ValueError: the same object registered twice
            if self.pm.has_plugin(name):
                self.pm.unregister(name=name)
            reason = f"invalid hook: {e}" if isinstance(e, pluggy.PluginValidationError) else str(e)
            self.failures.append(PluginFailure(name, distribution, reason))
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
            package = package_name(distribution, plugin_name)
            entry = PluginEntry(kind, entry_name, factory, plugin_name, distribution, options, package)
            existing = self.entries[kind].get(entry_name)
            if existing is None:
                self.entries[kind][entry_name] = entry
            else:
                self._collide(existing, entry)

        try:
            impl.function(register=register)
        except Exception as e:
            self.failures.append(
                PluginFailure(plugin_name, distribution, f"{impl.function.__name__} raised {type(e).__name__}: {e}")
            )

    def _collide(self, existing: PluginEntry, entry: PluginEntry) -> None:
        """Two plugins registered one name: each becomes selectable as package:name too, and the
        name itself stays the built-in's (inferlab's), when one of them is; otherwise selecting
        the name is an error that names both (collisions)."""
        kind, name = entry.kind, entry.name
        owners = self.collisions.setdefault((kind, name), [existing])
        owners.append(entry)
        for owner in (existing, entry):
            qualified = f"{owner.package}:{name}"
            if qualified not in self.entries[kind]:
                self.entries[kind][qualified] = dataclasses.replace(owner, name=qualified, qualified_only=True)
        builtin = next((e for e in owners if e.package == BUILTIN_PACKAGE), None)
        if builtin is not None:
            self.entries[kind][name] = builtin
            log.warning(
                "%s %r of %s is also the name of a built-in %s: %r selects the built-in, %r the other",
                kind,
                name,
                entry.distribution or f"plugin {entry.plugin!r}",
                kind,
                name,
                f"{entry.package}:{name}",
            )

    def names(self, kind: str) -> list[str]:
        return sorted(self.entries[kind])

    def model_config_defaults(self) -> dict[str, dict]:
        """model_type -> the defaults of transformers' config class for it, as the model plugins
        declare them (ConfigDefaults on the factory), for reading config.json without transformers'
        config classes. Where two plugins declare one model_type, the first in name order counts."""
        defaults: dict[str, dict] = {}
        for name in self.names("model"):
            entry = self.entries["model"][name]
            factory = entry.factory
            if isinstance(factory, protocols.ConfigDefaults) and not entry.qualified_only:
                for model_type, fields in factory.config_defaults.items():
                    defaults.setdefault(model_type, fields)
        return defaults

    def collision_of(self, kind: str, name: str) -> list[PluginEntry] | None:
        """The plugins that registered this name (bare, or the name in package:name), if more than one did."""
        return self.collisions.get((kind, name.rsplit(":", 1)[-1]))

    def get(self, kind: str, name: str) -> PluginEntry:
        if kind not in KINDS:
            raise PluginError(f"unknown plugin kind {kind!r}; kinds: {sorted(KINDS)}")
        owners = self.collisions.get((kind, name))
        if owners and not any(e.package == BUILTIN_PACKAGE for e in owners):
            listed = ", ".join(
                f"{e.distribution or 'registered by hand'} (plugin {e.plugin!r}) as {e.package + ':' + name!r}"
                for e in owners
            )
            raise PluginError(f"{kind} {name!r} is registered by more than one package: {listed}; select one of those")
        entry = self.entries[kind].get(name)
        if entry is None and ":" in name:  # package:name of a plugin whose name collides with none
            package, _, bare = name.rpartition(":")
            found = self.entries[kind].get(bare)
            entry = found if found is not None and found.package == package else None
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


def _is_builtin(ep) -> bool:
    return ep.dist is not None and package_name(ep.dist.name, "") == BUILTIN_PACKAGE


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
