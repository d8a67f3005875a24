"""`bench` as a new user meets it: bad options are one line before anything runs, a terminal sees each
row once, the header names columns the table has, and `--help` names the program the user typed."""
from __future__ import annotations

import os
import pty
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from draftkv_sim.cli import MODULE_PROG, PROG, bench_header, main, program_name

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # `benchmarks` of this checkout
from benchmarks.kernels import HEADER, RowStream  # noqa: E402


def _env() -> dict[str, str]:
    env = os.environ.copy()
    env.pop("TRITON_INTERPRET", None)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = str(REPO)
    return env


def bench_error(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *args])
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert out == "", out  # nothing ran: not even the header
    lines = err.splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"{PROG} bench: error: argument ")
    return lines[0]


@pytest.mark.parametrize(
    "args, text",
    [
        (("--reps", "-3"), "argument --reps: must be >= 1, got -3"),
        (("--reps", "0"), "argument --reps: must be >= 1, got 0"),
        (("--threads", "0"), "argument --threads: must be >= 1, got 0"),
        (("--reps", "x"), "argument --reps: must be an integer, got 'x'"),
        (("--json", "/nonexistent/b.json"), "argument --json: folder /nonexistent does not exist"),
    ],
)
def test_bad_bench_options_are_one_line_before_anything_runs(capsys, args, text):
    assert text in bench_error(capsys, "--device", "cpu", *args)


def test_a_json_folder_is_a_file_is_refused_up_front(capsys, tmp_path):
    (tmp_path / "f").write_text("")
    assert "argument --json:" in bench_error(capsys, "--device", "cpu", "--json", str(tmp_path / "f" / "b.json"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_one_line_naming_the_device(capsys):
    line = bench_error(capsys, "--device", "cuda")
    assert "argument --device: cuda:" in line and "--device cpu" in line


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("interpret", [None, "1"])
def test_the_header_names_only_columns_the_table_has(monkeypatch, device, interpret):
    if interpret is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
    header = bench_header(Path("benchmarks/kernels.py"), device)
    columns = set(re.findall(r"'([^']+)'", header))  # every quoted name is a column of the table
    assert columns, header
    table_columns = [c.strip() for c in HEADER.splitlines()[0].split("|")]
    for column in columns:
        assert f"{column} µs" in table_columns, (column, table_columns)
    if device == "cpu":
        assert ("interpreter" in header) == (interpret == "1")


def test_program_name_is_what_the_user_typed():
    assert program_name("/usr/lib/python3/site-packages/tensorrt_llm_draftkv/__main__.py") == PROG
    assert program_name("/home/me/.venv/bin/draftkv") == "draftkv"
    assert program_name("/usr/lib/python3/site-packages/draftkv_sim/__main__.py", MODULE_PROG) == MODULE_PROG
    assert program_name("/home/me/.venv/bin/draftkv", MODULE_PROG) == "draftkv"


@pytest.mark.parametrize("module, prog", [("tensorrt_llm_draftkv", PROG), ("draftkv_sim", MODULE_PROG)])
def test_each_module_names_itself_in_help(tmp_path, module, prog):
    proc = subprocess.run(
        [sys.executable, "-m", module, "simulate", "--help"],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: {prog} simulate "), proc.stdout


def test_the_console_script_names_itself_in_bench_help(tmp_path):
    script = shutil.which("draftkv")
    if script is None:
        pytest.skip("the draftkv console script is not installed (pip install -e .)")
    proc = subprocess.run(
        [script, "bench", "--help"], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: draftkv bench "), proc.stdout
    assert "python -m" not in proc.stdout


class _Stream:
    def __init__(self, tty: bool) -> None:
        self.tty, self.text = tty, ""

    def isatty(self) -> bool:
        return self.tty

    def write(self, text: str) -> None:
        self.text += text

    def flush(self) -> None:
        pass


def test_rows_stream_to_stderr_when_stdout_is_not_the_terminal():
    out, err = _Stream(False), _Stream(True)
    show = RowStream(out, err)
    show("| 1 | 2 |")
    show.close()
    assert err.text == "| 1 | 2 |\n"


def test_on_one_terminal_a_row_is_a_transient_status_line_erased_at_the_end():
    out, err = _Stream(True), _Stream(True)
    show = RowStream(out, err)
    show("|    1 |    16 | 0.00 |")
    show.close()
    assert "\n" not in err.text and err.text.endswith("\r\033[K")
    assert "|    1 |    16 |" not in err.text  # the row itself appears once: in the table on stdout


def test_on_a_terminal_each_row_prints_once():
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tensorrt_llm_draftkv", "bench", "--quick", "--device", "cpu", "--reps", "1"],
        cwd=REPO, env=_env(), stdout=slave, stderr=slave, stdin=subprocess.DEVNULL,
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
    assert proc.wait(timeout=300) == 0, terminal.decode(errors="replace")
    text = terminal.decode(errors="replace")
    for b, m in ((1, 16), (8, 16), (1, 128), (8, 128)):
        assert text.count(f"| {b:4d} | {m:5d} |") == 1, text
