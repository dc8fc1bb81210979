"""A prefill pod and a decode slice on the serving path under Ray (#16).

Default suite: the per-process command lines ``ray_pods`` builds from a
supervisor's (pure). Slow: a RayCluster on two region-labelled Ray nodes with
a prefill pod of 2 and a decode slice of 2, each process its own actor in its
region's placement group, serves remote and local requests token-exact; a
pod process killed (its subprocess, then a slice process's actor) restarts
the whole pod (slice) on the same ports and the next request is token-exact;
a slice spread over two nodes with their own addresses takes its parts through
the WAN relay on the TCP data plane.
"""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

from paas_jax.client import BrokerClient, GenerationError
from paas_jax.netem import LinkSpec
from paas_jax.proto import serving_pb2, serving_pb2_grpc
from paas_jax.serving import launch_args, ray_pods
from paas_jax.serving.child_process import LaunchError
from paas_jax.serving.launch import ClusterSpec
from paas_jax.serving.ray_launch import RayCluster, RayPlacement

from tests.serving.ray_nodes import labelled_ray_cluster, process_gone

# -- per-process command lines (default suite) ------------------------------------


def _flags(args):
  return [a for a in args if a.startswith("--")]


def test_pod_process_args_replace_the_supervisors_flags():
  spec = ClusterSpec(prefill_pod=2, prefill_pod_devices=2, prefill_pod_fault="1:prefill")
  args = launch_args.prefill_args(spec, "10.0.0.1") + ["--tls_dir=/c", "--tls_name=prefill"]
  region = ray_pods.region_of(args, max_restarts=4)
  assert (region.kind, region.processes, region.devices, region.fault, region.max_restarts) == (
      "pod", 2, 2, "1:prefill", 4)
  assert not region.own_transfer_ports and not region.own_data_plane_ports
  p0 = ray_pods.process_args(args, region, 0, coordinator="10.0.0.1:7000", host="10.0.0.1",
                             port=5001, transfer_port=5002)
  p1 = ray_pods.process_args(args, region, 1, coordinator="10.0.0.1:7000", host="10.0.0.9",
                             port=5001, transfer_port=None, first=False)
  assert p0[:2] == p1[:2] == ["-m", "paas_jax.serving.pod_prefill_server"]
  for flag in ("--pod_process_id=0", "--pod_coordinator=10.0.0.1:7000", "--port=5001",
               "--transfer_port=5002", "--host=10.0.0.1", "--pod_fault=1:prefill",
               "--pod_processes=2", "--pod_devices=2", "--tls_name=prefill"):
    assert flag in p0, flag
  # Process 1 serves nothing: no control/transfer port; its own host; no fault plan
  # in a restarted pod (a one-shot injection).
  assert "--pod_process_id=1" in p1 and "--host=10.0.0.9" in p1
  assert not [a for a in p1 if a.startswith(("--port=", "--transfer_port=", "--pod_fault"))]
  assert [a for a in p1 if a.startswith("--host=")] == ["--host=10.0.0.9"]  # one, replaced
  assert ray_pods.process_env(region) == {
      "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}


def test_slice_process_args_fix_transfer_and_data_plane_ports():
  spec = ClusterSpec(decode_slice=2, tls=True)
  args = launch_args.decode_args(spec, "10.0.1.1", "127.0.0.3", 0)
  region = ray_pods.region_of(args)
  assert region.kind == "slice" and region.own_transfer_ports and region.own_data_plane_ports
  p1 = ray_pods.process_args(args, region, 1, coordinator="10.0.1.1:7100", host="10.0.1.1",
                             port=0, transfer_port=6001, data_plane_port=6002)
  assert {"--slice_process_id=1", "--transfer_port=6001", "--data_plane_port=6002",
          "--slice_tls_names=decode-slice0,decode-slice1",
          "--data_plane_host=127.0.0.3"} <= set(_flags(p1))
  assert not [a for a in p1 if a.startswith("--port=")]
  grpc_plane = ray_pods.region_of(
      launch_args.decode_args(ClusterSpec(decode_slice=2, transfer_plane="grpc"), "h", None))
  assert grpc_plane.own_transfer_ports and not grpc_plane.own_data_plane_ports


def test_a_slice_spread_over_nodes_binds_its_data_planes_where_the_relay_reaches_them():
  hosts_of = ray_pods.relayed_data_plane_hosts
  # Process 0's node runs the relay: its processes bind the other loopback address;
  # a process on another node binds its own node's address.
  assert hosts_of("decode", ["n0", "n1", "n0"], ["10.0.1.1", "10.0.1.2", "10.0.1.1"],
                  "127.0.0.3") == ["127.0.0.3", "10.0.1.2", "127.0.0.3"]
  assert hosts_of("decode", ["n0", "n1"], ["10.0.1.1", "10.0.1.2"], None) == [None, None]
  # Two nodes with one address: the other node's data plane would take the relay's port.
  with pytest.raises(LaunchError, match="10.0.1.1 of process 0's node"):
    hosts_of("decode", ["n0", "n1"], ["10.0.1.1", "10.0.1.1"], "127.0.0.3")
  args = launch_args.decode_args(ClusterSpec(decode_slice=2), "10.0.1.1", "127.0.0.3", 0)
  region = ray_pods.region_of(args)
  p1 = ray_pods.process_args(args, region, 1, coordinator="10.0.1.1:7100", host="10.0.1.2",
                             port=0, transfer_port=6001, data_plane_port=6002,
                             data_plane_host="10.0.1.2")
  assert [a for a in p1 if a.startswith("--data_plane_host=")] == ["--data_plane_host=10.0.1.2"]


def test_process_args_refuse_what_a_process_cannot_run_with():
  args = launch_args.prefill_args(ClusterSpec(prefill_pod=2), "10.0.0.1")
  region = ray_pods.region_of(args)
  ok = dict(coordinator="10.0.0.1:7000", host="h", port=0, transfer_port=0)
  with pytest.raises(ValueError, match="outside the pod of 2"):
    ray_pods.process_args(args, region, 2, **ok)
  with pytest.raises(ValueError, match="outside"):
    ray_pods.process_args(args, region, -1, **ok)
  for bad in ("10.0.0.1", "10.0.0.1:0", ":7000", "10.0.0.1:port"):
    with pytest.raises(ValueError, match="host:port"):
      ray_pods.process_args(args, region, 0, **dict(ok, coordinator=bad))
  with pytest.raises(ValueError, match="transfer_port is required"):
    ray_pods.process_args(args, region, 0, **dict(ok, transfer_port=None))
  dargs = launch_args.decode_args(ClusterSpec(decode_slice=2), "h", None)
  with pytest.raises(ValueError, match="data_plane_port is required"):
    ray_pods.process_args(dargs, ray_pods.region_of(dargs), 1, **ok)
  # Not a pod's supervisor: a single server, or already one process's line.
  assert ray_pods.region_of(launch_args.prefill_args(ClusterSpec(), "h")) is None
  with pytest.raises(ValueError, match="already one process"):
    ray_pods.region_of(args + ["--pod_process_id=0"])
  with pytest.raises(ValueError, match="must be >= 1"):
    ray_pods.region_of(args + ["--pod_processes=0"])


# -- the serving path on two Ray nodes (slow) -------------------------------------


def _prompt(n: int, salt: int) -> list[int]:
  return [int(t) for t in np.random.default_rng(2600 + salt).integers(1, 256, n)]


def _remote_exact(client, reference, salt: int, deadline_s: float = 240):
  """A remote (PrfaaS) request, token-exact, once the broker routes to region A
  again (its health checks take a restarted pod back)."""
  prompt = _prompt(40, salt)
  deadline = time.monotonic() + deadline_s
  while True:
    try:
      out = client.generate(prompt_ids=prompt, max_new_tokens=6, seed=salt, route="remote",
                            request_id=f"ray-pod-{salt}-{time.monotonic():.1f}")
    except GenerationError as e:
      # A restarted slice is the region's only PD node: until the broker's health
      # checks see it serve again, it has no decode server to offer.
      assert e.code == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline, e
      time.sleep(1.0)
      continue
    assert out.tokens == reference(tuple(prompt), 6, seed=salt)
    if out.route == "prfaas":
      return out
    assert time.monotonic() < deadline, out.summary
    time.sleep(1.0)


@pytest.mark.slow
def test_pod_and_slice_as_actors_on_ray_nodes_restart_as_units(reference, tmp_path):
  spec = ClusterSpec(n_slots=4, max_queue=8, max_ctx=256, prefill_buckets=(64,),
                     prefill_max_batch=1, threshold=16, prefill_pod=2, decode_slice=2,
                     link=LinkSpec(bandwidth_bps=200e6, rtt_s=0.01), tls=True)
  with labelled_ray_cluster() as (_, nodes):  # region_a: 2 CPUs, region_b: 4
    cluster = RayCluster(spec, tmp_path, RayPlacement(address="auto", max_restarts=2))
    try:
      cluster.start()
      pod, slice_ = cluster.procs["prefill"], cluster.procs["decode"]
      for group, region in ((pod, "a"), (slice_, "b")):
        assert isinstance(group, ray_pods.RegionGroup)
        where = group.info["processes"]
        # One actor (and server process) per pod process, all in one placement group.
        assert len(where) == 2 and len({w["actor_pid"] for w in where}) == 2
        assert len({w["pid"] for w in where}) == 2
        assert {w["node_id"] for w in where} == {nodes[region]}
        assert group.info["placement_group"] == cluster.groups[
            "a" if region == "a" else "b-slice"].id.hex()
      assert {cluster.procs[n].info["node_id"] for n in ("relay", "broker")} == {nodes["b"]}
      assert len(slice_.info["slice_transfer"]) == 2
      with BrokerClient(cluster.broker_address, timeout_s=180,
                        credentials=cluster.client_credentials()) as client:
        _remote_exact(client, reference, 0)
        prompt = _prompt(30, 1)  # prefilled on the slice itself
        out = client.generate(prompt_ids=prompt, max_new_tokens=5, seed=1, route="local")
        assert out.route != "prfaas" and out.tokens == reference(tuple(prompt), 5, seed=1)

        # A pod process's server dies: the whole pod restarts, same ports.
        first = pod.info
        pod.kill_process(1)
        again = cluster.wait_restarted("prefill", 400)
        assert again["restarts"] == 1 and again["failures"][0]["process"] == 1
        assert (again["port"], again["transfer_port"]) == (first["port"],
                                                           first["transfer_port"])
        old = {w["actor_pid"] for w in first["processes"]}
        assert not old & {w["actor_pid"] for w in again["processes"]}  # both replaced
        # The survivor was stopped, not left waiting in a collective (one machine here).
        assert all(process_gone(w["pid"]) for w in first["processes"])
        _remote_exact(client, reference, 2)

        # A slice process's actor is killed (a lost machine): the slice restarts whole.
        first = slice_.info
        slice_.kill_process(1, actor=True)
        again = cluster.wait_restarted("decode", 400)
        assert again["restarts"] == 1 and again["failures"][0]["process"] == 1
        assert again["slice_transfer"] == first["slice_transfer"]
        assert again["slice_data_plane_ports"] == first["slice_data_plane_ports"]
        assert all(process_gone(w["pid"]) for w in first["processes"])
        _remote_exact(client, reference, 3)
    finally:
      cluster.stop()
    assert not cluster.groups


@pytest.mark.slow
def test_a_slice_spread_over_two_nodes_takes_its_parts_through_the_relay(reference, tmp_path):
  """A slice of 2 over two region_b nodes with their own addresses (as two
  machines), behind the emulated link on the TCP data plane: the relay, on
  process 0's node, forwards process 1's data plane to process 1's node."""
  spec = ClusterSpec(n_slots=4, max_queue=8, max_ctx=256, prefill_buckets=(64,),
                     prefill_max_batch=1, threshold=16, decode_slice=2, prefill_pod=1,
                     link=LinkSpec(bandwidth_bps=200e6, rtt_s=0.01), tls=True)
  assert spec.transfer_plane == "tcp"
  with labelled_ray_cluster(more={"b": ("127.0.0.22",)}) as (_, nodes):
    cluster = RayCluster(spec, tmp_path, RayPlacement(
        address="auto", max_restarts=0, region_b_slice_strategy="STRICT_SPREAD"))
    try:
      cluster.start()
      slice_ = cluster.procs["decode"]
      where = [w["node_id"] for w in slice_.info["processes"]]
      assert set(where) == {nodes["b"], nodes["b1"]}, where
      relay_node = cluster.procs["relay"].info["node_id"]
      assert where[0] == relay_node
      # Process 1 bound its data plane on its own node's address, process 0 beside
      # the relay on the other loopback address.
      assert slice_.info["slice_data_plane_hosts"][1] == slice_.hosts[1] != slice_.hosts[0]
      assert slice_.info["slice_data_plane_hosts"][0] == "127.0.0.3"
      with BrokerClient(cluster.broker_address, timeout_s=180,
                        credentials=cluster.client_credentials()) as client:
        out = _remote_exact(client, reference, 7)
        assert out.route == "prfaas"
      with cluster.channel("decode") as ch:
        stats = dict(serving_pb2_grpc.DecodeStub(ch).GetStats(serving_pb2.StatsRequest(),
                                                              timeout=30).gauges)
      assert all(stats[f"slice_bytes_in:{q}"] > 0 for q in (0, 1)), stats
      # Both processes' parts crossed the emulated link on their data-plane routes.
      deadline = time.monotonic() + 30
      while not all((cluster.relay_stats() or {}).get("route_bytes", {}).get(r, 0) > 0
                    for r in ("dataplane0", "slicedataplane1")):
        assert time.monotonic() < deadline, cluster.relay_stats()
        time.sleep(0.2)
    finally:
      cluster.stop()
