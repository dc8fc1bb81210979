"""Region B as a decode slice on the real serving path (#16).

A real cluster: region A a prefill pod of two processes (TP=2 over gloo),
region B a decode slice of two processes (its own TP=2 mesh), and the broker,
with mutual TLS between them (each slice process its own certificate).
The broker learns the slice from its GetModel (each process's transfer
address) and asks the pod for per-process parts; each pod process streams to
each slice process only the shard bytes that process needs, the slice
restores them in place, checks the handoff probe and decodes in lockstep,
continuously batched. Tokens and logprobs are compared with single-process
generation, for offloaded (PrfaaS) and local (prefilled on the slice)
requests, one at a time and sharing the batch.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time

import grpc
import numpy as np
import pytest

from paas_jax.client import BrokerClient, GenerationError
from paas_jax.netem import LinkSpec
from paas_jax.proto import serving_pb2, serving_pb2_grpc
from paas_jax.serving.launch import ClusterSpec, LocalCluster
from tests.serving.conftest import relay_stats_reaching
from tests.serving.test_pod_serving import _stats, _wait_remote


def _prompt(n: int, salt: int) -> list[int]:
  return [int(t) for t in np.random.default_rng(1700 + salt).integers(1, 256, n)]


def _idle_stats(cluster, name: str, stub) -> dict:
  """GetStats once the node has no job running or waiting: a job's counters
  land after its client has the last token (the other processes report then)."""
  deadline = time.monotonic() + 30
  while (s := _stats(cluster, name, stub)).get("busy", 0) or s.get("queue", 0):
    assert time.monotonic() < deadline, s
    time.sleep(0.1)
  return s


def _wait_slice_back(client, deadline_s: float = 180) -> None:
  """Until the broker's health checks take a restarted slice back and it routes
  to region A again (UNAVAILABLE meanwhile)."""
  deadline = time.monotonic() + deadline_s
  while True:
    try:
      _wait_remote(client, deadline_s)
      return
    except GenerationError as e:
      assert e.code == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline, e
      time.sleep(0.5)


@pytest.fixture(scope="module")
def slice_cluster(tmp_path_factory):
  spec = ClusterSpec(n_slots=4, max_queue=8, max_ctx=256, prefill_buckets=(64,),
                     prefill_max_batch=1, threshold=16, prefill_pod=2, decode_slice=2,
                     link=LinkSpec(bandwidth_bps=200e6, rtt_s=0.01), tls=True)
  c = LocalCluster(spec, tmp_path_factory.mktemp("slice_serving")).start()
  yield c
  c.stop()


# In the default suite (~1 min): the only run of a decode slice behind a broker.
def test_a_pod_streams_to_a_decode_slice_shard_to_shard_token_and_logprob_exact(
    slice_cluster, reference, assert_logprobs):
  cluster = slice_cluster
  info = cluster.procs["decode"].info
  assert info["slice"]["num_processes"] == 2 and len(info["slice_transfer"]) == 2
  with cluster.channel("decode") as ch:
    served = serving_pb2_grpc.DecodeStub(ch).GetModel(serving_pb2.ModelRequest(), timeout=30)
  assert list(served.slice.transfer_targets) == info["slice_transfer"]
  # Mutual TLS (#16): process 0 takes Decode calls from brokers only
  # (test_slice_tls.py has the other negative controls).
  with cluster.channel("decode", as_role="prefill") as ch, pytest.raises(grpc.RpcError) as e:
    list(serving_pb2_grpc.DecodeStub(ch).Decode(serving_pb2.DecodeRequest(
        request_id="not-a-broker", prompt_ids=[1, 2], max_new_tokens=1), timeout=30))
  assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
  with BrokerClient(cluster.broker_address, timeout_s=120,
                    credentials=cluster.client_credentials()) as client:
    _wait_remote(client)
    before = _idle_stats(cluster, "decode", serving_pb2_grpc.DecodeStub)
    pod_before = _stats(cluster, "prefill", serving_pb2_grpc.PrefillStub)
    for i, (n, temperature) in enumerate([(40, 0.0), (70, 0.8)]):
      prompt = _prompt(n, i)
      out = client.generate(prompt_ids=prompt, max_new_tokens=6, route="remote",
                            request_id=f"slice-{i}", logprobs=True, top_logprobs=2,
                            temperature=temperature, seed=7)
      assert out.route == "prfaas", out.summary
      assert out.tokens == reference(tuple(prompt), 6, temperature, 0, 1.0, 7)
      assert_logprobs(prompt, out)
    # Prefilled on the slice itself (the broker's local route).
    prompt = _prompt(12, 9)
    out = client.generate(prompt_ids=prompt, max_new_tokens=5, route="local",
                          request_id="slice-local", logprobs=True)
    assert out.route != "prfaas", out.summary
    assert out.tokens == reference(tuple(prompt), 5)
    assert_logprobs(prompt, out)
    # Concurrent requests share the slice's batch, each token-exact.
    jobs = [(_prompt(30 + 9 * i, 30 + i), route, temperature)
            for i, (route, temperature) in enumerate([("local", 0.0), ("local", 0.7),
                                                      ("remote", 0.0)])]

    def run(i):
      prompt, route, temperature = jobs[i]
      return client.generate(prompt_ids=prompt, max_new_tokens=12, route=route,
                             request_id=f"slice-batch-{i}", temperature=temperature, seed=3)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
      outs = list(pool.map(run, range(3)))
    for (prompt, _, temperature), out in zip(jobs, outs):
      assert out.tokens == reference(tuple(prompt), 12, temperature, 0, 1.0, 3), out.summary
  after = _idle_stats(cluster, "decode", serving_pb2_grpc.DecodeStub)
  pod_after = _stats(cluster, "prefill", serving_pb2_grpc.PrefillStub)
  assert after["slice_processes"] == 2 and after["slice_tp"] == 2
  assert after["jobs_done"] - before.get("jobs_done", 0) == 6
  assert after["max_batch"] >= 2 and after["slots_total"] == 4, after
  assert after.get("jobs_failed", 0) == 0 and after["slice_parts_pending"] == 0
  # Shard to shard: each slice process received its own part from each pod
  # process (heads split, replicated leaves to both), never the whole state
  # through one of them; the pod's processes each sent theirs.
  got = [after[f"slice_bytes_in:{q}"] - before.get(f"slice_bytes_in:{q}", 0) for q in (0, 1)]
  assert all(b > 0 for b in got), got
  sent = [pod_after[f"pod_bytes_sent:{p}"] - pod_before.get(f"pod_bytes_sent:{p}", 0)
          for p in (0, 1)]
  assert all(b > 0 for b in sent), sent
  total = sum(sent)
  assert max(got) < total and sum(got) <= total, (got, sent)
  # The parts crossed the emulated link (a relay route per slice process).
  relay = relay_stats_reaching(cluster.relay_stats, sum(got))
  # ... on the TCP data plane: the relay forwards every slice process's data plane.
  assert relay["route_bytes"].get("dataplane0", 0) > 0, relay["route_bytes"]
  assert relay["route_bytes"].get("slicedataplane1", 0) > 0, relay["route_bytes"]


@pytest.mark.slow  # the slice restarts (both processes start and compile again)
def test_a_lost_slice_process_restarts_the_slice_on_the_same_ports(slice_cluster, reference):
  cluster = slice_cluster
  ready = cluster.procs["decode"].ready_file
  first = json.loads(ready.read_text())
  os.kill(first["pod_pids"][1], signal.SIGKILL)
  deadline = time.monotonic() + 180
  while json.loads(ready.read_text()).get("incarnation", 0) < 1:
    assert time.monotonic() < deadline, "the slice did not restart"
    time.sleep(0.5)
  again = json.loads(ready.read_text())
  assert again["restarts"][0]["process"] == 1
  assert not set(again["pod_pids"]) & set(first["pod_pids"])
  # Where the broker and the pod reach it did not move: the same addresses serve.
  assert again["port"] == first["port"] and again["slice_transfer"] == first["slice_transfer"]
  assert again["slice_data_plane_ports"] == first["slice_data_plane_ports"]  # relay routes
  with BrokerClient(cluster.broker_address, timeout_s=180,
                    credentials=cluster.client_credentials()) as client:
    _wait_slice_back(client)
    prompt = _prompt(50, 20)
    before = cluster.relay_stats()["route_bytes"].get("slicedataplane1", 0)
    out = client.generate(prompt_ids=prompt, max_new_tokens=6, route="remote",
                          request_id="slice-after-restart")
    assert out.route == "prfaas", out.summary
    assert out.tokens == reference(tuple(prompt), 6)
  # The restarted processes' data planes are where the relay's routes lead.
  deadline = time.monotonic() + 20
  while cluster.relay_stats()["route_bytes"].get("slicedataplane1", 0) <= before:
    assert time.monotonic() < deadline, cluster.relay_stats()["route_bytes"]
    time.sleep(0.2)


@pytest.mark.slow  # its own cluster (a one-process pod and a slice start and compile)
def test_region_a_of_one_process_feeds_a_slice_token_exact(tmp_path, reference):
  """P=1 -> Q=2 on the serving path: region A of one process runs as a pod of
  one (launch_args.prefill_args) and streams each slice process its shards."""
  spec = ClusterSpec(n_slots=2, max_queue=8, max_ctx=256, prefill_buckets=(64,),
                     prefill_max_batch=1, threshold=16, decode_slice=2, prefix_block=0)
  cluster = LocalCluster(spec, tmp_path).start()
  try:
    assert "paas_jax.serving.pod_prefill_server" in cluster.procs["prefill"].args
    with BrokerClient(cluster.broker_address, timeout_s=120,
                      credentials=cluster.client_credentials()) as client:
      _wait_remote(client)
      prompt = _prompt(45, 40)
      out = client.generate(prompt_ids=prompt, max_new_tokens=6, route="remote",
                            request_id="one-to-slice", temperature=0.8, seed=5)
      assert out.route == "prfaas", out.summary
      assert out.tokens == reference(tuple(prompt), 6, 0.8, 0, 1.0, 5)
    stats = _idle_stats(cluster, "decode", serving_pb2_grpc.DecodeStub)
    assert all(stats[f"slice_bytes_in:{q}"] > 0 for q in (0, 1)), stats
  finally:
    cluster.stop()


@pytest.mark.slow  # its own cluster: a pod, two slices, two relays and two brokers
def test_two_decode_regions_each_a_slice_share_region_a_token_exact(tmp_path, reference):
  """Regions B and C each run a decode slice behind their own relay and broker,
  and share region A's pod: offloaded and local requests through each broker
  are token-exact, and each region's slice decoded its own (its bytes in)."""
  spec = ClusterSpec(n_slots=4, max_queue=8, max_ctx=256, prefill_buckets=(64,),
                     prefill_max_batch=1, threshold=16, prefill_pod=2, decode_slice=2,
                     decode_regions=2, link=LinkSpec(bandwidth_bps=200e6, rtt_s=0.01))
  cluster = LocalCluster(spec, tmp_path).start()
  try:
    assert set(cluster.broker_addresses) == {"b", "c"}
    for k, (region, address) in enumerate(sorted(cluster.broker_addresses.items())):
      name = cluster.pd_names_of(region)[0]
      assert "paas_jax.serving.slice_decode_server" in cluster.procs[name].args
      with BrokerClient(address, timeout_s=180) as client:
        _wait_remote(client)
        before = _idle_stats(cluster, name, serving_pb2_grpc.DecodeStub)
        for i, (n, route) in enumerate([(40, "remote"), (12, "local")]):
          prompt = _prompt(n, 60 + 10 * k + i)
          out = client.generate(prompt_ids=prompt, max_new_tokens=6, route=route,
                                request_id=f"{region}-{route}")
          assert (out.route == "prfaas") == (route == "remote"), out.summary
          assert out.tokens == reference(tuple(prompt), 6), (region, route)
        after = _idle_stats(cluster, name, serving_pb2_grpc.DecodeStub)
        assert after["jobs_done"] - before.get("jobs_done", 0) >= 2, (region, after)
        assert all(after[f"slice_bytes_in:{q}"] > before.get(f"slice_bytes_in:{q}", 0)
                   for q in (0, 1)), (region, after)
  finally:
    cluster.stop()


