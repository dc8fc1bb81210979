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
from paas_jax.scheduling import (ClusterView, FinishedRequest, PrfaasRouter, RouterConfig,
                                 rebalance_step)
from paas_jax.serving import broker as broker_lib
from paas_jax.serving.live_view import LiveClusterState
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
      assert info["route_rule"] == f"{name}:{'short' if expected == 'pdp' else 'long'}"
      assert info["bandwidth_mode"] == name and info["threshold"] == THRESHOLD


def test_congested_link_raises_the_threshold(adaptive):
  client, holder, server = adaptive
  holder["view"] = ClusterView(link_bandwidth_bps=200e6, link_utilization=0.95)
  prompt = _tokens(180, 3)  # 180 > t = 100, but <= 2t: kept local while the link is hot
  out = client.generate(prompt_ids=prompt, max_new_tokens=4, request_id="congested")
  assert out.route == "pdp"
  info = _route_info(server, "congested")
  assert "raised:congested_link" in info["route_reason"] and info["threshold"] == 2 * THRESHOLD
  assert info["threshold_adjustment"] == "raised:congested_link"


def test_prefix_cached_in_the_other_region(adaptive, reference, region_stubs):
  """A prefix only region A holds: scarce -> offload and reuse it there; abundant ->
  the router wants it shipped to PD-P; with the broker's prefix transfers off
  the scarce test decides (still PrfaaS). Once PD holds it too, abundant keeps
  it local. (The transfers themselves: tests/serving/test_prefix_transfer.py.)"""
  client, holder, server = adaptive
  prefill_stub, decode_stub = region_stubs
  # Region A streams remote prefills chunk by chunk and caches chunk ends (every
  # 128 tokens here), so the shared prefix is two whole chunks.
  shared = _tokens(4 * PREFIX_BLOCK, 11)
  warm = shared + _tokens(30, 12)
  out = client.generate(prompt_ids=warm, max_new_tokens=4, route="remote", request_id="warm-a")
  assert out.route == "prfaas"
  prompt = shared + _tokens(40, 13)  # 296 tokens, 40 past the shared prefix
  probe = serving_pb2.PrefixProbeRequest(prompt_ids=prompt)
  assert prefill_stub.ProbePrefix(probe, timeout=10).cached_tokens == len(shared)
  assert decode_stub.ProbePrefix(probe, timeout=10).cached_tokens == 0

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


def test_streamed_prompt_caches_chunk_ends_only(client, region_stubs):
  """Region A streams a remote prompt's chunks as they are computed: it keeps
  the chunk ends strictly inside the prompt as shared entries and makes no
  transfer-only entries (the state leaves from the computation itself), so
  nothing is released afterwards. (The store-then-send path, which caches
  every block and releases the transfer's own last block, is
  ``stream_chunks=False``: tests/serving/test_engine.py covers its cache.)"""
  prefill_stub, _ = region_stubs
  before = _stats(prefill_stub).get("prefix_released_bytes", 0.0)
  prompt = _tokens(4 * PREFIX_BLOCK, 31)  # two 128-token chunks
  out = client.generate(prompt_ids=prompt, max_new_tokens=3, route="remote")
  assert out.route == "prfaas"
  assert _stats(prefill_stub).get("prefix_released_bytes", 0.0) == before
  longer = serving_pb2.PrefixProbeRequest(prompt_ids=prompt + [1, 2])
  # The first chunk's end stays; the prompt's own end is not cached.
  assert prefill_stub.ProbePrefix(longer, timeout=10).cached_tokens == 2 * PREFIX_BLOCK


