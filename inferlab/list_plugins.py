"""`inferlab-plugins`: every registered plugin by kind, the distribution and version providing it
and its options, then the plugins that failed to load and the names registered twice, and why."""

import argparse
import dataclasses

from inferlab.conf import store_configs
from inferlab.core.plugins import KINDS, PluginRegistry, get_registry


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
            if (kind, entry.name) in registry.collisions:
                line += "  [COLLISION]"
            lines.append(line)
    problems = []
    for (kind, name), owners in sorted(registry.collisions.items()):
        providers = ", ".join(f"{e.plugin!r} ({e.distribution or 'registered by hand'})" for e in owners)
        problems.append(
            f"  COLLISION {kind} {name!r} is registered by {providers}: selecting it is an error "
            "until one is uninstalled or renamed"
        )
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
