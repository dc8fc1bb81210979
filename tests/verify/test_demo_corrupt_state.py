"""The demo's ``--fault=corrupt_state``: region B damages received states behind
the transport's checks; the logit probe catches each one, the broker re-prefills
those requests locally, and no wrong answer reaches a client."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_demo_corrupt_state_catches_every_damaged_state(tmp_path):
  out = tmp_path / "report.json"
  proc = subprocess.run(
      [sys.executable, str(REPO / "experiments" / "demo_two_region.py"), "--num_requests=5",
       "--max_new_tokens=8", "--rate=20", "--threshold=0", "--fault=corrupt_state",
       "--fault_states=2", "--trace=", "--bandwidth=200mbit", "--notls",
       f"--json_out={out}", f"--workdir={tmp_path / 'work'}", "--progress=false"],
      capture_output=True, text=True, timeout=900, cwd=REPO)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  fault = json.loads(out.read_text())["fault"]
  assert fault["probe_mismatches"] == 2
  assert fault["wrong_answers_delivered"] == 0 and fault["completed"] == 5
  assert fault["fallback_pdp"] >= 2
