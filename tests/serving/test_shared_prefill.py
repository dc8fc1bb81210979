"""One region-A prefill pool serving two decode regions (real processes, slow).

Region B and region C each have their own PD node, emulated link (different
bandwidth and RTT), relay and broker; both brokers send long prompts to the
same region-A prefill server as tenants "B" and "C". Each region's answers are
token-exact, each state went to the region that asked (over its own link), and
region A accounts egress per tenant's link.
"""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest

from paas_jax.client import BrokerClient
from paas_jax.netem import LinkSpec
from paas_jax.proto import serving_pb2, serving_pb2_grpc
from paas_jax.serving.launch import ClusterSpec, LocalCluster

from tests.serving.conftest import (CONFIG, LONG, MAX_CTX, SEED, SHORT, THRESHOLD,
                                    relay_stats_reaching)

pytestmark = pytest.mark.slow


def _prompt(length: int, salt: int) -> list[int]:
  rng = np.random.default_rng(3000 + salt)
  return [int(t) for t in rng.integers(0, 256, length)]


def _prefill_stats(cluster) -> dict:
  with cluster.channel("prefill") as ch:
    r = serving_pb2_grpc.PrefillStub(ch).GetStats(serving_pb2.StatsRequest(), timeout=10)
  return dict(r.gauges)


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
  spec = ClusterSpec(config=CONFIG, seed=SEED, n_slots=4, max_queue=8, max_ctx=MAX_CTX,
                     prefill_buckets=(128,), prefill_max_batch=2, threshold=THRESHOLD,
                     decode_regions=2, tenant_weights="B=1,C=1",
                     region_links=(LinkSpec(bandwidth_bps=200e6, rtt_s=0.01),
                                   LinkSpec(bandwidth_bps=50e6, rtt_s=0.04)))
  c = LocalCluster(spec, tmp_path_factory.mktemp("shared"))
  c.start()
  yield c
  c.stop()


def test_each_decode_region_gets_its_own_states_token_exact(shared, reference):
  assert set(shared.broker_addresses) == {"b", "c"}
  assert {"c.decode", "c.relay", "c.broker", "decode", "relay", "broker"} <= set(shared.procs)
  link_bytes = {}
  for region, salt in (("b", 0), ("c", 1)):
    with BrokerClient(shared.broker_addresses[region], timeout_s=180) as client:
      for i, (length, route) in enumerate([(LONG, "prfaas"), (SHORT, "pdp")]):
        prompt = _prompt(length, 10 * salt + i)
        out = client.generate(prompt_ids=prompt, max_new_tokens=10, seed=i)
        assert out.summary["route"] == route
        assert out.tokens == reference(tuple(prompt), 10, seed=i)
        link_bytes[region] = link_bytes.get(region, 0) + int(out.summary.get("link_bytes", 0))
  stats = _prefill_stats(shared)
  # Region A accounted each tenant's egress on its own link, equal to what that
  # region's broker saw arrive; each relay carried only its own region's states.
  for region in ("b", "c"):
    tenant = region.upper()
    assert stats[f"egress_bytes:{tenant}"] == link_bytes[region] > 0
    assert stats[f"egress_transfers:{tenant}"] == 1
    assert stats[f"tenant_prefill_tokens:{tenant}"] == LONG
    relay_stats_reaching(lambda: shared.relay_stats(region), link_bytes[region])
  # Negative control on the accounting: the two links carried different bytes
  # from one another's tenants only (B's relay saw none of C's state).
  assert shared.relay_stats("b")["a_to_b"]["bytes"] < link_bytes["b"] + link_bytes["c"]


def test_a_bad_tenant_name_is_refused(shared):
  with shared.channel("prefill") as ch:
    stub = serving_pb2_grpc.PrefillStub(ch)
    req = serving_pb2.PrefillRequest(request_id="bad-tenant", model=CONFIG,
                                     prompt_ids=_prompt(SHORT, 5), decode_target="127.0.0.1:1",
                                     tenant="B; DROP")
    with pytest.raises(grpc.RpcError) as e:
      list(stub.Prefill(req, timeout=30))
  assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
  assert "tenant" in e.value.details()


def test_a_tenant_over_its_quota_falls_back_to_its_own_region(tmp_path, reference):
  # Region A admits at most one waiting prompt per tenant and is slowed down
  # (layer_delay_s), so region B's burst overflows its quota: the overflow is
  # refused (RESOURCE_EXHAUSTED) and B's broker prefills it locally (PD-P),
  # token-exact, while region C's prompt is admitted and prefilled in region A.
  spec = ClusterSpec(config=CONFIG, seed=SEED, n_slots=8, max_queue=16, max_ctx=MAX_CTX,
                     prefill_buckets=(128,), prefill_max_batch=2, threshold=THRESHOLD,
                     decode_regions=2, tenant_quota=1, prefill_faults="layer_delay_s=0.05",
                     region_links=(LinkSpec(bandwidth_bps=200e6, rtt_s=0.01),
                                   LinkSpec(bandwidth_bps=50e6, rtt_s=0.04)))
  cluster = LocalCluster(spec, tmp_path)
  cluster.start()
  try:
    prompts = [_prompt(LONG, 40 + i) for i in range(8)]
    outs: dict[int, object] = {}

    def send(i):
      with BrokerClient(cluster.broker_addresses["b"], timeout_s=300) as client:
        outs[i] = client.generate(prompt_ids=prompts[i], max_new_tokens=6, seed=i)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(prompts))]
    for t in threads:
      t.start()
    c_prompt = _prompt(LONG, 60)
    with BrokerClient(cluster.broker_addresses["c"], timeout_s=300) as client:
      c_out = client.generate(prompt_ids=c_prompt, max_new_tokens=6, seed=9)
    for t in threads:
      t.join()
    stats = _prefill_stats(cluster)
  finally:
    cluster.stop()
  assert c_out.summary["route"] == "prfaas"
  assert c_out.tokens == reference(tuple(c_prompt), 6, seed=9)
  assert stats.get("rejected_quota:B", 0) >= 1
  assert stats.get("rejected_quota:C", 0) == 0
  routes = [outs[i].summary["route"] for i in range(len(prompts))]
  assert "pdp" in routes and "prfaas" in routes, routes
  for i in range(len(prompts)):  # refused or not, every answer is exact
    assert outs[i].tokens == reference(tuple(prompts[i]), 6, seed=i)
