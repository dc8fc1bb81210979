"""The broker's launcher: ``python -m paas_jax.serving.broker`` (flags, wiring).

Flags are defined by ``define_flags`` (called by ``run``), never on import, so
importing this module next to other launchers cannot collide on flag names.
"""

from __future__ import annotations

import logging
import os

from absl import app, flags

from paas_jax.models import load_config
from paas_jax.security import cli as security_cli
from paas_jax.serving import child_process, common
from paas_jax.serving import pd_roles
from paas_jax.serving.broker import (MAX_ATTEMPTS, MAX_REQUEST_BYTES, DecodeTarget,
                                     model_config_from_decode, start)
from paas_jax.serving.control_plane import served_model_of
from paas_jax.serving.node_pool import AffinityBalance
from paas_jax.serving.routing import make_policy
from paas_jax.serving.tokenizer import served_text

log = logging.getLogger("paas_jax.serving.broker")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  child_process.die_with_parent()
  security_cli.setup_logging("broker", FLAGS.log_level)
  security = security_cli.security_from_flags("broker")
  metrics, metrics_port = security_cli.start_metrics("broker")
  channel_creds = security.channel_credentials()
  if len(FLAGS.decode) != len(FLAGS.decode_transfer):
    raise app.UsageError("--decode and --decode_transfer need the same number of entries")
  local = list(FLAGS.decode_local_transfer) or [""] * len(FLAGS.decode)
  if len(local) != len(FLAGS.decode):
    raise app.UsageError("--decode_local_transfer needs one entry per --decode")
  try:
    targets = [DecodeTarget.parse(c, t, lt)
               for c, t, lt in zip(FLAGS.decode, FLAGS.decode_transfer, local)]
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  try:  # the roles' form now (before waiting); against the nodes' shapes below
    if FLAGS.pd_roles:
      pd_roles.validate_roles(FLAGS.pd_roles)
  except pd_roles.RoleError as e:
    raise app.UsageError(f"--pd_roles: {e}") from None
  threshold = float("inf") if FLAGS.threshold < 0 else FLAGS.threshold
  for target in list(FLAGS.prefill) + list(FLAGS.decode):
    common.wait_healthy(target, FLAGS.wait_s, credentials=channel_creds)
  try:  # a decode slice takes state on every process: where region A sends its parts
    targets = [t.with_slice(served_model_of(t.control, channel_creds).slice) for t in targets]
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  # A decode slice among the nodes has a fixed role ("both"); the default
  # split places only the single-process nodes (pd_roles.default_roles_for).
  shapes = [t.shape for t in targets]
  try:
    roles = (pd_roles.check_roles(FLAGS.pd_roles, shapes) if FLAGS.pd_roles
             else pd_roles.default_roles_for(shapes, FLAGS.pd_prefill_nodes))
  except pd_roles.RoleError as e:
    flag = "--pd_roles" if FLAGS.pd_roles else "--pd_prefill_nodes"
    raise app.UsageError(f"{flag}: {e}") from None
  try:
    affinity = AffinityBalance(FLAGS.affinity_abs_load, FLAGS.affinity_rel_load)
  except ValueError as e:
    raise app.UsageError(f"--affinity_abs_load / --affinity_rel_load: {e}") from None
  config = (load_config(FLAGS.config) if FLAGS.config
            else model_config_from_decode(FLAGS.decode[0], channel_creds))
  text = served_text(config, FLAGS.checkpoint, FLAGS.tokenizer, FLAGS.served_model_name,
                     declared_config=bool(FLAGS.config))
  policy = make_policy(FLAGS.router, threshold)
  server = start(config, policy,
                 prefill_targets=FLAGS.prefill, decode_targets=targets, host=FLAGS.host,
                 port=FLAGS.port, codec_json=FLAGS.codec_json, text=text,
                 security=security, metrics=metrics, max_attempts=FLAGS.max_attempts,
                 max_request_bytes=FLAGS.max_request_bytes, roles=roles,
                 affinity=affinity)
  server.servicer.runner.tenant = FLAGS.tenant
  if FLAGS.prefill_transfer and len(FLAGS.prefill_transfer) != len(FLAGS.prefill):
    raise app.UsageError("--prefill_transfer needs one entry per --prefill")
  server.servicer.enable_prefix_transfer(FLAGS.prefill_transfer,
                                         enabled=FLAGS.cross_cluster_prefix)
  if FLAGS.router == "adaptive" or FLAGS.live_view:
    server.servicer.enable_live_view(FLAGS.link_bandwidth_bps, poll_s=FLAGS.poll_ms / 1e3,
                                     rebalance_every_s=FLAGS.rebalance_every_s,
                                     n_slots=FLAGS.n_slots,
                                     apply_threshold=FLAGS.rebalance_apply)
  common.announce_ready(FLAGS.ready_file, {"pid": os.getpid(), "port": server.control.port,
                                           "metrics_port": metrics_port})
  log.info("broker on %s: prefill %s, decode %s (roles %s), router %s, threshold %s",
           server.address, FLAGS.prefill, targets, list(roles), FLAGS.router, threshold)
  common.wait_for_termination(server.stop)


