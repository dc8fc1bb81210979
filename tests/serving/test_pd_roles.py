"""Moving PD nodes between PD-P and PD-D roles ("re-balance P/D nodes").

Pure role bookkeeping (``paas_jax/serving/pd_roles.py``), the rebalancer step
with N > 1 PD nodes, the broker's role/drain accounting on a broker with no
servers behind it, and one real two-PD-node cluster (module-scoped).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import types

import grpc
import numpy as np
import pytest

from paas_jax.scheduling import FinishedRequest, rebalance_step
from paas_jax.serving.pd_roles import (BOTH_ROLE, DECODE, PDD_ROLE, PDP_ROLE, PREFILL, NodeRole,
                                       RoleError, begin_moves, default_roles, plan_split,
                                       serving_counts, settle, split, validate_roles)

# -- pure role bookkeeping ---------------------------------------------------------


def test_default_roles():
  assert default_roles(1) == (BOTH_ROLE,)
  assert default_roles(2) == (PDD_ROLE, PDP_ROLE)
  assert default_roles(5) == (PDD_ROLE,) * 3 + (PDP_ROLE,) * 2
  assert default_roles(4, 1) == (PDD_ROLE,) * 3 + (PDP_ROLE,)
  assert default_roles(4, 0) == (PDD_ROLE,) * 4
  with pytest.raises(RoleError) as e:
    default_roles(3, 3)
  assert e.value.precondition
  with pytest.raises(RoleError):
    default_roles(0)


def test_validate_roles():
  assert validate_roles(["pdp", "pdd"]) == ("pdp", "pdd")
  with pytest.raises(RoleError) as e:
    validate_roles(["pdp", "decode"])
  assert not e.value.precondition and "unknown role" in str(e.value)
  with pytest.raises(RoleError) as e:
    validate_roles(["pdp", "pdp"])
  assert e.value.precondition and "no PD node to decode" in str(e.value)
  with pytest.raises(RoleError):
    validate_roles([])


def test_capabilities_while_draining():
  n = NodeRole(PDD_ROLE, PDP_ROLE)
  assert n.draining and n.serving == frozenset() and n.dropped == {DECODE}
  assert n.final == PDP_ROLE
  n = NodeRole(BOTH_ROLE, PDD_ROLE)
  assert n.serving == {DECODE} and n.dropped == {PREFILL}
  n = NodeRole(PDP_ROLE, BOTH_ROLE)  # gains decode only once nothing is dropped
  assert n.serving == {PREFILL} and n.dropped == frozenset()
  assert not NodeRole(PDP_ROLE).draining and NodeRole(PDP_ROLE).serving == {PREFILL}


def test_plan_split_flips_the_fewest_nodes():
  roles = (PDD_ROLE, PDD_ROLE, PDP_ROLE, PDP_ROLE)
  assert plan_split(roles, 2) == roles
  out = plan_split(roles, 1)
  assert sum(a != b for a, b in zip(roles, out)) == 1 and out.count(PDP_ROLE) == 1
  out = plan_split(roles, 3)
  assert sum(a != b for a, b in zip(roles, out)) == 1 and out.count(PDP_ROLE) == 3
  # Among equally few, the node with the least work to drain moves.
  assert plan_split(roles, 1, load={2: 5, 3: 0}) == (PDD_ROLE, PDD_ROLE, PDP_ROLE, PDD_ROLE)
  assert plan_split(roles, 1, load={2: 0, 3: 5}) == (PDD_ROLE, PDD_ROLE, PDD_ROLE, PDP_ROLE)
  assert plan_split(roles, 3, load={0: 4, 1: 1}) == (PDD_ROLE, PDP_ROLE, PDP_ROLE, PDP_ROLE)
  # "both" nodes become whatever fills the gap first.
  assert plan_split((BOTH_ROLE, BOTH_ROLE, PDD_ROLE), 1).count(PDP_ROLE) == 1
  assert plan_split((BOTH_ROLE, BOTH_ROLE, PDD_ROLE), 1)[2] == PDD_ROLE
  for n_p in range(0, 3):
    assert plan_split((BOTH_ROLE, PDP_ROLE, PDD_ROLE), n_p).count(PDP_ROLE) == n_p
  with pytest.raises(RoleError):
    plan_split(roles, 4)


def test_moves_drain_then_switch():
  nodes = tuple(NodeRole(r) for r in (PDD_ROLE, PDP_ROLE))
  nodes, moves = begin_moves(nodes, (PDP_ROLE, PDD_ROLE))
  assert [(m.node, m.from_role, m.to_role) for m in moves] == [(0, "pdd", "pdp"),
                                                                (1, "pdp", "pdd")]
  assert all(n.draining for n in nodes)
  assert serving_counts(nodes) == (0, 0)  # both drain: neither takes new work yet
  assert split(nodes) == (1, 1)
  # Node 0 still decodes one request, node 1 has no prefill in flight.
  inflight = {(0, DECODE): 1, (1, PREFILL): 0, (1, DECODE): 3}
  nodes, done = settle(nodes, inflight)
  assert done == [1] and nodes[1] == NodeRole(PDD_ROLE) and nodes[0].draining
  nodes, done = settle(nodes, {(0, DECODE): 0, (0, PREFILL): 2})
  assert done == [0] and nodes == (NodeRole(PDP_ROLE), NodeRole(PDD_ROLE))
  # Asked back while draining: stops draining at once; a no-op move is no move.
  nodes2, moves = begin_moves((NodeRole(PDD_ROLE, PDP_ROLE),), (PDD_ROLE,))
  assert nodes2 == (NodeRole(PDD_ROLE),) and len(moves) == 1
  assert begin_moves(nodes, (PDP_ROLE, PDD_ROLE))[1] == []
  with pytest.raises(RoleError):
    begin_moves(nodes, (PDP_ROLE,))
  with pytest.raises(RoleError) as e:
    begin_moves(nodes, (PDP_ROLE, PDP_ROLE))
  assert e.value.precondition


def test_admin_interceptor_guards_only_set_roles():
  from paas_jax.security.peers import (BROKER_ADMIN_METHOD, admin_interceptor,
                                       service_rules)
  ic = admin_interceptor()
  assert ic.patterns_for(BROKER_ADMIN_METHOD) == ("admin*", "broker*")
  handler = object()
  generate = types.SimpleNamespace(method="/paas_jax.serving.v1.Broker/Generate")
  assert ic.intercept_service(lambda d: handler, generate) is handler  # token check only
  assert service_rules("broker")[BROKER_ADMIN_METHOD] == ["admin*", "broker*"]
  # Brokers may ask PD nodes to prefill (PD-P); PD nodes push states to each other.
  rules = service_rules("decode")
  assert rules["/paas_jax.serving.v1.Prefill/"] == ["broker*"]
  assert "decode*" in rules["/paas_jax.transport.v1.StateTransfer/"]


# -- the rebalancer with several PD nodes -----------------------------------------------


def _rows(n: int = 60, seed: int = 0, pdp_slow: float = 1.0) -> list[FinishedRequest]:
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(n):
    l = int(rng.integers(30, 600))
    route = "prfaas" if l > 150 else "pdp"
    rows.append(FinishedRequest(
        route=route, input_tokens=l, cached_tokens=0, output_tokens=16,
        prefill_s=(0.01 + 1e-4 * l) * (0.5 if route == "prfaas" else pdp_slow),
        link_bytes=5e4 + 500 * l if route == "prfaas" else None, tpot_s=0.02))
  return rows


def test_rebalance_step_unpins_the_split_with_several_pd_nodes():
  pinned = rebalance_step(_rows(), threshold=150, n_slots=8, link_bandwidth_bps=1e8)
  assert pinned["status"] == "ok" and pinned["n_pd_nodes"] == 1
  assert pinned["proposed_split"] == {"n_prfaas": 1, "n_p": 1, "n_d": 1}
  assert "pinned" in pinned["note"]
  assert "decode_step_seconds" in pinned["calibrated"]
  seen = set()
  for pdp_slow, tpot in ((1.0, 0.002), (40.0, 0.002), (1.0, 0.5)):
    rows = [dataclasses.replace(r, tpot_s=tpot) for r in _rows(pdp_slow=pdp_slow)]
    p = rebalance_step(rows, threshold=150, n_slots=8, link_bandwidth_bps=1e8, n_pd_nodes=4,
                       current_n_p=2)
    assert p["status"] == "ok", p
    assert "split free" in p["note"] and p["n_pd_nodes"] == 4
    sp = p["proposed_split"]
    assert 1 <= sp["n_p"] <= 3 and sp["n_p"] + sp["n_d"] == 4
    assert p["decode_step_s"] == pytest.approx(tpot)
    assert p["proposed_lambda_max"] >= p["current_lambda_max"] * (1 - 1e-9)
    seen.add(sp["n_p"])
  # Slow PD-P prefill wants more PD-P nodes than slow decode does.
  assert len(seen) >= 2, seen


# -- the broker's role bookkeeping (no servers behind it) ------------------------------


@pytest.fixture
def offline_broker():
  from paas_jax.models import load_config
  from paas_jax.serving import broker as broker_lib
  from paas_jax.serving.routing import StaticThresholdPolicy
  # Nothing listens on these ports: only the bookkeeping is exercised.
  targets = [broker_lib.DecodeTarget(f"127.0.0.1:{p}", f"127.0.0.1:{p + 1}")
             for p in (1, 3, 5)]
  b = broker_lib.BrokerServicer(load_config("tiny_gdn_gqa"), StaticThresholdPolicy(100),
                                prefill_targets=[], decode_targets=targets)
  yield b
  b.close()


def test_broker_drains_a_moving_node(offline_broker):
  b = offline_broker
  assert b.roles() == ["pdd", "pdd", "pdp"]
  assert b.instance_counts() == (1, 2)
  # Decode work lands only on PD-D nodes, PD-P work only on the PD-P node.
  picks = {b.pool.pick("decode") for _ in range(6)}
  assert picks == {0, 1}
  assert b.pool.pick("pdp") == 2
  # (loads now: decode 3 + 3 on nodes 0/1, pdp 1 on node 2)
  moves = b.set_roles(["pdp", "pdd", "pdd"], reason="test")
  assert [(m.node, m.from_role, m.to_role) for m in moves] == [(0, "pdd", "pdp"),
                                                                (2, "pdp", "pdd")]
  info = {r["index"]: r for r in b.roles_info()}
  assert info[0]["draining"] and info[0]["serving"] == []
  assert info[2]["draining"] and info[2]["inflight_prefill"] == 1
  # Draining nodes get no new work: decode goes to node 1 only, no PD-P node.
  assert {b.pool.pick("decode") for _ in range(4)} == {1}
  assert b.pool.pick("pdp") is None
  b.pool.release("pdp", 2)  # node 2's PD-P prefill finished: it now decodes
  info = {r["index"]: r for r in b.roles_info()}
  assert not info[2]["draining"] and info[2]["role"] == "pdd"
  assert info[0]["draining"]
  for _ in range(3):
    b.pool.release("decode", 0)
  info = {r["index"]: r for r in b.roles_info()}
  assert info[0]["role"] == "pdp" and not info[0]["draining"]
  moves = [m for m in b.role_moves]
  assert all(m["completed"] is not None and m["reason"] == "test" for m in moves)
  assert b.counters["role_moves"] == 2 and b.counters["role_moves_completed"] == 2
  assert b.instance_counts() == (1, 2)
  stats = json.loads(b.GetStats(None, None).json)
  assert stats["router"]["roles"][0]["role"] == "pdp"
  assert len(stats["router"]["role_moves"]) == 2


def test_broker_rejects_bad_roles(offline_broker):
  b = offline_broker
  with pytest.raises(RoleError):
    b.set_roles(["pdp", "pdp", "pdp"])
  with pytest.raises(RoleError):
    b.set_roles(["pdp", "pdd"])
  with pytest.raises(RoleError):
    b.set_roles(["pdp", "pdd", "prefill"])
  assert b.roles() == ["pdd", "pdd", "pdp"] and not b.role_moves


def test_decode_falls_back_to_any_node_without_pd_d(offline_broker):
  b = offline_broker
  b.set_roles(["both", "pdp", "pdp"])
  assert b.pool.pick("decode") == 0
  b.health.mark_down(b.decode_targets[0].control, "test")
  # No healthy decode-capable node: any healthy node (colocated fallback).
  assert b.pool.pick("decode") in (1, 2)


def _broker_with_records(apply: bool, pdp_slow: float):
  from paas_jax.models import load_config
  from paas_jax.serving import broker as broker_lib
  from paas_jax.serving.broker import make_policy
  from paas_jax.serving.request_lifecycle import RequestLifecycle, RequestPhase
  targets = [broker_lib.DecodeTarget(f"127.0.0.1:{p}", f"127.0.0.1:{p + 1}")
             for p in (1, 3, 5)]
  b = broker_lib.BrokerServicer(load_config("tiny_gdn_gqa"), make_policy("adaptive", 150),
                                prefill_targets=["127.0.0.1:7"], decode_targets=targets)
  # What enable_live_view sets, without its poller.
  b.live = types.SimpleNamespace(link_bandwidth_bps=1e8, stop=lambda: None)
  b._n_slots, b.rebalance_apply = 8, apply
  for i, r in enumerate(_rows(pdp_slow=pdp_slow)):
    rec = broker_lib.RequestRecord(request_id=f"r{i}", prompt_tokens=r.input_tokens,
                                   max_new_tokens=16, route=r.route,
                                   lifecycle=RequestLifecycle(f"r{i}", RequestPhase.FINISHED),
                                   prefill_s=r.prefill_s, generated=16,
                                   link_bytes=int(r.link_bytes or 0), first_token_s=0.1,
                                   total_s=0.1 + 15 * 0.002)  # TPOT 2 ms
    b._recent.append(rec)
  return b


@pytest.mark.parametrize("apply", [False, True])
def test_broker_rebalance_step_moves_nodes_only_with_apply(apply):
  # Fast decode, one PD-D node is plenty: the solver wants N_p = 2 of 3.
  b = _broker_with_records(apply, pdp_slow=1.0)
  try:
    assert b.roles() == ["pdd", "pdd", "pdp"]
    b._rebalance_step()
    prop = b.rebalance
    assert prop["status"] == "ok", prop
    assert prop["proposed_split"]["n_p"] == 2 and prop["apply"]
    # The measured service times reach the router either way.
    cfg = b.policy.router.config
    assert cfg.pdp_service_s == pytest.approx(max(prop["pdp_service_s"], 1e-3))
    assert cfg.prfaas_service_s == pytest.approx(max(prop["prfaas_service_s"], 1e-3))
    assert b.counters["service_times_updated"] == 1
    if not apply:
      assert b.roles() == ["pdd", "pdd", "pdp"] and not b.role_moves
      assert b.policy.router.threshold_tokens == 150
      return
    # One node flips (the fewest), with nothing in flight it is done at once.
    assert sorted(b.roles()) == ["pdd", "pdp", "pdp"] and b.roles()[2] == "pdp"
    assert len(b.role_moves) == 1 and b.role_moves[0]["reason"].startswith("rebalance")
    assert b.role_moves[0]["completed"] is not None
    assert b.instance_counts() == (2, 1)
    assert b.policy.router.threshold_tokens == prop["proposed_threshold"]
  finally:
    b.close()


# -- a real cluster with two PD nodes ------------------------------------------------

PD_SLOTS = 4
PD_MAX_CTX = 512


def _prompt(length: int, salt: int) -> tuple[int, ...]:
  rng = np.random.default_rng(9000 + salt)
  return tuple(int(t) for t in rng.integers(0, 256, length))


@pytest.fixture(scope="module")
def pd_cluster(tmp_path_factory):
  from paas_jax.serving.launch import ClusterSpec, LocalCluster
  from tests.serving.conftest import CONFIG, SEED
  # Two PD nodes: "decode" starts as PD-D, "decode1" as PD-P. No WAN emulation
  # (not what is tested here) keeps the start-up short.
  spec = ClusterSpec(config=CONFIG, seed=SEED, n_slots=PD_SLOTS, max_queue=8,
                     max_ctx=PD_MAX_CTX, prefill_buckets=(64,), prefill_max_batch=2,
                     threshold=100, pd_nodes=2, rebalance_every_s=0)
  c = LocalCluster(spec, tmp_path_factory.mktemp("pd_cluster"))
  c.start()
  yield c
  c.stop()


@pytest.fixture(scope="module")
def pd_client(pd_cluster):
  from paas_jax.client import BrokerClient
  with BrokerClient(pd_cluster.broker_address, timeout_s=120) as c:
    yield c


def _set_roles(cluster, roles, reason="test"):
  from paas_jax.proto import serving_pb2, serving_pb2_grpc
  with grpc.insecure_channel(cluster.broker_address) as ch:
    return serving_pb2_grpc.BrokerStub(ch).SetRoles(
        serving_pb2.SetRolesRequest(roles=roles, reason=reason), timeout=10)


def _roles(client) -> dict:
  return {r["index"]: r for r in client.stats()["router"]["roles"]}


def test_pdp_node_prefills_for_the_pdd_node(pd_cluster, pd_client, reference):
  node0, node1 = (pd_cluster.pd_address(n) for n in pd_cluster.pd_names)
  roles = _roles(pd_client)
  assert (roles[0]["role"], roles[1]["role"]) == ("pdd", "pdp")
  prompt = _prompt(40, 1)
  out = pd_client.generate(prompt_ids=prompt, max_new_tokens=8, route="local")
  s = out.summary
  assert out.route == "pdp"
  assert s["prefill_server"] == node1 and s["decode_server"] == node0
  assert out.tokens == reference(prompt, 8)
  assert int(s.get("link_bytes", 0)) == 0 and int(s["state_bytes"]) > 0
  # Sampled too (sampling is keyed by seed and position on both nodes).
  out = pd_client.generate(prompt_ids=prompt, max_new_tokens=8, route="local",
                           temperature=0.9, top_k=40, seed=5)
  assert out.tokens == reference(prompt, 8, 0.9, 40, 1.0, 5)
  # PrfaaS requests decode on the PD-D node only.
  out = pd_client.generate(prompt_ids=_prompt(150, 2), max_new_tokens=4, route="remote")
  assert out.route == "prfaas" and out.summary["decode_server"] == node0
  assert out.tokens == reference(_prompt(150, 2), 4)


def test_set_roles_rpc_errors(pd_cluster):
  with pytest.raises(grpc.RpcError) as e:
    _set_roles(pd_cluster, ["pdp", "gpu"])
  assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "unknown role" in e.value.details()
  with pytest.raises(grpc.RpcError) as e:
    _set_roles(pd_cluster, ["pdd"])
  assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
  with pytest.raises(grpc.RpcError) as e:
    _set_roles(pd_cluster, ["pdp", "pdp"])
  assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_role_move_drains_then_serves_the_new_role(pd_cluster, pd_client, reference,
                                                   assert_logprobs):
  node0, node1 = (pd_cluster.pd_address(n) for n in pd_cluster.pd_names)
  long_prompt, n_long = _prompt(40, 3), 300
  result = {}

  def run():
    result["out"] = pd_client.generate(prompt_ids=long_prompt, max_new_tokens=n_long,
                                       route="local", request_id="long", logprobs=True)
  t = threading.Thread(target=run)
  t.start()
  deadline = time.monotonic() + 60
  # Wait until it decodes on node 0 (the PD-D node) and node 1 (PD-P) holds nothing of
  # it: with the first token early the request decodes while its transfer may still be
  # leaving node 1, and a move of a node with PD-P work in flight drains first.
  while True:
    stats = pd_client.stats()
    decoding = any(r["request_id"] == "long" and r["phase"] == "decoding"
                   for r in stats["inflight"])
    roles = {r["index"]: r for r in stats["router"]["roles"]}
    if decoding and roles[1]["inflight_prefill"] == 0:
      break
    assert time.monotonic() < deadline and t.is_alive(), "the long request never decoded"
    time.sleep(0.02)
  # Swap the roles while it decodes: node 0 (PD-D -> PD-P) must drain it first.
  resp = _set_roles(pd_cluster, ["pdp", "pdd"], reason="swap")
  assert list(resp.roles) == ["pdp", "pdd"] and resp.moves_started == 2
  info = {r["index"]: r for r in json.loads(resp.json)}
  assert info[0]["draining"] and info[0]["inflight_decode"] >= 1 and info[0]["serving"] == []
  assert info[1]["role"] == "pdd" and not info[1]["draining"]  # nothing of PD-P in flight
  # Meanwhile: no PD-P node serves, so a local request runs colocated on node 1.
  prompt = _prompt(30, 4)
  out = pd_client.generate(prompt_ids=prompt, max_new_tokens=6, route="local")
  assert out.summary["decode_server"] == node1 and out.summary["prefill_server"] == node1
  assert "no_pdp_node" in out.summary["route_reason"]
  assert out.tokens == reference(prompt, 6)
  t.join(120)
  assert result["out"].tokens == reference(long_prompt, n_long)
  # Drained while decoding: every step's logits still the reference's.
  assert_logprobs(long_prompt, result["out"])
  assert result["out"].summary["decode_server"] == node0
  stats = pd_client.stats()
  roles = {r["index"]: r for r in stats["router"]["roles"]}
  assert (roles[0]["role"], roles[1]["role"]) == ("pdp", "pdd")
  assert not roles[0]["draining"]
  moves = [m for m in stats["router"]["role_moves"] if m["reason"] == "swap"]
  assert {(m["index"], m["from"], m["to"]) for m in moves} == {(0, "pdd", "pdp"),
                                                                (1, "pdp", "pdd")}
  assert all(m["completed"] is not None for m in moves)
  assert stats["role_moves"] >= 2
  # The new roles: node 0 prefills, node 1 decodes.
  prompt = _prompt(50, 5)
  out = pd_client.generate(prompt_ids=prompt, max_new_tokens=8, route="local",
                           logprobs=True, top_logprobs=3)
  assert out.summary["prefill_server"] == node0 and out.summary["decode_server"] == node1
  assert out.tokens == reference(prompt, 8)
  assert_logprobs(prompt, out)


def test_dead_pdp_node_falls_back(pd_cluster, pd_client, reference):
  """Runs last (it kills a node): node 0 is PD-P after the swap above."""
  node0, node1 = (pd_cluster.pd_address(n) for n in pd_cluster.pd_names)
  assert _roles(pd_client)[0]["role"] == "pdp"
  pd_cluster.kill("decode")
  prompt = _prompt(45, 6)
  # The PD-P prefill fails before any token: re-prefilled (PrfaaS is healthy), decoded
  # on the PD-D node; the dead node is marked down.
  out = pd_client.generate(prompt_ids=prompt, max_new_tokens=6, route="local")
  assert out.summary["decode_server"] == node1
  assert out.tokens == reference(prompt, 6)
  roles = _roles(pd_client)
  assert not roles[0]["healthy"]
  # With no PD-P node left, local requests run colocated on the PD-D node.
  out = pd_client.generate(prompt_ids=prompt, max_new_tokens=6, route="local")
  assert out.summary["prefill_server"] == node1 == out.summary["decode_server"]
  assert out.tokens == reference(prompt, 6)
