"""Cross-cluster prefix-cache transfer (``ExportPrefix``, paas_jax.serving.prefix_transfer).

In-process part: a real prefill server (region A, with its prefix import port)
and a real decode server (region B) in this process; prefixes move with the
real StateSender / StateReceiver over gRPC in both directions, and the
importer's cache must then hold exactly what the exporter's holds.

Cluster part: an in-process adaptive broker (crafted abundant-link view) in
front of the session cluster's processes (conftest.py), so the prefixes cross
the emulated WAN relay: A->B on the states' route, B->A on the route
LocalCluster opens to region A's prefix port.
"""

from __future__ import annotations

import json

import grpc
import jax
import numpy as np
import pytest

from paas_jax.models import api
from paas_jax.proto import serving_pb2, serving_pb2_grpc
from paas_jax.serving import common
from paas_jax.serving import decode_server, prefill_server
from paas_jax.serving.engine_config import EngineConfig
from paas_jax.serving.prefill_engine import PrefillInput
from paas_jax.serving.validation import RequestParams

from tests.serving.conftest import CONFIG, PREFIX_BLOCK, SEED, THRESHOLD

DEADLINE_S = 60.0
GREEDY = RequestParams(api.SamplingParams(0.0, 0, 1.0), seed=0, max_new_tokens=1)


def _tokens(length: int, salt: int) -> list[int]:
  rng = np.random.default_rng(9100 + salt)
  return [int(t) for t in rng.integers(0, 256, length)]


def _leaves(state) -> list[np.ndarray]:
  return [np.asarray(x) for x in jax.tree_util.tree_leaves(state)]


def _assert_same_state(a, b) -> None:
  la, lb = _leaves(a), _leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    assert x.shape == y.shape and x.dtype == y.dtype
    np.testing.assert_array_equal(x, y)


@pytest.fixture(scope="module")
def regions():
  """(prefill server, decode server, prefill stub, decode stub), in this process."""
  common.enable_compilation_cache(common.default_compilation_cache())
  model, _ = common.load_model(CONFIG, SEED)
  cfg = EngineConfig(n_slots=2, max_ctx=512, prefill_buckets=(128,), prefill_max_batch=1,
                     prefix_block=PREFIX_BLOCK)
  a = prefill_server.start(model, cfg, transfer_port=0, warmup=False)
  b = decode_server.start(model, cfg, warmup=False)
  chans = [grpc.insecure_channel(a.address), grpc.insecure_channel(b.address)]
  yield (a, b, serving_pb2_grpc.PrefillStub(chans[0]), serving_pb2_grpc.DecodeStub(chans[1]),
         model)
  for c in chans:
    c.close()
  a.stop()
  b.stop()


def _export(stub, prompt, target, transfer_id, **kw):
  return stub.ExportPrefix(serving_pb2.ExportPrefixRequest(
      transfer_id=transfer_id, model=CONFIG, prompt_ids=prompt, target=target, **kw),
      timeout=DEADLINE_S)


def test_export_a_to_b_is_bit_exact_and_reused_by_pdp(regions):
  a, b, a_stub, b_stub, model = regions
  shared = _tokens(2 * PREFIX_BLOCK, 1)
  a.servicer.engine.prefill([PrefillInput("warm", tuple(shared + _tokens(9, 2)), GREEDY)])
  prompt = shared + _tokens(20, 3)
  assert b.servicer.prefill_engine.cached_prefix_tokens(prompt) == 0

  r = _export(a_stub, prompt, b.transfer_address, "a-to-b")
  assert r.tokens == len(shared) and r.bytes_sent >= r.state_bytes > 0 and r.transfer_s > 0
  # In the cache of PD-P now, bit for bit what region A holds.
  assert b.servicer.prefill_engine.cached_prefix_tokens(prompt) == len(shared)
  got = b.servicer.prefill_engine.export_prefix(prompt)
  want = a.servicer.engine.export_prefix(prompt)
  assert got[0] == want[0] == len(shared)
  _assert_same_state(got[1], want[1])
  gauges = b_stub.GetStats(serving_pb2.StatsRequest(), timeout=10).gauges
  assert gauges["prefix_imports"] == 1 and gauges["prefix_import_tokens"] == len(shared)
  assert a_stub.GetStats(serving_pb2.StatsRequest(), timeout=10).gauges[
      "prefix_exports"] == 1

  # PD-P reuses it, and the tokens are those of single-process generation.
  events = list(b_stub.Decode(serving_pb2.DecodeRequest(
      request_id="after-import", model=CONFIG, prompt_ids=prompt, max_new_tokens=6),
      timeout=DEADLINE_S))
  cached = [e.prefill_cached_tokens for e in events
            if not e.accepted and not e.token_ids and not e.finished]
  tokens = [t for e in events for t in e.token_ids]
  assert cached and cached[0] == len(shared)
  assert tokens == api.generate(model, prompt, 6).tokens