@pytest.mark.slow  # its own cluster (a pod and a slice start and compile)
def test_states_damaged_on_a_slice_are_caught_and_reprefilled(tmp_path, reference):
  """``decode_faults="corrupt_states=2"`` on a slice: its processes damage the
  first two received states after the transport verified them; the handoff
  probe catches each (DATA_LOSS, before any token past the first) and the
  broker prefills those requests again, so every client still gets the
  reference tokens. The slice counts both mismatches."""
  spec = ClusterSpec(n_slots=4, max_queue=8, max_ctx=256, prefill_buckets=(64,),
                     prefill_max_batch=1, threshold=16, prefill_pod=2, decode_slice=2,
                     decode_faults="corrupt_states=2")
  cluster = LocalCluster(spec, tmp_path).start()
  try:
    with BrokerClient(cluster.broker_address, timeout_s=180) as client:
      outs = []
      for i in range(3):
        prompt = _prompt(40 + 5 * i, 80 + i)
        out = client.generate(prompt_ids=prompt, max_new_tokens=6, route="auto",
                              request_id=f"damaged-{i}")
        assert out.tokens == reference(tuple(prompt), 6), (i, out.summary)
        outs.append(out)
    stats = _idle_stats(cluster, "decode", serving_pb2_grpc.DecodeStub)
    assert stats["handoff_probe_mismatch"] == 2 and stats["handoff_probe_ok"] >= 1, stats
  finally:
    cluster.stop()


