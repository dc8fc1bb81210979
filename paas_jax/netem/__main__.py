"""Runs a WAN relay process.

  python -m paas_jax.netem --bandwidth=100mbit --rtt_ms=30 --jitter_ms=2 \
      --trace="0:100mbit,5:20mbit,8:100mbit" \
      --route="transfer=127.0.0.1:0->127.0.0.1:50053@a_to_b" \
      --route="control=127.0.0.1:0->127.0.0.1:50051@b_to_a" \
      --ready_file=/tmp/relay.json --stats_file=/tmp/relay_stats.json

Writes the bound ports to ``--ready_file`` and the link statistics to
``--stats_file`` every ``--stats_interval_s`` and on exit (SIGTERM/SIGINT).
``--engine=splice`` (the default on Linux) forwards in the kernel
(``splice_relay``), ~3x the asyncio relay's ceiling; ``--engine=asyncio`` is the
portable userspace relay.
"""

from __future__ import annotations

import json
import os
import signal
import threading

from absl import app, flags

from paas_jax.netem.link import BandwidthTrace, LinkSpec, describe, parse_rate
from paas_jax.netem.relay import Relay, Route
from paas_jax.netem.splice_relay import SpliceRelay, default_engine
from paas_jax.serving import child_process

FLAGS = flags.FLAGS
flags.DEFINE_string("bandwidth", "100mbit", "Link bandwidth (e.g. 100mbit, 1gbit; 0: unlimited).")
flags.DEFINE_float("rtt_ms", 20.0, "Round-trip time added by the link.")
flags.DEFINE_float("jitter_ms", 0.0, "Standard deviation of the one-way delay.")
flags.DEFINE_string("trace", None, "Bandwidth over time: 't:rate,t:rate[,period=s]' or a .json.")
flags.DEFINE_bool("shape_bandwidth", True, "False: account bandwidth but only add delay "
                  "(when tbf in a network namespace shapes).")
flags.DEFINE_multi_string("route", [], "name=listen->target@a_to_b|b_to_a (repeatable).")
flags.DEFINE_string("ready_file", None, "JSON with the bound ports, written once listening.")
flags.DEFINE_string("stats_file", None, "JSON link statistics, rewritten periodically.")
flags.DEFINE_float("stats_interval_s", 0.5, "How often --stats_file is rewritten.")
flags.DEFINE_integer("seed", 0, "Jitter seed.")
flags.DEFINE_enum("engine", default_engine(), ["asyncio", "splice"],
                  "asyncio: the portable userspace relay; splice: forward in the kernel "
                  "(Linux splice; for high rates).")
flags.DEFINE_integer("max_queued_mb", 0, "Bytes one direction of one connection may hold "
                     "on the link (MiB; 0: the engine's default, for splice the link's "
                     "one-way bandwidth-delay product).")


def _write(path: str | None, data: dict) -> None:
  if not path:
    return
  tmp = f"{path}.{os.getpid()}.tmp"
  with open(tmp, "w") as f:
    json.dump(data, f)
  os.replace(tmp, path)


def main(argv):
  del argv
  child_process.die_with_parent()
  if not FLAGS.route:
    raise app.UsageError("give at least one --route")
  spec = LinkSpec(bandwidth_bps=parse_rate(FLAGS.bandwidth), rtt_s=FLAGS.rtt_ms / 1e3,
                  jitter_s=FLAGS.jitter_ms / 1e3,
                  trace=BandwidthTrace.parse(FLAGS.trace) if FLAGS.trace else None,
                  seed=FLAGS.seed, shape_bandwidth=FLAGS.shape_bandwidth)
  routes = [Route.parse(r) for r in FLAGS.route]
  queued = {"max_queued_bytes": FLAGS.max_queued_mb << 20} if FLAGS.max_queued_mb else {}
  relay = (SpliceRelay(spec, routes, **queued) if FLAGS.engine == "splice"
           else Relay(spec, routes, **queued)).start()
  _write(FLAGS.ready_file, {"pid": os.getpid(), "ports": relay.ports})
  print(f"netem relay ({FLAGS.engine}): {describe(spec)}; routes " + ", ".join(
      f"{r.name} :{relay.ports[r.name]} -> {r.target} ({r.direction})" for r in relay.routes),
        flush=True)
  stop = threading.Event()
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda *_: stop.set())
  while not stop.wait(FLAGS.stats_interval_s):
    _write(FLAGS.stats_file, relay.stats())
  _write(FLAGS.stats_file, relay.stats())
  relay.stop()


if __name__ == "__main__":
  app.run(main)
