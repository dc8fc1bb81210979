r"""Prefill as a shared service: does a burst from one decode region starve another?

  .venv/bin/python experiments/bench_shared_prefill.py \
      --json_out=docs/results/shared_prefill.json

One region-A prefill pool serves two decode regions, B and C. Each has its own
PD node, emulated link (B: --b_link, C: --c_link) and broker. Every prompt is
longer than the threshold, so all of them are prefilled in region A. For each
sharing mode of region A (``fifo``: arrival order; ``wfq``: weighted fair
queueing over prompt tokens, scheduling/tenant_queue.py) on a fresh cluster:

  alone  region C sends --c_requests prompts, one every --c_interval_s
  burst  the same, starting --c_delay_s after region B fires --burst prompts at once

and the JSON reports region C's TTFT (P50/P90) per phase, the burst/alone ratio
of its P90 per mode, region B's TTFT, and region A's egress per link. Both modes
run in one invocation, on the same workload, one after the other.
"""

from __future__ import annotations

import json
import pathlib
import sys
import threading
import time

import numpy as np
from absl import app, flags

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from paas_jax.client import BrokerClient, GenerationError  # noqa: E402
from paas_jax.netem import LinkSpec, parse_rate  # noqa: E402
from paas_jax.proto import serving_pb2, serving_pb2_grpc  # noqa: E402
from paas_jax.serving import tenant_report  # noqa: E402
from paas_jax.serving.launch import ClusterSpec, LocalCluster  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("config", "tiny_gdn_gqa", "Model config (random init).")
flags.DEFINE_list("modes", ["fifo", "wfq"], "Region A's sharing modes to compare.")
flags.DEFINE_integer("burst", 32, "Prompts region B fires at once.")
flags.DEFINE_integer("burst_len", 448, "Prompt length of the burst.")
flags.DEFINE_integer("c_requests", 12, "Prompts region C sends per phase.")
flags.DEFINE_integer("c_len", 192, "Prompt length of region C's prompts.")
flags.DEFINE_float("c_interval_s", 0.25, "Time between region C's prompts.")
flags.DEFINE_float("c_delay_s", 0.3, "Region C starts this long after the burst.")
flags.DEFINE_integer("max_new_tokens", 4, "Tokens generated per request.")
flags.DEFINE_string("b_link", "200mbit/20", "Region B's link, rate/rtt_ms.")
flags.DEFINE_string("c_link", "100mbit/40", "Region C's link, rate/rtt_ms.")
flags.DEFINE_string("json_out", "docs/results/shared_prefill.json", "Where to write the JSON.")
flags.DEFINE_string("workdir", "runs/bench_shared_prefill", "Logs of the processes.")


def _link(text: str) -> LinkSpec:
  rate, _, rtt = text.partition("/")
  return LinkSpec(bandwidth_bps=parse_rate(rate), rtt_s=float(rtt or 20) / 1e3)


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(0, 256, length).tolist() for _ in range(n)]


def _send(client: BrokerClient, prompt, rid: str, out: list, region: str) -> None:
  t0 = time.perf_counter()
  try:
    r = client.generate(prompt_ids=prompt, max_new_tokens=FLAGS.max_new_tokens, seed=0,
                        request_id=rid)
    out.append({"region": region, "ttft_s": r.ttft_s, "route": r.summary.get("route", ""),
                "link_bytes": int(r.summary.get("link_bytes", 0)), "error": "",
                "start_s": t0})
  except GenerationError as e:
    out.append({"region": region, "ttft_s": None, "route": "", "link_bytes": 0,
                "error": str(e), "start_s": t0})


def _phase(clients, burst: bool, tag: str) -> list[dict]:
  """One phase: region C's paced prompts, with or without region B's burst."""
  rows: list[dict] = []
  threads = []
  if burst:
    for i, p in enumerate(_prompts(FLAGS.burst, FLAGS.burst_len, 1)):
      t = threading.Thread(target=_send, args=(clients["b"], p, f"{tag}-b{i}", rows, "b"))
      t.start()
      threads.append(t)
    time.sleep(FLAGS.c_delay_s)
  for i, p in enumerate(_prompts(FLAGS.c_requests, FLAGS.c_len, 2)):
    t = threading.Thread(target=_send, args=(clients["c"], p, f"{tag}-c{i}", rows, "c"))
    t.start()
    threads.append(t)
    time.sleep(FLAGS.c_interval_s)
  for t in threads:
    t.join()
  return rows


def _prefill_gauges(cluster) -> dict:
  with cluster.channel("prefill") as ch:
    r = serving_pb2_grpc.PrefillStub(ch).GetStats(serving_pb2.StatsRequest(), timeout=30)
  return dict(r.gauges)