def test_probe_by_hashes_answers_like_ids_over_grpc(client, region_stubs):
  """Both regions' ProbePrefix give the same cached prefix for the prompt's ids
  and for the hashes of its blocks (block size and fingerprint from GetLoad);
  a bad block_tokens is refused with INVALID_ARGUMENT (<= 0) or
  FAILED_PRECONDITION (not the server's). GetStats answers no probe: it is for
  people and Prometheus (the StatsRequest probe fields are reserved)."""
  from paas_jax.state import block_hashes, probe_tokens
  assert not {"prefix_probe_ids", "prefix_probe_hashes", "prefix_probe_block"} & set(
      serving_pb2.StatsRequest.DESCRIPTOR.fields_by_name)
  shared = _tokens(2 * PREFIX_BLOCK, 51)
  for route in ("remote", "local"):
    out = client.generate(prompt_ids=shared + _tokens(9, 52), max_new_tokens=2, route=route)
    assert out.route == ("prfaas" if route == "remote" else "pdp")
  prompts = [shared + _tokens(20, 53), shared[:PREFIX_BLOCK + 1], shared, _tokens(150, 54)]
  for stub in region_stubs:
    cache = stub.GetLoad(serving_pb2.LoadRequest(), timeout=10).prefix_cache
    block, fp = cache.block_tokens, cache.config_fingerprint
    assert cache.enabled and block == PREFIX_BLOCK
    assert "prefix_cached_tokens" not in stub.GetStats(serving_pb2.StatsRequest(),
                                                       timeout=10).gauges
    answers = []
    for prompt in prompts:
      by_ids = stub.ProbePrefix(serving_pb2.PrefixProbeRequest(prompt_ids=prompt), timeout=10)
      hashed = serving_pb2.PrefixProbeRequest(
          block_hashes=block_hashes(probe_tokens(prompt), block, fp), block_tokens=block)
      answers.append(by_ids.cached_tokens)
      assert stub.ProbePrefix(hashed, timeout=10).cached_tokens == answers[-1]
    # Region A (streamed remote prefills) caches 128-token chunk ends; PD-P
    # (store-then-send / local prefill) caches every 64-token block.
    expected = ([2 * PREFIX_BLOCK, 0, 0, 0] if stub is region_stubs[0]
                else [2 * PREFIX_BLOCK, PREFIX_BLOCK, PREFIX_BLOCK, 0])
    assert answers == expected
    hashes = block_hashes(probe_tokens(prompts[0]), block, fp)
    for bad, code, msg in ((0, grpc.StatusCode.INVALID_ARGUMENT, "must be > 0"),
                           (-64, grpc.StatusCode.INVALID_ARGUMENT, "must be > 0"),
                           (block // 2, grpc.StatusCode.FAILED_PRECONDITION,
                            f"uses {block}-token blocks")):
      with pytest.raises(grpc.RpcError) as err:
        stub.ProbePrefix(serving_pb2.PrefixProbeRequest(block_hashes=hashes,
                                                        block_tokens=bad), timeout=10)
      assert err.value.code() == code and msg in err.value.details()
    for req, msg in ((serving_pb2.PrefixProbeRequest(), "give prompt_ids or block_hashes"),
                     (serving_pb2.PrefixProbeRequest(prompt_ids=prompts[0], block_hashes=hashes,
                                                     block_tokens=block), "not both"),
                     (serving_pb2.PrefixProbeRequest(block_hashes=[b"x" * 8],
                                                     block_tokens=block), "not 16")):
      with pytest.raises(grpc.RpcError) as err:
        stub.ProbePrefix(req, timeout=10)
      assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, req
      assert msg in err.value.details()


def _wait_for(predicate, timeout_s: float = 10.0) -> bool:
  import time
  end = time.monotonic() + timeout_s
  while time.monotonic() < end:
    if predicate():
      return True
    time.sleep(0.05)
  return predicate()


