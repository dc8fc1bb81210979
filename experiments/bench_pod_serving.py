r"""Region A as a prefill pod vs one process, on the serving path, side by side.

  .venv/bin/python experiments/bench_pod_serving.py \
      --json_out=docs/results/bench_pod_serving.json

Two clusters run at once, identical but for region A: a single-process prefill
server (``prefill_pod=1``) and a pod of ``--pod`` processes (one JAX program,
TP over the processes; serving/pod_prefill_server.py). Each has its own relay
(--link), decode server and broker. Every prompt is longer than the threshold,
so it is prefilled in region A; the same prompts go to both clusters,
alternating which goes first, one request at a time. After one warm-up prompt
per length (compiles) the JSON reports, per cluster, the medians of the
client's TTFT, region A's prefill_s (prefill and sampling; the logit probe's
decode step, in TTFT too, is ``probe_mean_ms``), the transfer time and the
link bytes, and the pod / single ratios; every output is checked against
single-process generation. The load average goes into the JSON.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

import numpy as np
from absl import app, flags

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from paas_jax.client import BrokerClient  # noqa: E402
from paas_jax.models import api  # noqa: E402
from paas_jax.netem import LinkSpec, parse_rate  # noqa: E402
from paas_jax.proto import serving_pb2, serving_pb2_grpc  # noqa: E402
from paas_jax.serving import common  # noqa: E402
from paas_jax.serving.launch import ClusterSpec, LocalCluster  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("config", "tiny_gdn_gqa", "Model config (random init, seed 0).")
flags.DEFINE_integer("pod", 2, "Processes of the pod.")
flags.DEFINE_list("lengths", ["100", "200", "400"], "Prompt lengths (tokens).")
flags.DEFINE_integer("repeats", 4, "Measured prompts per length and cluster.")
flags.DEFINE_integer("max_new_tokens", 4, "Tokens generated per request.")
flags.DEFINE_string("link", "200mbit/20", "Each cluster's link, rate/rtt_ms.")
flags.DEFINE_string("json_out", "docs/results/bench_pod_serving.json", "Where to write.")
flags.DEFINE_string("workdir", "runs/bench_pod_serving", "Logs of the processes.")


def _spec(pod: int) -> ClusterSpec:
  rate, _, rtt = FLAGS.link.partition("/")
  return ClusterSpec(config=FLAGS.config, n_slots=4, max_queue=16, max_ctx=1024,
                     prefill_buckets=(128, 256), prefill_max_batch=1, threshold=32,
                     link=LinkSpec(bandwidth_bps=parse_rate(rate), rtt_s=float(rtt) / 1e3),
                     prefill_pod=pod)


def _median(xs):
  return float(np.median(xs)) if xs else None


def main(argv):
  del argv
  os.chdir(REPO)
  common.enable_compilation_cache(common.default_compilation_cache())
  model, _ = common.load_model(FLAGS.config, 0)
  lengths = [int(n) for n in FLAGS.lengths]
  rng = np.random.default_rng(16)
  clusters = {}
  try:
    for name, pod in (("single", 1), ("pod", FLAGS.pod)):
      clusters[name] = LocalCluster(_spec(pod), pathlib.Path(FLAGS.workdir) / name).start()
    clients = {n: BrokerClient(c.broker_address, timeout_s=600) for n, c in clusters.items()}
    rows = {n: [] for n in clusters}
    exact = True
    for i, n_tokens in enumerate([n for n in lengths for _ in range(FLAGS.repeats + 1)]):
      prompt = [int(t) for t in rng.integers(1, 256, n_tokens)]
      want = api.generate(model, prompt, FLAGS.max_new_tokens).tokens
      order = list(clients) if i % 2 == 0 else list(clients)[::-1]
      warm = i % (FLAGS.repeats + 1) == 0
      for name in order:
        t0 = time.perf_counter()
        out = clients[name].generate(prompt_ids=prompt, max_new_tokens=FLAGS.max_new_tokens,
                                     route="remote", request_id=f"{name}-{i}")
        s = out.summary
        exact &= out.tokens == want
        print(f"{name:6s} {n_tokens:4d} route={out.route} ttft={out.ttft_s * 1e3:7.1f} ms "
              f"prefill={float(s.get('prefill_s', 0)) * 1e3:7.1f} ms "
              f"{'warm-up' if warm else ''}", flush=True)
        if not warm and out.route == "prfaas":
          rows[name].append({"tokens": n_tokens, "ttft_s": out.ttft_s,
                             "prefill_s": float(s.get("prefill_s", 0.0)),
                             "transfer_s": float(s.get("transfer_s", 0.0)),
                             "link_bytes": int(s.get("link_bytes", 0)),
                             "total_s": time.perf_counter() - t0})
    for c in clients.values():
      c.close()
    probe_ms = {}
    for name, c in clusters.items():  # the probe step is in TTFT, not in prefill_s
      with c.channel("prefill") as ch:
        gauges = serving_pb2_grpc.PrefillStub(ch).GetStats(serving_pb2.StatsRequest(),
                                                           timeout=30).gauges
      probe_ms[name] = float(gauges["probe_mean_ms"])
  finally:
    for c in clusters.values():
      c.stop()
  report = {"config": FLAGS.config, "pod_processes": FLAGS.pod, "link": FLAGS.link,
            "lengths": lengths, "repeats": FLAGS.repeats, "tokens_exact": bool(exact),
            "load_average": os.getloadavg(), "probe_mean_ms": probe_ms, "by_length": {},
            "rows": rows}
  for n in lengths:
    entry = {}
    for name in clusters:
      sel = [r for r in rows[name] if r["tokens"] == n]
      entry[name] = {k: _median([r[k] for r in sel]) for k in
                     ("ttft_s", "prefill_s", "transfer_s", "link_bytes")}
      entry[name]["requests"] = len(sel)
    entry["pod_over_single"] = {
        k: (entry["pod"][k] / entry["single"][k] if entry["single"][k] else None)
        for k in ("ttft_s", "prefill_s", "transfer_s", "link_bytes")}
    report["by_length"][str(n)] = entry
  pathlib.Path(FLAGS.json_out).parent.mkdir(parents=True, exist_ok=True)
  pathlib.Path(FLAGS.json_out).write_text(json.dumps(report, indent=1))
  print(json.dumps({k: v for k, v in report.items() if k != "rows"}, indent=1))


if __name__ == "__main__":
  app.run(main)
