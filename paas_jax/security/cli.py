"""Command-line flags of the serving processes for security and observability.

  --tls_dir=runs/certs --tls_name=decode        # files from make_certs
  --tls_cert=... --tls_key=... --tls_ca=...     # or explicit PEM files
  --insecure                                    # plaintext, explicitly (warns)
  --api_tokens_file=runs/certs/api_tokens.txt   # broker: bearer tokens
  --metrics_port=9100                           # Prometheus /metrics (-1: off)
  --log_format=json                             # structured logs with request_id

A server started with neither certificates nor ``--insecure`` refuses to
start: plaintext is never a silent default.
"""

from __future__ import annotations

import logging
import os

from absl import flags

from paas_jax.observability.logs import configure_json_logging
from paas_jax.observability.metrics import ServingMetrics
from paas_jax.security import ServiceSecurity, TLSConfig, TokenSet
from paas_jax.security.auth import TOKENS_ENV
from paas_jax.security.tls import SecurityConfigError

FLAGS = flags.FLAGS


def define_flags(role: str) -> None:
  """Defines the flags (once per process); ``role`` is broker, prefill or decode."""
  flags.DEFINE_string("tls_dir", None, "Directory made by `python -m "
                      "paas_jax.security.make_certs`: uses <tls_name>.pem/.key and ca.pem.")
  flags.DEFINE_string("tls_name", role, "Identity inside --tls_dir (e.g. prefill-0).")
  flags.DEFINE_string("tls_cert", None, "PEM certificate of this process (server and client).")
  flags.DEFINE_string("tls_key", None, "PEM private key of this process.")
  flags.DEFINE_string("tls_ca", None, "PEM CA that peers' certificates chain to (verifies "
                      "client certificates and the servers this process calls).")
  flags.DEFINE_bool("insecure", False, "Serve and call PLAINTEXT gRPC (no TLS, no peer "
                    "authentication). Must be asked for explicitly; logs a warning.")
  flags.DEFINE_integer("metrics_port", -1, "Serve Prometheus /metrics on this port of "
                       "--metrics_host (0: any free port, -1: off).")
  flags.DEFINE_string("metrics_host", "127.0.0.1", "Address of the /metrics endpoint.")
  flags.DEFINE_enum("log_format", "text", ["text", "json"],
                    "json: one JSON object per line with request_id.")
  if role == "broker":
    flags.DEFINE_string("api_tokens_file", None, "Bearer tokens accepted on the public API "
                        f"(`name:token` lines); default ${TOKENS_ENV}.")
    flags.DEFINE_bool("public_client_auth", False, "Also require client certificates from "
                      "our CA on the public API.")
  if role in ("prefill", "decode"):
    flags.DEFINE_string("faults", "", "Fault injection (tests/demo), e.g. "
                        "'kill_after_layers=2,corrupt_chunks=1' (prefill) or "
                        "'corrupt_states=1' (decode); see "
                        "paas_jax.security.faults.FaultPlan.")


def tls_from_flags(role: str, tls_name: str | None = None) -> TLSConfig:
  """``tls_name``: the identity in --tls_dir, overriding --tls_name (one
  process of a decode slice presents its own certificate)."""
  name = tls_name or FLAGS.tls_name or role
  if FLAGS.insecure:
    if FLAGS.tls_dir or FLAGS.tls_cert:
      raise SecurityConfigError("--insecure together with TLS files; choose one")
    return TLSConfig.plaintext(role)
  if FLAGS.tls_dir:
    return TLSConfig.from_dir(FLAGS.tls_dir, name)
  if FLAGS.tls_cert:
    return TLSConfig(cert=FLAGS.tls_cert, key=FLAGS.tls_key, ca=FLAGS.tls_ca, name=name)
  raise SecurityConfigError(
      f"{role}: no TLS identity. Pass --tls_dir (see `python -m paas_jax.security.make_certs`) "
      "or --tls_cert/--tls_key/--tls_ca, or --insecure for explicit plaintext.")


def security_from_flags(role: str, tls_name: str | None = None) -> ServiceSecurity:
  """``role`` selects the peer rules (``peers.service_rules``); ``tls_name``
  as in ``tls_from_flags``."""
  tls = tls_from_flags(role, tls_name)
  tokens = None
  public_client_auth = False
  if role == "broker":
    public_client_auth = FLAGS.public_client_auth
    if FLAGS.api_tokens_file or os.environ.get(TOKENS_ENV):
      tokens = TokenSet.load(FLAGS.api_tokens_file)
    elif not tls.insecure and not public_client_auth:
      raise SecurityConfigError(
          "broker: the public API needs bearer tokens (--api_tokens_file or "
          f"${TOKENS_ENV}) or client certificates (--public_client_auth)")
    else:
      logging.getLogger("paas_jax.security").warning(
          "SECURITY: the broker's public API checks no bearer token")
  return ServiceSecurity(tls=tls, role=role, tokens=tokens,
                         public_client_auth=public_client_auth)


def setup_logging(server: str, level: str = "INFO") -> None:
  """Text or JSON logs (``--log_format``) for a process of role ``server``."""
  if FLAGS.log_format == "json":
    configure_json_logging(level, server=server, pid=os.getpid())
  else:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


def start_metrics(server: str):
  """(ServingMetrics, port or None): the metrics object is always made (servers
  record into it); it is exposed over HTTP only with ``--metrics_port >= 0``."""
  metrics = ServingMetrics(server)
  port = None
  if FLAGS.metrics_port >= 0:
    port = metrics.serve(FLAGS.metrics_port, FLAGS.metrics_host)
  return metrics, port