def test_link_gauges_match_the_brokers_link_bytes(adaptive, region_stubs, reference):
  """Region A's link gauges after a run: nothing pending, and the bytes sent
  equal the broker's link_bytes of its PrfaaS requests plus its A->B prefix
  transfers; the broker's live view measures the link from them."""
  client, holder, server = adaptive
  prefill_stub, decode_stub = region_stubs
  before = _stats(prefill_stub)
  for key in ("link_bytes_pending", "link_bytes_sent_total", "link_transfers_active",
              "link_bytes_queued_total", "link_transfers_total"):
    assert key in before, key
  b_before = _stats(decode_stub)
  assert "link_bytes_sent_total" in b_before  # region B's prefix exports (B->A)
  ids = []
  holder["view"] = SCARCE
  for i, length in enumerate((180, 260, 330)):
    rid = f"link-gauges-{i}"
    out = client.generate(prompt_ids=_tokens(length, 60 + i), max_new_tokens=3, route="remote",
                          request_id=rid)
    assert out.route == "prfaas"
    ids.append(rid)
  # A prefix only region A holds, shipped A->B for a request PD-P prefills.
  shared = _tokens(2 * PREFIX_BLOCK, 65)
  out = client.generate(prompt_ids=shared + _tokens(20, 66), max_new_tokens=2, route="remote",
                        request_id="link-gauges-warm")
  ids.append("link-gauges-warm")
  holder["view"] = ABUNDANT
  prompt = shared + _tokens(30, 67)
  out = client.generate(prompt_ids=prompt, max_new_tokens=4, request_id="link-gauges-ship")
  assert out.tokens == reference(tuple(prompt), 4)
  ids.append("link-gauges-ship")
  holder["view"] = SCARCE

  def records():
    s = json.loads(server.servicer.GetStats(serving_pb2.StatsRequest(), None).json)
    return {r["request_id"]: r for r in s["recent"] if r["request_id"] in ids}
  # link_bytes lands when the broker reads TransferDone, which may trail the tokens.
  assert _wait_for(lambda: all(r["link_bytes"] > 0 for r in records().values()
                               if r["route"] == "prfaas") and len(records()) == len(ids))
  recs = records()
  assert recs["link-gauges-ship"]["prefix_transfer"] == "prfaas->pdp", recs["link-gauges-ship"]
  expected = (sum(r["link_bytes"] for r in recs.values() if r["route"] == "prfaas")
              + sum(r["prefix_transfer_bytes"] for r in recs.values()
                    if r["prefix_transfer"].startswith("prfaas->")))
  after = _stats(prefill_stub)
  assert after["link_bytes_pending"] == 0 and after["link_transfers_active"] == 0
  assert after["link_bytes_sent_total"] - before["link_bytes_sent_total"] == expected
  # Each streamed chunk is a transfer of its own: at least one per request.
  assert after["link_transfers_total"] - before["link_transfers_total"] >= len(ids)
  # The broker's live view reads them: measured utilization, backlog 0.
  live = server.servicer.live
  assert _wait_for(lambda: live.snapshot()["link_measured"])
  assert _wait_for(lambda: live.backlog_bytes() == 0)
  assert live.snapshot()["probe_requests"] > 0
  # The polls taught it both regions' blocks: its probes carry hashes, not ids.
  probes = live.probe_requests_for(prompt)
  assert {side for side, _, _ in probes} == {"pdp", "prfaas"}
  assert all(r.block_hashes and not r.prompt_ids for _, _, r in probes)
  # What it read: the typed GetLoad reports, which agree with the GetStats gauges.
  load = prefill_stub.GetLoad(serving_pb2.LoadRequest(), timeout=10)
  stats = _stats(prefill_stub)
  assert load.server == "prefill" and load.link.link == "A->B"
  assert load.link.bytes_sent_total == stats["link_bytes_sent_total"] == (
      after["link_bytes_sent_total"])
  assert load.link.bytes_pending == 0 and load.link.transfers_active == 0
  assert load.prefill_queue_depth == stats["queue"] == 0
  assert (load.prefix_cache.enabled, load.prefix_cache.block_tokens) == (True, PREFIX_BLOCK)
  d_load = decode_stub.GetLoad(serving_pb2.LoadRequest(), timeout=10)
  d_stats = _stats(decode_stub)
  assert d_load.server == "decode" and d_load.link.link == "B->A"
  assert d_load.link.bytes_sent_total == d_stats["link_bytes_sent_total"]
  assert (d_load.decode_slots_total, d_load.prefill_queue_depth) == (
      d_stats["slots_total"], d_stats["pdp_queue"])
  assert live.snapshot()["refused_reports"] == 0
  # The node pool keeps the PD nodes' reports (GetStats json router.roles).
  roles = json.loads(server.servicer.GetStats(serving_pb2.StatsRequest(), None).json)
  reported = roles["router"]["roles"][0]["reported"]
  assert reported["decode_slots_total"] == d_stats["slots_total"]


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
    rows.append(FinishedRequest(
        route=route, input_tokens=n, cached_tokens=0, output_tokens=16,
        prefill_s=0.01 + 1e-4 * n * (0.5 if route == "prfaas" else 1.0),
        link_bytes=5e4 + 500 * n if route == "prfaas" else None))
  assert rebalance_step(rows[:3], threshold=150, n_slots=8,
                        link_bandwidth_bps=1e8)["status"].startswith("waiting")
  p = rebalance_step(rows, threshold=150, n_slots=8, link_bandwidth_bps=1e8)
  assert p["status"] == "ok", p
  assert p["proposed_split"] == {"n_prfaas": 1, "n_p": 1, "n_d": 1}
  assert p["proposed_lambda_max"] >= p["current_lambda_max"] > 0
  assert "prfaas_prefill" in p["calibrated"] and "s_kv" in p["calibrated"]