@pytest.mark.slow  # its own cluster (a pod and a slice start and compile)
def test_a_flaky_wan_in_front_of_a_slice_cuts_every_process_and_requests_survive(
    tmp_path, reference):
  """``flaky_wan`` with a slice: one link (``FlakyLinks``) fronts each slice
  process's transfer port, and the broker's entry for the slice lists those
  addresses. Up, a remote request's parts cross every process's link; cut,
  region A's transfer fails and the broker prefills the request again on the
  slice itself, token-exact; back up, requests offload again."""
  spec = ClusterSpec(n_slots=4, max_queue=8, max_ctx=256, prefill_buckets=(64,),
                     prefill_max_batch=1, threshold=16, prefill_pod=2, decode_slice=2,
                     flaky_wan=True)
  cluster = LocalCluster(spec, tmp_path).start()
  try:
    links = cluster.wan.links
    assert len(links) == 2 and {link.target for link in links} == {
        f"127.0.0.1:{a.rsplit(':', 1)[1]}" for a in cluster.procs["decode"].info["slice_transfer"]}
    with BrokerClient(cluster.broker_address, timeout_s=180) as client:
      _wait_remote(client)
      prompt = _prompt(40, 90)
      out = client.generate(prompt_ids=prompt, max_new_tokens=6, route="remote",
                            request_id="over-the-wan")
      assert out.route == "prfaas" and out.tokens == reference(tuple(prompt), 6), out.summary
      assert all(link.bytes > 0 for link in links), [link.bytes for link in links]
      cluster.wan.down()
      prompt = _prompt(44, 91)
      out = client.generate(prompt_ids=prompt, max_new_tokens=6, route="auto",
                            request_id="while-cut")
      assert out.route != "prfaas" and out.tokens == reference(tuple(prompt), 6), out.summary
      assert sum(link.refused + link.resets for link in links) > 0
      cluster.wan.up()
      _wait_remote(client)
  finally:
    cluster.stop()


