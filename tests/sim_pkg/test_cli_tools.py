"""The command line's tools: `bench` from any directory, `--version`, the progress bar, the plot, the example.

Commands run as a user runs them: a subprocess, without the test suite's
TRITON_INTERPRET. The bench and version checks run from a temporary directory
with the package on the path through a link, so nothing of the checkout is
importable by accident (`benchmarks` in particular). The progress bar is
checked on a pseudo-terminal, where it is on by default.
"""
from __future__ import annotations

import fcntl
import importlib.metadata
import importlib.util
import os
import pty
import re
import shutil
import struct
import subprocess
import sys
import termios
import zlib
from pathlib import Path

import pytest

from tensorrt_llm_draftkv.manager.rules import MirrorSizing
from draftkv_sim import RunSpec, Scenario

from sim_pkg.sim_support import SMALL

REPO = Path(__file__).resolve().parents[2]
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
FAST_RUN = ("--runs", "disagg-16k", "--sizing", "history", "--max-new-tokens", "8")


def _env(pythonpath: Path | None = None) -> dict[str, str]:
    env = os.environ.copy()
    env.pop("TRITON_INTERPRET", None)
    env["OMP_NUM_THREADS"] = "1"
    if pythonpath is None:
        env.pop("PYTHONPATH", None)
    else:
        env["PYTHONPATH"] = str(pythonpath)
    return env


@pytest.fixture
def elsewhere(tmp_path: Path) -> tuple[Path, Path]:
    """(a working directory outside the checkout, a path entry holding only links to the two packages)."""
    site = tmp_path / "site"
    site.mkdir()
    for package in ("tensorrt_llm_draftkv", "draftkv_sim"):
        (site / package).symlink_to(REPO / package, target_is_directory=True)
    work = tmp_path / "work"
    work.mkdir()
    return work, site


def module_cli(*args: str, cwd: Path, pythonpath: Path | None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tensorrt_llm_draftkv", *args],
        cwd=cwd, env=_env(pythonpath), capture_output=True, text=True, timeout=timeout,
    )


# -- bench, --version ------------------------------------------------------------------------------------
def test_bench_help_works_from_a_temporary_directory(elsewhere):
    work, site = elsewhere
    proc = module_cli("bench", "--help", cwd=work, pythonpath=site)
    assert proc.returncode == 0, proc.stderr
    assert "--quick" in proc.stdout and "--device" in proc.stdout
    assert "Traceback" not in proc.stderr