def _report(pending: float | None = None, sent_total: float = 0.0, rows: dict | None = None,
            *, server: str = "prefill", queue: int = 0,
            cache: serving_pb2.PrefixCacheInfo | None = None) -> serving_pb2.LoadReport:
  """A server's GetLoad answer: its link (None: ``pending`` None, an
  unmeasured link), in-flight ``rows`` by transfer id, queue and prefix cache."""
  link = None
  if pending is not None:
    link = serving_pb2.LinkLoad(
        link="A->B" if server == "prefill" else "B->A", bytes_pending=int(pending),
        bytes_sent_total=int(sent_total),
        transfers=[serving_pb2.LinkTransferLoad(transfer_id=tid, pending_bytes=int(r["pending"]),
                                                sent_bytes=int(r["sent"]),
                                                encoded=r["encoded"])
                   for tid, r in (rows or {}).items()])
  return serving_pb2.LoadReport(
      server=server, prefill_queue_depth=queue, link=link,
      prefix_cache=cache or serving_pb2.PrefixCacheInfo(enabled=False))


def test_live_backlog_from_server_gauges_counts_nothing_twice():
  """Backlog = the servers' measured pending + estimates only for transfers
  they do not list yet (a fake sequence of GetLoad answers)."""
  clock = _Clock()
  live = LiveClusterState([None], [None], link_bandwidth_bps=8e6, window_s=2.0, clock=clock)
  live.transfer_finished("old1", prompt_tokens=100, nbytes=1e6, duration_s=1.0)
  live.transfer_finished("old2", prompt_tokens=300, nbytes=2e6, duration_s=1.0)
  live.transfer_started("r1", 200)  # estimate 1.5e6 (c + k*l)
  est = live.estimate_bytes(200)
  assert est == pytest.approx(1.5e6)
  assert live.backlog_bytes() == pytest.approx(est)  # no gauges yet: estimate only
  # r1 waits for its prefill batch: the server does not list it; another
  # sender's transfer ("x") has 1e5 bytes pending on the link.
  live.ingest("prefill", 0, _report(1e5, 0, {"x": {
      "pending": 1e5, "sent": 0, "encoded": True}}))
  assert live.backlog_bytes() == pytest.approx(1e5 + est)
  # r1 streams layer by layer: measured pending + what the estimate says is left.
  live.ingest("prefill", 0, _report(3e5, 4e5, {"r1": {
      "pending": 3e5, "sent": 4e5, "encoded": False}}))
  assert live.backlog_bytes() == pytest.approx(3e5 + (est - 4e5 - 3e5))
  # Every layer encoded: only the measurement is left.
  live.ingest("prefill", 0, _report(2e5, 1.3e6, {"r1": {
      "pending": 2e5, "sent": 1.3e6, "encoded": True}}))
  assert live.backlog_bytes() == pytest.approx(2e5)
  # Committed at the server before the broker read TransferDone: nothing left,
  # and the estimate does not come back.
  live.ingest("prefill", 0, _report(0, 1.5e6, {}))
  assert live.backlog_bytes() == 0
  live.transfer_finished("r1", prompt_tokens=200, nbytes=1.5e6, duration_s=1.0)
  assert live.backlog_bytes() == 0
  # Region B's prefix exports (B->A) are ingress, never the router's backlog.
  live.ingest("decode", 0, _report(7e4, 9e4, server="decode", queue=2))
  assert live.backlog_bytes() == 0 and live.ingress_pending_bytes() == 7e4
  assert live.view().pdp_queue_depth == 2
  # A prefill server reporting no link: back to the estimates.
  live.transfer_started("r2", 200)
  live.ingest("prefill", 0, _report(queue=1))
  assert live.backlog_bytes() == pytest.approx(est)


