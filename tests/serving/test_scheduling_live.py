"""Issue 7, live part: the broker's adaptive router and the prefix caches of both regions.

Uses the session cluster (conftest.py: both regions prefill through a
HybridPrefixCache with 64-token blocks). Routing decisions are checked through
an in-process broker whose ``AdaptiveRouterPolicy`` reads a crafted
``ClusterView``, in front of the cluster's real prefill and decode servers.
"""

from __future__ import annotations

import json

import grpc
import numpy as np
import pytest

from paas_jax.client import BrokerClient
from paas_jax.proto import serving_pb2, serving_pb2_grpc
from paas_jax.scheduling import ClusterView, PrfaasRouter, RouterConfig
from paas_jax.serving import broker as broker_lib
from paas_jax.serving.live_view import LiveClusterState, rebalance_step
from paas_jax.serving.routing import AdaptiveRouterPolicy

from tests.serving.conftest import CONFIG, PREFIX_BLOCK, THRESHOLD

SCARCE = ClusterView(link_bandwidth_bps=200e6, link_utilization=0.5)  # not congested
ABUNDANT = ClusterView(link_bandwidth_bps=200e6, link_utilization=0.0)


def _tokens(length: int, salt: int) -> list[int]:
  rng = np.random.default_rng(7000 + salt)
  return [int(t) for t in rng.integers(0, 256, length)]


def _stats(stub) -> dict:
  return dict(stub.GetStats(serving_pb2.StatsRequest(), timeout=10).gauges)


@pytest.fixture(scope="module")
def client(cluster):
  with BrokerClient(cluster.broker_address, timeout_s=120) as c:
    yield c


@pytest.fixture(scope="module")
def targets(cluster):
  with BrokerClient(cluster.broker_address) as c:
    s = c.stats()
  return s["prefill"], [broker_lib.DecodeTarget(**d) for d in s["decode"]]


@pytest.fixture(scope="module")
def adaptive(targets):
  """(client, holder): an in-process adaptive broker; holder["view"] is what it sees."""
  from paas_jax.models import load_config
  prefill, decode = targets
  holder = {"view": ABUNDANT}
  policy = AdaptiveRouterPolicy(PrfaasRouter(RouterConfig(threshold_tokens=THRESHOLD)),
                                view=lambda: holder["view"])
  server = broker_lib.start(load_config(CONFIG), policy, prefill_targets=prefill,
                            decode_targets=decode)
  # Prefix probes only: the policy keeps the crafted view.
  server.servicer.enable_live_view(200e6, rebalance_every_s=0)
  assert policy.view is not None and policy.view() is holder["view"]
  with BrokerClient(server.address, timeout_s=120) as c:
    yield c, holder, server
  server.servicer.close()
  server.stop()


@pytest.fixture(scope="module")
def region_stubs(targets):
  prefill, decode = targets
  chans = [grpc.insecure_channel(prefill[0]), grpc.insecure_channel(decode[0].control)]
  yield serving_pb2_grpc.PrefillStub(chans[0]), serving_pb2_grpc.DecodeStub(chans[1])
  for c in chans:
    c.close()


def _route_info(server, request_id: str) -> dict:
  s = json.loads(server.servicer.GetStats(serving_pb2.StatsRequest(), None).json)
  return next(r for r in s["recent"] if r["request_id"] == request_id)


def test_cold_requests_follow_the_threshold_in_both_regimes(adaptive, reference):
  client, holder, server = adaptive
  for name, view in (("scarce", SCARCE), ("abundant", ABUNDANT)):
    holder["view"] = view
    for length, expected in ((40, "pdp"), (200, "prfaas")):
      prompt = _tokens(length, length + (0 if name == "scarce" else 1))
      out = client.generate(prompt_ids=prompt, max_new_tokens=6, request_id=f"cold-{name}-{length}")
      assert out.route == expected, (name, length, out.summary)
      assert out.tokens == reference(tuple(prompt), 6)
      info = _route_info(server, f"cold-{name}-{length}")
      assert info["route_reason"].startswith(f"adaptive:{name}:")
      assert info["bandwidth_mode"] == name and info["threshold"] == THRESHOLD


