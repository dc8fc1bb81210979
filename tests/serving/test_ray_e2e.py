"""The two-region serving path placed by Ray on two region-labelled nodes (slow).

A local Ray cluster with a ``region_a`` node and a ``region_b`` node runs the
prefill server on the first, the PD node, WAN relay and broker on the second,
with mutual TLS and the bearer token carried to each actor. Requests routed to
both regions are token-exact against single-process generation; then region
A's actor is killed, Ray restarts it on its ports, the broker's health checks
take it back and a long prompt is prefilled remotely again, token-exact.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest
import ray

from paas_jax.client import BrokerClient, GenerationError
from paas_jax.netem import LinkSpec
from paas_jax.serving.launch import ClusterSpec
from paas_jax.serving.ray_launch import RayCluster, RayPlacement

from tests.serving.conftest import (CONFIG, LONG, MAX_CTX, SEED, SHORT, THRESHOLD,
                                    relay_stats_reaching)
from tests.serving.ray_nodes import labelled_ray_cluster

pytestmark = pytest.mark.slow
REPO = pathlib.Path(__file__).resolve().parents[2]


def _prompt(length: int, salt: int) -> list[int]:
  rng = np.random.default_rng(2000 + salt)
  return [int(t) for t in rng.integers(0, 256, length)]


def test_two_regions_on_ray_nodes_token_exact_and_region_a_restarts(reference, tmp_path):
  spec = ClusterSpec(config=CONFIG, seed=SEED, n_slots=4, max_queue=8, max_ctx=MAX_CTX,
                     prefill_buckets=(128,), prefill_max_batch=2, threshold=THRESHOLD,
                     link=LinkSpec(bandwidth_bps=200e6, rtt_s=0.01), tls=True)
  with labelled_ray_cluster() as (_, nodes):
    cluster = RayCluster(spec, tmp_path, RayPlacement(address="auto", max_restarts=2))
    try:
      cluster.start()
      where = {name: p.info for name, p in cluster.procs.items()}
      assert where["prefill"]["node_id"] == nodes["a"]
      assert {where[n]["node_id"] for n in ("decode", "relay", "broker")} == {nodes["b"]}
      creds = cluster.client_credentials()
      assert creds is not None  # TLS + bearer token at the broker
      with BrokerClient(cluster.broker_address, timeout_s=180, credentials=creds) as client:
        for i, (length, route) in enumerate([(SHORT, "pdp"), (LONG, "prfaas")]):
          prompt = _prompt(length, i)
          out = client.generate(prompt_ids=prompt, max_new_tokens=12, seed=i,
                                request_id=f"ray-{i}")
          assert out.summary["route"] == route
          assert out.tokens == reference(tuple(prompt), 12, seed=i)
        # Without the token the broker refuses (mTLS/token stayed on across nodes).
        with BrokerClient(cluster.broker_address, timeout_s=30,
                          credentials=cluster.client_credentials(token=None)) as anon:
          with pytest.raises(GenerationError):
            anon.generate(prompt_ids=_prompt(SHORT, 9), max_new_tokens=2)

        # Region A's actor dies (and its server with it); Ray restarts it on its port.
        old_pid = where["prefill"]["pid"]
        ray.kill(cluster.procs["prefill"].actor, no_restart=False)
        info = cluster.wait_restarted("prefill", 300)
        assert info["restarts"] == 1 and info["pid"] != old_pid
        assert info["port"] == where["prefill"]["port"] and info["node_id"] == nodes["a"]
        prompt = _prompt(LONG, 7)
        deadline = time.monotonic() + 120
        while True:  # until the broker's health checks have taken region A back
          out = client.generate(prompt_ids=prompt, max_new_tokens=12, seed=7,
                                request_id=f"ray-after-{time.monotonic():.0f}")
          assert out.tokens == reference(tuple(prompt), 12, seed=7)
          if out.summary["route"] == "prfaas" or time.monotonic() > deadline:
            break
          time.sleep(1.0)
        assert out.summary["route"] == "prfaas"
    finally:
      cluster.stop()


def test_demo_with_the_ray_launcher(tmp_path):
  # The README's demo with --launcher=ray: a local Ray (ray.init()) with both
  # region resources, every process an actor, token-exact over both routes.
  out = tmp_path / "report.json"
  proc = subprocess.run(
      [sys.executable, str(REPO / "experiments" / "demo_two_region.py"), "--launcher=ray",
       "--num_requests=6", "--max_new_tokens=8", "--rate=20",
       "--trace=0:20mbit,1:5mbit,period=2", f"--json_out={out}",
       f"--workdir={tmp_path / 'work'}", "--progress=false"],
      capture_output=True, text=True, timeout=1100, cwd=REPO)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  report = json.loads(out.read_text())
  assert report["all_tokens_match_reference"] is True and report["errors"] == 0
  assert report["launcher"] == "ray"
  assert set(report["placement"]) == {"prefill", "decode", "relay", "broker"}
  assert all(p["node_id"] for p in report["placement"].values())
  routes = [r["route"] for r in report["requests"]]
  assert routes.count("pdp") >= 1 and routes.count("prfaas") >= 1, routes
  assert report["link_utilization"]["a_to_b"]["bytes"] > 0


def test_shared_prefill_pool_on_three_ray_nodes(reference, tmp_path):
  # Prefill as a shared service placed by Ray: region A on the region_a node,
  # regions B and C (each its PD node, relay and broker) on their own nodes.
  spec = ClusterSpec(config=CONFIG, seed=SEED, n_slots=4, max_queue=8, max_ctx=MAX_CTX,
                     prefill_buckets=(128,), prefill_max_batch=2, threshold=THRESHOLD,
                     decode_regions=2, tls=True,
                     region_links=(LinkSpec(bandwidth_bps=200e6, rtt_s=0.01),
                                   LinkSpec(bandwidth_bps=50e6, rtt_s=0.04)))
  with labelled_ray_cluster(("a", "b", "c")) as (_, nodes):
    cluster = RayCluster(spec, tmp_path, RayPlacement(address="auto"))
    try:
      cluster.start()
      for name, proc in cluster.procs.items():
        assert proc.info["node_id"] == nodes[cluster.region_of(name)], name
      for i, region in enumerate(("b", "c")):
        with BrokerClient(cluster.broker_addresses[region], timeout_s=180,
                          credentials=cluster.client_credentials()) as client:
          prompt = _prompt(LONG, 20 + i)
          out = client.generate(prompt_ids=prompt, max_new_tokens=8, seed=i)
          assert out.summary["route"] == "prfaas"
          assert out.tokens == reference(tuple(prompt), 8, seed=i)
        link_bytes = int(out.summary["link_bytes"])
        assert link_bytes > 0
        relay_stats_reaching(lambda: cluster.relay_stats(region), link_bytes)
    finally:
      cluster.stop()
