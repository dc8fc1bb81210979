"""Serving over the TCP data plane (ClusterSpec.transfer_plane="tcp"):
token-exact generations on both routes of the real two-region cluster, with the
state bytes of the PrfaaS route crossing the WAN relay on the data-plane route
rather than in gRPC Push streams; region A sized for its link (the link flags
LocalCluster passes, and lanes from the link: transfer_lanes=0)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from paas_jax.client import BrokerClient
from paas_jax.netem import LinkSpec
from paas_jax.serving.launch import ClusterSpec, LocalCluster
from paas_jax.transport import SenderOptions
from paas_jax.transport.dataplane.tuning import Tuning
from tests.serving import conftest as base
from tests.serving.conftest import LONG, SHORT

# Its own two-region cluster, on a longer and faster link than the shared one's,
# with lanes from the link: slow.
pytestmark = pytest.mark.slow
# 3 Gbit/s x 40 ms: a 15 MB bandwidth-delay product, enough for more than one lane.
LINK = LinkSpec(bandwidth_bps=3e9, rtt_s=0.04, jitter_s=0.001)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
  spec = ClusterSpec(config=base.CONFIG, seed=base.SEED, n_slots=base.N_SLOTS,
                     max_queue=base.MAX_QUEUE, max_ctx=base.MAX_CTX, prefill_buckets=(128,),
                     prefill_max_batch=4, threshold=base.THRESHOLD,
                     prefix_block=base.PREFIX_BLOCK, transfer_plane="tcp",
                     transfer_lanes=0, startup_timeout_s=1500.0, link=LINK)
  c = LocalCluster(spec, tmp_path_factory.mktemp("tcp_cluster"))
  c.start()
  yield c
  c.stop()


@pytest.fixture(scope="module")
def client(cluster):
  with BrokerClient(cluster.broker_address, timeout_s=120) as c:
    yield c


def _prompt(length, seed):
  return tuple(int(t) for t in np.random.default_rng(seed + 500).integers(0, 256, length))


def _relay_stats(cluster, route, minimum, timeout=10.0):
  end = time.monotonic() + timeout
  stats = cluster.relay_stats() or {}
  while time.monotonic() < end and stats.get("route_bytes", {}).get(route, 0) < minimum:
    time.sleep(0.2)  # the relay rewrites its stats file every 0.5 s
    stats = cluster.relay_stats() or {}
  return stats


def test_both_routes_token_exact_over_the_data_plane(cluster, client, reference):
  assert cluster.spec.transfer_plane == "tcp"
  assert cluster.procs["decode"].info["data_plane_port"] > 0
  before = (cluster.relay_stats() or {}).get("route_bytes", {})
  prfaas = client.generate(prompt_ids=list(_prompt(LONG, 1)), max_new_tokens=8, route="remote")
  assert prfaas.route == "prfaas"
  assert prfaas.tokens == reference(_prompt(LONG, 1), 8)
  state_bytes = int(prfaas.summary["state_bytes"])
  assert state_bytes > 0
  stats = _relay_stats(cluster, "dataplane0", before.get("dataplane0", 0) + state_bytes)
  moved = stats["route_bytes"].get("dataplane0", 0) - before.get("dataplane0", 0)
  # The state crossed the WAN relay on the data-plane route (frames add headers)...
  assert moved >= state_bytes
  # ...and not in gRPC Push streams: the transfer route carried only control.
  control = stats["route_bytes"].get("transfer", 0) - before.get("transfer", 0)
  assert control < state_bytes
  pdp = client.generate(prompt_ids=list(_prompt(SHORT, 2)), max_new_tokens=8, route="local")
  assert pdp.route == "pdp"
  assert pdp.tokens == reference(_prompt(SHORT, 2), 8)


def test_region_a_opens_the_lanes_its_link_needs(cluster, client, reference):
  # SenderOptions(lanes=0) for this link on this host (its kernel's send-buffer
  # limits count): 3 on a stock kernel, where the default (2 lanes) or a link flag
  # lost on the way to the prefill server would open another number.
  expected = SenderOptions(plane="tcp", lanes=0, tuning=Tuning(
      rate_bytes_per_s=LINK.bandwidth_bps / 8, rtt_s=LINK.rtt_s)).lanes
  assert expected > 1
  info = cluster.procs["prefill"].info  # its ready file
  assert info["transfer_lanes"] == expected
  assert (info["transfer_link_bytes_per_s"], info["transfer_rtt_s"]) == (
      LINK.bandwidth_bps / 8, LINK.rtt_s)
  prompt = _prompt(LONG, 3)
  done = client.generate(prompt_ids=list(prompt), max_new_tokens=4, route="remote")
  assert done.route == "prfaas" and done.tokens == reference(prompt, 4)
  # Across the relay: that many connections per transfer in flight at once
  # (chunk segments overlap), each set from the lane pool.
  stats = _relay_stats(cluster, "dataplane0", 1)
  opened = stats.get("connections", {}).get("dataplane0", 0)
  assert opened >= expected and opened % expected == 0, stats.get("connections")
