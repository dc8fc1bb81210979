"""Several decode slices in one decode region (#16: ``ClusterSpec.slice_nodes``).

Unit part: the launcher gives each slice its own names, routes and broker
entry (``launch_args``, ``launch_routes``) and refuses what cannot run; the
real broker in front of fake region stubs (test_slice_pd_nodes) with two
slices: both ``both``, no whole state into either, each remote request's parts
to its own slice's processes only.

Cluster part (slow): region A a pod of two processes, region B two slices of
two processes ("decode", "decode1") behind one broker, relay and TLS; remote
requests land on both slices, token-exact. The same cluster under Ray, on two
region-labelled Ray nodes: each slice in its own placement group.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from paas_jax.client import BrokerClient
from paas_jax.models import load_config
from paas_jax.netem import LinkSpec
from paas_jax.proto import serving_pb2, serving_pb2_grpc
from paas_jax.serving import broker as broker_lib
from paas_jax.serving import launch_args, launch_routes, pd_roles, ray_pods
from paas_jax.serving.child_process import LaunchError
from paas_jax.serving.launch import ClusterSpec, LocalCluster
from paas_jax.serving.node_pool import DecodeTarget, NodeKind
from paas_jax.serving.ray_launch import RayCluster, RayPlacement
from paas_jax.serving.routing import StaticThresholdPolicy
from tests.serving.ray_nodes import labelled_ray_cluster
from tests.serving.test_pod_serving import _wait_remote
from tests.serving.test_slice_pd_nodes import _context, _Region, serve_in_pairs
from tests.serving.test_slice_serving import _idle_stats

TWO = ClusterSpec(prefill_pod=2, decode_slice=2, pd_nodes=2, slice_nodes=2, tls=True)


# -- launcher: per-node names, routes, entries and refusals ----------------------


def test_each_slice_node_gets_its_own_shape_module_and_certificates():
  spec = dataclasses.replace(TWO, pd_nodes=3)
  launch_args.check_decode_slice(spec)
  assert launch_args.pd_node_shapes(spec) == [pd_roles.SLICE, pd_roles.SLICE, pd_roles.SINGLE]
  args = [launch_args.decode_args(spec, "127.0.0.1", None, n) for n in range(3)]
  assert [a[1] for a in args] == ["paas_jax.serving.slice_decode_server"] * 2 + [
      "paas_jax.serving.decode_server"]
  # Node 0 keeps its names of before; node 1's differ, and both match "decode*".
  assert "--slice_tls_names=decode-slice0,decode-slice1" in args[0]
  assert "--slice_tls_names=decode1-slice0,decode1-slice1" in args[1]
  assert not any(a.startswith("--slice_") for a in args[2])
  names = launch_args.all_slice_tls_names(spec)
  assert len(set(names)) == 4 and all(n.startswith("decode") for n in names)
  # Negative: with the default slice_nodes=1 node 1 is a single decode server.
  one = dataclasses.replace(spec, slice_nodes=1)
  assert launch_args.decode_args(one, "127.0.0.1", None, 1)[1] == "paas_jax.serving.decode_server"
  assert launch_args.slice_tls_names(one, 1) == []
  assert launch_args.all_slice_tls_names(one) == ["decode-slice0", "decode-slice1"]


@pytest.mark.parametrize("change,match", [
    ({"slice_nodes": 3}, "slice_nodes=3 slices need as many PD nodes: pd_nodes=2"),
    ({"decode_slice": 1}, "slice_nodes=2 needs decode_slice > 1"),
    ({"slice_nodes": 0}, "slice_nodes must be >= 1"),
    # No single node is left to take a PD-P role.
    ({"pd_prefill_nodes": 1}, "all 2 PD nodes are decode slices"),
])
def test_slice_nodes_that_cannot_run_are_refused_naming_the_flag(change, match):
  launch_args.check_decode_slice(TWO)  # the positive case beside each refusal
  with pytest.raises(ValueError, match=match):
    launch_args.check_decode_slice(dataclasses.replace(TWO, **change))
  with pytest.raises(LaunchError, match=match):  # before any process starts
    LocalCluster(dataclasses.replace(TWO, **change)).start()


def test_on_ray_each_slice_node_has_its_own_placement_group():
  layout = ray_pods.layout_of(dataclasses.replace(TWO, pd_nodes=3))
  assert (layout.pod, layout.slice, layout.slices) == (2, 2, 2)
  assert ray_pods.layout_of(dataclasses.replace(TWO, decode_slice=1, slice_nodes=1)).slices == 0
  assert [ray_pods.slice_group(ray_pods.slice_node_of(n)) for n in ("decode", "decode1",
                                                                    "decode12")] == [
      "b-slice", "b-slice1", "b-slice12"]
  for bad in ("prefill", "decodex", "decode-1"):
    with pytest.raises(ValueError, match="not a PD node's name"):
      ray_pods.slice_node_of(bad)


def _ready(q_ports, node):
  """A slice node's ready info: process 0 on q_ports[0], the others after."""
  return {"transfer_port": q_ports[0], "data_plane_port": 9000 + 10 * node,
          "slice_transfer": [f"127.0.0.1:{p}" for p in q_ports],
          "slice_data_plane_ports": [9000 + 10 * node + q for q in range(len(q_ports))]}