def test_live_utilization_is_the_rate_of_sent_bytes():
  """Utilization = rate of link_bytes_sent_total over the window, from polls;
  TransferDone records only when the servers report no link."""
  clock = _Clock()
  live = LiveClusterState([None, None], [], link_bandwidth_bps=8e6, window_s=2.0,
                          clock=clock)  # 8 Mbit/s = 1e6 B/s
  # A TransferDone of 2 MB: ignored while the gauges measure the link.
  live.transfer_finished("a", prompt_tokens=100, nbytes=2e6, duration_s=0.5)
  for t, (s0, s1) in ((99.0, (0, 0)), (100.0, (2e5, 0)), (101.0, (6e5, 2e5)),
                      (102.0, (9e5, 4e5))):
    clock.t = t
    live.ingest("prefill", 0, _report(0, s0))
    live.ingest("prefill", 1, _report(0, s1))
  # Window [100, 102]: (9e5 - 2e5) + (4e5 - 0) bytes in 2 s = 0.55e6 B/s.
  assert live.measured_link_rate() == pytest.approx(0.55e6)
  assert live.view().link_utilization == pytest.approx(0.55)
  clock.t = 102.5  # between polls: the window ends at the latest poll
  live.ingest("prefill", 0, _report(0, 1.0e6))
  # Server 0: window [100.5, 102.5]; the counter at 100.5 is interpolated (4e5).
  assert live.measured_link_rate() == pytest.approx((1.0e6 - 4e5) / 2.0 + 4e5 / 2.0)
  clock.t = 110.0  # no poll for longer than the window: nothing measured as sent
  assert live.view().link_utilization == 0.0
  # A restarted server (counter back to 0) starts a new series.
  live.ingest("prefill", 0, _report(0, 1e3))
  clock.t = 111.0
  live.ingest("prefill", 0, _report(0, 5e5))
  assert live.measured_link_rate() == pytest.approx(4.99e5)
  # A server reporting no link: TransferDone accounting again.
  live.ingest("prefill", 1, _report())
  assert live.measured_link_rate() is None
  live.transfer_finished("b", prompt_tokens=100, nbytes=1e6, duration_s=1.0)
  assert live.view().link_utilization == pytest.approx(0.5)
  assert live.snapshot()["link_measured"] is False


