"""NodePool (serving/node_pool.py) on its own: picking by load and health,
preferences, roles gating what a node is picked for, drains completing on
release. No servers listen behind these addresses: only the bookkeeping runs."""

from __future__ import annotations

import pytest

from paas_jax.serving import pd_roles
from paas_jax.serving.node_pool import AffinityBalance, DecodeTarget, NodeKind, NodePool


@pytest.fixture
def pool():
  p = NodePool(["127.0.0.1:9", "127.0.0.1:11"],
               [DecodeTarget(f"127.0.0.1:{n}", f"127.0.0.1:{n + 1}") for n in (1, 3, 5)],
               roles=["pdd", "pdd", "pdp"])
  yield p
  p.close()


def test_pick_spreads_by_load_and_release_frees(pool):
  a = pool.pick(NodeKind.PREFILL)
  b = pool.pick(NodeKind.PREFILL)
  assert {a, b} == {0, 1}  # least loaded first
  assert pool.load(NodeKind.PREFILL, a) == 1
  pool.release(NodeKind.PREFILL, a)
  assert pool.load(NodeKind.PREFILL, a) == 0
  assert pool.pick(NodeKind.PREFILL) == a


def test_unhealthy_and_excluded_nodes_are_not_picked(pool):
  pool.mark_down(NodeKind.PREFILL, 0, "test")
  assert not pool.healthy(NodeKind.PREFILL, 0)
  assert {pool.pick(NodeKind.PREFILL) for _ in range(3)} == {1}
  assert pool.pick(NodeKind.PREFILL, exclude={1}) is None
  assert pool.healthy_prefill() == [1]


def test_roles_decide_what_a_node_is_picked_for(pool):
  assert {pool.pick(NodeKind.DECODE) for _ in range(4)} <= {0, 1}  # node 2 is PD-P only
  assert pool.pick(NodeKind.PDP) == 2
  assert not pool.colocated(0) and pool.colocated(2)
  assert pool.instance_counts() == (1, 2)


def test_prefer_wins_when_it_qualifies(pool):
  assert pool.pick(NodeKind.DECODE, prefer=1) == 1
  assert pool.pick(NodeKind.DECODE, prefer=1) == 1  # even though more loaded
  assert pool.pick(NodeKind.DECODE, prefer=2) in (0, 1)  # PD-P only: not a decode node


def test_preferred_nodes_share_the_load_among_themselves(pool):
  picks = [pool.pick(NodeKind.DECODE, prefer={0, 1, 2}) for _ in range(4)]
  assert sorted(picks) == [0, 0, 1, 1]  # node 2 does not qualify; 0 and 1 alternate
  assert pool.pick(NodeKind.DECODE, prefer={1}) == 1  # one preferred: even more loaded
  assert pool.pick(NodeKind.DECODE, prefer=set()) == 0  # none: the least loaded


def test_a_soft_preference_yields_to_load_past_the_affinity_balance(pool):
  """Node 1 holds a hot prefix: requests go there until it carries more than
  abs_load (4) more in flight than node 0 and more than rel_load (2x) as
  many; then node 0 takes one. A hard preference (a commit point, a prefix
  shipped for the request) never yields: the control."""
  picks = [pool.pick(NodeKind.DECODE, prefer=1, soft=True) for _ in range(10)]
  # loads (node 1, node 0) before each pick: (0,0)..(4,0) -> 1; (5,0) yields;
  # (5,1) -> 1; (6,1) yields; (6,2) -> 1; (7,2) yields.
  assert picks == [1, 1, 1, 1, 1, 0, 1, 0, 1, 0]
  assert pool.counters["affinity_yielded"] == 3
  assert (pool.load(NodeKind.DECODE, 1), pool.load(NodeKind.DECODE, 0)) == (7, 3)
  hard = [pool.pick(NodeKind.DECODE, prefer=1) for _ in range(5)]
  assert hard == [1] * 5 and pool.counters["affinity_yielded"] == 3


def test_the_affinity_balance_is_configurable_and_checked():
  p = NodePool([], [DecodeTarget(f"127.0.0.1:{n}", "x") for n in (1, 3)], roles=["both", "both"],
               affinity=AffinityBalance(abs_load=0, rel_load=1.0))
  try:  # no slack: the preference holds only while node 1 is no busier than node 0
    assert [p.pick(NodeKind.DECODE, prefer=1, soft=True) for _ in range(4)] == [1, 0, 1, 0]
  finally:
    p.close()
  assert not AffinityBalance(4, 2.0).yields(9, 5)  # 4 more: within abs_load
  assert not AffinityBalance(4, 2.0).yields(12, 6)  # 2x: within rel_load
  assert AffinityBalance(4, 2.0).yields(13, 6)
  for bad in ((-1, 2.0), (4, 0.5)):
    with pytest.raises(ValueError, match="affinity balance"):
      AffinityBalance(*bad)