def test_every_slice_process_gets_its_own_relay_route_and_broker_address():
  shapes = [pd_roles.SLICE, pd_roles.SLICE, pd_roles.SINGLE]
  info = [_ready([7000, 7001], 0), _ready([7100, 7101], 1),
          {"transfer_port": 7200, "data_plane_port": 9020}]
  local = [f"127.0.0.1:{d['transfer_port']}" for d in info]
  routes = launch_routes.relay_routes(
      shapes, info, dial="10.0.0.2", local="127.0.0.1", transfer_target=local[0],
      control_target="a:1", prefix_target="a:2", local_transfer=local, tcp=True,
      data_plane_host="127.0.0.3")
  by_name = dict(r.split("=", 1) for r in routes)
  assert by_name["slice1"] == "10.0.0.2:0->127.0.0.1:7001@a_to_b"  # node 0: names of before
  assert by_name["slicedataplane1"] == "10.0.0.2:9001->127.0.0.3:9001@a_to_b"
  assert by_name["node1slice1"] == "10.0.0.2:0->127.0.0.1:7101@a_to_b"
  assert by_name["node1slicedataplane1"] == "10.0.0.2:9011->127.0.0.3:9011@a_to_b"
  assert by_name["transfer1"] == "10.0.0.2:0->127.0.0.1:7100@a_to_b"
  assert by_name["dataplane1"] == "10.0.0.2:9010->127.0.0.3:9010@a_to_b"
  assert not any(n.startswith("node2") for n in by_name)  # node 2 is one process
  # Every StateTransfer port and data plane has its own route.
  targets = [r.split("->")[1] for r in routes]
  assert len(set(targets)) == len(targets)
  # On the gRPC plane no data plane is forwarded.
  grpc_routes = launch_routes.relay_routes(
      shapes, info, dial="10.0.0.2", local="127.0.0.1", transfer_target=local[0],
      control_target="a:1", prefix_target="a:2", local_transfer=local, tcp=False,
      data_plane_host="127.0.0.3")
  assert not any("dataplane" in r for r in grpc_routes)
  # The broker's entries: each slice lists its own processes, node 2 one address.
  assert launch_routes.direct_entries(shapes, info, local[0], local) == [
      "127.0.0.1:7000+127.0.0.1:7001", "127.0.0.1:7100+127.0.0.1:7101", "127.0.0.1:7200"]
  ports = {"transfer": 1, "transfer1": 2, "transfer2": 3, "slice1": 4, "node1slice1": 5}
  assert launch_routes.relayed_entries(shapes, info, ports, "r") == ["r:1+r:4", "r:2+r:5", "r:3"]
  # Negative: node 1 taken for a single node announces no parts of its own.
  flat = [pd_roles.SLICE, pd_roles.SINGLE, pd_roles.SINGLE]
  assert launch_routes.direct_entries(flat, info, local[0], local)[1] == "127.0.0.1:7100"


def test_a_slice_process_on_another_node_is_relayed_to_its_own_address():
  """Under Ray a slice may spread over nodes: the relay (on process 0's node)
  forwards each other process's data plane to where that process bound it, as
  its ready file says, not to the relay node's loopback address."""
  info = dict(_ready([7000, 7001, 7002], 0),
              slice_data_plane_hosts=["127.0.0.3", "10.0.0.7", "127.0.0.3"])
  local = [f"127.0.0.1:{info['transfer_port']}"]
  kw = dict(dial="10.0.0.2", local="127.0.0.1", transfer_target=local[0],
            control_target="a:1", prefix_target="a:2", local_transfer=local, tcp=True,
            data_plane_host="127.0.0.3")
  by_name = dict(r.split("=", 1) for r in launch_routes.relay_routes([pd_roles.SLICE], [info],
                                                                     **kw))
  assert by_name["slicedataplane1"] == "10.0.0.2:9001->10.0.0.7:9001@a_to_b"
  assert by_name["slicedataplane2"] == "10.0.0.2:9002->127.0.0.3:9002@a_to_b"
  # Control: a ready file without the hosts (one node) gets data_plane_host for all.
  del info["slice_data_plane_hosts"]
  by_name = dict(r.split("=", 1) for r in launch_routes.relay_routes([pd_roles.SLICE], [info],
                                                                     **kw))
  assert by_name["slicedataplane1"] == "10.0.0.2:9001->127.0.0.3:9001@a_to_b"