class _FakeFuture:
  def __init__(self, fn):
    try:
      self._value, self._error = fn(), None
    except grpc.RpcError as e:
      self._value, self._error = None, e

  def result(self):
    if self._error is not None:
      raise self._error
    return self._value


class _FakeRpcError(grpc.RpcError):
  def __init__(self, code, details):
    super().__init__(details)
    self._code, self._details = code, details

  def code(self):
    return self._code

  def details(self):
    return self._details


class _FakeContext:
  def abort(self, code, details):
    raise _FakeRpcError(code, details)


class _CacheEngine:
  """The prefix-cache side of a ``PrefillEngine`` over an in-process cache."""

  def __init__(self, cache):
    self.prefix_cache = cache


class _Method:
  def __init__(self, fn):
    self.fn = fn

  def future(self, req, timeout=None):
    del timeout
    return _FakeFuture(lambda: self.fn(req))


class _CacheStub:
  """A server's GetLoad and ProbePrefix (the servers' own ``control_plane``
  code) over an in-process HybridPrefixCache (no gRPC); keeps the probes it got."""

  def __init__(self, cache, server: str):
    from paas_jax.serving import control_plane
    self.requests, engine = [], _CacheEngine(cache)

    def probe(req):
      self.requests.append(req)
      return control_plane.probe_prefix(engine, req, _FakeContext())
    self.ProbePrefix = _Method(probe)
    self.GetLoad = _Method(lambda req: serving_pb2.LoadReport(
        server=server, prefix_cache=control_plane.prefix_cache_info(engine)))


