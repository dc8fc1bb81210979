r"""Region B as a decode slice vs one decode process, on the serving path, side by side (#16).

  .venv/bin/python experiments/bench_slice_serving.py \
      --json_out=docs/results/bench_slice_serving.json

Two clusters run at once, identical but for region B: a single-process decode
server (``decode_slice=1``) and a slice of ``--slice`` processes (one JAX
program, TP over the processes; serving/slice_decode_server.py). Both have
region A as the same prefill pod (``--pod`` processes; a slice takes its parts
from a pod), their own relay (--link) and broker. Every prompt is longer than
the threshold and sent with route="remote", so it is prefilled in region A,
streamed shard by shard to region B and decoded there; the same prompts go to
both clusters, alternating which goes first, one request at a time (the cost
per request). Then ``--bursts`` bursts of ``--burst`` requests measure batching: each
burst's prompts go to each cluster all at once and then one at a time (output
tokens per second of each; at once over one at a time is the batching gain),
and the slice's GetStats say how many rows shared a step.
After one warm-up prompt per length (compiles) the JSON reports,
per cluster and prompt length, the medians of the client's TTFT, time per
output token and end-to-end latency, the transfer time and link bytes, and
the slice / single ratios; the tokens of the two clusters are compared with
each other and with single-process generation. The load average goes into the
JSON.

Both clusters move states on the same plane (--transfer_plane; behind the
relay a slice's parts ride each process's TCP data plane or gRPC), so the
ratios measure the slice, not the transfer plane.
"""

from __future__ import annotations

import concurrent.futures
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
flags.DEFINE_integer("pod", 2, "Processes of region A's prefill pod (both clusters).")
flags.DEFINE_integer("slice", 2, "Processes of region B's decode slice.")
flags.DEFINE_list("lengths", ["100", "300"], "Prompt lengths (tokens).")
flags.DEFINE_integer("repeats", 6, "Measured prompts per length and cluster.")
flags.DEFINE_integer("max_new_tokens", 16, "Tokens generated per request.")
flags.DEFINE_string("link", "200mbit/20", "Each cluster's link, rate/rtt_ms.")
flags.DEFINE_enum("transfer_plane", "tcp", ["grpc", "tcp"], "What carries the states "
                  "to region B, in both clusters.")
flags.DEFINE_integer("burst", 4, "Then: bursts of this many requests sent at once to each "
                     "cluster (0: none), to measure batching.")
flags.DEFINE_integer("bursts", 3, "Measured bursts per cluster (after one warm-up burst).")
flags.DEFINE_integer("burst_max_new_tokens", 64, "Tokens per request of a burst (long enough "
                     "that a burst's requests, prefilled one after another by the pod, "
                     "overlap in decode).")
flags.DEFINE_string("json_out", "docs/results/bench_slice_serving.json", "Where to write.")
flags.DEFINE_string("workdir", "runs/bench_slice_serving", "Logs of the processes.")

METRICS = ("ttft_s", "tpot_s", "total_s", "transfer_s", "link_bytes")


def _spec(decode_slice: int) -> ClusterSpec:
  rate, _, rtt = FLAGS.link.partition("/")
  return ClusterSpec(config=FLAGS.config, n_slots=4, max_queue=16, max_ctx=512,
                     prefill_buckets=(128, 256), prefill_max_batch=1, threshold=32,
                     link=LinkSpec(bandwidth_bps=parse_rate(rate), rtt_s=float(rtt) / 1e3),
                     transfer_plane=FLAGS.transfer_plane, prefill_pod=FLAGS.pod,
                     decode_slice=decode_slice)


def _median(xs):
  return float(np.median(xs)) if xs else None


def _medians(rows: list[dict]) -> dict:
  out = {k: _median([r[k] for r in rows]) for k in METRICS}
  out["requests"] = len(rows)
  return out


def _ratios(slice_medians: dict, single_medians: dict) -> dict:
  return {k: (slice_medians[k] / single_medians[k] if single_medians[k] else None)
          for k in METRICS}


