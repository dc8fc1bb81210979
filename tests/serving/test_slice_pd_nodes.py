"""A decode slice among several PD nodes (#16 follow-up).

Unit part: the real broker (``BrokerServicer``: routing, ``AttemptRunner``,
``NodePool``) in front of fake region stubs that record every state delivery
(who streamed a state to which node, as a whole or as a slice's parts). The
rules checked: a request offloaded to the slice gets parts from region A
(``decode_slice`` set), one offloaded to a single-process node a whole state
(no ``decode_slice``); a slice never receives a whole state from another PD
node and never prefills for one; a local request on the slice is prefilled
there. The negative control runs the same requests with the pool blind to the
slice's shape (the old choice) and shows the check catches the whole state it
sends into the slice.

Cluster part (slow): region A a pod of two processes, region B the slice
("decode", two processes) and a single decode server ("decode1") behind one
broker; remote and local requests land on both, token-exact.
"""

from __future__ import annotations

import concurrent.futures
import threading
import types

import numpy as np
import pytest

from paas_jax.client import BrokerClient
from paas_jax.models import load_config
from paas_jax.netem import LinkSpec
from paas_jax.proto import serving_pb2, serving_pb2_grpc
from paas_jax.serving import broker as broker_lib
from paas_jax.serving import pd_roles
from paas_jax.serving.launch import ClusterSpec, LocalCluster
from paas_jax.serving.node_pool import DecodeTarget, NodeKind
from paas_jax.serving.routing import StaticThresholdPolicy
from tests.serving.test_pod_serving import _stats, _wait_remote
from tests.serving.test_slice_serving import _idle_stats

SLICE_PROCS = ("10.0.0.1:7001", "10.0.0.2:7001")  # the slice's StateTransfer ports


class _Call:
  """A streaming call's fake: iterates its events, can be cancelled."""

  def __init__(self, events):
    self._it = iter(events)

  def __iter__(self):
    return self

  def __next__(self):
    return next(self._it)

  def cancel(self):
    pass


class _Region:
  """Fake region stubs: every Decode finishes with two tokens; every Prefill
  (region A's or a PD node's) records its delivery and reports a first token
  and a finished transfer."""

  def __init__(self):
    self.lock = threading.Lock()
    self.deliveries = []  # (sender, decode_target, decode_slice targets or ())
    self.decoded = []     # (node, remote_prefill)

  def decode_stub(self, node: int):
    region = self

    class Stub:
      def Decode(self, req, timeout=None, metadata=None):
        with region.lock:
          region.decoded.append((node, req.remote_prefill))
        events = [serving_pb2.DecodeEvent(accepted=True)] if req.remote_prefill else []
        events += [serving_pb2.DecodeEvent(slot=0),
                   serving_pb2.DecodeEvent(token_ids=[5, 6], finished=True,
                                           finish_reason="length")]
        return _Call(events)

      def Handoff(self, req, timeout=None, metadata=None):
        return serving_pb2.HandoffResponse()
    return Stub()

  def prefill_stub(self, sender: str):
    region = self

    class Stub:
      def Prefill(self, req, timeout=None, metadata=None):
        with region.lock:
          region.deliveries.append((sender, req.decode_target,
                                    tuple(req.decode_slice.transfer_targets)
                                    if req.HasField("decode_slice") else ()))
        return _Call([serving_pb2.PrefillEvent(first_token=serving_pb2.FirstToken(token_id=5)),
                      serving_pb2.PrefillEvent(done=serving_pb2.TransferDone(bytes_sent=1))])
    return Stub()


def _context():
  return types.SimpleNamespace(add_callback=lambda cb: None, time_remaining=lambda: 60.0,
                               abort=lambda code, msg: pytest.fail(f"{code}: {msg}"))


def _broker(shape_blind: bool = False):
  """Node 0 a slice of two processes, nodes 1 and 2 single processes; one
  region-A server. ``shape_blind``: the pool ignores shapes (the old choice)."""
  targets = [DecodeTarget("10.0.0.1:6000", SLICE_PROCS[0], slice=SLICE_PROCS, slice_devices=1),
             DecodeTarget("10.0.1.1:6000", "10.0.1.1:7001", "10.0.1.1:7002"),
             DecodeTarget("10.0.2.1:6000", "10.0.2.1:7001", "10.0.2.1:7002")]
  roles = None
  if shape_blind:  # the roles and shapes of before: node 0 PD-D only, fed by PD-P
    targets[0] = DecodeTarget(targets[0].control, SLICE_PROCS[0])
    roles = ["pdd", "pdd", "pdp"]
  b = broker_lib.BrokerServicer(load_config("tiny_gdn_gqa"), StaticThresholdPolicy(100),
                                prefill_targets=["10.9.9.9:5000"], decode_targets=targets,
                                roles=roles)
  region = _Region()
  b.pool.prefill_stubs = [region.prefill_stub("region_a")]
  b.pool.decode_stubs = [region.decode_stub(i) for i in range(3)]
  b.pool.pdp_stubs = [region.prefill_stub(f"pd{i}") for i in range(3)]
  return b, region