def test_congested_link_raises_the_threshold(adaptive):
  client, holder, server = adaptive
  holder["view"] = ClusterView(link_bandwidth_bps=200e6, link_utilization=0.95)
  prompt = _tokens(180, 3)  # 180 > t = 100, but <= 2t: kept local while the link is hot
  out = client.generate(prompt_ids=prompt, max_new_tokens=4, request_id="congested")
  assert out.route == "pdp"
  info = _route_info(server, "congested")
  assert "raised:congested_link" in info["route_reason"] and info["threshold"] == 2 * THRESHOLD


def test_prefix_cached_in_the_other_region(adaptive, reference, region_stubs):
  """A prefix only region A holds: scarce -> offload and reuse it there; abundant ->
  the router wants it shipped to PD-P; with the broker's prefix transfers off
  the scarce test decides (still PrfaaS). Once PD holds it too, abundant keeps
  it local. (The transfers themselves: tests/serving/test_prefix_transfer.py.)"""
  client, holder, server = adaptive
  prefill_stub, decode_stub = region_stubs
  shared = _tokens(3 * PREFIX_BLOCK, 11)
  warm = shared + _tokens(30, 12)
  out = client.generate(prompt_ids=warm, max_new_tokens=4, route="remote", request_id="warm-a")
  assert out.route == "prfaas"
  prompt = shared + _tokens(40, 13)  # 232 tokens, 40 past the shared prefix
  probe = serving_pb2.StatsRequest(prefix_probe_ids=prompt)
  assert prefill_stub.GetStats(probe, timeout=10).gauges["prefix_cached_tokens"] == len(shared)
  assert decode_stub.GetStats(probe, timeout=10).gauges["prefix_cached_tokens"] == 0

  holder["view"] = SCARCE
  out = client.generate(prompt_ids=prompt, max_new_tokens=8, request_id="other-scarce")
  info = _route_info(server, "other-scarce")
  assert out.route == "prfaas" and info["prefix_source"] == "prfaas"
  assert (info["l_pd_cached"], info["l_prfaas_cached"]) == (0, len(shared))
  assert out.summary["cached_tokens"] == len(shared)  # reused by region A
  assert out.tokens == reference(tuple(prompt), 8)

  holder["view"] = ABUNDANT
  server.servicer.enable_prefix_transfer(enabled=False)
  try:
    out = client.generate(prompt_ids=prompt, max_new_tokens=8, request_id="other-abundant")
  finally:
    server.servicer.enable_prefix_transfer()
  info = _route_info(server, "other-abundant")
  assert out.route == "prfaas"
  assert "no_cross_cluster_prefix(prfaas->pdp)" in info["route_reason"]
  assert out.tokens == reference(tuple(prompt), 8)

  # Now PD-P learns the prefix too; the abundant link keeps the request local.
  out = client.generate(prompt_ids=warm, max_new_tokens=4, route="local", request_id="warm-b")
  assert out.route == "pdp"
  out = client.generate(prompt_ids=prompt, max_new_tokens=8, request_id="local-hit")
  info = _route_info(server, "local-hit")
  assert out.route == "pdp" and info["prefix_source"] == "pdp"
  assert info["route_reason"].startswith("adaptive:abundant:short")
  assert out.summary["cached_tokens"] == len(shared)  # reused by PD-P
  assert out.tokens == reference(tuple(prompt), 8)


def test_shared_prefix_reuse_is_token_exact(client, reference):
  """Two sampled requests sharing a prefix through the launched (static) broker."""
  shared = _tokens(2 * PREFIX_BLOCK + 10, 21)
  for route in ("local", "remote"):
    outs = []
    for i in range(2):
      prompt = shared + _tokens(25 + i, 22 + i + (10 if route == "remote" else 0))
      out = client.generate(prompt_ids=prompt, max_new_tokens=10, temperature=0.8, top_k=40,
                            top_p=0.95, seed=5 + i, route=route)
      assert out.tokens == reference(tuple(prompt), 10, 0.8, 40, 0.95, 5 + i)
      outs.append(out)
    assert outs[1].summary["cached_tokens"] >= 2 * PREFIX_BLOCK, route


