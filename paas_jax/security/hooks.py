"""The interceptor stack of a serving process, in one place.

Order matters: metrics first (so refused calls are counted), then the request
id (so auth refusals are logged with it), then the bearer-token check, then
the peer-role check.
"""

from __future__ import annotations

import grpc

from paas_jax.observability.logs import RequestIdInterceptor
from paas_jax.security import ServiceSecurity


def server_interceptors(security: ServiceSecurity | None = None,
                        metrics=None) -> list[grpc.ServerInterceptor]:
  """Interceptors for a server with ``security`` (None: none) recording into
  ``metrics`` (a ``ServingMetrics`` or None)."""
  out: list[grpc.ServerInterceptor] = []
  if metrics is not None:
    out.append(metrics.interceptor())
  out.append(RequestIdInterceptor())
  if security is not None:
    out += security.interceptors(on_auth=metrics.on_auth if metrics is not None else None,
                                 on_peer=metrics.on_peer if metrics is not None else None)
  return out
