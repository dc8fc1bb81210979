"""Command-line flags shared by the serving processes."""

from __future__ import annotations

from absl import flags

from paas_jax.security import cli as security_cli
from paas_jax.serving import child_process, common

FLAGS = flags.FLAGS


def define_server_flags(role: str):
  """Flags shared by the prefill and decode servers (``role``: prefill or decode)."""
  flags.DEFINE_string("config", "tiny_gdn_gqa", "Model config name or .py path.")
  flags.DEFINE_integer("seed", 0, "Random-init seed (same seed => same weights everywhere).")
  flags.DEFINE_string("checkpoint", None, "Checkpoint directory (overrides --config).")
  flags.DEFINE_enum("dtype", "", ["", "float32", "bfloat16"], "Serving dtype of weights, "
                    "activations and KV cache (recurrent states stay f32); empty: the "
                    "config's / checkpoint's.")
  flags.DEFINE_integer("tp", 1, "Tensor-parallel degree: the model sharded over this many "
                       "local devices (on CPU: XLA_FLAGS=--xla_force_host_platform_device_"
                       "count=N); tokens equal --tp=1's.")
  flags.DEFINE_string("host", "127.0.0.1", "Address to bind.")
  flags.DEFINE_integer("port", 0, "Control port (0: pick a free one).")
  flags.DEFINE_string("ready_file", None, "Write ports/pid as JSON here once serving.")
  flags.DEFINE_string("compilation_cache", None,
                      "Persistent XLA compilation cache dir ('none': off). Default "
                      "$PAAS_JAX_COMPILATION_CACHE or runs/.jax_cache.")
  flags.DEFINE_integer("prefill_max_batch", 4, "Prompts per prefill batch.")
  flags.DEFINE_list("prefill_buckets", ["64", "256"],
                    "Padded prefill chunk lengths (the largest is the chunk size).")
  flags.DEFINE_float("batch_window_ms", 5.0, "How long prefill waits to fill a batch.")
  flags.DEFINE_integer("prefix_block", 0, "Hybrid prefix cache block size in tokens "
                       "(0: no prefix cache).")
  flags.DEFINE_integer("prefix_cache_mb", 256, "Prefix cache budget, MiB.")
  flags.DEFINE_integer("max_ctx", 0, "Context per request (0: the model's max_seq_len).")
  flags.DEFINE_string("log_level", "INFO", "Logging level.")
  flags.DEFINE_bool("logit_probe", True, "Fail closed at the state handoff: the prefill "
                    "side sends a probe of its state's first decode step, the decode side "
                    "checks the received state against it (one decode step each; "
                    "paas_jax.serving.handoff_probe).")
  # TLS/mTLS identity or --insecure, --metrics_port, --log_format (paas_jax.security.cli).
  security_cli.define_flags(role)


def setup_process(role: str, *, name: str | None = None, tls_name: str | None = None):
  """(model, ServiceSecurity, ServingMetrics, metrics port or None).

  ``role`` (prefill or decode) selects the peer rules; ``name`` labels this
  process's logs and metrics (default ``role``; e.g. ``decode-slice1``: one
  process of a slice, whose peer rules are still a decode server's);
  ``tls_name`` overrides --tls_name (the process's own certificate)."""
  child_process.die_with_parent()
  name = name or role
  security_cli.setup_logging(name, FLAGS.log_level)
  # before the slow model load
  security = security_cli.security_from_flags(role, tls_name)
  metrics, metrics_port = security_cli.start_metrics(name)
  common.enable_compilation_cache(FLAGS.compilation_cache or common.default_compilation_cache())
  model, _ = common.load_model(FLAGS.config, FLAGS.seed, FLAGS.checkpoint, FLAGS.dtype,
                               tp=FLAGS.tp)
  return model, security, metrics, metrics_port
