"""The gateway process: OpenAI HTTP API on one port, the broker behind it.

  python -m paas_jax.frontdoor --broker=127.0.0.1:50050 --port=8000 --insecure
  python -m paas_jax.frontdoor --broker=127.0.0.1:50050 --port=8443 \\
      --tls_dir=runs/certs --tls_name=broker --api_tokens_file=runs/certs/api_tokens.txt \\
      --api_token_file=runs/certs/client.token

Security is the gRPC front door's: the same certificate (HTTPS with
``--tls_name``'s identity, default the broker's), the same bearer-token file
(checked here and again by the broker, to which each caller's token is
forwarded), and the same rule that plaintext must be asked for (``--insecure``).
``--api_token_file``: the gateway's own token, for reading the served model
from the broker at start.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import ssl
import time

import grpc
from absl import flags
from aiohttp import web

from paas_jax.frontdoor.app import Gateway, GatewayConfig, make_app
from paas_jax.frontdoor.backend import BrokerBackend
from paas_jax.security import channel_credentials, read_token
from paas_jax.security import cli as security_cli
from paas_jax.serving import child_process, common

log = logging.getLogger("paas_jax.frontdoor")
FLAGS = flags.FLAGS


def define_flags() -> None:
  flags.DEFINE_string("broker", "127.0.0.1:50050", "The broker's public host:port.")
  flags.DEFINE_string("host", "127.0.0.1", "HTTP address to bind.")
  flags.DEFINE_integer("port", 8000, "HTTP port (0: pick a free one).")
  flags.DEFINE_string("served_model_name", "", "Model name clients send (default: the "
                      "broker's served model name).")
  flags.DEFINE_integer("max_inflight", 256, "Concurrent generations before 429.")
  flags.DEFINE_float("timeout_s", 600.0, "Deadline of one generation at the broker.")
  flags.DEFINE_float("wait_s", 300.0, "How long to wait for the broker at start.")
  flags.DEFINE_string("api_token_file", None, "The gateway's own bearer token (default "
                      "$PAAS_JAX_API_TOKEN), for its GetModel call to a broker with tokens.")
  flags.DEFINE_string("ready_file", None, "Write port/pid as JSON here once serving.")
  flags.DEFINE_string("log_level", "INFO", "Logging level.")
  # --tls_dir/--tls_name/--tls_cert/--tls_key/--tls_ca, --insecure, --api_tokens_file.
  security_cli.define_flags("broker")


def ssl_context(cert: str, key: str) -> ssl.SSLContext:
  ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
  ctx.minimum_version = ssl.TLSVersion.TLSv1_2
  ctx.load_cert_chain(cert, key)
  return ctx


async def _model_info(gateway: Gateway, wait_s: float):
  deadline = time.monotonic() + wait_s
  while True:
    try:
      return await gateway.load_model_info()
    except grpc.aio.AioRpcError as e:
      if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
        raise
      await asyncio.sleep(0.5)


async def serve() -> None:
  security = security_cli.security_from_flags("broker")
  tls = security.tls
  creds = None if tls.insecure else channel_credentials(tls.ca, what="gateway->broker")
  backend = BrokerBackend(FLAGS.broker, credentials=creds, timeout_s=FLAGS.timeout_s,
                          token=read_token(FLAGS.api_token_file))
  gateway = Gateway(backend, GatewayConfig(tokens=security.tokens,
                                           max_inflight=FLAGS.max_inflight,
                                           model_name=FLAGS.served_model_name))
  info = await _model_info(gateway, FLAGS.wait_s)
  # handler_cancellation: a client that disconnects cancels its handler task,
  # which cancels the broker call (aiohttp's default lets it run on).
  runner = web.AppRunner(make_app(gateway), handler_cancellation=True, access_log=None)
  await runner.setup()
  site = web.TCPSite(runner, FLAGS.host, FLAGS.port,
                     ssl_context=None if tls.insecure else ssl_context(tls.cert, tls.key))
  await site.start()
  port = runner.addresses[0][1]
  common.announce_ready(FLAGS.ready_file, {"pid": os.getpid(), "port": port,
                                           "model": info.name, "tls": not tls.insecure})
  log.info("OpenAI API on %s://%s:%d for model %r (broker %s, chat template: %s)",
           "http" if tls.insecure else "https", FLAGS.host, port, info.name, FLAGS.broker,
           gateway.template.name)
  stop = asyncio.Event()
  loop = asyncio.get_running_loop()
  for sig in (signal.SIGTERM, signal.SIGINT):
    loop.add_signal_handler(sig, stop.set)
  await stop.wait()
  await runner.cleanup()
  await backend.close()


def main(argv) -> None:
  del argv
  child_process.die_with_parent()
  security_cli.setup_logging("gateway", FLAGS.log_level)
  asyncio.run(serve())
