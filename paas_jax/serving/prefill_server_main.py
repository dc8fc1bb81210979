"""The prefill server's launcher: ``python -m paas_jax.serving.prefill_server`` (flags, wiring).

Flags are defined by ``define_flags`` (called by ``run``), never on import, so
importing this module next to other launchers cannot collide on flag names.
"""

from __future__ import annotations

import logging
import os
import time

from absl import app, flags

from paas_jax.codec import CodecOptions
from paas_jax.scheduling.tenant_queue import TenantPolicy
from paas_jax.security.faults import FaultPlan
from paas_jax.serving import cli, common, transfer_flags
from paas_jax.serving.engine_config import EngineConfig
from paas_jax.serving.prefill_server import start

log = logging.getLogger("paas_jax.serving.prefill")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  t0 = time.time()
  model, security, metrics, metrics_port = cli.setup_process("prefill")
  faults = FaultPlan.parse(FLAGS.faults)
  if faults.active:
    log.warning("FAULT INJECTION enabled: %s", faults)
  engine_config = EngineConfig(
      n_slots=1, max_ctx=FLAGS.max_ctx,
      prefill_buckets=tuple(int(b) for b in FLAGS.prefill_buckets),
      prefill_max_batch=FLAGS.prefill_max_batch, prefix_block=FLAGS.prefix_block,
      prefix_cache_bytes=FLAGS.prefix_cache_mb << 20)
  sender_options = transfer_flags.sender_options()
  server = start(model, engine_config, host=FLAGS.host, port=FLAGS.port,
                 batch_window_s=FLAGS.batch_window_ms / 1e3,
                 codec=CodecOptions(compression=FLAGS.codec_compression),
                 sender_options=sender_options,
                 security=security, metrics=metrics,
                 faults=faults if faults.active else None, max_queue=FLAGS.max_queue,
                 transfer_port=FLAGS.transfer_port, stream_chunks=FLAGS.stream_chunks,
                 commit_every=FLAGS.commit_every, logit_probe=FLAGS.logit_probe,
                 tenants=TenantPolicy.parse(FLAGS.tenant_weights, FLAGS.tenant_quotas,
                                            fair=FLAGS.tenant_sharing == "wfq",
                                            default_quota=FLAGS.tenant_quota))
  common.announce_ready(FLAGS.ready_file, {
      "pid": os.getpid(), "port": server.control.port, "model": model.config.name,
      "transfer_port": server.transfer.port,
      "metrics_port": metrics_port, **transfer_flags.announced(sender_options),
      "startup_s": time.time() - t0})
  log.info("prefill server on %s, model %s", server.address, model.config.name)
  common.wait_for_termination(lambda: server.preempt_and_stop(FLAGS.preempt_grace_s))


def define_flags() -> None:
  cli.define_server_flags("prefill")
  flags.DEFINE_integer("max_queue", 64, "Prompts allowed to wait for a prefill batch.")
  flags.DEFINE_enum("codec_compression", "raw", ["raw", "zstd", "blosc"],
                    "State codec compression on the link.")
  transfer_flags.define_flags()
  flags.DEFINE_integer("transfer_port", 0, "StateTransfer port for prefixes shipped from PD "
                       "nodes (cross-cluster prefix cache; 0: pick a free one).")
  flags.DEFINE_bool("stream_chunks", True, "Stream every prefill chunk as a segment as soon "
                    "as it is computed (commit points, resume); false: one transfer per "
                    "prompt, layers of the last chunk pipelined.")
  flags.DEFINE_integer("commit_every", 2, "Chunks per commit point (stream_chunks).")
  flags.DEFINE_enum("tenant_sharing", "wfq", ["wfq", "fifo"], "How the prompts of several "
                    "tenants (decode regions, PrefillRequest.tenant) share this pool: weighted "
                    "fair queueing over prompt tokens, or one FIFO (arrival order).")
  flags.DEFINE_string("tenant_weights", "", "Tenant weights for wfq, e.g. 'B=2,C=1' (others 1).")
  flags.DEFINE_integer("tenant_quota", 0, "Most prompts one tenant may have waiting (0: only "
                       "--max_queue for all together); past it, RESOURCE_EXHAUSTED.")
  flags.DEFINE_string("tenant_quotas", "", "Per-tenant overrides of --tenant_quota, 'B=8,C=4'.")
  flags.DEFINE_float("preempt_grace_s", 5.0, "On SIGTERM (a preemption notice): stop taking "
                     "work and let running prefills commit for up to this long, then hand "
                     "the rest to the broker's resume path (0: stop at once).")


def run() -> None:
  define_flags()
  app.run(main)


if __name__ == "__main__":
  run()
