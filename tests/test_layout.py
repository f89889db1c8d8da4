"""The layering the design states, read from the source: core and the shared kernels import no
plugin, and no built-in plugin imports another plugin's module (so one plugin's broken dependency
cannot break another)."""

import ast
import pathlib
from importlib.metadata import entry_points

import inferlab

PACKAGE = pathlib.Path(inferlab.__file__).parent


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: pathlib.Path) -> set[str]:
    """The inferlab modules (and names within them) a file imports anywhere, including by
    importlib.import_module("...")."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", None) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            names.add(node.args[0].value)
    return {name for name in names if name.startswith("inferlab.")}


SOURCES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def test_core_and_kernels_import_no_plugin():
    for name, path in SOURCES.items():
        if name.startswith(("inferlab.core.", "inferlab.kernels")):
            plugins = sorted(n for n in imported_names(path) if n.startswith("inferlab.plugins"))
            assert not plugins, f"{name} imports {plugins}"


def test_no_builtin_plugin_imports_another_plugins_module():
    plugins = {ep.value for ep in entry_points(group="inferlab") if ep.value.startswith("inferlab.plugins.")}
    assert {"inferlab.plugins.attention.triton_backend", "inferlab.plugins.attention.flash_attn_backend"} <= plugins
    for plugin in plugins:
        reached, pending = set(), [plugin]
        while pending:  # every module of inferlab.plugins it imports, directly or not
            for name in imported_names(SOURCES[pending.pop()]):
                if name in SOURCES and name.startswith("inferlab.plugins.") and name not in reached:
                    reached.add(name)
                    pending.append(name)
        others = sorted((reached & plugins) - {plugin})
        assert not others, f"{plugin} imports the plugin module(s) {others}"
