"""experiments/load_test.py: its accounting, and a short bounded real run (in the default
suite since issue 12: 3 s phases at 1x and 4x capacity, 4 prompts, 8 tokens)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from experiments import load_accounting as lt

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_every_request_lands_in_exactly_one_outcome():
  O = lt.Outcome
  outcomes = ([O(kind="completed", ttft_s=0.1 * i, total_s=0.2 * i, tokens_ok=True,
                 route="pdp") for i in range(1, 11)]
              + [O(kind="completed", ttft_s=1.0, total_s=2.0, tokens_ok=False, route="prfaas")]
              + [O(kind="rejected", code="RESOURCE_EXHAUSTED")] * 3
              + [O(kind="failed", code="UNAVAILABLE")]
              + [O(kind="lost", code="ended_without_finish"), O()])
  s = lt.summarize(outcomes, window_s=2.0)
  assert s["sent"] == 17
  assert s["completed"] + s["rejected"] + s["failed"] + s["lost"] == s["sent"]
  assert s["accepted"] == 14 and s["rejected_by_code"] == {"RESOURCE_EXHAUSTED": 3}
  assert s["failed_by_code"] == {"UNAVAILABLE": 1}
  assert s["lost"] == 2 and s["lost_by_reason"] == {"ended_without_finish": 1,
                                                    "open_at_drain_deadline": 1}
  assert s["wrong_tokens"] == 1 and s["routes"] == {"pdp": 10, "prfaas": 1}
  assert s["completed_per_s"] == 5.5
  assert s["latency_ms"]["p50"] == 1200.0 and s["latency_ms"]["p99"] == 2000.0
  assert lt.percentile([], 50) is None


@pytest.mark.timeout(1200)  # wall-clock guard for cold compiles on a loaded machine
def test_short_overload_run_loses_nothing(tmp_path):
  out = tmp_path / "load.json"
  proc = subprocess.run(
      [sys.executable, str(REPO / "experiments" / "load_test.py"), f"--json_out={out}",
       "--phase_s=3", "--capacity_s=3", "--multipliers=1,4", "--num_prompts=4",
       "--max_new_tokens=8", "--request_timeout_s=15", "--drain_s=5",
       f"--workdir={tmp_path / 'work'}"],
      capture_output=True, text=True, timeout=1100, cwd=REPO)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  r = json.loads(out.read_text())
  assert r["lost_total"] == 0 and r["reference"]["local_vs_remote_mismatch"] == 0
  assert r["after_overload"] == {"kind": "completed", "code": "", "tokens_ok": True}
  for phase in r["phases"]:
    assert phase["wrong_tokens"] == 0
    assert phase["completed"] + phase["rejected"] + phase["failed"] == phase["sent"]
    assert set(phase["rejected_by_code"]) <= {"RESOURCE_EXHAUSTED"}
  assert r["phases"][-1]["rejected"] > 0  # 4x capacity is refused, not queued forever
  assert len(r["memory_timeline"]) > 3
