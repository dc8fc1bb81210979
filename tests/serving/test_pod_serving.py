"""Region A as a prefill pod on the real serving path (#16).

A real cluster whose region A is a pod of two processes (one JAX program,
jax.distributed over gloo; the tiny hybrid's GDN and attention heads split
TP=2 over the two processes), region B one decode server (Q = 1), and the
broker. Requests come through the broker; the pod's process 0 fronts the
Prefill service, both processes prefill in lockstep and each streams only its
own shards to the decode server, which restores the state once both parts
arrived. Tokens and logprobs are compared with single-process generation.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from paas_jax.client import BrokerClient
from paas_jax.proto import serving_pb2, serving_pb2_grpc
from paas_jax.serving.launch import ClusterSpec, LocalCluster


def _prompt(n: int, salt: int) -> list[int]:
  return [int(t) for t in np.random.default_rng(1600 + salt).integers(1, 256, n)]


def _stats(cluster, name: str, stub) -> dict:
  with cluster.channel(name) as ch:
    return dict(stub(ch).GetStats(serving_pb2.StatsRequest(), timeout=30).gauges)


def _wait_remote(client, deadline_s: float = 90) -> None:
  """Until the broker routes to region A (its health checks saw the pod)."""
  deadline = time.monotonic() + deadline_s
  while client.generate(prompt_ids=_prompt(24, 99), max_new_tokens=1,
                        route="remote").route != "prfaas":
    assert time.monotonic() < deadline, "the broker never saw the prefill pod healthy"
    time.sleep(0.3)


@pytest.fixture(scope="module")
def pod_cluster(tmp_path_factory):
  spec = ClusterSpec(n_slots=4, max_queue=8, max_ctx=256, prefill_buckets=(64,),
                     prefill_max_batch=1, threshold=16, prefill_pod=2)
  c = LocalCluster(spec, tmp_path_factory.mktemp("pod_serving")).start()
  yield c
  c.stop()


@pytest.mark.slow  # ~2 min at load 7: a two-process pod, a decode server and a broker start
def test_a_pod_prefills_through_the_broker_token_and_logprob_exact(pod_cluster, reference,
                                                                  assert_logprobs):
  cluster = pod_cluster
  info = cluster.procs["prefill"].info
  assert info["pod"]["num_processes"] == 2 and len(info["pod_pids"]) == 2
  with BrokerClient(cluster.broker_address, timeout_s=120) as client:
    _wait_remote(client)
    before = _stats(cluster, "prefill", serving_pb2_grpc.PrefillStub)
    prompts = [_prompt(40, 0), _prompt(70, 1)]
    for i, prompt in enumerate(prompts):
      out = client.generate(prompt_ids=prompt, max_new_tokens=6, route="remote",
                            request_id=f"pod-{i}", logprobs=True, top_logprobs=2,
                            temperature=0.0 if i == 0 else 0.8, seed=7)
      assert out.route == "prfaas", out.summary
      want = reference(tuple(prompt), 6, 0.0 if i == 0 else 0.8, 0, 1.0, 7)
      assert out.tokens == want
      assert_logprobs(prompt, out)
  after = _stats(cluster, "prefill", serving_pb2_grpc.PrefillStub)
  decode = _stats(cluster, "decode", serving_pb2_grpc.DecodeStub)
  assert after["pod_processes"] == 2 and after["pod_tp"] == 2
  assert after["transfers_ok"] - before.get("transfers_ok", 0) == 2
  # Shard to shard: each pod process sent its own part (process 1 holds half
  # of the split heads, process 0 the other half plus the replicated leaves),
  # never the whole state through one process.
  sent = [after[f"pod_bytes_sent:{p}"] - before.get(f"pod_bytes_sent:{p}", 0) for p in (0, 1)]
  assert all(b > 0 for b in sent), sent
  assert sent[1] < sent[0] < sum(sent), sent
  assert decode["pod_states_in"] >= 3 and decode["pod_parts_in"] == 2 * decode["pod_states_in"]
  assert decode["pod_parts_pending"] == 0 and decode["pod_states_refused"] == 0
  assert decode["handoff_probe_ok"] >= 3, decode


@pytest.fixture(scope="module", params=["prefill", "transfer"])
def faulty_pod_cluster(tmp_path_factory, request):
  # Pod process 1 exits in the middle of the pod's second request (the first
  # one shows the broker routes to the pod): before its part of the prefill
  # program, or once the manifests are merged, before it sends its shards
  # (process 0 may have sent its own part by then).
  spec = ClusterSpec(n_slots=4, max_queue=8, max_ctx=256, prefill_buckets=(64,),
                     prefill_max_batch=1, threshold=16, prefill_pod=2,
                     prefill_pod_fault=f"1:{request.param}:2")
  c = LocalCluster(spec, tmp_path_factory.mktemp("pod_fault_serving")).start()
  yield c
  c.stop()


def _ready(cluster) -> dict:
  return json.loads(cluster.procs["prefill"].ready_file.read_text())


@pytest.mark.slow  # ~2 min each at load 7: the pod starts twice
def test_a_pod_process_lost_mid_request_fails_cleanly_and_the_pod_restarts(
    faulty_pod_cluster, reference, assert_logprobs):
  cluster = faulty_pod_cluster
  first = _ready(cluster)
  assert first["incarnation"] == 0
  with BrokerClient(cluster.broker_address, timeout_s=180) as client:
    _wait_remote(client)
    decode_before = _stats(cluster, "decode", serving_pb2_grpc.DecodeStub)
    # The pod's second request: process 1 dies mid-request. The supervisor stops
    # process 0 too, the broker's Prefill stream breaks (UNAVAILABLE) and the
    # request is prefilled again in region B (PD-P): token- and logprob-exact.
    prompt = _prompt(50, 2)
    out = client.generate(prompt_ids=prompt, max_new_tokens=6, route="remote",
                          request_id="pod-fault", logprobs=True, top_logprobs=2)
    assert out.tokens == reference(tuple(prompt), 6)
    assert_logprobs(prompt, out)
    s = out.summary
    assert s["route"] == "pdp" and "UNAVAILABLE" in json.dumps(s), s
    # Nothing of the failed attempt reached decode as a state.
    decode = _stats(cluster, "decode", serving_pb2_grpc.DecodeStub)
    assert decode["pod_states_in"] == decode_before["pod_states_in"]
    assert decode["pod_states_refused"] == 0
    # The pod restarted as a unit: both processes are new.
    deadline = time.monotonic() + 180
    while _ready(cluster)["incarnation"] < 1:
      assert time.monotonic() < deadline, "the pod did not restart"
      time.sleep(0.5)
    again = _ready(cluster)
    assert again["restarts"][0]["process"] == 1 and again["restarts"][0]["returncode"] == 75
    assert not set(again["pod_pids"]) & set(first["pod_pids"])
    assert again["port"] == first["port"]
    for pid in first["pod_pids"]:
      with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    # The restarted pod serves again, exactly.
    _wait_remote(client, 180)
    prompt = _prompt(60, 3)
    out = client.generate(prompt_ids=prompt, max_new_tokens=6, route="remote",
                          request_id="pod-after-restart", logprobs=True)
    assert out.route == "prfaas", out.summary
    assert out.tokens == reference(tuple(prompt), 6)
    assert_logprobs(prompt, out)
