"""Shard-to-shard state transfer between multi-process regions: goodput of
1x1, 2x1 and 2x2 sender x receiver processes on the same state, as ratios.

Each topology runs the real path (``paas_jax.serving.pod_launch.run_local``):
a pod of P processes (``--devices_per_process`` devices each, TP = P x that)
holds one random full state of ``--tokens`` tokens of ``--model`` (heads
widened to ``--kv_heads``), encodes only its own shards, plans and streams
them over gRPC to a slice of Q processes (TP = Q x that), which verifies and
restores its shards. Time is measured from the moment every pod process holds
the state (a barrier) to the last slice process holding its restored shards;
goodput = state bytes / that time. The slice's checksum of every leaf must
equal the pod's (else the run fails). Topologies are interleaved over
``--repeats`` rounds and the median of each is reported, with ratios to 1x1.

All processes share this machine's cores, so >1 process buys parallel
encode/restore only where cores are free; the ratio says what the process
split costs or gains here, not on a pod of real hosts.

usage: python experiments/bench_pod_transfer.py --json_out=/tmp/bench_pod_transfer.json
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import tempfile

from absl import app, flags

from paas_jax.models import load_config
from paas_jax.serving import pod_launch

flags.DEFINE_string("json_out", None, "Where to write the results (JSON).", required=True)
flags.DEFINE_string("model", "tiny_dense_gqa", "Model config whose state layout is used.")
flags.DEFINE_integer("kv_heads", 8, "KV heads (must divide by every TP used).")
flags.DEFINE_integer("head_dim", 64, "Head dim.")
flags.DEFINE_integer("layers", 8, "Layers.")
flags.DEFINE_integer("tokens", 2048, "Tokens in the state.")
flags.DEFINE_integer("devices_per_process", 2, "Devices of each process.")
flags.DEFINE_list("topologies", ["1x1", "2x1", "2x2"], "sender x receiver processes.")
flags.DEFINE_integer("repeats", 3, "Rounds (topologies interleaved).")
flags.DEFINE_float("timeout_s", 600.0, "Deadline of each run.")
FLAGS = flags.FLAGS


def _config():
  base = load_config(FLAGS.model)
  attention = dataclasses.replace(base.attention, n_heads=FLAGS.kv_heads,
                                  n_kv_heads=FLAGS.kv_heads, head_dim=FLAGS.head_dim)
  return dataclasses.replace(base, attention=attention, n_layers=FLAGS.layers,
                             layer_pattern="A", max_seq_len=max(base.max_seq_len,
                                                                FLAGS.tokens))


def _one(config, senders: int, receivers: int, workdir: str) -> dict:
  d = FLAGS.devices_per_process
  run = pod_launch.run_local(config, [], pod_processes=senders, pod_devices=d,
                             slice_processes=receivers, slice_devices=d, max_new_tokens=1,
                             workdir=workdir, timeout_s=FLAGS.timeout_s,
                             synthetic_tokens=FLAGS.tokens)
  source_sum = run.prefill[0]["checksum"]
  for r in run.decode:
    if r["checksum"] != source_sum:
      raise SystemExit(f"{senders}x{receivers}: slice process {r['process']} restored a "
                       f"different state: {r['checksum']} vs {source_sum}")
  start = min(r["transfer_start_wall"] for r in run.prefill)
  end = max(r["done_wall"] for r in run.decode)
  state_bytes = run.prefill[0]["state_bytes"]
  sent = {r["process"]: sum(s["planned_bytes"] for s in r["sent"]) for r in run.prefill}
  return {"seconds": end - start, "goodput_MBps": state_bytes / (end - start) / 1e6,
          "state_bytes": state_bytes, "bytes_sent_per_sender": sent,
          "bytes_received_per_receiver": {r["process"]: r["wire_bytes"] for r in run.decode},
          "restore_s": [r["restore_s"] for r in run.decode]}


def main(argv):
  del argv
  config = _config()
  topologies = [tuple(int(x) for x in t.split("x")) for t in FLAGS.topologies]
  runs: dict[str, list[dict]] = {f"{s}x{r}": [] for s, r in topologies}
  with tempfile.TemporaryDirectory() as tmp:
    for i in range(FLAGS.repeats):
      for s, r in topologies:
        name = f"{s}x{r}"
        runs[name].append(_one(config, s, r, os.path.join(tmp, f"{name}-{i}")))
        print(name, i, json.dumps(runs[name][-1]["seconds"]), flush=True)
  median = {n: statistics.median(x["seconds"] for x in v) for n, v in runs.items()}
  base = median.get("1x1")
  results = {
      "what": "shard-to-shard transfer, pod barrier -> last slice process restored",
      "model": config.name, "layers": config.n_layers, "kv_heads": FLAGS.kv_heads,
      "head_dim": FLAGS.head_dim, "tokens": FLAGS.tokens,
      "devices_per_process": FLAGS.devices_per_process, "repeats": FLAGS.repeats,
      "cpu_count": os.cpu_count(), "load_avg": os.getloadavg(), "python": platform.python_version(),
      "median_seconds": median,
      "goodput_MBps": {n: runs[n][0]["state_bytes"] / s / 1e6 for n, s in median.items()},
      "time_ratio_vs_1x1": {n: s / base for n, s in median.items()} if base else None,
      "runs": runs,
  }
  with open(FLAGS.json_out, "w") as f:
    json.dump(results, f, indent=2)
  print(json.dumps({k: results[k] for k in ("median_seconds", "goodput_MBps",
                                            "time_ratio_vs_1x1")}, indent=2))


if __name__ == "__main__":
  app.run(main)