def test_hashed_probes_answer_like_ids_and_fall_back():
  """The broker probes by ids until a poll taught it a server's block and
  fingerprint, then by hashes (same answers); a server whose block changed
  answers FAILED_PRECONDITION and gets ids again until the next poll."""
  import dataclasses

  import jax.numpy as jnp

  from paas_jax.models import load_config
  from paas_jax.state import HybridPrefixCache, init_state

  config = load_config(CONFIG)
  caches = [HybridPrefixCache(config, block_size=PREFIX_BLOCK),
            HybridPrefixCache(config, block_size=PREFIX_BLOCK // 2)]
  shared = _tokens(3 * PREFIX_BLOCK, 41)
  for cache, n in ((caches[0], 2 * PREFIX_BLOCK), (caches[1], 3 * PREFIX_BLOCK)):
    state = dataclasses.replace(init_state(config, 1, n),
                                lengths=jnp.full((1,), n, jnp.int32))
    cache.insert(shared[:n], state)
  pd, pf = _CacheStub(caches[0], "decode"), _CacheStub(caches[1], "prefill")
  live = LiveClusterState([pf], [pd], link_bandwidth_bps=1e9)
  prompts = [shared + _tokens(9, 42), shared[:PREFIX_BLOCK + 3], shared[:2 * PREFIX_BLOCK],
             _tokens(300, 43), shared[:10]]
  by_ids = [live.probe_prefix(p) for p in prompts]
  assert by_ids[0] == (2 * PREFIX_BLOCK, 3 * PREFIX_BLOCK)
  assert all(r.prompt_ids and not r.block_hashes for r in pd.requests + pf.requests)
  live.poll_once()  # learns the block size and fingerprint of both
  pd.requests.clear(), pf.requests.clear()
  assert [live.probe_prefix(p) for p in prompts] == by_ids
  assert all(r.block_hashes and not r.prompt_ids for r in pd.requests + pf.requests)
  assert {r.block_tokens for r in pd.requests} == {PREFIX_BLOCK}
  assert {r.block_tokens for r in pf.requests} == {PREFIX_BLOCK // 2}
  # shared[:10] has no complete block before its last token: no probe at all.
  assert len(pd.requests) == 4 and len(pf.requests) == 4
  # Region A restarts with another block size: the old hashes are refused...
  live._probe_info[("prfaas", 0)] = (PREFIX_BLOCK, config.fingerprint())
  pf.requests.clear()
  assert live.probe_prefix(prompts[0]) == (2 * PREFIX_BLOCK, 0)
  assert pf.requests[-1].block_tokens == PREFIX_BLOCK
  # ... and forgotten: ids until the next poll.
  assert live.probe_prefix(prompts[0]) == by_ids[0]
  assert pf.requests[-1].prompt_ids
  # A server without a prefix cache is never probed.
  assert live.ingest("prefill", 0, serving_pb2.LoadReport(
      server="prefill", prefix_cache=serving_pb2.PrefixCacheInfo(enabled=False)))
  pf.requests.clear()
  assert live.probe_prefix(prompts[0]) == (2 * PREFIX_BLOCK, 0) and not pf.requests


def test_hashed_probe_is_much_smaller_than_ids():
  """The serialized probe of a 4096-token prompt with 64-token blocks: 63
  hashes of 16 bytes instead of 4096 varint ids (a property of the encoding)."""
  from paas_jax.serving import control_plane
  live = LiveClusterState([None], [], link_bandwidth_bps=1e9)
  rng = np.random.default_rng(5)
  prompt = [int(t) for t in rng.integers(0, 151_936, 4096)]  # a Qwen-sized vocabulary
  ids = serving_pb2.PrefixProbeRequest(prompt_ids=prompt)
  # A server whose cache is not learned yet (no poll) is probed by ids.
  assert live.probe_requests_for(prompt) == [("prfaas", 0, ids)]
  assert live.ingest("prefill", 0, serving_pb2.LoadReport(
      server="prefill", prefix_cache=serving_pb2.PrefixCacheInfo(
          enabled=True, block_tokens=64, config_fingerprint="f" * 16)))
  [(_, _, hashed)] = live.probe_requests_for(prompt)
  assert len(hashed.block_hashes) == 4095 // 64 == 63
  # field 2: 63 x (tag + length + 16 bytes); field 3: tag + varint(64).
  assert hashed.ByteSize() == 63 * 18 + 2
  assert ids.ByteSize() > 4 * 4096 * 0.7  # 3-byte varints plus the packed header
  assert hashed.ByteSize() / ids.ByteSize() < 0.1
  # Malformed probes are refused before any cache work (no engine needed), as
  # are a probe that gives nothing and one to a server without a cache
  # (FAILED_PRECONDITION).
  P = serving_pb2.PrefixProbeRequest
  no_cache = _CacheEngine(None)
  for req, code, msg in (
      (P(block_hashes=[b"x" * 16]), grpc.StatusCode.INVALID_ARGUMENT, "must be > 0"),
      (P(block_hashes=[b"x" * 8], block_tokens=64), grpc.StatusCode.INVALID_ARGUMENT, "not 16"),
      (P(prompt_ids=[1, 2], block_hashes=[b"x" * 16], block_tokens=64),
       grpc.StatusCode.INVALID_ARGUMENT, "not both"),
      (P(), grpc.StatusCode.INVALID_ARGUMENT, "give prompt_ids or block_hashes"),
      (P(prompt_ids=[1, 2]), grpc.StatusCode.FAILED_PRECONDITION, "no prefix cache")):
    with pytest.raises(_FakeRpcError) as err:
      control_plane.probe_prefix(no_cache, req, _FakeContext())
    assert err.value.code() == code and msg in err.value.details(), req


def _valid_report(**kw) -> serving_pb2.LoadReport:
  fields = dict(server="decode", prefill_queue_depth=3, decode_slots_total=4,
                decode_slots_busy=2, decode_waiting=1,
                link=serving_pb2.LinkLoad(link="B->A", bytes_sent_total=10),
                prefix_cache=serving_pb2.PrefixCacheInfo(enabled=True, block_tokens=64,
                                                         config_fingerprint="f" * 16))
  fields.update(kw)
  return serving_pb2.LoadReport(**fields)


@pytest.mark.parametrize("broken, why", [
    ({"server": "prefill"}, "answered as 'prefill'"),
    ({"server": ""}, "answered as ''"),
    ({"prefill_queue_depth": -1}, "negative counts: prefill_queue_depth=-1"),
    ({"decode_slots_busy": 5}, "5 busy decode slots of 4"),
    ({"prefix_cache": None}, "prefix_cache is missing"),
    ({"prefix_cache": serving_pb2.PrefixCacheInfo(enabled=True, config_fingerprint="f")},
     "block_tokens > 0"),
    ({"prefix_cache": serving_pb2.PrefixCacheInfo(enabled=True, block_tokens=64)},
     "config_fingerprint"),
    ({"link": serving_pb2.LinkLoad(transfers=[serving_pb2.LinkTransferLoad(pending_bytes=1)])},
     "without transfer_id"),
])
def test_malformed_load_reports_are_refused(broken, why):
  """A PD node's report with a wrong or missing field is refused: the view keeps
  the node's last good values and counts the refusal; the well-formed report
  (the control) is taken."""
  from paas_jax.serving import control_plane
  live = LiveClusterState([], [None], link_bandwidth_bps=1e9)
  seen = []
  live.on_load_report = lambda *a: seen.append(a)
  good = _valid_report()
  control_plane.check_load_report(good, "decode")
  assert live.ingest("decode", 0, good)
  assert live.view().pdp_queue_depth == 3 and live._probe_info[("pdp", 0)][0] == 64
  bad = _valid_report(**broken)
  with pytest.raises(control_plane.InvalidLoadReport, match=why):
    control_plane.check_load_report(bad, "decode")
  assert not live.ingest("decode", 0, bad)
  assert live.snapshot()["refused_reports"] == 1
  assert live.view().pdp_queue_depth == 3 and live._probe_info[("pdp", 0)][0] == 64


def test_load_report_without_link_is_flagged_unmeasured():
  """A prefill server's report without ``link`` is taken (queue, cache) but its
  link counts as unmeasured: utilization falls back to TransferDone records."""
  clock = _Clock()
  live = LiveClusterState([None], [], link_bandwidth_bps=8e6, window_s=2.0, clock=clock)
  live.transfer_finished("a", prompt_tokens=100, nbytes=1e6, duration_s=1.0)
  for t, sent in ((99.0, 0), (100.0, 2e5)):
    clock.t = t
    assert live.ingest("prefill", 0, _report(0, sent))
  assert live.snapshot()["link_measured"]
  assert live.view().link_utilization == pytest.approx(0.2)  # 2e5 B/s measured
  assert live.ingest("prefill", 0, _report(queue=4))
  assert not live.snapshot()["link_measured"]
  assert live.view().link_utilization == pytest.approx(0.5)  # 1 MB TransferDone in 2 s
  assert live.view().prfaas_queue_depth == 4 and live.refused_reports == 0


def test_poll_reads_get_load_with_a_deadline_and_counts_errors():
  """poll_once calls GetLoad on every server with the poll deadline; an error
  answer counts in poll_errors and keeps the last values."""
  calls = []

  class _Stub:
    def __init__(self, answer):
      def get_load(req):
        calls.append(req)
        if isinstance(answer, Exception):
          raise answer
        return answer
      self.GetLoad = _Method(get_load)

  live = LiveClusterState(
      [_Stub(_report(0, 10, queue=2))],
      [_Stub(_FakeRpcError(grpc.StatusCode.UNIMPLEMENTED, "no GetLoad"))],
      link_bandwidth_bps=1e9)
  live.poll_once()
  assert len(calls) == 2 and all(isinstance(c, serving_pb2.LoadRequest) for c in calls)
  assert live.prfaas_queue == [2] and live.poll_errors == 1 and live.polls == 1