def define_flags() -> None:
  flags.DEFINE_string("config", "tiny_gdn_gqa", "Model config served (vocabulary, context); "
                      "empty: ask the first decode server (e.g. when serving a checkpoint).")
  flags.DEFINE_string("tokenizer", None, "tokenizer.json for --prompt text (default: the "
                      "--checkpoint's; byte-level for a --config with >= 256 ids).")
  flags.DEFINE_string("checkpoint", None, "The served checkpoint directory: its tokenizer, "
                      "chat template, EOS ids (generation_config.json) and model name.")
  flags.DEFINE_string("served_model_name", "", "Model name clients send (default: the "
                      "checkpoint's own name or the config name).")
  flags.DEFINE_string("host", "127.0.0.1", "Address to bind.")
  flags.DEFINE_integer("port", 0, "Port (0: pick a free one).")
  flags.DEFINE_list("prefill", [], "Prefill servers (PrfaaS region), host:port.")
  flags.DEFINE_list("decode", [], "Decode servers' control addresses, host:port.")
  flags.DEFINE_list("prefill_transfer", [],
                    "Each prefill server's prefix-import (StateTransfer) address as reached "
                    "from the PD region (e.g. the WAN relay's B->A route); empty: PD-P's "
                    "cached prefixes are never shipped to PrfaaS.")
  flags.DEFINE_bool("cross_cluster_prefix", True, "Ship a cached prefix to the other region "
                    "before prefilling when the adaptive router asks for it (abundant "
                    "link); off: such decisions fall back to the scarce rule.")
  flags.DEFINE_list("decode_transfer", [],
                    "Each decode server's StateTransfer address as reached from the prefill "
                    "region (e.g. the WAN relay); a decode slice's processes' addresses "
                    "joined by '+' by rank (one address: process 0's, the others' as the "
                    "slice announces them).")
  flags.DEFINE_list("decode_local_transfer", [],
                    "Each decode server's StateTransfer address inside the PD region (PD-P "
                    "node -> PD-D node states; empty: --decode_transfer).")
  flags.DEFINE_list("pd_roles", [], "Starting role of each decode server: pdp, pdd or both "
                    "(empty: --pd_prefill_nodes).")
  flags.DEFINE_integer("pd_prefill_nodes", -1, "With N > 1 decode servers and no --pd_roles: "
                       "the last K are PD-P, the rest PD-D (-1: N // 2). One server: both.")
  flags.DEFINE_integer("affinity_abs_load", AffinityBalance.abs_load,
                       "A PD node preferred for its cached prefix yields to the least loaded "
                       "node once it has more than this many more requests in flight ...")
  flags.DEFINE_float("affinity_rel_load", AffinityBalance.rel_load,
                     "... and more than this many times as many (node_pool.AffinityBalance).")
  flags.DEFINE_float("threshold", 128, "Selective offloading: prompts longer than this many "
                     "tokens are prefilled remotely (<0: never).")
  flags.DEFINE_string("tenant", "", "This broker's decode region as a tenant of a shared "
                      "prefill pool (fair sharing, egress per link); '': the default tenant.")
  flags.DEFINE_string("codec_json", "", "CodecOptions JSON for the link (empty: server default).")
  flags.DEFINE_enum("router", "adaptive", ["static", "adaptive"],
                    "adaptive: PrfaasRouter (bandwidth regime, queue-aware t, prefix caches "
                    "of both regions) on a live ClusterView. static: l > threshold offloads "
                    "(the baseline; ClusterSpec's default, for deterministic tests).")
  flags.DEFINE_bool("live_view", False, "Poll the regions for the live ClusterView and probe "
                    "prefix caches even with --router=static.")
  flags.DEFINE_float("link_bandwidth_bps", 1e9, "PrfaaS->PD link capacity the router assumes.")
  flags.DEFINE_float("poll_ms", 200, "GetStats poll period of the live view.")
  flags.DEFINE_float("rebalance_every_s", 5.0, "Rebalancer period (0: off). Measured service "
                     "times always reach the router; t and PD roles only with --rebalance_apply.")
  flags.DEFINE_bool("rebalance_apply", False, "Put the rebalancer's t into the router and, with "
                    "several PD nodes, move nodes between PD-P and PD-D (drained first).")
  flags.DEFINE_integer("n_slots", 8, "Decode slots per decode server (rebalancer's BS_max).")
  flags.DEFINE_float("wait_s", 300, "How long to wait for the regions to become healthy.")
  flags.DEFINE_string("ready_file", None, "Write port/pid as JSON here once serving.")
  flags.DEFINE_integer("max_attempts", MAX_ATTEMPTS, "Tries per request (re-prefill / "
                       "restart after a server or link fault).")
  flags.DEFINE_integer("max_request_bytes", MAX_REQUEST_BYTES, "Largest request accepted.")
  flags.DEFINE_string("log_level", "INFO", "Logging level.")
  # TLS identity / --insecure, --api_tokens_file, --metrics_port, --log_format.
  security_cli.define_flags("broker")


def run() -> None:
  define_flags()
  app.run(main)


if __name__ == "__main__":
  run()
