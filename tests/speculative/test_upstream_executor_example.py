"""`examples/upstream_executor.py`, run as a user runs it: it must finish with every pool free."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_upstream_executor_example_runs_to_completion_with_every_pool_free(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "upstream_executor.py")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    assert "4 requests and 2 warmup dummies served" in out and "every pool is fully free" in out
    assert "one step rejected and rolled back" in out
    assert "'suspended': 0" not in out and "'resumed': 0" not in out and "'resume refused': 0" not in out


def test_the_example_request_carries_only_upstream_attributes():
    """The example's request class names nothing of this package (no target_view/draft_view)."""
    source = (REPO / "examples" / "upstream_executor.py").read_text()
    body = source[source.index("class Request"): source.index("def make_request")]
    for ours in ("target_view", "draft_view", "reused_tokens", "tensorrt_llm_draftkv"):
        assert ours not in body
