"""Resume, do not recompute, with real processes: region A (the prefill server)
kills itself (``os._exit(137)``, like a preempted machine) in the middle of a
chunk-streamed prefill; the broker resumes the request on the decode node that
holds the segments (``resume_from``): from the last commit point when there is
one, else a full re-prefill. Tokens equal single-process generation either way,
and the prompt tokens not recomputed are recorded per request and exported as
a Prometheus metric.

A third test sends region A a preemption notice (SIGTERM with a grace period)
instead: it hands the running request over at its commit point.

The prefill server's faults count transfers: transfer 1 is a short probe that
also tells us the broker sees region A healthy; transfer 2 is killed."""

from __future__ import annotations

import signal
import threading
import time
import urllib.request

import numpy as np
import pytest

from paas_jax.client import BrokerClient
from paas_jax.serving.launch import ClusterSpec, LocalCluster

pytestmark = pytest.mark.slow  # processes start, region A dies and restarts

CHUNK = 64
PROMPT = 300  # chunks of 64, commit every 2: commit points 128, 256, 300
SLOW_PREFILL = "layer_delay_s=0.1,kill_on_transfer=2"  # ~0.4 s per chunk


def _prompt(n: int, salt: int) -> list[int]:
  return [int(t) for t in np.random.default_rng(700 + salt).integers(1, 256, n)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
  spec = ClusterSpec(n_slots=4, max_queue=8, max_ctx=512, prefill_buckets=(CHUNK,),
                     prefill_max_batch=1, threshold=48, metrics=True,
                     prefill_faults=f"kill_after_commits=1,{SLOW_PREFILL}")
  c = LocalCluster(spec, tmp_path_factory.mktemp("resume_cluster")).start()
  yield c
  c.stop()


@pytest.fixture(scope="module")
def client(cluster):
  with BrokerClient(cluster.broker_address, timeout_s=120) as c:
    yield c


def _probe_region_a(client, salt: int) -> None:
  """Transfer 1 of the prefill process; returns once the broker routes to it."""
  deadline = time.monotonic() + 30
  while True:
    out = client.generate(prompt_ids=_prompt(60, salt), max_new_tokens=1, route="remote")
    if out.route == "prfaas":
      return
    assert time.monotonic() < deadline, "the broker never saw region A healthy"
    time.sleep(0.3)


def _broker_metric(cluster, name: str) -> float:
  port = cluster.procs["broker"].info["metrics_port"]
  text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
  return sum(float(line.split()[-1]) for line in text.splitlines()
             if line.startswith(name) and not line.startswith("#"))


def test_killed_after_a_commit_point_resumes_from_it(cluster, client, reference):
  _probe_region_a(client, 1)
  prompt = _prompt(PROMPT, 2)
  out = client.generate(prompt_ids=prompt, max_new_tokens=8, route="remote",
                        request_id="resume-after-commit")
  assert cluster.procs["prefill"].popen.wait(20) == 137  # region A really died
  assert out.tokens == reference(tuple(prompt), 8)
  s = out.summary
  assert s["route"] == "pdp" and "resume:n=" in s["route_reason"]
  # Resumed from a commit point: a chunk boundary past the first commit, and
  # fewer prompt tokens recomputed than the prompt.
  assert s["resumed_tokens"] >= 2 * CHUNK and s["resumed_tokens"] % CHUNK == 0
  assert s["recomputed_tokens"] == PROMPT - s["resumed_tokens"] < PROMPT
  assert _broker_metric(cluster, "paas_resume_saved_tokens_total") >= s["resumed_tokens"]
  assert _broker_metric(cluster, "paas_resumed_requests_total") >= 1


def test_killed_before_any_commit_point_reprefills_in_full(cluster, client, reference):
  cluster.restart("prefill", drop_prefix="--faults",
                  extra_args=[f"--faults=kill_after_layers=2,{SLOW_PREFILL}"])
  _probe_region_a(client, 3)
  prompt = _prompt(PROMPT, 4)
  out = client.generate(prompt_ids=prompt, max_new_tokens=8, route="remote",
                        request_id="resume-before-commit")
  assert cluster.procs["prefill"].popen.wait(20) == 137
  assert out.tokens == reference(tuple(prompt), 8)
  s = out.summary
  assert s["route"] == "pdp"
  assert s.get("resumed_tokens", 0) == 0
  assert s["recomputed_tokens"] == PROMPT


def test_preempted_prefill_hands_its_request_over_to_resume(cluster, client, reference):
  """SIGTERM with a grace period (a preemption notice): region A stops taking
  work, lets the running prefill commit for the grace period, then ends its
  stream at the commit point; the broker resumes from it."""
  cluster.restart("prefill", drop_prefix="--faults",
                  extra_args=["--faults=layer_delay_s=0.1", "--preempt_grace_s=0.2"])
  _probe_region_a(client, 5)
  prompt = _prompt(PROMPT, 6)
  result = {}
  worker = threading.Thread(target=lambda: result.update(out=client.generate(
      prompt_ids=prompt, max_new_tokens=8, route="remote", request_id="preempted")))
  worker.start()
  deadline = time.monotonic() + 60
  while True:  # a commit point reached the broker: preempt now
    inflight = [r for r in client.stats().get("inflight", [])
                if r["request_id"] == "preempted"]
    if inflight and inflight[0]["commit_point"] > 0:
      break
    assert time.monotonic() < deadline and worker.is_alive(), "no commit point seen"
    time.sleep(0.05)
  cluster.procs["prefill"].popen.send_signal(signal.SIGTERM)
  worker.join(120)
  assert cluster.procs["prefill"].popen.wait(20) == 0  # a clean exit after the hand-over
  out = result["out"]
  assert out.tokens == reference(tuple(prompt), 8)
  s = out.summary
  assert s["route"] == "pdp" and s["resumed_tokens"] >= 2 * CHUNK
  assert s["recomputed_tokens"] == PROMPT - s["resumed_tokens"] < PROMPT
  log = (cluster.workdir / "prefill.log").read_text()
  assert "preempted" in log and "handed_over=1" in log