def test_transfer_owned_entries_released(client, region_stubs):
  """Region A keeps the shared blocks of a remote prompt but drops the entries it
  made only for the transfer (the last block and its checkpoint) afterwards."""
  prefill_stub, _ = region_stubs
  before = _stats(prefill_stub).get("prefix_released_bytes", 0.0)
  prompt = _tokens(4 * PREFIX_BLOCK, 31)  # block-aligned: the last block is transfer-only
  out = client.generate(prompt_ids=prompt, max_new_tokens=3, route="remote")
  assert out.route == "prfaas"
  after = _stats(prefill_stub).get("prefix_released_bytes", 0.0)
  assert after > before
  longer = serving_pb2.StatsRequest(prefix_probe_ids=prompt + [1, 2])
  # Blocks 0-2 stay (shared, owner None); block 3 went with the transfer.
  assert prefill_stub.GetStats(longer, timeout=10).gauges["prefix_cached_tokens"] == (
      3 * PREFIX_BLOCK)


def test_broker_stats_report_router_and_rebalance(adaptive):
  _, _, server = adaptive
  info = json.loads(server.servicer.GetStats(serving_pb2.StatsRequest(), None).json)["router"]
  assert info["policy"] == "AdaptiveRouterPolicy" and info["threshold_tokens"] == THRESHOLD
  assert info["live_view"]["link_bandwidth_bps"] == 200e6


# -- no servers needed ---------------------------------------------------------------------

class _Clock:
  def __init__(self):
    self.t = 100.0

  def __call__(self):
    return self.t


def test_live_state_link_utilization_and_backlog():
  clock = _Clock()
  live = LiveClusterState([], [], link_bandwidth_bps=8e6, window_s=2.0, clock=clock)
  assert live.view().link_utilization == 0.0
  live.transfer_started("a", 100)
  assert live.backlog_bytes() == 0.0  # nothing measured yet to estimate from
  live.transfer_finished("a", prompt_tokens=100, nbytes=1e6, duration_s=1.0)
  # 1 MB in the last 2 s of a 1 MB/s link: 50%.
  assert live.view().link_utilization == pytest.approx(0.5)
  live.transfer_finished("b", prompt_tokens=300, nbytes=2e6, duration_s=1.0)
  live.transfer_started("c", 200)
  assert live.backlog_bytes() == pytest.approx(1.5e6)  # c + k*l through both samples
  v = live.view()
  assert v.link_utilization == 1.0 and v.link_backlog_bytes == pytest.approx(1.5e6)
  clock.t += 5.0
  assert live.view().link_utilization == 0.0


def test_rebalance_step_resolves_t_from_measurements():
  rng = np.random.default_rng(0)
  rows = []
  for _ in range(40):
    n = int(rng.integers(30, 600))
    route = "prfaas" if n > 150 else "pdp"
    rows.append({"route": route, "input_tokens": n, "cached_tokens": 0, "output_tokens": 16,
                 "prefill_s": 0.01 + 1e-4 * n * (0.5 if route == "prfaas" else 1.0),
                 "link_bytes": 5e4 + 500 * n if route == "prfaas" else None})
  assert rebalance_step(rows[:3], threshold=150, n_slots=8,
                        link_bandwidth_bps=1e8)["status"].startswith("waiting")
  p = rebalance_step(rows, threshold=150, n_slots=8, link_bandwidth_bps=1e8)
  assert p["status"] == "ok", p
  assert p["proposed_split"] == {"n_prfaas": 1, "n_p": 1, "n_d": 1}
  assert p["proposed_lambda_max"] >= p["current_lambda_max"] > 0
  assert "prfaas_prefill" in p["calibrated"] and "s_kv" in p["calibrated"]