def test_export_b_to_a_is_bit_exact_and_reused_by_prfaas(regions):
  a, b, a_stub, b_stub, model = regions
  shared = _tokens(2 * PREFIX_BLOCK, 11)
  b.servicer.prefill_engine.prefill([PrefillInput("warm", tuple(shared + [7] * 5), GREEDY)])
  prompt = shared + _tokens(30, 12)
  assert a.servicer.engine.cached_prefix_tokens(prompt) == 0

  r = _export(b_stub, prompt, a.transfer.address, "b-to-a", max_tokens=len(shared) + 10)
  assert r.tokens == len(shared)
  got = a.servicer.engine.export_prefix(prompt)
  want = b.servicer.prefill_engine.export_prefix(prompt)
  assert got[0] == len(shared)
  _assert_same_state(got[1], want[1])

  out, = a.servicer.engine.prefill([PrefillInput("after-import", tuple(prompt), GREEDY)])
  assert out.cached_tokens == len(shared)
  assert out.first_token == api.generate(model, prompt, 1).tokens[0]


def test_max_tokens_caps_the_export(regions):
  a, b, a_stub, _, _ = regions
  shared = _tokens(3 * PREFIX_BLOCK, 21)
  a.servicer.engine.prefill([PrefillInput("warm", tuple(shared + [1]), GREEDY)])
  r = _export(a_stub, shared + [2, 3], b.transfer_address, "capped",
              max_tokens=PREFIX_BLOCK + 5)
  assert r.tokens == PREFIX_BLOCK  # rounded down to a block
  assert b.servicer.prefill_engine.cached_prefix_tokens(shared + [2]) == PREFIX_BLOCK


