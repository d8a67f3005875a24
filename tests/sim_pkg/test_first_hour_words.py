"""Words a newcomer meets: a glossary linked where they first appear, a table that fits 120 columns and
names its drafter (`--wide` for the rest), and one default drafter for `plan` and `simulate`."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tensorrt_llm_draftkv.config import DEFAULT_DRAFTER
from draftkv_sim.cli import main
from draftkv_sim.scenario import DEFAULT_SCENARIO, SimSetup
from draftkv_sim.report import TABLE_WIDTH, fit_lines, format_table
from draftkv_sim.run_result import RunResult

REPO = Path(__file__).resolve().parents[2]
GLOSSARY = REPO / "docs" / "glossary.md"
TERMS = ("DFlash", "DSpark", "PARD", "one-engine drafter", "draft view", "cpp export", "stale", "unbacked", "lag",
         "handoff", "reused", "events")


# -- the glossary ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("term", TERMS)
def test_the_glossary_defines_each_term(term):
    text = GLOSSARY.read_text()
    defined = re.search(rf"\*\*[^*]*{re.escape(term)}[^*]*\*\*|`{re.escape(term)}[=`]", text)
    assert defined, f"{term} is not defined in docs/glossary.md"


@pytest.mark.parametrize("doc, first_word", [("README.md", "DFlash"), ("docs/simulator.md", "DFlash"),
                                             ("docs/simulator.md", "stale")])
def test_the_glossary_is_linked_before_the_words_first_appear(doc, first_word):
    text = (REPO / doc).read_text()
    link = re.search(r"\[(docs/)?glossary\.md\]\((docs/)?glossary\.md\)", text)
    assert link, f"{doc} does not link the glossary"
    if doc == "README.md":  # its first sentence names the drafters: the link is the paragraph right after it
        assert link.start() < text.index("## "), doc
    else:
        assert link.start() < text.index(first_word), doc


# -- the table ------------------------------------------------------------------------------------------------
def result_row(**changes) -> RunResult:
    fields = dict(
        name="disagg-prefix-joint", sizing="legacy", mode="disaggregated", prompt_tokens=[524287, 131071],
        finished=0, resize_failures=1, refused_requests=3, first_error="Draft KV cache context resize failed for "
        "request 1: could not resize to 131086 tokens (history unchanged) " + "and more words " * 20,
        foreign_page_accesses=1552005, stale_reads=1289211, unbacked_accesses=1552005, accounting_errors=7,
        slot_reseeds=92, max_seed_lag_tokens=524287, peak_draft_pages_per_request=16385,
        estimated_draft_pages_per_request=386, acceptance_length=1.0, output_matches_target=False,
        skipped_warmups=1, tokens_per_s=12345.6, wall_s=1.0, drafter_handoff="window", drafter_bytes_sent=1,
        full_drafter_bytes=3, reseeds_without_handoff=60, handoff_fallbacks=2, block_reuse="joint",
        reused_tokens=[0, 196608], prefill_tokens_saved=196608, gen_reused_tokens=[0, 196608],
        pages_held_at_end=12, shared_page_writes=3, peak_over_estimate=True, pool_requests=8,
        requests_pool_holds_at_peak=0, setup=DEFAULT_SCENARIO.setup,
    )
    fields.update(changes)
    return RunResult(**fields)


def test_the_default_table_fits_120_columns_however_much_a_row_has_to_say():
    table = format_table([result_row(), result_row(name="agg-16k", sizing="history", mode="aggregated")])
    for line in table.splitlines():
        assert len(line) <= TABLE_WIDTH, line
    events = [line for line in table.splitlines() if line.startswith("    events: ") or line.startswith(" " * 12)]
    said = " ".join(" ".join(events).split())
    for event in ("over_est=16385/386", "pool_holds=0/8", "stale=1289211", "unbacked=1552005", "lag=524287",
                  "reseeds_without_handoff=60", "held_at_end=12", "warmup=skipped"):
        assert event in said, event  # wrapped, never cut
    assert any(line.startswith("    error: Draft KV cache context resize failed") for line in table.splitlines())


def test_the_table_names_the_drafter_and_explains_handoff_reused_and_events():
    for wide in (False, True):
        table = format_table([result_row(setup=DEFAULT_SCENARIO.setup)], wide=wide)
        assert table.splitlines()[0].startswith("drafter: dflash ")
        legend = " ".join(table.split("\n\n")[-1].split())
        assert "handoff: drafter context" in legend and "reused: prompt tokens" in legend
        assert "events: docs/glossary.md" in legend
    assert format_table([result_row(setup=SimSetup(drafter=DEFAULT_DRAFTER.DSPARK))]).startswith("drafter: dspark ")


def test_wide_keeps_every_column_and_the_events_on_the_row():
    (row,) = [line for line in format_table([result_row()], wide=True).splitlines() if line.startswith("disagg-")]
    assert "12345.6" in row and "skipped" in row and "over_est=16385/386" in row and "Draft KV cache" in row
    head = format_table([result_row()], wide=True).splitlines()[1]
    assert "tok/s" in head and "warmup" in head and "events / first error" in head


def test_long_lines_after_the_table_are_wrapped_not_cut():
    line = "  accept 6.000 / 6.000 = 1.000: " + "word " * 60
    wrapped = fit_lines(line).splitlines()
    assert all(len(x) <= TABLE_WIDTH for x in wrapped) and len(wrapped) > 1
    assert " ".join(" ".join(wrapped).split()) == " ".join(line.split())


def test_the_command_prints_nothing_wider_than_120_columns(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, "-m", "tensorrt_llm_draftkv", "--prompts", "70001,5000", "--draft-window", "1024",
         "--mode", "aggregated", "--max-new-tokens", "8", "--quiet"],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("drafter: dflash ")
    for line in proc.stdout.splitlines():
        assert len(line) <= TABLE_WIDTH, line


# -- one default drafter --------------------------------------------------------------------------------------
def test_plan_and_simulate_default_to_the_same_drafter(capsys, tmp_path):
    assert SimSetup().drafter is DEFAULT_DRAFTER is DEFAULT_SCENARIO.setup.drafter
    path = tmp_path / "plan.json"
    assert main(["plan", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"draft ({DEFAULT_DRAFTER.label}) pool" in out
    assert json.loads(path.read_text())["inputs"]["drafter"] == DEFAULT_DRAFTER.label