def test_a_slice_without_its_processes_or_with_clashing_routes_is_refused():
  with pytest.raises(ValueError, match="lists no other process"):
    launch_routes.slice_others(pd_roles.SLICE, {"slice_transfer": ["127.0.0.1:1"]})
  assert launch_routes.slice_others(pd_roles.SINGLE, {"slice_transfer": ["x:1", "x:2"]}) == []
  with pytest.raises(ValueError, match="process 0"):
    launch_routes.slice_route_names(1, 0)
  assert launch_routes.slice_route_names(0, 2) != launch_routes.slice_route_names(2, 2)


# -- the broker with two slices ---------------------------------------------------

SLICES = (("10.0.0.1:7001", "10.0.0.2:7001"), ("10.0.1.1:7001", "10.0.1.2:7001"))


def _two_slice_broker():
  targets = [DecodeTarget(f"10.0.{n}.1:6000", s[0], slice=s, slice_devices=1)
             for n, s in enumerate(SLICES)]
  b = broker_lib.BrokerServicer(load_config("tiny_gdn_gqa"), StaticThresholdPolicy(100),
                                prefill_targets=["10.9.9.9:5000"], decode_targets=targets)
  region = _Region()
  b.pool.prefill_stubs = [region.prefill_stub("region_a")]
  b.pool.decode_stubs = [region.decode_stub(i) for i in range(2)]
  b.pool.pdp_stubs = [region.prefill_stub(f"pd{i}") for i in range(2)]
  return b, region


def test_the_broker_sends_each_slice_its_own_parts_and_no_whole_state():
  b, region = _two_slice_broker()
  try:
    assert b.roles() == ["both", "both"]
    assert [r["shape"] for r in b.roles_info()] == ["slice", "slice"]
    for route in (serving_pb2.ROUTE_REMOTE, serving_pb2.ROUTE_LOCAL):
      for k in range(4):  # one after another: the broker alternates the nodes
        out = list(b.Generate(serving_pb2.GenerateRequest(
            prompt_ids=list(range(1, 9)), max_new_tokens=2, route=route,
            request_id=f"{route}-{k}"), _context()))
        assert out[-1].finished
    # Only region A sent states, each to one slice's process 0 with that slice's parts.
    assert {s for s, _, _ in region.deliveries} == {"region_a"}
    assert {(t, p) for _, t, p in region.deliveries} == {(s[0], s) for s in SLICES}
    # Local requests were prefilled on the slice that decoded them.
    assert {(0, True), (1, True), (0, False), (1, False)} <= set(region.decoded)
    assert b.pool.pick(NodeKind.PDP) is None  # neither slice prefills for the other
    with pytest.raises(pd_roles.RoleError, match="PD node 1 is a decode slice"):
      b.set_roles(["both", "pdd"])
  finally:
    b.close()


def test_the_role_split_refuses_a_prefill_count_when_every_node_is_a_slice():
  assert pd_roles.default_roles_for([pd_roles.SLICE] * 2) == ("both", "both")
  assert pd_roles.default_roles_for([pd_roles.SLICE] * 2, 0) == ("both", "both")
  with pytest.raises(pd_roles.RoleError, match="all 2 PD nodes are decode slices"):
    pd_roles.default_roles_for([pd_roles.SLICE] * 2, 1)
  # Negative: one single node beside the slices may not be PD-P alone either.
  with pytest.raises(pd_roles.RoleError, match="leave no PD-D node"):
    pd_roles.default_roles_for([pd_roles.SLICE, pd_roles.SLICE, pd_roles.SINGLE, pd_roles.SINGLE], 2)


# -- a real cluster: two slices behind one broker ----------------------------------


def _prompt(n: int, salt: int) -> list[int]:
  return [int(t) for t in np.random.default_rng(3100 + salt).integers(1, 256, n)]


def _route_bytes(cluster, names, timeout_s: float = 30.0) -> dict:
  """The relay's bytes per route once every one of ``names`` carried some (the
  relay rewrites its statistics every 0.5 s)."""
  deadline = time.monotonic() + timeout_s
  while True:
    got = (cluster.relay_stats() or {}).get("route_bytes", {})
    if all(got.get(n, 0) > 0 for n in names):
      return got
    assert time.monotonic() < deadline, (names, got)
    time.sleep(0.2)


