"""The demo's resume faults (#15), at the demo's small settings: region A killed
after its first partial commit point (``--fault=kill_prefill``), or sent a
preemption notice while a prompt is mid-stream (``--fault=preempt_prefill``).
The report must show the request resumed from its commit point and the prompt
tokens that saved, with every answer equal to the reference. The negative
control, a run without a fault reporting no resume, is in test_demo.py."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
CHUNK = 256  # the demo's largest prefill bucket: its chunk, one commit point each


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kill_prefill", "preempt_prefill"])
def test_demo_reports_resumed_requests_and_tokens_saved(tmp_path, fault):
  out = tmp_path / "report.json"
  proc = subprocess.run(
      [sys.executable, str(REPO / "experiments" / "demo_two_region.py"), "--num_requests=6",
       "--max_new_tokens=8", "--rate=20", "--threshold=0", f"--fault={fault}", "--trace=",
       "--bandwidth=200mbit", "--notls", f"--json_out={out}",
       f"--workdir={tmp_path / 'work'}", "--progress=false"],
      capture_output=True, text=True, timeout=1100, cwd=REPO)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  report = json.loads(out.read_text())
  f = report["fault"]
  assert report["all_tokens_match_reference"] is True and f["completed"] == 6, f
  assert f["resumed_requests"] >= 1, f
  # Saved tokens are whole chunks (commit points), fewer than the prompts hold.
  assert f["tokens_saved"] >= CHUNK and f["tokens_saved"] % CHUNK == 0, f
  assert f["tokens_saved"] < sum(r["prompt_tokens"] for r in report["requests"])
  resumed = [r for r in report["requests"] if r["resumed_tokens"] > 0]
  assert all(r["resumed_tokens"] < r["prompt_tokens"] for r in resumed)
  assert f"{f['resumed_requests']} requests resumed from a commit point, " \
         f"{f['tokens_saved']} prompt tokens not recomputed" in proc.stdout
  if fault == "preempt_prefill":
    assert any("mid-stream" in e and "nothing" not in e for e in f["events"]), f["events"]
