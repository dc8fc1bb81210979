"""The decode server's launcher: ``python -m paas_jax.serving.decode_server`` (flags, wiring).

Flags are defined by ``define_flags`` (called by ``run``), never on import, so
importing this module next to other launchers cannot collide on flag names.
"""

from __future__ import annotations

import logging
import os
import time

from absl import app, flags

from paas_jax.security.faults import FaultPlan
from paas_jax.serving import cli, common, handoff_probe
from paas_jax.serving.decode_server import start
from paas_jax.serving.engine_config import EngineConfig

log = logging.getLogger("paas_jax.serving.decode")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  t0 = time.time()
  model, security, metrics, metrics_port = cli.setup_process("decode")
  faults = FaultPlan.parse(FLAGS.faults)
  if faults.active:
    log.warning("FAULT INJECTION enabled: %s", faults)
  engine_config = EngineConfig(
      n_slots=FLAGS.n_slots, max_ctx=FLAGS.max_ctx, page_size=FLAGS.page_size,
      num_pages=FLAGS.num_pages, prefill_buckets=tuple(int(b) for b in FLAGS.prefill_buckets),
      prefill_max_batch=FLAGS.prefill_max_batch, prefix_block=FLAGS.prefix_block,
      prefix_cache_bytes=FLAGS.prefix_cache_mb << 20,
      decode_steps_per_sync=FLAGS.decode_steps_per_sync)
  server = start(model, engine_config, host=FLAGS.host, port=FLAGS.port,
                 transfer_port=FLAGS.transfer_port, max_queue=FLAGS.max_queue,
                 batch_window_s=FLAGS.batch_window_ms / 1e3, security=security,
                 metrics=metrics, logit_probe=FLAGS.logit_probe,
                 corrupt_state=handoff_probe.fault_hook(faults, model.config),
                 data_plane=FLAGS.transfer_plane == "tcp",
                 data_plane_host=FLAGS.data_plane_host or None,
                 first_token_early=FLAGS.first_token_early)
  common.announce_ready(FLAGS.ready_file, {
      "pid": os.getpid(), "port": server.control.port,
      "transfer_port": server.transfer.port, "model": model.config.name,
      "data_plane_port": (server.transfer.data_plane.port
                          if server.transfer.data_plane is not None else 0),
      "metrics_port": metrics_port,
      "startup_s": time.time() - t0})
  log.info("decode server on %s (transfer %s), model %s", server.address,
           server.transfer_address, model.config.name)
  common.wait_for_termination(server.stop)


def define_flags() -> None:
  cli.define_server_flags("decode")
  flags.DEFINE_integer("transfer_port", 0, "StateTransfer port (0: pick a free one).")
  flags.DEFINE_enum("transfer_plane", "tcp", ["tcp", "grpc"], "tcp: the transfer port also "
                    "opens the TCP data plane (announced in BeginResponse); grpc: gRPC only.")
  flags.DEFINE_string("data_plane_host", "", "Bind the data plane on this address instead "
                      "of --host (the launcher puts a WAN relay on the announced port).")
  flags.DEFINE_integer("n_slots", 8, "Decode slots.")
  flags.DEFINE_integer("page_size", 16, "KV page size (positions).")
  flags.DEFINE_integer("num_pages", 0, "KV pages (0: n_slots * max_ctx / page_size).")
  flags.DEFINE_integer("max_queue", 64, "Requests allowed to wait for a slot.")
  flags.DEFINE_integer("decode_steps_per_sync", 1, "Most decode steps per device call (one "
                       "token read-back per window; 1 while a request waits for a slot or "
                       "asks for logprobs); tokens then stream in bursts of the window.")
  flags.DEFINE_bool("first_token_early", True, "Stream a remote request's first token "
                    "(sampled by the prefill side) at its Handoff, before the state lands; "
                    "the logit probe still gates token 2 onwards.")


def run() -> None:
  define_flags()
  app.run(main)


if __name__ == "__main__":
  run()