@pytest.mark.parametrize("field, code, needle", [
    ({"model": "no-such-model"}, grpc.StatusCode.INVALID_ARGUMENT, "unknown model"),
    ({"transfer_id": ""}, grpc.StatusCode.INVALID_ARGUMENT, "transfer_id"),
    ({"target": ""}, grpc.StatusCode.INVALID_ARGUMENT, "target"),
    ({"prompt_ids": [1, 10**6]}, grpc.StatusCode.INVALID_ARGUMENT, "vocabulary"),
    ({"max_tokens": -1}, grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    ({"prompt_ids": list(range(200))}, grpc.StatusCode.NOT_FOUND, "no cached prefix"),
])
def test_export_refuses_bad_requests(regions, field, code, needle):
  _, b, a_stub, b_stub, _ = regions
  req = dict(transfer_id="bad", model=CONFIG, prompt_ids=[1, 2, 3], target=b.transfer_address)
  req.update(field)
  for stub in (a_stub, b_stub):
    with pytest.raises(grpc.RpcError) as e:
      stub.ExportPrefix(serving_pb2.ExportPrefixRequest(**req), timeout=10)
    assert e.value.code() == code and needle in e.value.details(), e.value.details()


def test_export_to_an_unreachable_target_is_unavailable(regions):
  a, _, a_stub, _, _ = regions
  shared = _tokens(PREFIX_BLOCK, 31)
  a.servicer.engine.prefill([PrefillInput("warm", tuple(shared + [5]), GREEDY)])
  with pytest.raises(grpc.RpcError) as e:
    _export(a_stub, shared + [6], "127.0.0.1:1", "nowhere")
  assert e.value.code() == grpc.StatusCode.UNAVAILABLE
  assert "127.0.0.1:1" in e.value.details()
  assert a_stub.GetStats(serving_pb2.StatsRequest(), timeout=10).gauges[
      "prefix_exports_failed"] >= 1


def test_prefill_transfer_port_takes_prefixes_only(regions):
  """Region A's import port refuses an ordinary state (not a "prefix:" id) at Begin."""
  a, _, _, _, _ = regions
  from paas_jax.transport import StateSender, TransferError
  from paas_jax.state import init_state
  cfg = a.servicer.config
  state = init_state(cfg, 1, 64).replace(lengths=np.asarray([64], np.int32))
  with StateSender(a.transfer.address) as sender:
    with pytest.raises(TransferError) as e:
      sender.send_state(state, model_id=cfg.name, config_fingerprint=cfg.fingerprint(),
                        transfer_id="req-1")
  assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
  assert "not a prefix transfer" in e.value.message


# -- through the session cluster (real processes, the emulated WAN relay) ----------------

@pytest.fixture(scope="module")
def shipping_broker(cluster):
  """(client, in-process adaptive broker): abundant link (crafted view), prefix
  probes and transfers against the session cluster's prefill and decode servers."""
  from paas_jax.client import BrokerClient
  from paas_jax.models import load_config
  from paas_jax.scheduling import ClusterView, PrfaasRouter, RouterConfig
  from paas_jax.serving import broker as broker_lib
  from paas_jax.serving.routing import AdaptiveRouterPolicy
  with BrokerClient(cluster.broker_address) as c:
    s = c.stats()
  # The launched broker got region A's prefix port through the relay's B->A route.
  assert len(s["prefill_transfer"]) == 1 and s["prefix_sources"] == ["pdp", "prfaas"]
  view = ClusterView(link_bandwidth_bps=200e6, link_utilization=0.0)
  policy = AdaptiveRouterPolicy(PrfaasRouter(RouterConfig(threshold_tokens=THRESHOLD)),
                                view=lambda: view)
  server = broker_lib.start(load_config(CONFIG), policy, prefill_targets=s["prefill"],
                            decode_targets=[broker_lib.DecodeTarget(**d) for d in s["decode"]])
  server.servicer.enable_prefix_transfer(s["prefill_transfer"])
  server.servicer.enable_live_view(200e6, rebalance_every_s=0)
  # The link checks below read utilization after a PD-P prefill that can take longer
  # than the default 2 s window on a loaded machine; a wide window keeps the prefix
  # bytes in view without changing what is counted.
  server.servicer.live.window_s = 30.0
  assert policy.cross_cluster_prefix == frozenset({"pdp", "prfaas"})
  with BrokerClient(server.address, timeout_s=120) as c:
    yield c, server
  server.stop()


def _record(server, request_id: str) -> dict:
  s = json.loads(server.servicer.GetStats(serving_pb2.StatsRequest(), None).json)
  return next(r for r in s["recent"] if r["request_id"] == request_id)


def test_cluster_ships_region_a_prefix_to_pdp(shipping_broker, reference, assert_logprobs):
  client, server = shipping_broker
  shared = _tokens(2 * PREFIX_BLOCK, 41)
  out = client.generate(prompt_ids=shared + _tokens(30, 42), max_new_tokens=2, route="remote")
  assert out.route == "prfaas"  # region A now holds the shared blocks, PD-P does not
  prompt = shared + _tokens(40, 43)  # 40 tokens past the prefix <= t: stays local
  live = server.servicer.live
  live.poll_once()
  sent_before = live.link_bytes_sent()
  out = client.generate(prompt_ids=prompt, max_new_tokens=8, request_id="ship-a-b",
                        logprobs=True, top_logprobs=3)
  live.poll_once()
  sent_after = live.link_bytes_sent()
  rec = _record(server, "ship-a-b")
  assert out.route == "pdp" and rec["prefix_source"] == "prfaas", rec
  assert (rec["l_pd_cached"], rec["l_prfaas_cached"]) == (0, len(shared))
  assert rec["prefix_transfer"] == "prfaas->pdp" and not rec["prefix_transfer_error"]
  assert rec["prefix_transfer_tokens"] == len(shared) and rec["prefix_transfer_bytes"] > 0
  assert "prefix_transfer(prfaas->pdp):128" in rec["route_reason"]
  assert out.summary["prefix_transfer_tokens"] == len(shared)
  assert out.summary["cached_tokens"] == len(shared)  # PD-P reused the shipped prefix
  assert out.tokens == reference(tuple(prompt), 8)
  gauges = server.servicer.GetStats(serving_pb2.StatsRequest(), None).gauges
  assert gauges["prefix_transfers"] >= 1
  # The link view counted the prefix bytes (A->B is the router's link). Its
  # cumulative counter, not the 2 s utilization window: on loaded CI machines the
  # request plus the reference can outlast the window.
  assert sent_after - sent_before >= rec["prefix_transfer_bytes"] > 0
  assert_logprobs(prompt, out)


def test_cluster_ships_pdp_prefix_to_region_a(shipping_broker, reference, assert_logprobs):
  client, server = shipping_broker
  shared = _tokens(3 * PREFIX_BLOCK, 51)
  out = client.generate(prompt_ids=shared + _tokens(20, 52), max_new_tokens=2, route="local")
  assert out.route == "pdp"  # PD-P now holds the prefix, region A does not
  prompt = shared + _tokens(150, 53)  # 150 tokens past the prefix > t: offloaded
  out = client.generate(prompt_ids=prompt, max_new_tokens=8, request_id="ship-b-a",
                        logprobs=True, top_logprobs=3)
  rec = _record(server, "ship-b-a")
  assert out.route == "prfaas" and rec["prefix_source"] == "pdp", rec
  assert rec["prefix_transfer"] == "pdp->prfaas" and not rec["prefix_transfer_error"]
  assert rec["prefix_transfer_tokens"] == len(shared) and rec["prefix_transfer_bytes"] > 0
  assert out.summary["cached_tokens"] == len(shared)  # region A reused it
  assert out.tokens == reference(tuple(prompt), 8)
  assert server.servicer.live.snapshot()["ingress_bytes"] >= rec["prefix_transfer_bytes"]
  assert_logprobs(prompt, out)


def test_cluster_failed_prefix_transfer_only_recomputes(shipping_broker, reference):
  client, server = shipping_broker
  shared = _tokens(2 * PREFIX_BLOCK, 61)
  client.generate(prompt_ids=shared + _tokens(20, 62), max_new_tokens=2, route="local")
  prompt = shared + _tokens(150, 63)
  good = server.servicer.prefill_transfer_targets
  server.servicer.enable_prefix_transfer(["127.0.0.1:1"])  # nobody listens there
  try:
    out = client.generate(prompt_ids=prompt, max_new_tokens=6, request_id="ship-fails")
  finally:
    server.servicer.enable_prefix_transfer(good)
  rec = _record(server, "ship-fails")
  assert out.route == "prfaas" and rec["prefix_transfer"] == "pdp->prfaas"
  assert rec["prefix_transfer_error"].startswith("UNAVAILABLE"), rec["prefix_transfer_error"]
  assert "prefix_transfer_failed(pdp->prfaas):UNAVAILABLE" in rec["route_reason"]
  assert rec["prefix_transfer_tokens"] == 0 and out.summary["cached_tokens"] == 0
  assert out.tokens == reference(tuple(prompt), 6)
  gauges = server.servicer.GetStats(serving_pb2.StatsRequest(), None).gauges
  assert gauges["prefix_transfer_failed"] >= 1


# -- no servers needed ---------------------------------------------------------------------

def test_policy_ships_only_the_sources_the_broker_can():
  from paas_jax.scheduling import ClusterView, PrfaasRouter, RouterConfig
  from paas_jax.serving.routing import AdaptiveRouterPolicy, RouteRequest
  view = ClusterView(link_bandwidth_bps=200e6, link_utilization=0.0)
  policy = AdaptiveRouterPolicy(PrfaasRouter(RouterConfig(threshold_tokens=100)),
                                view=lambda: view, cross_cluster_prefix=frozenset({"prfaas"}))
  # Prefix in region A, short remainder: kept local, the prefix is shipped A->B.
  d = policy.decide(RouteRequest(168, cached_prefix_tokens=0, prfaas_cached_tokens=128))
  assert (d.route, d.prefix_source, d.prefix_tokens) == ("pdp", "prfaas", 128)
  # Prefix in PD-P, long remainder: B->A is not available -> scarce fallback.
  d = policy.decide(RouteRequest(342, cached_prefix_tokens=192, prfaas_cached_tokens=0))
  assert d.route == "prfaas" and d.prefix_source == "none"
  assert "no_cross_cluster_prefix(pdp->prfaas):prfaas" in d.reason
  policy.cross_cluster_prefix = True
  d = policy.decide(RouteRequest(342, cached_prefix_tokens=192, prfaas_cached_tokens=0))
  assert (d.route, d.prefix_source, d.prefix_tokens) == ("prfaas", "pdp", 192)


def test_live_view_counts_a_to_b_prefixes_on_the_link_and_b_to_a_apart():
  from paas_jax.serving.live_view import LiveClusterState
  t = [100.0]
  live = LiveClusterState([], [], link_bandwidth_bps=8e6, window_s=2.0, clock=lambda: t[0])
  live.transfer_started("prefix:x", 128, direction="B->A")
  live.transfer_finished("prefix:x", prompt_tokens=128, nbytes=1e6, duration_s=1.0,
                         direction="B->A")
  assert live.link_utilization() == 0.0 and live.snapshot()["ingress_bytes"] == 1e6
  live.transfer_started("prefix:y", 128)
  live.transfer_finished("prefix:y", prompt_tokens=128, nbytes=1e6, duration_s=1.0)
  assert live.link_utilization() == pytest.approx(0.5)


def test_peer_rules_for_prefix_transfers():
  from paas_jax.security import PeerIdentityInterceptor, service_rules
  prefill = PeerIdentityInterceptor(service_rules("prefill"))
  decode = PeerIdentityInterceptor(service_rules("decode"))
  # Region A's transfer port takes states from PD nodes only (their prefixes).
  assert prefill.patterns_for("/paas_jax.transport.v1.StateTransfer/Begin") == ("decode*",)
  assert prefill.patterns_for("/paas_jax.serving.v1.Prefill/ExportPrefix") == ("broker*",)
  assert decode.patterns_for("/paas_jax.serving.v1.Decode/ExportPrefix") == ("broker*",)
