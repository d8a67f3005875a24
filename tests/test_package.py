"""The drop-in library stands apart from its simulator (the top-level package `draftkv_sim`)."""
from __future__ import annotations

import subprocess
import sys


def test_importing_the_library_loads_no_simulation_module():
    code = (
        "import sys, tensorrt_llm_draftkv, tensorrt_llm_draftkv.kernels, tensorrt_llm_draftkv.manager, "
        "tensorrt_llm_draftkv.speculative, tensorrt_llm_draftkv.runtime\n"
        "loaded = sorted(m for m in sys.modules if m.startswith(('tensorrt_llm_draftkv', 'draftkv_sim')))\n"
        "print('\\n'.join(loaded))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert "tensorrt_llm_draftkv.manager.kv_cache_manager" in out  # the check can see what loaded
    assert [m for m in out if m.startswith("draftkv_sim")] == []


def test_the_library_sets_no_process_environment_variable():
    code = (
        "import os; before = dict(os.environ)\n"
        "import tensorrt_llm_draftkv, tensorrt_llm_draftkv.kernels\n"
        "print(sorted(set(os.environ.items()) ^ set(before.items())))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def _simulator_imports(path) -> list[str]:
    """The modules `path` imports that are the simulator: `draftkv_sim` or the simulator tests' helpers
    (`sim_pkg.sim_support`)."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            names = [("." * node.level) + (node.module or "")]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found += [n for n in names if n.lstrip(".").split(".")[0] in ("draftkv_sim", "sim_pkg")]
    return found


def test_the_library_never_imports_the_simulator_in_its_source():
    from pathlib import Path

    import tensorrt_llm_draftkv

    root = Path(tensorrt_llm_draftkv.__file__).parent
    offenders = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if rel == Path("__main__.py"):  # the CLI shim imports the simulator lazily, by design
            continue
        offenders += [f"{rel}: {name}" for name in _simulator_imports(path)]
    assert offenders == []


def test_the_library_tests_never_import_the_simulator():
    """Library tests drive the library through tests/executor_fixture.py; only tests/sim_pkg/ may use
    the simulator."""
    from pathlib import Path

    tests = Path(__file__).parent
    offenders = []
    for path in tests.rglob("*.py"):
        rel = path.relative_to(tests)
        if rel.parts[0] == "sim_pkg" or rel.name == "test_package.py":
            continue
        offenders += [f"{rel}: {name}" for name in _simulator_imports(path)]
    assert offenders == []
