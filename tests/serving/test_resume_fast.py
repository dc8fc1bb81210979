"""Resume from a commit point, end to end and fast (default suite).

One small real cluster (prefill server = region A, decode server = region B,
WAN relay, broker; separate processes). Region A streams every 64-token
prefill chunk as a segment with a commit point after each
(``--commit_every=1``) and injects two faults into itself:

* chunks of segment 1 of 300-token prompts (``seg:1:64:128:``, a segment only
  prompts over 128 tokens have) are corrupted on the wire every time they are
  sent, so that segment fails the decode side's checksums for good;
* in its third transfer, it dies (``os._exit(137)``, no cleanup, like a
  preempted machine) as soon as the decode side acknowledged the first
  partial commit point.

The test sends: a probe (transfer 1), the corrupted 300-token prompt
(transfer 2: negative control, a commit point past a corrupted chunk is never
used: the request is re-prefilled in full and answered exactly, never from the
broken prefix), then a 100-token prompt (transfer 3: region A dies after
commit point 64; the broker resumes on the decode node from it: token-exact,
36 tokens recomputed instead of 100, the Prometheus counters record it). The
phases share one region A process, so they are one test.

The slow variants (death before any commit point, SIGTERM preemption) are in
``test_resume_serving.py``.
"""

from __future__ import annotations

import json
import time
import urllib.request

import numpy as np
import pytest

from paas_jax.client import BrokerClient
from paas_jax.serving import logprob_check
from paas_jax.serving.launch import ClusterSpec, LocalCluster

CHUNK = 64
KILLED = 100    # segments [0, 64) and [64, 100): region A dies after commit point 64
CORRUPT = 300   # segments 0..4; segment [64, 128) never verifies
FAULTS = ("layer_delay_s=0.1,kill_after_commits=1,kill_on_transfer=3,"
          "corrupt_chunks=100000,corrupt_transfer=^seg:1:64:128:")


def _prompt(n: int, salt: int) -> list[int]:
  return [int(t) for t in np.random.default_rng(900 + salt).integers(1, 256, n)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
  spec = ClusterSpec(n_slots=4, max_queue=8, max_ctx=512, prefill_buckets=(CHUNK,),
                     prefill_max_batch=1, threshold=48, metrics=True,
                     prefill_faults=FAULTS, prefill_args=("--commit_every=1",))
  c = LocalCluster(spec, tmp_path_factory.mktemp("resume_fast")).start()
  yield c
  c.stop()


def _metric(cluster, process: str, name: str) -> float:
  port = cluster.procs[process].info["metrics_port"]
  text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
  return sum(float(line.split()[-1]) for line in text.splitlines()
             if line.startswith(name) and not line.startswith("#"))


def test_region_a_dies_after_a_commit_point_and_the_request_resumes(cluster, reference,
                                                                    ref_model):
  with BrokerClient(cluster.broker_address, timeout_s=120) as client:
    # Transfer 1: a short prompt, once the broker routes to region A.
    deadline = time.monotonic() + 60
    while client.generate(prompt_ids=_prompt(40, 0), max_new_tokens=1,
                          route="remote").route != "prfaas":
      assert time.monotonic() < deadline, "the broker never saw region A healthy"
      time.sleep(0.3)

    # Transfer 2 (negative control): segment 1 is corrupted past the retry
    # limit. Segments 0, 2, 3, 4 verify on the decode side, but no commit point
    # at or past the broken one counts and the failed stream (DATA_LOSS) is not
    # resumed from: the prompt is re-prefilled in full and answered exactly.
    prompt = _prompt(CORRUPT, 1)
    out = client.generate(prompt_ids=prompt, max_new_tokens=6, route="remote",
                          request_id="corrupt-segment")
    assert out.tokens == reference(tuple(prompt), 6)
    s = out.summary
    assert s["route"] == "pdp" and "DATA_LOSS" in json.dumps(s)
    assert s.get("resumed_tokens", 0) == 0
    assert _metric(cluster, "broker", "paas_resume_saved_tokens_total") == 0
    assert cluster.procs["prefill"].popen.poll() is None  # region A still up
    log = (cluster.workdir / "prefill.log").read_text()
    assert "fault: corrupted chunk" in log

    # Transfer 3: region A dies after commit point 64 of 100.
    prompt = _prompt(KILLED, 2)
    out = client.generate(prompt_ids=prompt, max_new_tokens=8, route="remote",
                          request_id="resume-after-commit", logprobs=True, top_logprobs=3)
    assert cluster.procs["prefill"].popen.wait(20) == 137  # region A really died
    assert out.tokens == reference(tuple(prompt), 8)
    # The resumed prefill's first token and the decode steps keep the
    # reference logprobs (#12, logprob_check), one per token.
    cmp = logprob_check.compare(out.logprobs, logprob_check.reference_logprobs(
        ref_model, prompt, out.tokens))
    assert cmp.ok and cmp.steps == 8, cmp
    s = out.summary
    assert s["route"] == "pdp" and "resume:n=" in s["route_reason"]
    assert s["resumed_tokens"] == CHUNK
    assert s["recomputed_tokens"] == KILLED - CHUNK < KILLED
    assert _metric(cluster, "broker", "paas_resume_saved_tokens_total") == CHUNK
    assert _metric(cluster, "broker", "paas_resume_recomputed_tokens_total") == KILLED - CHUNK
    assert _metric(cluster, "broker", "paas_resumed_requests_total") == 1
