"""Prometheus metrics of one serving process, in a registry object passed explicitly.

  metrics = ServingMetrics(server="decode")            # its own CollectorRegistry
  server = grpc.server(pool, interceptors=[metrics.interceptor()])
  metrics.track_queue("decode_wait", lambda: scheduler.queue_depth)
  metrics.observe_first_token("prfaas", ttft_s)
  port = metrics.serve(9100)                           # GET http://127.0.0.1:9100/metrics

Nothing is registered in prometheus-client's global default registry, so
several servers (or tests) in one Python process never collide; each exposes
its own ``/metrics`` port.

Families (all prefixed ``paas_``):

* RPCs: ``rpcs_total{method,code}``, ``rpc_duration_seconds{method}``,
  ``rpcs_in_flight{method}`` (from ``interceptor()``).
* Queues: ``queue_depth{queue}`` (callbacks, read at scrape time),
  ``queue_rejections_total{queue}``.
* Latency: ``ttft_seconds{route}``, ``tpot_seconds{route}``,
  ``request_duration_seconds{route,outcome}``.
* Links: ``link_bytes_total{link}`` (everything put on the wire, resends
  included), ``link_goodput_bytes_total{link}`` (bytes of states that were
  committed), ``link_transfer_seconds{link}``,
  ``link_goodput_bytes_per_second{link}`` (last committed transfer),
  ``link_transfers_total{link,outcome}``, ``link_chunk_retries_total{link}``.
* Routing: ``routing_decisions_total{route,reason}``,
  ``reroutes_total{cause,to}`` (fault recovery: re-prefill elsewhere).
* Security: ``auth_refusals_total{check,code}``.
* ``process_*``: memory, CPU, file descriptors of this process.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Iterator

import grpc
import prometheus_client as prom

from paas_jax.security import interceptors

# Seconds: from a few ms (tiny models, loopback) to minutes (long prompts, slow links).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0)
TPOT_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)


def _reason_label(text: str, limit: int = 48) -> str:
  """Bounded label values: free text (e.g. a route reason with a number in it)
  must not create unbounded time series."""
  head = text.split(":", 1)[0] if text else ""
  return head[:limit] or "none"


class ServingMetrics:
  """The metric families of one paas-jax server, on ``registry``.

  Args:
    server: role of the process (``broker``, ``prefill``, ``decode``); exported
      as ``paas_server_info{server=...}``.
    registry: the registry to register on (default: a new one).
    process: also export ``process_*`` (memory, CPU) of this process.
  """

  def __init__(self, server: str, registry: prom.CollectorRegistry | None = None, *,
               process: bool = True):
    self.server = server
    self.registry = registry if registry is not None else prom.CollectorRegistry()
    r = self.registry
    self._lock = threading.Lock()
    self._http = None
    info = prom.Info("paas_server", "Role of this process.", registry=r)
    info.info({"server": server})
    if process:
      prom.ProcessCollector(registry=r)

    self.rpcs = prom.Counter("paas_rpcs", "Finished RPCs by method and status.",
                             ["method", "code"], registry=r)
    self.rpc_seconds = prom.Histogram("paas_rpc_duration_seconds", "RPC handler duration.",
                                      ["method"], buckets=LATENCY_BUCKETS, registry=r)
    self.rpcs_in_flight = prom.Gauge("paas_rpcs_in_flight", "RPCs being handled.",
                                     ["method"], registry=r)
    self.queue_depth = prom.Gauge("paas_queue_depth", "Items waiting in a bounded queue.",
                                  ["queue"], registry=r)
    self.queue_limit = prom.Gauge("paas_queue_limit", "Capacity of a bounded queue.",
                                  ["queue"], registry=r)
    self.queue_rejections = prom.Counter("paas_queue_rejections",
                                         "Items refused because a queue was full.",
                                         ["queue"], registry=r)
    self.ttft = prom.Histogram("paas_ttft_seconds", "Time to first token.", ["route"],
                               buckets=LATENCY_BUCKETS, registry=r)
    self.tpot = prom.Histogram("paas_tpot_seconds", "Mean time per output token after the "
                               "first, per request.", ["route"], buckets=TPOT_BUCKETS,
                               registry=r)
    self.request_seconds = prom.Histogram("paas_request_duration_seconds",
                                          "Whole request, accept to last token.",
                                          ["route", "outcome"], buckets=LATENCY_BUCKETS,
                                          registry=r)
    self.link_bytes = prom.Counter("paas_link_bytes", "Bytes put on an inter-region link "
                                   "(resends included).", ["link"], registry=r)
    self.link_goodput_bytes = prom.Counter("paas_link_goodput_bytes",
                                           "Bytes of states committed over a link.", ["link"],
                                           registry=r)
    self.link_seconds = prom.Histogram("paas_link_transfer_seconds",
                                       "State transfer time, Begin to Commit.", ["link"],
                                       buckets=LATENCY_BUCKETS, registry=r)
    self.link_goodput = prom.Gauge("paas_link_goodput_bytes_per_second",
                                   "Goodput of the last committed transfer.", ["link"],
                                   registry=r)
    self.link_transfers = prom.Counter("paas_link_transfers", "State transfers by outcome.",
                                       ["link", "outcome"], registry=r)
    self.link_retries = prom.Counter("paas_link_chunk_retries", "Chunks sent again after a "
                                     "failed integrity check or loss.", ["link"], registry=r)
    self.routing = prom.Counter("paas_routing_decisions", "Routing decisions.",
                                ["route", "reason"], registry=r)
    self.reroutes = prom.Counter("paas_reroutes", "Requests moved elsewhere after a fault.",
                                 ["cause", "to"], registry=r)
    self.auth_refusals = prom.Counter("paas_auth_refusals", "Calls refused by an auth check.",
                                      ["check", "code"], registry=r)
    self.handoff_probes = prom.Counter(
        "paas_handoff_probes", "Handed-off states checked against the prefill side's logit "
        "probe, by outcome (ok, mismatch: failed with DATA_LOSS, unverified: no probe sent, "
        "error).", ["outcome"], registry=r)

  # -- recording helpers ----------------------------------------------------------

  def track_queue(self, name: str, depth: Callable[[], float],
                  limit: float | None = None) -> None:
    """Reports ``depth()`` as ``paas_queue_depth{queue=name}`` at every scrape."""
    self.queue_depth.labels(name).set_function(lambda: float(depth()))
    if limit is not None:
      self.queue_limit.labels(name).set(limit)

  def observe_first_token(self, route: str, seconds: float) -> None:
    self.ttft.labels(route).observe(max(seconds, 0.0))

  def observe_request(self, route: str, outcome: str, *, ttft_s: float | None = None,
                      tpot_s: float | None = None, total_s: float | None = None) -> None:
    if ttft_s is not None:
      self.ttft.labels(route).observe(max(ttft_s, 0.0))
    if tpot_s is not None and tpot_s > 0:
      self.tpot.labels(route).observe(tpot_s)
    if total_s is not None:
      self.request_seconds.labels(route, outcome).observe(max(total_s, 0.0))

  def observe_transfer(self, link: str, *, bytes_sent: int, state_bytes: int, seconds: float,
                       ok: bool = True, retried_chunks: int = 0) -> None:
    self.link_bytes.labels(link).inc(max(bytes_sent, 0))
    if retried_chunks:
      self.link_retries.labels(link).inc(retried_chunks)
    self.link_transfers.labels(link, "ok" if ok else "failed").inc()
    if ok:
      self.link_goodput_bytes.labels(link).inc(max(state_bytes, 0))
      self.link_seconds.labels(link).observe(max(seconds, 0.0))
      if seconds > 0:
        self.link_goodput.labels(link).set(state_bytes / seconds)

  def observe_route(self, route: str, reason: str) -> None:
    self.routing.labels(route, _reason_label(reason)).inc()

  def observe_reroute(self, cause: str, to: str) -> None:
    self.reroutes.labels(_reason_label(cause), to).inc()

  def on_auth(self, method: str, verdict) -> None:
    """``BearerTokenInterceptor(on_result=...)`` hook."""
    del method
    if not verdict.ok:
      self.auth_refusals.labels("token", verdict.code.name).inc()

  def on_peer(self, method: str, allowed: bool, names) -> None:
    """``PeerIdentityInterceptor(on_result=...)`` hook."""
    del method
    if not allowed:
      code = "PERMISSION_DENIED" if names else "UNAUTHENTICATED"
      self.auth_refusals.labels("peer", code).inc()

  # -- exposition -------------------------------------------------------------------

  def text(self) -> str:
    return prom.generate_latest(self.registry).decode()

  def serve(self, port: int = 0, addr: str = "127.0.0.1") -> int:
    """Serves ``GET /metrics`` on ``addr:port`` (0: a free port); returns the port."""
    with self._lock:
      if self._http is not None:
        raise RuntimeError("metrics are already served")
      server, thread = prom.start_http_server(port, addr=addr, registry=self.registry)
      self._http = (server, thread)
      return server.server_port

  def stop(self) -> None:
    with self._lock:
      if self._http is not None:
        server, thread = self._http
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
        self._http = None

  def interceptor(self) -> "MetricsInterceptor":
    return MetricsInterceptor(self)


def _code_name(context: grpc.ServicerContext, default: str) -> str:
  try:
    code = context.code()
  except Exception:  # pylint: disable=broad-except
    code = None
  if isinstance(code, grpc.StatusCode):
    return code.name
  return default


class MetricsInterceptor(grpc.ServerInterceptor):
  """Counts every RPC by method and final status; times the handler.

  Put it first in the interceptor list so that calls refused by the auth
  interceptors are counted too.
  """

  def __init__(self, metrics: ServingMetrics, *,
               exempt: tuple[str, ...] = (interceptors.HEALTH_PREFIX,)):
    self.metrics = metrics
    self.exempt = exempt

  def intercept_service(self, continuation, handler_call_details):
    method = handler_call_details.method
    handler = continuation(handler_call_details)
    if handler is None or interceptors.matches(method, self.exempt):
      return handler
    short = method.rsplit("/", 2)[-2].rsplit(".", 1)[-1] + "/" + method.rsplit("/", 1)[-1]
    m = self.metrics

    def done(started: float, context, default: str) -> None:
      m.rpcs_in_flight.labels(short).dec()
      m.rpc_seconds.labels(short).observe(time.perf_counter() - started)
      m.rpcs.labels(short, _code_name(context, default)).inc()

    def wrap(behavior, response_streaming):
      if response_streaming:
        def run_stream(request, context) -> Iterator:
          started = time.perf_counter()
          m.rpcs_in_flight.labels(short).inc()
          recorded = threading.Lock()

          def finish(outcome: str) -> None:
            if recorded.acquire(blocking=False):  # exactly once, whichever path is first
              done(started, context, outcome)

          # gRPC may stop pulling from (and never close) the generator of a
          # cancelled call, so its end is also taken from the RPC's own
          # termination callback.
          context.add_callback(lambda: finish("CANCELLED"))
          outcome = "UNKNOWN"
          try:
            yield from behavior(request, context)
            # A handler can run to completion after the client went away
            # (its last messages are then discarded): that call was cancelled.
            outcome = "OK" if context.is_active() else "CANCELLED"
          except GeneratorExit:
            outcome = "CANCELLED"
            raise
          finally:
            finish(outcome)
        return run_stream

      def run(request, context):
        started = time.perf_counter()
        m.rpcs_in_flight.labels(short).inc()
        outcome = "UNKNOWN"
        try:
          response = behavior(request, context)
          outcome = "OK"
          return response
        finally:
          done(started, context, outcome)
      return run

    return interceptors.wrap_handler(handler, wrap)