@pytest.mark.slow  # its own cluster, and the slice starts twice
def test_a_killed_slice_supervisor_restarts_on_every_old_port(tmp_path, reference):
  """The demo's kill_decode against a slice: SIGKILL the slice's supervisor
  (its processes die with it) and start it again (``LocalCluster.restart``).
  Every process's transfer and data-plane port is the old one, so the
  broker's entry, the pod and the relay's routes still reach it, and a
  remote request is token-exact again."""
  spec = ClusterSpec(n_slots=4, max_queue=8, max_ctx=256, prefill_buckets=(64,),
                     prefill_max_batch=1, threshold=16, prefill_pod=2, decode_slice=2,
                     link=LinkSpec(bandwidth_bps=200e6, rtt_s=0.01))
  cluster = LocalCluster(spec, tmp_path).start()
  try:
    first = dict(cluster.procs["decode"].info)
    assert cluster.kill("decode") == -signal.SIGKILL
    cluster.restart("decode")
    again = cluster.procs["decode"].info
    assert not set(again["pod_pids"]) & set(first["pod_pids"])
    for key in ("port", "transfer_port", "slice_transfer", "slice_data_plane_ports"):
      assert again[key] == first[key], key
    with BrokerClient(cluster.broker_address, timeout_s=180) as client:
      _wait_slice_back(client)
      prompt = _prompt(50, 95)
      out = client.generate(prompt_ids=prompt, max_new_tokens=6, route="remote",
                            request_id="after-supervisor-restart")
      assert out.route == "prfaas" and out.tokens == reference(tuple(prompt), 6), out.summary
    stats = _idle_stats(cluster, "decode", serving_pb2_grpc.DecodeStub)
    assert all(stats[f"slice_bytes_in:{q}"] > 0 for q in (0, 1)), stats
  finally:
    cluster.stop()
