"""`inferlab-plugins`: every registered plugin by kind, the distribution and version providing it
and its options, then the plugins that failed to load and the names registered twice, and why.
A name two packages registered is listed once per package, as package:name, besides the name
itself (which selects the built-in's, if one of them is inferlab)."""

import argparse
import dataclasses

from inferlab.conf import store_configs
from inferlab.core.plugins import BUILTIN_PACKAGE, KINDS, PluginRegistry, get_registry


def describe_options(node: type | None) -> str:
    if node is None:
        return ""
    parts = []
    for f in dataclasses.fields(node):
        default = (
            f.default
            if f.default is not dataclasses.MISSING
            else (f.default_factory() if f.default_factory is not dataclasses.MISSING else "???")
        )
        parts.append(f"{f.name}={default!r}")
    return ", ".join(parts)


def listing(registry: PluginRegistry) -> str:
    lines = []
    for kind in KINDS:
        lines.append(f"{kind}:")
        entries = [registry.entries[kind][name] for name in registry.names(kind)]
        if not entries:
            lines.append("  (none)")
        width = max([len(e.name) for e in entries] + [4])
        for entry in entries:
            source = entry.distribution or "registered by hand"
            line = f"  {entry.name:<{width}}  {source} (plugin {entry.plugin!r})"
            options = describe_options(entry.options)
            if options:
                line += f"  options: {options}"
            if registry.collision_of(kind, entry.name):
                line += "  [COLLISION]"
            lines.append(line)
    problems = []
    for (kind, name), owners in sorted(registry.collisions.items()):
        providers = ", ".join(
            f"{e.distribution or 'registered by hand'} (plugin {e.plugin!r}) as {e.package + ':' + name!r}"
            for e in owners
        )
        builtin = any(e.package == BUILTIN_PACKAGE for e in owners)
        outcome = (
            f"{name!r} selects the built-in; the qualified names select each"
            if builtin
            else f"selecting {name!r} is an error: select a qualified name"
        )
        problems.append(f"  COLLISION {kind} {name!r} is registered by {providers}: {outcome}")
    for failure in registry.failures:
        problems.append(
            f"  FAILED    plugin {failure.plugin!r} ({failure.distribution or 'registered by hand'}): {failure.reason}"
        )
    if problems:
        lines += ["", "problems:", *problems]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="inferlab-plugins", description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)
    registry = get_registry()
    store_configs(registry)
    print(listing(registry))


if __name__ == "__main__":
    main()
