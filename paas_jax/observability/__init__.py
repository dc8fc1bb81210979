"""Metrics and structured logs of the serving processes.

* ``metrics.ServingMetrics``: Prometheus families on a per-server registry,
  an RPC-counting interceptor and ``serve(port)`` for ``/metrics``.
* ``logs``: JSON log lines carrying ``request_id``; the id travels between
  regions in the ``x-request-id`` header.
* ``health.HealthMonitor``: the broker's view of which servers are up.
"""

from paas_jax.observability.health import FAST_RECONNECT, HealthMonitor
from paas_jax.observability.logs import (REQUEST_ID_HEADER, JsonFormatter,
                                         RequestIdClientInterceptor, RequestIdInterceptor,
                                         RequestLogger, configure_json_logging,
                                         current_request_id, request_context, request_metadata)
from paas_jax.observability.metrics import MetricsInterceptor, ServingMetrics

__all__ = [
    "FAST_RECONNECT", "HealthMonitor", "JsonFormatter", "MetricsInterceptor", "REQUEST_ID_HEADER", "RequestIdClientInterceptor",
    "RequestIdInterceptor", "RequestLogger", "ServingMetrics", "configure_json_logging",
    "current_request_id", "request_context", "request_metadata",
]
