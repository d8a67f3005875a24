"""The command line: `python -m tensorrt_llm_draftkv` (simulate by default), `--json`, `--plot`, `plan`.

Every test runs the command as a user would: a subprocess from the repository
root, without the test suite's TRITON_INTERPRET (so the CPU run takes the
kernels' torch reference, as it does outside pytest).
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from filelock import FileLock

from tensorrt_llm_draftkv.manager.rules import drafter_window_hit_cap
from draftkv_sim.scenario import DEFAULT_SCENARIO, default_scenario
from draftkv_sim.run_build import draft_pages_per_request

REPO = Path(__file__).resolve().parents[1]
ISSUE_KEYS = {
    "sizing",
    "mode",
    "prompt_tokens",
    "finished",
    "resize_failures",
    "first_error",
    "foreign_page_accesses",
    "peak_draft_pages_per_request",
    "estimated_draft_pages_per_request",
    "acceptance_length",
    "output_matches_target",
    "slot_reseeds",
    "max_seed_lag_tokens",
    "stale_reads",
    "unbacked_accesses",
    "accounting_errors",
}
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
RESIZE_ERROR = re.compile(r"Draft KV cache context resize failed for request (\d+): could not resize to (\d+) tokens")


def cli(*args: str, timeout: float = 300, hide: Path | None = None) -> subprocess.CompletedProcess:
    """The command in a subprocess; `hide`: a folder put first on its path (see `hide_matplotlib`)."""
    env = os.environ.copy()
    env.pop("TRITON_INTERPRET", None)
    if hide is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(hide), env.get("PYTHONPATH", "")) if p)
    # One thread per process: the command spawns two ranks for its disaggregated runs, and
    # under `pytest -n 2` on two cores more threads oversubscribe the machine several-fold.
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "tensorrt_llm_draftkv", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def table_rows(out: str) -> dict[tuple[str, str], list[str]]:
    """(run, sizing) -> the row's cells of the `--wide` table: run sizing mode finished resize foreign peak/est
    warmup accept tok/s match handoff reused [events / error...]."""
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:3] == ["run", "sizing", "mode"])
    rows = {}
    for line in lines[head + 2 :]:
        if not line.strip():  # the table ends at the blank line before the acceptance pairs
            break
        cells = line.split()
        if len(cells) >= 12:
            rows[cells[0], cells[1]] = cells
    return rows


# -- --json on the run legacy's pool can hold -----------------------------------------------------
@pytest.fixture(scope="module")
def disagg_16k(tmp_path_factory):
    """(return code, stdout, stderr, records) of one `--runs disagg-16k --json` run, shared by xdist workers."""

    def compute():
        path = tmp_path_factory.mktemp("cli") / "runs.json"
        proc = cli("--runs", "disagg-16k", "--wide", "--json", str(path))
        records = json.loads(path.read_text()) if path.is_file() else None
        return proc.returncode, proc.stdout, proc.stderr, records

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return compute()
    shared = tmp_path_factory.getbasetemp().parent / "cli_disagg_16k.json"
    with FileLock(str(shared) + ".lock"):
        if shared.is_file():
            return tuple(json.loads(shared.read_text()))
        out = compute()
        shared.write_text(json.dumps(out))
        return out


def test_json_has_the_issue_keys_for_every_run(disagg_16k):
    returncode, _, stderr, records = disagg_16k
    assert returncode == 0, stderr
    assert [r["sizing"] for r in records] == ["history", "legacy"]  # --sizing both is the default
    for r in records:
        assert ISSUE_KEYS <= set(r), ISSUE_KEYS - set(r)
        assert r["mode"] == "disaggregated"
        assert r["prompt_tokens"] == [1000, 16385]
        assert isinstance(r["finished"], int) and isinstance(r["resize_failures"], int)
        assert isinstance(r["first_error"], str)
        assert isinstance(r["foreign_page_accesses"], int)
        assert isinstance(r["acceptance_length"], float)
        assert r["output_matches_target"] is True
        assert r["finished"] == 2 and r["resize_failures"] == 0 and r["first_error"] == ""
        assert r["estimated_draft_pages_per_request"] == records[0]["estimated_draft_pages_per_request"]
        assert r["transport"] in ("nixl", "torch") and r["transfer_failures"] == {}


def test_legacy_touches_foreign_pages_in_the_run_its_pool_holds_and_history_none(disagg_16k):
    history, legacy = disagg_16k[3]
    assert history["foreign_page_accesses"] == 0
    assert legacy["foreign_page_accesses"] > 0
    # history keeps a window per request; legacy backs the whole 16k prompt (16384 / 32 pages)
    assert history["peak_draft_pages_per_request"] <= history["estimated_draft_pages_per_request"]
    assert legacy["peak_draft_pages_per_request"] >= 16384 // 32


def test_the_table_shows_what_the_json_says(disagg_16k):
    _, stdout, _, records = disagg_16k
    rows = table_rows(stdout)
    for r in records:
        cells = rows["disagg-16k", r["sizing"]]
        assert cells[3] == f"{r['finished']}/2"
        assert int(cells[4]) == r["resize_failures"]
        assert int(cells[5]) == r["foreign_page_accesses"]
        assert cells[6] == f"{r['peak_draft_pages_per_request']}/{r['estimated_draft_pages_per_request']}"
        assert float(cells[8]) == pytest.approx(r["acceptance_length"], abs=1e-3)
        assert cells[10] == "yes"
        sent, full = r["drafter_bytes_sent"], r["full_drafter_bytes"]
        if r["sizing"] == "history":
            assert r["drafter_handoff"] == "window" and 0 < sent < full
            assert cells[11] == f"{100 * sent / full:.2f}%"
        else:  # legacy sizing sends no drafter context
            assert r["drafter_handoff"] == "none" and sent == 0 and cells[11] == "none"
    assert set(rows) == {("disagg-16k", "history"), ("disagg-16k", "legacy")}


# -- the default command, whole ----------------------------------------------------------------------
@pytest.mark.slow
def test_the_default_command_runs_the_whole_scenario():
    # How long it takes is a benchmark figure (benchmarks/main_command.py), not a test.
    proc = cli("--wide", timeout=900)
    assert proc.returncode == 0, proc.stderr
    rows = table_rows(proc.stdout)
    prefix_runs = [
        f"{short}-prefix{suffix}" for short in ("agg", "disagg") for suffix in ("", "-reuse", "-joint")
    ]
    totals = {
        "agg-16k": 2, "disagg-16k": 2, "agg-long": 4, "disagg-long": 4, "agg-evict": 5, "disagg-evict": 5,
        "agg-window": 3, "disagg-window": 3, **{name: 4 for name in prefix_runs},
    }
    # aggregated twins and the shared-prefix runs run under history only
    twins = {"agg-16k", "agg-evict", "agg-window", *prefix_runs}
    assert list(rows) == [
        (name, sizing) for name in totals for sizing in ("history", "legacy") if sizing == "history" or name not in twins
    ]
    for (name, sizing), cells in rows.items():
        finished, total = map(int, cells[3].split("/"))
        assert total == totals[name]
        if sizing == "history":
            assert finished == total and cells[4] == "0" and cells[5] == "0"
            peak, est = map(int, cells[6].split("/"))
            # only an aggregated prefill of a prompt past the window fills the whole charge
            assert peak <= est and (peak == est) == (name in ("agg-long", "agg-16k") or name.startswith("agg-prefix"))
            assert cells[7] == "ok"  # the warmup ran
            assert cells[10] == "yes", f"{name}: speculative output equals target-only output"
            events = " ".join(cells[13:])
            for bad in ("stale=", "unbacked=", "accounting=", "refused=", "shared_writes=", "held_at_end="):
                assert bad not in events, f"{name}: {events}"
    for name in ("agg-long", "disagg-long"):
        cells = rows[name, "legacy"]
        assert cells[3] == f"0/{totals[name]}" and cells[4] == "1"
        m = RESIZE_ERROR.search(" ".join(cells[13:]))
        assert m and int(m.group(1)) == 1 and int(m.group(2)) >= 131071
        assert cells[10] == "-"
    assert int(rows["disagg-16k", "legacy"][5]) > 0
    assert "reseeds=" in " ".join(rows["disagg-evict", "history"][13:])  # slots evicted and reseeded
    # the reseeds after a slot loss had no received context to draw on, and say so
    assert "reseeds_without_handoff=" in " ".join(rows["disagg-evict", "history"][13:])
    # with the handoff every first seed sits at the prompt end; no seed lags its request
    assert "lag=" not in " ".join(rows["disagg-long", "history"][13:])
    for name in totals:
        if name.startswith("disagg-"):  # the generation worker's acceptance against its aggregated twin
            disagg = float(rows[name, "history"][8])
            agg = float(rows[name.replace("disagg-", "agg-"), "history"][8])
            assert disagg >= 0.97 * agg, f"{name}: {disagg} against {agg}"
            assert rows[name, "history"][11].endswith("%")
            if name not in twins:
                assert rows[name, "legacy"][11] == "none"
        else:
            assert rows[name, "history"][11] == "-"
    # block reuse: under joint reuse three requests hit the whole 64k prefix; target-only reuse stops each
    # hit at the last chunk boundary below the draft window, so the drafter computes what it reads; both keep
    # the acceptance
    scenario = default_scenario()
    setup = scenario.setup
    for name in prefix_runs:
        cell = rows[name, "history"][12]
        base = name.removesuffix("-reuse").removesuffix("-joint")
        if name == base:
            assert cell == "-"
            continue
        spec = next(r for r in scenario.runs if r.name == name)
        prefix = spec.shared_prefix
        if name.endswith("-joint"):
            expected = "j:" + str(3 * prefix)
        else:
            caps = [drafter_window_hit_cap(prefix + t, (setup.draft_window,), setup.tokens_per_block) for t in spec.prompts[1:]]
            hits = [max(b for b in range(0, prefix + 1, setup.chunk) if b <= cap) for cap in caps]
            assert 0 < sum(hits) < 3 * prefix
            expected = f"t:{sum(hits)}"
        if spec.mode == "disaggregated":
            # the generation worker adopts the prefix where a window of its reusing pools still reads it at the
            # prompt end (the draft pool's, widened by the trail page, only under joint reuse)
            P = setup.tokens_per_block
            windows = [setup.target_window] + ([setup.draft_window + P] if name.endswith("-joint") else [])
            gen = sum(
                prefix for t in spec.prompts[1:]
                if any(w is None or (prefix + t + 1 - w) // P < prefix // P for w in windows)
            )
            assert 0 < gen <= 3 * prefix
            expected += f"/g:{gen}"
        assert cell == expected, name
        ratio = float(rows[name, "history"][8]) / float(rows[base, "history"][8])
        assert ratio >= 0.97, f"{name}: {ratio:.3f}"
    assert "with block reuse vs without, over the same prompts:" in proc.stdout
    assert "disaggregated vs aggregated over the same prompts:" in proc.stdout
    assert rows["disagg-16k", "legacy"][10] == "yes"


# -- --plot, --sizing, --no-trail-page ----------------------------------------------------------------------
def _plot_run(tmp_path: Path) -> tuple[subprocess.CompletedProcess, Path, Path]:
    png, js = tmp_path / "occupancy.png", tmp_path / "runs.json"
    proc = cli(
        "--runs", "disagg-16k", "--sizing", "history", "--max-new-tokens", "8", "--no-trail-page",
        "--json", str(js), "--plot", str(png),
    )
    return proc, png, js


def _check_history_only_without_trail_page(js: Path) -> None:
    (record,) = json.loads(js.read_text())
    assert record["sizing"] == "history"
    assert record["finished"] == 2 and record["foreign_page_accesses"] == 0
    assert record["output_matches_target"] is True
    # one trail page per windowed layer group per request fewer than with the trail page
    with_trail = draft_pages_per_request(DEFAULT_SCENARIO.setup)
    assert DEFAULT_SCENARIO.setup.trail_page
    assert record["estimated_draft_pages_per_request"] == with_trail - 1


@pytest.mark.skipif(not HAVE_MATPLOTLIB, reason="matplotlib is an optional extra")
def test_plot_writes_a_png(tmp_path):
    proc, png, js = _plot_run(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    _check_history_only_without_trail_page(js)


def hide_matplotlib(folder: Path) -> Path:
    """A folder whose `matplotlib` fails to import: first on a subprocess's path, it hides the extra
    whether or not this machine has it installed."""
    shadow = folder / "hidden-extras" / "matplotlib"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text('raise ImportError("matplotlib is hidden by the test")\n')
    return shadow.parent


def test_plot_without_matplotlib_exits_with_a_clear_message_before_simulating(tmp_path):
    png, js = tmp_path / "occupancy.png", tmp_path / "runs.json"
    proc = cli(
        "--runs", "disagg-16k", "--sizing", "history", "--max-new-tokens", "8", "--json", str(js), "--plot", str(png),
        hide=hide_matplotlib(tmp_path),
    )
    assert proc.returncode != 0
    assert "--plot needs matplotlib" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not png.exists() and not js.exists()  # refused up front, not after a minute of work


def test_history_only_without_the_trail_page_writes_its_record(tmp_path):
    js = tmp_path / "runs.json"
    proc = cli(
        "--runs", "disagg-16k", "--sizing", "history", "--max-new-tokens", "8", "--no-trail-page", "--json", str(js),
        "--wide",
    )
    assert proc.returncode == 0, proc.stderr
    _check_history_only_without_trail_page(js)
    assert ("disagg-16k", "history") in table_rows(proc.stdout)


# -- fast paths --------------------------------------------------------------------------------------------------
def test_unknown_run_names_are_an_explicit_error():
    proc = cli("--runs", "no-such-run")
    assert proc.returncode != 0
    assert "unknown run(s) ['no-such-run']" in proc.stderr
    assert "disagg-16k" in proc.stderr and "Traceback" not in proc.stderr


def test_simulate_help_lists_the_options():
    proc = cli("simulate", "--help")
    assert proc.returncode == 0
    for opt in ("--runs", "--sizing", "--json", "--plot", "--max-new-tokens", "--no-trail-page", "--device"):
        assert opt in proc.stdout
    assert "{history,legacy,both}" in proc.stdout


def test_plan_still_works():
    proc = cli(
        "plan", "--drafter", "dspark", "--num-layers", "5", "--num-kv-heads", "4", "--head-dim", "128",
        "--dtype", "bfloat16", "--tokens-per-block", "32", "--window", "4096",
    )
    assert proc.returncode == 0, proc.stderr
    assert "320 KiB" in proc.stdout
    assert "0.78 %" in proc.stdout