def main(argv):
  del argv
  os.chdir(REPO)
  if FLAGS.pod < 2 or FLAGS.slice < 2:
    raise app.UsageError(f"--pod ({FLAGS.pod}) and --slice ({FLAGS.slice}) must be >= 2: a "
                         "slice takes its parts from a prefill pod")
  lengths = [int(n) for n in FLAGS.lengths]
  if any(n + FLAGS.max_new_tokens > _spec(1).max_ctx or n <= _spec(1).threshold
         for n in lengths):
    raise app.UsageError(f"--lengths must be in ({_spec(1).threshold:g}, "
                         f"{_spec(1).max_ctx - FLAGS.max_new_tokens}]")
  common.enable_compilation_cache(common.default_compilation_cache())
  model, _ = common.load_model(FLAGS.config, 0)
  rng = np.random.default_rng(16)
  load_before = os.getloadavg()
  t_start = time.perf_counter()
  clusters = {}
  try:
    for name, decode_slice in (("single", 1), ("slice", FLAGS.slice)):
      clusters[name] = LocalCluster(_spec(decode_slice),
                                    pathlib.Path(FLAGS.workdir) / name).start()
    startup_s = {n: c.timings["cluster_ready_s"] for n, c in clusters.items()}
    clients = {n: BrokerClient(c.broker_address, timeout_s=600) for n, c in clusters.items()}
    rows = {n: [] for n in clusters}
    match_reference = {n: True for n in clusters}
    equal_between = True
    for i, n_tokens in enumerate([n for n in lengths for _ in range(FLAGS.repeats + 1)]):
      prompt = [int(t) for t in rng.integers(1, 256, n_tokens)]
      want = api.generate(model, prompt, FLAGS.max_new_tokens).tokens
      order = list(clients) if i % 2 == 0 else list(clients)[::-1]
      warm = i % (FLAGS.repeats + 1) == 0
      got = {}
      for name in order:  # one request at a time: concurrency 1
        out = clients[name].generate(prompt_ids=prompt, max_new_tokens=FLAGS.max_new_tokens,
                                     route="remote", request_id=f"{name}-{i}")
        s = out.summary
        got[name] = out.tokens
        match_reference[name] &= out.tokens == want
        print(f"{name:6s} {n_tokens:4d} route={out.route} ttft={out.ttft_s * 1e3:7.1f} ms "
              f"tpot={out.tpot_s * 1e3:6.2f} ms total={out.total_s * 1e3:7.1f} ms "
              f"{'warm-up' if warm else ''}", flush=True)
        if not warm and out.route == "prfaas":
          rows[name].append({"tokens": n_tokens, "ttft_s": out.ttft_s, "tpot_s": out.tpot_s,
                             "total_s": out.total_s,
                             "transfer_s": float(s.get("transfer_s", 0.0)),
                             "link_bytes": int(s.get("link_bytes", 0)),
                             "output_tokens": len(out.tokens)})
      equal_between &= got["single"] == got["slice"]
    bursts = _bursts(clusters, clients, model, rng, lengths) if FLAGS.burst > 0 else {}
    for c in clients.values():
      c.close()
  finally:
    for c in clusters.values():
      c.stop()
  report = {"config": FLAGS.config, "prefill_pod": FLAGS.pod,
            "decode_slice": {"single": 1, "slice": FLAGS.slice},
            # Requests were sent one at a time (the slice decodes one at a time).
            "concurrency": 1, "route": "remote (prefilled by the pod)",
            "bursts": bursts,
            "link": FLAGS.link,
            "transfer_plane": FLAGS.transfer_plane,
            # Per length, one warm-up prompt (compiles; not measured), then these.
            "lengths": lengths, "repeats": FLAGS.repeats,
            "max_new_tokens": FLAGS.max_new_tokens,
            "tokens_equal_single_vs_slice": bool(equal_between),
            "tokens_match_reference": match_reference,
            "startup_s": startup_s, "wall_s": time.perf_counter() - t_start,
            "load_average": {"before": load_before, "after": os.getloadavg()},
            "all": {}, "by_length": {}, "rows": rows}
  for name in clusters:
    report["all"][name] = _medians(rows[name])
  report["all"]["slice_over_single"] = _ratios(report["all"]["slice"], report["all"]["single"])
  for n in lengths:
    entry = {name: _medians([r for r in rows[name] if r["tokens"] == n]) for name in clusters}
    entry["slice_over_single"] = _ratios(entry["slice"], entry["single"])
    report["by_length"][str(n)] = entry
  pathlib.Path(FLAGS.json_out).parent.mkdir(parents=True, exist_ok=True)
  pathlib.Path(FLAGS.json_out).write_text(json.dumps(report, indent=1))
  print(json.dumps({k: v for k, v in report.items() if k != "rows"}, indent=1))
  exact = (equal_between and all(match_reference.values())
           and all(b["tokens_match_reference"] for k, b in bursts.items() if k in clusters))
  return 0 if exact and all(rows.values()) else 1


