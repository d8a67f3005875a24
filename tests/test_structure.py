"""The packages' structure, checked from their source: no import circle, no borrowed private names.

Both packages are checked, the library and its simulator (`draftkv_sim`), each on its own.

A module may import its own subpackage's underscore modules (`kernels/_dispatch.py`
is internal to `kernels/`), but never a name another module keeps private
(`from .x import _y`, `x._y` on an imported module), nor another subpackage's
internal modules. Imports form no cycle, counting type-only and function-level
imports too (a module's own parent packages load before it, so those edges are
left out; `__main__.py`, the command line's shim, is not part of the graph).
"""
from __future__ import annotations

import ast
from pathlib import Path

import importlib.util

import pytest

PACKAGE = "tensorrt_llm_draftkv"


def _modules(name: str) -> dict[str, Path]:
    """Every module of the package `name`, found on disk without importing it (these are source checks)."""
    root = Path(importlib.util.find_spec(name).origin).parent
    found = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).with_suffix("")
        parts = [name, *rel.parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if len(parts) > 1 and parts[1] == "__main__":
            continue  # a command line's shim is not part of the graph
        found[".".join(parts)] = path
    return found


LIBRARY = _modules(PACKAGE)
SIMULATOR = _modules("draftkv_sim")
MODULES = {**LIBRARY, **SIMULATOR}
PACKAGES = pytest.mark.parametrize("package", [LIBRARY, SIMULATOR], ids=["library", "simulator"])


def _package_of(name: str) -> str:
    return name if MODULES[name].name == "__init__.py" else name.rsplit(".", 1)[0]


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = _package_of(module).split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _edges(module: str) -> set[str]:
    """Every library module `module` imports, anywhere in it (type-only and lazy imports included:
    a circle hidden behind `TYPE_CHECKING` or a function-level import is still a circle)."""
    out = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            target = _resolve(module, node)
            targets = [f"{target}.{a.name}" if f"{target}.{a.name}" in MODULES else target for a in node.names]
        for t in targets:
            if t in MODULES and t != module and not module.startswith(t + "."):  # parents load first anyway
                out.add(t)
    return out


@PACKAGES
def test_no_import_circle_inside_a_package(package):
    graph = {m: _edges(m) & set(package) for m in package}
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(path[path.index(n):] + [n] if n in path else [m, n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


@PACKAGES
def test_no_module_uses_another_modules_private_names(package):
    offenders = []
    for module, path in package.items():
        tree = ast.parse(path.read_text())
        aliases = {}  # local name -> library module it names
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = _resolve(module, node)
                for a in node.names:
                    full = f"{source}.{a.name}"
                    if full in MODULES:
                        aliases[a.asname or a.name] = full
                        same_package = _package_of(full).rsplit(".", 0)[0] == _package_of(module)
                        if _private(a.name) and not same_package:
                            offenders.append(f"{module}: imports {full}, internal to another subpackage")
                    elif _private(a.name) and source.split(".")[0] in (PACKAGE, "draftkv_sim"):
                        offenders.append(f"{module}: from {source} import {a.name}")
                    elif source in MODULES and any(_private(p) for p in source.split(".")) and \
                            _package_of(source) != _package_of(module):
                        offenders.append(f"{module}: imports from {source}, internal to another subpackage")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name):
                if node.value.id in aliases:
                    offenders.append(f"{module}:{node.lineno}: {node.value.id}.{node.attr}")
    assert offenders == []


def test_the_checks_see_what_they_guard(tmp_path):
    """The scanners find an imported private name and an edge, so an empty result means something."""
    edges = _edges(f"{PACKAGE}.manager.kv_cache_manager")
    assert f"{PACKAGE}.manager.request_caches" in edges and f"{PACKAGE}.manager.prefix_reuse" in edges
    node = ast.parse("from .x import _y").body[0]
    assert _private(node.names[0].name) and _resolve(f"{PACKAGE}.manager.kv_cache_manager", node) == f"{PACKAGE}.manager.x"
    sim_edges = _edges("draftkv_sim.simulate")
    assert "draftkv_sim.engine" in sim_edges and "draftkv_sim.simulate" in SIMULATOR


@PACKAGES
def test_every_attribute_read_off_an_imported_module_exists(package):
    """`mod.name` on an imported library module names something that module has.

    Paths that only run on a GPU (a bound launch, a graph capture) are never executed on the CPU,
    so a name moved out of a module would otherwise fail only on the device.
    """
    import importlib

    offenders = []
    for module, path in package.items():
        tree = ast.parse(path.read_text())
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = _resolve(module, node)
                for a in node.names:
                    if f"{source}.{a.name}" in MODULES:
                        aliases[a.asname or a.name] = f"{source}.{a.name}"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in MODULES and a.asname:
                        aliases[a.asname] = a.name
        # a name also bound locally (an argument, an assignment) may shadow the module: leave it out
        rebound = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        rebound |= {a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments)
                    for a in n.args + n.kwonlyargs + n.posonlyargs}
        for name in rebound:
            aliases.pop(name, None)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                target = importlib.import_module(aliases[node.value.id])
                if not hasattr(target, node.attr) and not isinstance(node.ctx, ast.Store):
                    offenders.append(f"{module}:{node.lineno}: {node.value.id}.{node.attr} ({aliases[node.value.id]})")
    assert offenders == []