def test_the_nodes_that_reuse_a_prefix_follow_roles_and_shapes(pool):
  # pdd, pdd, pdp: a prefix on PD-P node 2 is reused by a local request decoded
  # on 0 or 1 (node 2 prefills it for them); one on node 0 only by node 0.
  assert pool.decode_nodes_reusing({2}) == {0, 1}
  assert pool.decode_nodes_reusing({0}) == {0}
  assert pool.decode_nodes_reusing(()) == set()
  pool.set_roles(["both", "pdd", "pdp"], reason="test")
  # Node 0 prefills its own requests now: node 2's prefix reaches only node 1.
  assert pool.decode_nodes_reusing({2}) == {1}
  assert pool.decode_nodes_reusing({0}) == {0, 1}  # itself, and node 1 through its PD-P


def test_drain_completes_on_release(pool):
  d = pool.pick(NodeKind.DECODE, prefer=0)
  assert d == 0
  moves = pool.set_roles(["pdp", "pdd", "pdd"], reason="test")
  assert {m.node for m in moves} == {0, 2}
  # Node 2 had no PD-P work: its move completed at once. Node 0 drains its
  # decode stream and serves nothing meanwhile.
  assert pool.split_now() == (1, True)
  assert pool.roles_info()[0]["draining"] and not pool.roles_info()[2]["draining"]
  assert {pool.pick(NodeKind.DECODE) for _ in range(4)} == {1, 2}
  assert pool.pick(NodeKind.PDP) is None
  pool.release(NodeKind.DECODE, 0)
  n_p, moving = pool.split_now()
  assert not moving and pool.roles() == ["pdp", "pdd", "pdd"]
  assert all(m["completed"] is not None for m in pool.role_moves)
  assert pool.counters["role_moves"] == 2 and pool.counters["role_moves_completed"] == 2


def test_bad_roles_are_refused(pool):
  with pytest.raises(pd_roles.RoleError):
    pool.set_roles(["pdp", "pdp", "pdp"])  # no node left to decode
  assert pool.roles() == ["pdd", "pdd", "pdp"]
  with pytest.raises(ValueError, match="2 roles for 3 PD nodes"):
    NodePool([], [DecodeTarget(f"127.0.0.1:{n}", "x") for n in (1, 3, 5)], roles=["pdd", "pdp"])


def test_other_decode_healthy_and_index(pool):
  assert pool.decode_index("127.0.0.1:3") == 1 and pool.decode_index("nope") == -1
  assert pool.other_decode_healthy(0)
  pool.mark_down(NodeKind.DECODE, 1, "t")
  pool.mark_down(NodeKind.DECODE, 2, "t")
  assert not pool.other_decode_healthy(0)


def test_reported_load_is_kept_per_node_and_shown_with_roles(pool):
  """The live view hands the pool each accepted GetLoad report: PD nodes' show
  in roles_info next to the broker's in-flight count; picking is unchanged."""
  from paas_jax.proto import serving_pb2
  assert pool.reported_load(NodeKind.DECODE, 1) is None
  assert "reported" not in pool.roles_info()[1]
  pool.observe_load("decode", 1, serving_pb2.LoadReport(
      server="decode", prefill_queue_depth=2, decode_slots_total=8, decode_slots_busy=5,
      decode_waiting=1))
  pool.observe_load("prefill", 0, serving_pb2.LoadReport(server="prefill",
                                                         prefill_queue_depth=7))
  r = pool.reported_load(NodeKind.DECODE, 1)
  assert (r.prefill_queue, r.decode_slots_busy, r.decode_slots_total, r.decode_waiting) == (
      2, 5, 8, 1)
  assert pool.reported_load(NodeKind.PDP, 1) == r  # PD-P reads its PD node's report
  assert pool.reported_load(NodeKind.PREFILL, 0).prefill_queue == 7
  assert pool.reported_load(NodeKind.DECODE, 0) is None
  assert pool.roles_info()[1]["reported"] == {"pdp_queue": 2, "decode_slots_busy": 5,
                                              "decode_slots_total": 8, "decode_waiting": 1}
  assert pool.load(NodeKind.DECODE, 1) == 0  # the broker's own count is separate