def test_the_draftkv_console_script_runs_bench_help_from_a_temporary_directory(tmp_path):
    script = shutil.which("draftkv")
    if script is None:
        pytest.skip("the draftkv console script is not installed (pip install -e .)")
    proc = subprocess.run(
        [script, "bench", "--help"], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "--quick" in proc.stdout


def test_bench_prints_one_header_saying_what_a_cpu_run_compares(elsewhere):
    work, site = elsewhere
    proc = module_cli("bench", "--quick", "--device", "cpu", "--reps", "1", cwd=work, pythonpath=site)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.count("bench: ") == 1 and out.startswith("python -m tensorrt_llm_draftkv bench: ")
    assert str(REPO / "benchmarks" / "kernels.py") in out.splitlines()[0]
    header = out.splitlines()[1]
    assert "CPU run" in header and "reference" in header and "eager baseline" in header
    assert "interpreted" in header and "not GPU figures" in header
    assert "|    B |     M |" in out  # the benchmark's table


def test_bench_without_the_source_checkout_says_so_in_one_line(tmp_path):
    site = tmp_path / "site"
    skip_caches = shutil.ignore_patterns("__pycache__")
    for package in ("tensorrt_llm_draftkv", "draftkv_sim"):
        shutil.copytree(REPO / package, site / package, ignore=skip_caches)
    proc = module_cli("bench", "--quick", cwd=tmp_path, pythonpath=site)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "benchmarks live in the source checkout" in lines[0], proc.stderr


def test_version_prints_the_package_version(elsewhere):
    work, site = elsewhere
    proc = module_cli("--version", cwd=work, pythonpath=site)
    assert proc.returncode == 0, proc.stderr
    try:
        version = importlib.metadata.version("tensorrt_llm_draftkv")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the package is not installed (pip install -e .): no version to compare")
    assert proc.stdout.strip() == f"tensorrt_llm_draftkv {version}"
    setup_version = re.search(r'version="([^"]+)"', (REPO / "setup.py").read_text()).group(1)
    assert version == setup_version


@pytest.mark.parametrize("module", ["tensorrt_llm_draftkv", "draftkv_sim"])
def test_version_loads_neither_torch_nor_the_library(module):
    """`--version` answers before anything heavy loads (it took seconds when it imported torch first)."""
    code = (
        "import runpy, sys\n"
        f"sys.argv = ['{module}', '--version']\n"
        "try:\n"
        f"    runpy.run_module('{module}', run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    assert e.code in (0, None), e.code\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'numpy')\n"
        "               or m.startswith(('tensorrt_llm_draftkv.', 'draftkv_sim.cli_')))\n"
        "print('HEAVY', heavy)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("tensorrt_llm_draftkv ")
    assert proc.stdout.strip().splitlines()[-1] == "HEAVY []"


# -- the example ---------------------------------------------------------------------------------------
def test_the_executor_step_example_runs_and_frees_every_page(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "executor_step.py")],
        cwd=tmp_path, env=_env(REPO), capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "context [0, 2048)" in proc.stdout
    assert "fresh slot seeded" in proc.stdout  # the disaggregated request's slot got a base
    assert "request 1 finished" in proc.stdout and "every page is free again" in proc.stdout


# -- the progress bar ----------------------------------------------------------------------------------
def on_a_terminal(*args: str, timeout: float = 300) -> tuple[int, str, str]:
    """(return code, stdout, what reached the terminal) of the command with stderr on a pseudo-terminal."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "tensorrt_llm_draftkv", *args],
        cwd=REPO, env=_env(REPO), stdout=subprocess.PIPE, stderr=slave, stdin=subprocess.DEVNULL,
    )
    os.close(slave)
    terminal = bytearray()
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: every writer closed the terminal
            break
        if not chunk:
            break
        terminal += chunk
    os.close(master)
    stdout = proc.stdout.read().decode()
    proc.stdout.close()
    return proc.wait(timeout=timeout), stdout, terminal.decode(errors="replace")


def test_a_terminal_gets_a_bar_fed_by_the_generation_rank():
    code, stdout, terminal = on_a_terminal(*FAST_RUN)
    assert code == 0, terminal
    assert "disagg-16k" in stdout  # the table
    assert "disagg-16k (history)" in terminal
    # Requests finished and steps exist only on the generation rank: it reported them to the parent.
    assert "2/2 req" in terminal and re.search(r"step \d+", terminal), terminal
    assert "prompts sent 2/2" in terminal  # and the context rank its prompts
    assert "target-only reference" in terminal  # the reference run has its bar too


def test_quiet_prints_no_bar_even_on_a_terminal():
    code, stdout, terminal = on_a_terminal(*FAST_RUN, "--quiet")
    assert code == 0, terminal
    assert "disagg-16k" in stdout
    assert "req" not in terminal and "step" not in terminal and "\r" not in terminal, terminal


# -- the plot ------------------------------------------------------------------------------------------
def png_text(path: Path) -> dict[str, str]:
    """The tEXt/zTXt/iTXt entries of a PNG (where matplotlib writes its metadata)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    out, i = {}, 8
    while i < len(data):
        (length,) = struct.unpack(">I", data[i : i + 4])
        kind, body = data[i + 4 : i + 8], data[i + 8 : i + 8 + length]
        if kind == b"tEXt":
            key, _, value = body.partition(b"\0")
            out[key.decode("latin-1")] = value.decode("latin-1")
        elif kind == b"zTXt":
            key, _, rest = body.partition(b"\0")
            out[key.decode("latin-1")] = zlib.decompress(rest[1:]).decode("latin-1")
        elif kind == b"iTXt":
            key, _, rest = body.partition(b"\0")
            compressed, rest = rest[0], rest[2:]
            _, _, rest = rest.partition(b"\0")  # language tag
            _, _, text = rest.partition(b"\0")  # translated keyword
            out[key.decode("latin-1")] = (zlib.decompress(text) if compressed else text).decode()
        i += 12 + length
    return out


def test_write_plot_without_matplotlib_names_the_extra(tmp_path, monkeypatch):
    from draftkv_sim.plot import write_plot

    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # hidden whether or not it is installed
    png = tmp_path / "occupancy.png"
    with pytest.raises(SystemExit, match=r"--plot needs matplotlib \(pip install -e '\.\[plot\]'\)"):
        write_plot([], str(png))
    assert not png.exists()


@pytest.mark.skipif(not HAVE_MATPLOTLIB, reason="matplotlib is not installed (pip install -e '.[plot]')")
def test_the_plot_has_one_panel_per_row_of_the_table(tmp_path, reference_kernels):
    from draftkv_sim.plot import write_plot
    from draftkv_sim.report import format_table
    from draftkv_sim.simulate import simulate

    # Two small aggregated runs (in this process: no ranks to spawn), both sizings: four rows.
    scenario = Scenario(
        setup=SMALL,
        runs=(
            RunSpec("small-a", "aggregated", (600, 900), 2),
            RunSpec("small-b", "aggregated", (300,), 1, max_new_tokens=16),
        ),
    )
    results = simulate(scenario, [MirrorSizing.HISTORY, MirrorSizing.LEGACY])
    png = tmp_path / "occupancy.png"
    write_plot(results, str(png))
    lines = format_table(results, wide=True).splitlines()
    body = lines[lines.index(next(x for x in lines if x.startswith("---"))) + 1 :]
    rows = [line.split()[:2] for line in body[: body.index("")]]
    description = png_text(png)["Description"]
    assert description.startswith(f"{len(rows)} panels: ")
    assert description.split(": ", 1)[1].split("; ") == [f"{name}/{sizing}" for name, sizing in rows]
    for r in results:  # what each panel draws beside the occupancy: the foreign trace, the pool's capacity
        assert len(r.plot_trace.foreign_per_step) == len(r.draft_pool_occupancy) > 0
        assert r.plot_trace.foreign_per_step[-1] == r.foreign_page_accesses
        assert r.plot_trace.pool_pages == SMALL.pool_requests * r.estimated_draft_pages_per_request