def _run(b, route, n: int):
  for k in range(n):
    req = serving_pb2.GenerateRequest(prompt_ids=list(range(1, 9)), max_new_tokens=2,
                                      route=route, request_id=f"{route}-{k}")
    out = list(b.Generate(req, _context()))
    assert out[-1].finished


def _violations(region) -> list[str]:
  """Every state delivery that breaks the rules (module docstring)."""
  bad = []
  for sender, target, parts in region.deliveries:
    into_slice = target in SLICE_PROCS
    if sender == "pd0":
      bad.append(f"the slice prefilled for another node ({target})")
    if into_slice and (sender != "region_a" or parts != SLICE_PROCS):
      bad.append(f"{sender} sent a whole state into the slice")
    if not into_slice and parts:
      bad.append(f"{sender} sent slice parts to single node {target}")
  return bad


def test_the_broker_never_hands_the_slice_a_whole_state_and_uses_every_node():
  b, region = _broker()
  try:
    assert b.roles() == ["both", "pdd", "pdp"]  # the slice "both"; nodes 1, 2 split
    assert [r["shape"] for r in b.roles_info()] == ["slice", "single", "single"]
    _run(b, serving_pb2.ROUTE_REMOTE, 4)
    _run(b, serving_pb2.ROUTE_LOCAL, 4)
    assert _violations(region) == []
    # Offloaded to the slice: its parts; to node 1: a whole state, both from region A.
    remote = {(t, p) for s, t, p in region.deliveries if s == "region_a"}
    assert remote == {(SLICE_PROCS[0], SLICE_PROCS), ("10.0.1.1:7001", ())}
    # Local on the slice: prefilled there (no Prefill for it); local on node 1:
    # PD-P node 2 streams the whole state inside region B.
    assert ("pd2", "10.0.1.1:7002", ()) in region.deliveries
    decoded = set(region.decoded)
    assert {(0, True), (0, False), (1, True)} <= decoded and (2, True) not in decoded
    assert (0, False) in decoded  # the slice's local requests: colocated
    # Nothing the slice cannot serve is picked for it.
    assert all(b.pool.pick(NodeKind.PDP, to=i) in (2, None) for i in range(3))
    assert b.pool.pick(NodeKind.PDP, to=0) is None  # nothing hands a state to the slice
  finally:
    b.close()


def test_the_shape_blind_choice_sends_a_whole_state_into_the_slice():
  # Negative control: without shapes node 0 is PD-D only and node 2's PD-P
  # streams local requests' whole states into the slice's transfer port.
  b, region = _broker(shape_blind=True)
  try:
    _run(b, serving_pb2.ROUTE_LOCAL, 4)
    assert "pd2 sent a whole state into the slice" in _violations(region)
  finally:
    b.close()


def test_a_slice_keeps_its_role_and_moves_only_the_single_nodes():
  b, _ = _broker()
  try:
    for roles in (["pdd", "pdd", "pdp"], ["pdp", "both", "both"]):
      with pytest.raises(pd_roles.RoleError, match="PD node 0 is a decode slice"):
        b.set_roles(roles)
    assert b.roles() == ["both", "pdd", "pdp"] and not b.role_moves
    b.set_roles(["both", "both", "pdd"])
    assert b.roles() == ["both", "both", "pdd"]
    shapes = b.pool.shapes
    assert pd_roles.plan_split_for(["both", "pdd", "pdd"], shapes, 1) in (
        ("both", "pdp", "pdd"), ("both", "pdd", "pdp"))
    with pytest.raises(pd_roles.RoleError):  # would leave no single PD-D node
      pd_roles.plan_split_for(["both", "pdd", "pdp"], shapes, 2)
  finally:
    b.close()
  # The default split places the single nodes only, and says so when it cannot.
  assert pd_roles.default_roles_for([pd_roles.SLICE, pd_roles.SINGLE]) == ("both", "both")
  assert pd_roles.default_roles_for([pd_roles.SLICE]) == ("both",)
  with pytest.raises(pd_roles.RoleError, match="leave no PD-D node"):
    pd_roles.default_roles_for([pd_roles.SLICE, pd_roles.SINGLE, pd_roles.SINGLE], 2)