def run_mode(mode: str) -> dict:
  spec = ClusterSpec(config=FLAGS.config, seed=0, n_slots=8, max_queue=64, max_ctx=512,
                     prefill_buckets=(128,), prefill_max_batch=4, threshold=64,
                     router="static", decode_regions=2, tenant_sharing=mode,
                     region_links=(_link(FLAGS.b_link), _link(FLAGS.c_link)))
  cluster = LocalCluster(spec, pathlib.Path(FLAGS.workdir) / mode)
  cluster.start()
  try:
    clients = {r: BrokerClient(a, timeout_s=300) for r, a in cluster.broker_addresses.items()}
    # Warm-up: every prompt shape once per region (compiles, opens channels).
    warm: list[dict] = []
    for region, length in (("b", FLAGS.burst_len), ("c", FLAGS.c_len)):
      _send(clients[region], _prompts(1, length, 9)[0], f"warm-{region}", warm, region)
    alone = _phase(clients, burst=False, tag=f"{mode}-alone")
    burst = _phase(clients, burst=True, tag=f"{mode}-burst")
    gauges = _prefill_gauges(cluster)
    relays = {r: cluster.relay_stats(r) for r in cluster.decode_regions}
    for c in clients.values():
      c.close()
  finally:
    cluster.stop()
  c_alone = tenant_report.latency_stats([r["ttft_s"] for r in alone if not r["error"]])
  c_burst = tenant_report.latency_stats(
      [r["ttft_s"] for r in burst if r["region"] == "c" and not r["error"]])
  b_burst = tenant_report.latency_stats(
      [r["ttft_s"] for r in burst if r["region"] == "b" and not r["error"]])
  return {
      "mode": mode,
      "c_ttft_alone_s": c_alone, "c_ttft_with_burst_s": c_burst, "b_ttft_burst_s": b_burst,
      "c_p90_burst_over_alone": (c_burst["p90"] / c_alone["p90"]
                                 if c_alone and c_burst else None),
      "errors": sorted({r["error"].split(":", 1)[0] for r in alone + burst if r["error"]}),
      "error_count": sum(1 for r in alone + burst if r["error"]),
      "routes": sorted({r["route"] for r in alone + burst if not r["error"]}),
      # Region A's egress per tenant's link (cumulative, warm-up included).
      "regions": tenant_report.per_region(warm + alone + burst, gauges, relays),
  }


def main(argv):
  del argv
  results = [run_mode(m) for m in FLAGS.modes]
  report = {
      "bench": "shared_prefill", "config": FLAGS.config,
      "workload": {"burst": FLAGS.burst, "burst_len": FLAGS.burst_len,
                   "c_requests": FLAGS.c_requests, "c_len": FLAGS.c_len,
                   "c_interval_s": FLAGS.c_interval_s, "c_delay_s": FLAGS.c_delay_s,
                   "max_new_tokens": FLAGS.max_new_tokens, "b_link": FLAGS.b_link,
                   "c_link": FLAGS.c_link},
      "modes": {r["mode"]: r for r in results},
  }
  if {"fifo", "wfq"} <= set(report["modes"]):
    f, w = report["modes"]["fifo"], report["modes"]["wfq"]
    if f["c_ttft_with_burst_s"] and w["c_ttft_with_burst_s"]:
      report["c_p90_with_burst_wfq_over_fifo"] = (w["c_ttft_with_burst_s"]["p90"]
                                                  / f["c_ttft_with_burst_s"]["p90"])
  out = pathlib.Path(FLAGS.json_out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(report, indent=1))
  for r in results:
    a, b = r["c_ttft_alone_s"] or {}, r["c_ttft_with_burst_s"] or {}
    print(f"{r['mode']:>4}: region C TTFT p90 alone {a.get('p90', 0) * 1e3:7.0f} ms, with "
          f"B's burst {b.get('p90', 0) * 1e3:7.0f} ms (x{r['c_p90_burst_over_alone'] or 0:.2f}); "
          f"region B burst p90 {(r['b_ttft_burst_s'] or {}).get('p90', 0) * 1e3:.0f} ms; "
          f"errors {r['error_count']}")
    for region, g in r["regions"].items():
      print(f"      egress A->{g['tenant']}: {g['egress_bytes'] / 1e6:.2f} MB in "
            f"{g['egress_transfers']} transfers (its relay {g['relay_a_to_b_bytes'] / 1e6:.2f} MB)")
  if "c_p90_with_burst_wfq_over_fifo" in report:
    print(f"region C TTFT p90 under B's burst, wfq / fifo: "
          f"{report['c_p90_with_burst_wfq_over_fifo']:.2f}")
  print(f"wrote {out}")


if __name__ == "__main__":
  app.run(main)