# A pod and two slices of two processes each, with a relay and TLS.
SERVED = ClusterSpec(n_slots=4, max_queue=8, max_ctx=256, prefill_buckets=(64,),
                     prefill_max_batch=1, threshold=16, prefill_pod=2, decode_slice=2,
                     pd_nodes=2, slice_nodes=2,
                     link=LinkSpec(bandwidth_bps=200e6, rtt_s=0.01), tls=True)


@pytest.mark.slow  # a pod and two slices of two processes each start and compile
@pytest.mark.timeout(1500)
def test_two_slices_behind_one_broker_serve_token_exact(tmp_path, reference):
  cluster = LocalCluster(SERVED, tmp_path).start()
  try:
    _serve_on_two_slices(cluster, reference)
  finally:
    cluster.stop()


@pytest.mark.slow  # the same on two region-labelled Ray nodes, every process an actor
@pytest.mark.timeout(1500)
def test_two_slices_on_ray_serve_token_exact(tmp_path, reference):
  with labelled_ray_cluster() as (_, ray_nodes):  # region_a: 2 CPUs, region_b: 4
    cluster = RayCluster(SERVED, tmp_path, RayPlacement(address="auto", cpus_per_server=0.5))
    try:
      cluster.start()
      groups = [cluster.procs[n] for n in ("decode", "decode1")]
      # Each slice its own placement group, both on region B's node (process 0
      # of the second pinned beside the first's).
      assert [g.info["placement_group"] for g in groups] == [
          cluster.groups[k].id.hex() for k in ("b-slice", "b-slice1")]
      assert {w["node_id"] for g in groups for w in g.info["processes"]} == {ray_nodes["b"]}
      _serve_on_two_slices(cluster, reference)
    finally:
      cluster.stop()
    assert not cluster.groups


def _serve_on_two_slices(cluster, reference):
  """Remote and local requests on both slices, token-exact, each slice with
  its own processes, ports, counters and relay routes."""
  nodes = ("decode", "decode1")
  for n, name in enumerate(nodes):
    assert "paas_jax.serving.slice_decode_server" in cluster.procs[name].args
    assert any(a.startswith("--slice_tls_names=") for a in cluster.procs[name].args)
  # Each slice its own processes and ports: nothing shared between the two.
  infos = [cluster.procs[n].info for n in nodes]
  assert not set(infos[0]["slice_transfer"]) & set(infos[1]["slice_transfer"])
  assert not set(infos[0]["slice_data_plane_ports"]) & set(infos[1]["slice_data_plane_ports"])
  # (a local supervisor lists its children; on Ray each process is an actor's)
  pids = [set(i.get("pod_pids") or [w["pid"] for w in i["processes"]]) for i in infos]
  assert len(pids[0]) == len(pids[1]) == 2 and not pids[0] & pids[1]
  node_of = {cluster.pd_address(n): n for n in nodes}
  with BrokerClient(cluster.broker_address, timeout_s=180,
                    credentials=cluster.client_credentials()) as client:
    router = client.stats()["router"]
    assert [(r["shape"], r["role"]) for r in router["roles"]] == [("slice", "both")] * 2
    _wait_remote(client)
    before = {n: _idle_stats(cluster, n, serving_pb2_grpc.DecodeStub) for n in nodes}
    # Two at a time: the broker puts the second on the less loaded slice.
    served = serve_in_pairs(client, reference, node_of, [
        ("remote", 0.0), ("remote", 0.8), ("remote", 0.0), ("remote", 0.6),
        ("local", 0.0), ("local", 0.7)], length_step=9, tag="two-slices", seed=7)
    assert {("prfaas", "decode"), ("prfaas", "decode1")} <= served, served
  after = {n: _idle_stats(cluster, n, serving_pb2_grpc.DecodeStub) for n in nodes}
  # Each slice's own counters: remote parts reached both of its processes.
  for n in nodes:
    s, b0 = after[n], before[n]
    assert s["jobs_done"] - b0.get("jobs_done", 0) >= 1, (n, s)
    assert s.get("jobs_failed", 0) == 0 and s["slice_parts_pending"] == 0, (n, s)
    assert all(s[f"slice_bytes_in:{q}"] > b0.get(f"slice_bytes_in:{q}", 0)
               for q in (0, 1)), (n, s)
  # Both slices' process-1 data planes were reached through their own relay routes.
  _route_bytes(cluster, ["slicedataplane1", "node1slicedataplane1"])