# -- a real cluster: the slice and a single decode server behind one broker ------


def _prompt(n: int, salt: int) -> list[int]:
  return [int(t) for t in np.random.default_rng(2600 + salt).integers(1, 256, n)]

def serve_in_pairs(client, reference, node_of: dict, routes: list[tuple[str, float]], *,
                   length_step: int, tag: str, seed: int) -> set[tuple[str, str]]:
  """Sends one request per (route, temperature), two at a time (the broker puts
  the second of a pair on the less loaded node), checks each token-exact and on
  the route asked for, and returns the (route, node name) pairs that served."""
  jobs = [(_prompt(30 + length_step * i, i), route, temperature)
          for i, (route, temperature) in enumerate(routes)]

  def run(i):
    prompt, route, temperature = jobs[i]
    return client.generate(prompt_ids=prompt, max_new_tokens=8, route=route,
                           request_id=f"{tag}-{i}", temperature=temperature, seed=seed)
  outs = []
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    for pair in zip(range(0, len(jobs), 2), range(1, len(jobs), 2)):
      outs += list(pool.map(run, pair))
  served = set()
  for (prompt, route, temperature), out in zip(jobs, outs):
    assert out.tokens == reference(tuple(prompt), 8, temperature, 0, 1.0, seed), out.summary
    assert out.route == ("prfaas" if route == "remote" else "pdp"), out.summary
    served.add((out.route, node_of[out.summary["decode_server"]]))
  return served


@pytest.mark.slow  # a pod, a slice of two processes and a decode server start and compile
@pytest.mark.timeout(1200)
def test_a_slice_and_a_single_node_behind_one_broker_serve_token_exact(tmp_path, reference):
  # PD node 0 ("decode") is the slice, node 1 ("decode1") a single decode
  # server; both "both". Behind the emulated link, mutual TLS.
  spec = ClusterSpec(n_slots=4, max_queue=8, max_ctx=256, prefill_buckets=(64,),
                     prefill_max_batch=1, threshold=16, prefill_pod=2, decode_slice=2,
                     pd_nodes=2, link=LinkSpec(bandwidth_bps=200e6, rtt_s=0.01), tls=True)
  cluster = LocalCluster(spec, tmp_path).start()
  try:
    assert "paas_jax.serving.slice_decode_server" in cluster.procs["decode"].args
    assert "paas_jax.serving.decode_server" in cluster.procs["decode1"].args
    node_of = {cluster.pd_address("decode"): "decode", cluster.pd_address("decode1"): "decode1"}
    with BrokerClient(cluster.broker_address, timeout_s=180,
                      credentials=cluster.client_credentials()) as client:
      router = client.stats()["router"]
      assert [(r["shape"], r["role"]) for r in router["roles"]] == [("slice", "both"),
                                                                    ("single", "both")]
      _wait_remote(client)
      before = {"decode": _idle_stats(cluster, "decode", serving_pb2_grpc.DecodeStub),
                "decode1": _stats(cluster, "decode1", serving_pb2_grpc.DecodeStub)}
      # Two at a time: the broker puts the second on the less loaded node,
      # so each pair covers both nodes.
      served = serve_in_pairs(client, reference, node_of, [
          ("remote", 0.0), ("remote", 0.8), ("local", 0.0), ("local", 0.7),
          ("remote", 0.5), ("local", 0.0)], length_step=11, tag="mixed", seed=11)
      # Offloaded and local requests landed on both nodes.
      assert served >= {("prfaas", "decode"), ("prfaas", "decode1"), ("pdp", "decode"),
                        ("pdp", "decode1")}, served
    after = {"decode": _idle_stats(cluster, "decode", serving_pb2_grpc.DecodeStub),
             "decode1": _stats(cluster, "decode1", serving_pb2_grpc.DecodeStub)}
    # Each node served some (its own counters): the slice got its parts on
    # both processes, the single node whole states assembled from the pod.
    sl, one = after["decode"], after["decode1"]
    assert sl["jobs_done"] - before["decode"].get("jobs_done", 0) >= 2, sl
    assert sl.get("jobs_failed", 0) == 0 and sl["slice_parts_pending"] == 0
    assert all(sl[f"slice_bytes_in:{q}"] > before["decode"].get(f"slice_bytes_in:{q}", 0)
               for q in (0, 1)), sl
    assert one["finished"] - before["decode1"].get("finished", 0) >= 2, one
    assert one["pod_states_in"] > before["decode1"].get("pod_states_in", 0), one
    assert one.get("failed", 0) == 0, one
  finally:
    cluster.stop()
