"""The README's main command, shrunk: a real two-region run with a reference check.

In the default suite (issue 12): 6 requests, 8 tokens, on the default tiny model. The
reference is ``api.generate`` in the demo process (no paging, transport, batching or
prefix cache), and the run must take both routes, so both serving paths are checked.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


# Wall-clock guard only (not a speed check): a cold start compiles every engine of
# four processes, which took ~10 min on a 2-core machine shared by other jobs.
@pytest.mark.timeout(1200)
def test_demo_two_region_small(tmp_path):
  out = tmp_path / "report.json"
  proc = subprocess.run(
      [sys.executable, str(REPO / "experiments" / "demo_two_region.py"), "--num_requests=6",
       "--max_new_tokens=8", "--rate=20", "--trace=0:20mbit,1:5mbit,period=2",
       f"--json_out={out}", f"--workdir={tmp_path / 'work'}", "--progress=false"],
      capture_output=True, text=True, timeout=1100, cwd=REPO)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "all_tokens_match_reference: true" in proc.stdout
  report = json.loads(out.read_text())
  assert report["all_tokens_match_reference"] is True
  assert report["errors"] == 0 and len(report["requests"]) == 6
  for r in report["requests"]:
    assert r["route"] in ("pdp", "prfaas") and r["ttft_s"] > 0
    assert (r["link_bytes"] > 0) == (r["route"] == "prfaas")
    assert r["matches_reference"] is True
  # Both serving paths ran: local PD-P prefill and remote prefill over the link.
  routes = [r["route"] for r in report["requests"]]
  assert routes.count("pdp") >= 1 and routes.count("prfaas") >= 1, routes
  # No fault, no resume (the negative control of test_demo_resume.py's counts).
  assert report["fault"]["resumed_requests"] == 0 and report["fault"]["tokens_saved"] == 0
  assert report["link_utilization"]["a_to_b"]["bytes"] >= sum(
      r["link_bytes"] for r in report["requests"])
