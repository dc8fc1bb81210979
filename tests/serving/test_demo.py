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
from absl import app

from experiments.demo_options import resolve_pools

REPO = pathlib.Path(__file__).resolve().parents[2]
DEMO = REPO / "experiments" / "demo_two_region.py"
# The demo's defaults as resolve_pools sees them (no flag given).
DEFAULTS = dict(decode_slice=1, decode_slice_devices=1, prefill_pod=1, prefix_block=64,
                pd_nodes=1, decode_regions=1, fault="none", tls=True, explicit=(),
                slice_nodes=1)


# Wall-clock guard only (not a speed check): a cold start compiles every engine of
# four processes, which took ~10 min on a 2-core machine shared by other jobs.
@pytest.mark.timeout(1200)
def test_demo_two_region_small(tmp_path):
  out = tmp_path / "report.json"
  proc = subprocess.run(
      [sys.executable, str(DEMO), "--num_requests=6",
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


# --decode_slice (#16): the slice's constraints against the demo's other flags.

def test_a_decode_slice_turns_defaults_that_do_not_fit_into_ones_that_do_and_says_so():
  pools = resolve_pools(**{**DEFAULTS, "decode_slice": 2})
  # TLS stays on: every slice process presents its own certificate (#16); the
  # slice keeps a prefix cache for its local prefills (said, not changed).
  assert (pools.prefill_pod, pools.prefix_block, pools.tls) == (2, 64, True)
  assert len(pools.notes) == 2
  assert "--prefill_pod=2" in pools.notes[0]
  assert "prefix cache (--prefix_block=64) for its own local prefills" in pools.notes[1]
  # What the user asked for that fits is kept, with nothing to say (TLS either way).
  for tls in (False, True):
    pools = resolve_pools(**{**DEFAULTS, "decode_slice": 2, "prefill_pod": 3,
                             "prefix_block": 0, "tls": tls,
                             "explicit": ("prefill_pod", "prefix_block", "tls")})
    assert (pools.prefill_pod, pools.prefix_block, pools.tls, pools.notes) == (3, 0, tls, ())
  # Region A of one process, asked for, feeds the slice as a pod of one.
  pools = resolve_pools(**{**DEFAULTS, "decode_slice": 2, "prefill_pod": 1, "prefix_block": 0,
                           "explicit": ("prefill_pod", "prefix_block")})
  assert pools.prefill_pod == 1 and "a pod of one process" in pools.notes[0]


def test_a_decode_slice_among_several_pd_nodes_is_node_0_and_says_so():
  # Once refused (the slice had to be region B's only PD node); now node 0.
  pools = resolve_pools(**{**DEFAULTS, "decode_slice": 2, "pd_nodes": 3, "prefix_block": 0,
                           "explicit": ("prefix_block",)})
  assert pools.prefill_pod == 2
  assert any("PD node 0" in n and "2 PD node(s) are single decode servers" in n
             for n in pools.notes), pools.notes


def test_several_slices_are_the_first_pd_nodes_and_say_so():
  pools = resolve_pools(**{**DEFAULTS, "decode_slice": 2, "pd_nodes": 3, "slice_nodes": 2,
                           "prefix_block": 0, "explicit": ("prefix_block",)})
  assert any("PD nodes 0..1 are 2 decode slices of 2 processes" in n
             and "the other 1 PD node(s) are single decode servers" in n
             for n in pools.notes), pools.notes
  # Negative: with one slice the note names node 0 alone.
  pools = resolve_pools(**{**DEFAULTS, "decode_slice": 2, "pd_nodes": 3, "prefix_block": 0,
                           "explicit": ("prefix_block",)})
  assert not any("decode slices of" in n for n in pools.notes), pools.notes


@pytest.mark.parametrize("given, flag", [
    ({"decode_slice": 2, "pd_nodes": 2, "slice_nodes": 3}, "--slice_nodes=3 .* --pd_nodes=2"),
    ({"pd_nodes": 2, "slice_nodes": 2}, "--slice_nodes=2 .* --decode_slice > 1"),
    ({"decode_slice": 2, "slice_nodes": 0}, "--slice_nodes must be >= 1"),
])
def test_slice_nodes_that_cannot_run_are_refused_and_named(given, flag):
  with pytest.raises(app.UsageError, match=flag):
    resolve_pools(**{**DEFAULTS, **given})


def test_without_a_slice_the_defaults_stay_as_they_are():
  pools = resolve_pools(**DEFAULTS)
  assert (pools.prefill_pod, pools.prefix_block, pools.tls, pools.notes) == (1, 64, True, ())


def test_a_decode_slice_keeps_an_explicit_prefix_block():
  # Once refused (a slice kept no prefix cache); now its local prefills use one.
  pools = resolve_pools(**{**DEFAULTS, "decode_slice": 2, "prefix_block": 32,
                           "explicit": ("prefix_block",)})
  assert pools.prefix_block == 32 and any("--prefix_block=32" in n for n in pools.notes)
  # Without one, nothing is said about it.
  pools = resolve_pools(**{**DEFAULTS, "decode_slice": 2, "prefix_block": 0,
                           "explicit": ("prefix_block",)})
  assert pools.prefix_block == 0 and not any("prefix" in n for n in pools.notes)


@pytest.mark.parametrize("given, flag", [
    ({"fault": "kill_prefill"}, "--fault=kill_prefill"),
    ({"decode_slice_devices": 0}, "--decode_slice_devices"),
])
def test_a_decode_slice_refuses_a_flag_it_conflicts_with_and_names_it(given, flag):
  with pytest.raises(app.UsageError, match=flag):
    resolve_pools(**{**DEFAULTS, "decode_slice": 2, **given})


@pytest.mark.parametrize("given", [{"decode_regions": 2}, {"fault": "drop_link"},
                                   {"fault": "stall_link"}, {"fault": "corrupt_state"},
                                   {"fault": "kill_decode"}])
def test_a_decode_slice_takes_several_regions_and_the_wan_and_state_faults(given):
  pools = resolve_pools(**{**DEFAULTS, "decode_slice": 2, **given})
  assert pools.prefill_pod == 2
  if "decode_regions" in given:
    assert any("each of the 2 decode regions" in n for n in pools.notes), pools.notes


@pytest.mark.parametrize("given, flag", [
    ({"decode_slice_devices": 2}, "--decode_slice_devices"),  # without a slice
    ({"fault": "kill_pod_process"}, "--prefill_pod > 1"),
    ({"prefill_pod": 2, "fault": "corrupt_chunks"}, "--prefill_pod = 1"),
])
def test_flags_that_need_a_slice_or_a_pod_are_refused_without_one(given, flag):
  with pytest.raises(app.UsageError, match=flag):
    resolve_pools(**{**DEFAULTS, **given})


def test_the_demo_refuses_a_conflicting_flag_up_front_without_a_traceback(tmp_path):
  proc = subprocess.run(
      [sys.executable, str(DEMO), "--decode_slice=2", "--fault=kill_prefill",
       f"--json_out={tmp_path / 'report.json'}", f"--workdir={tmp_path / 'work'}"],
      capture_output=True, text=True, timeout=300, cwd=REPO)
  assert proc.returncode != 0
  assert "--fault=kill_prefill" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
  assert not (tmp_path / "work").exists()  # nothing started


@pytest.mark.slow  # a pod and a slice of two processes each, and their compiles
@pytest.mark.timeout(1200)
def test_demo_with_region_b_as_a_decode_slice_is_token_exact(tmp_path):
  out = tmp_path / "report.json"
  proc = subprocess.run(
      [sys.executable, str(DEMO), "--decode_slice=2", "--prefill_pod=2", "--num_requests=4",
       "--max_new_tokens=8", "--rate=20", "--trace=",
       f"--json_out={out}", f"--workdir={tmp_path / 'work'}", "--progress=false"],
      capture_output=True, text=True, timeout=1100, cwd=REPO)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  # The slice keeps a prefix cache for its local prefills (the demo's default block).
  assert "keeps a prefix cache (--prefix_block=64) for its own local prefills" in proc.stdout
  # TLS on, the demo's default: a slice process per certificate (#16).
  assert "security   : mutual TLS" in proc.stdout and "--notls" not in proc.stdout
  assert "decode slice     : 2 processes x 1 devices (TP=2)" in proc.stdout
  report = json.loads(out.read_text())
  assert report["decode_slice"] == 2 and report["prefill_pod"] == 2
  assert report["security"]["tls"] is True
  assert report["prefix_cache"]["block_tokens"] == 64
  assert report["decode_server"]["prefix_cache_enabled"] == 1.0
  assert report["all_tokens_match_reference"] is True and report["errors"] == 0
  assert report["decode_server"]["slice_processes"] == 2
  assert report["decode_server"]["jobs_done"] == 4
  # Both paths onto the slice: parts from the pod, and prefilled on the slice itself.
  routes = [r["route"] for r in report["requests"]]
  assert routes.count("pdp") >= 1 and routes.count("prfaas") >= 1, routes