def _decode_stats(cluster) -> dict:
  with cluster.channel("decode") as ch:
    return dict(serving_pb2_grpc.DecodeStub(ch).GetStats(serving_pb2.StatsRequest(),
                                                         timeout=30).gauges)


def _bursts(clusters, clients, model, rng, lengths) -> dict:
  """Bursts of ``--burst`` remote requests, clusters in turn (the first burst
  a warm-up): each burst's prompts sent all at once and then one at a time,
  alternating which goes first; per cluster the median tokens/s of each mode
  and their ratio (the batching gain)."""
  out = {}
  modes = ("at_once", "one_at_a_time")
  per_cluster = {name: {m: [] for m in modes} for name in clusters}
  match = {name: True for name in clusters}
  new = FLAGS.burst_max_new_tokens
  for b in range(FLAGS.bursts + 1):
    prompts = [[int(t) for t in rng.integers(1, 256, lengths[i % len(lengths)])]
               for i in range(FLAGS.burst)]
    wants = [api.generate(model, p, new).tokens for p in prompts]
    for name in (list(clusters) if b % 2 == 0 else list(clusters)[::-1]):
      for mode in (modes if b % 2 == 0 else modes[::-1]):
        def one(i, name=name, b=b, mode=mode):
          return clients[name].generate(prompt_ids=prompts[i], max_new_tokens=new,
                                        route="remote",
                                        request_id=f"{name}-burst{b}-{mode}-{i}")
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(
            FLAGS.burst if mode == "at_once" else 1) as pool:
          outs = list(pool.map(one, range(FLAGS.burst)))
        wall = time.perf_counter() - t0
        match[name] &= [o.tokens for o in outs] == wants
        tokens = sum(len(o.tokens) for o in outs)
        print(f"{name:6s} burst {b} {mode:13s}: {tokens / wall:7.1f} tok/s "
              f"{'warm-up' if b == 0 else ''}", flush=True)
        if b:
          per_cluster[name][mode].append({"wall_s": wall, "tokens": tokens,
                                          "tokens_per_s": tokens / wall,
                                          "prfaas": sum(o.route == "prfaas" for o in outs)})
  for name, cluster in clusters.items():
    stats = _decode_stats(cluster)
    rates = {m: _median([r["tokens_per_s"] for r in per_cluster[name][m]]) for m in modes}
    out[name] = {"tokens_per_s": rates, "batching_gain": rates["at_once"]
                 / rates["one_at_a_time"], "tokens_match_reference": bool(match[name]),
                 "rows": per_cluster[name], "decode_max_batch": stats.get("max_batch"),
                 "decode_mean_batch": stats.get("mean_batch")}
  out["burst"] = FLAGS.burst
  out["max_new_tokens"] = new
  out["slice_over_single_tokens_per_s"] = {
      m: out["slice"]["tokens_per_s"][m] / out["single"]["tokens_per_s"][m] for m in modes}
  return out


if __name__ == "__main__":
  app.run(main)
