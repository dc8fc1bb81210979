"""Serving over the TCP data plane (ClusterSpec.transfer_plane="tcp"):
token-exact generations on both routes of the real two-region cluster, with the
state bytes of the PrfaaS route crossing the WAN relay on the data-plane route
rather than in gRPC Push streams."""

from __future__ import annotations

import time

import numpy as np
import pytest

from paas_jax.client import BrokerClient
from paas_jax.netem import LinkSpec
from paas_jax.serving.launch import ClusterSpec, LocalCluster
from tests.serving import conftest as base
from tests.serving.conftest import LONG, SHORT

# Its own two-region cluster (the shared one runs the gRPC path): slow.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
  spec = ClusterSpec(config=base.CONFIG, seed=base.SEED, n_slots=base.N_SLOTS,
                     max_queue=base.MAX_QUEUE, max_ctx=base.MAX_CTX, prefill_buckets=(128,),
                     prefill_max_batch=4, threshold=base.THRESHOLD,
                     prefix_block=base.PREFIX_BLOCK, transfer_plane="tcp",
                     startup_timeout_s=1500.0,
                     link=LinkSpec(bandwidth_bps=200e6, rtt_s=0.01, jitter_s=0.001))
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
