"""Server-interceptor plumbing shared by the auth, peer and metrics hooks.

A ``grpc.ServerInterceptor`` only sees the method name and the invocation
metadata; the ``ServicerContext`` (peer certificate, deadline, final status)
exists only once the handler runs, on a worker thread. ``wrap_handler``
therefore wraps the handler's behaviour: the wrapper runs on that worker
thread, sees the context, and can refuse the call before the servicer runs.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import grpc

HEALTH_PREFIX = "/grpc.health.v1.Health/"

# wrap(behavior, response_streaming) -> new behavior with the same signature
# (request_or_iterator, context) -> response or response iterator.
Wrap = Callable[[Callable[..., Any], bool], Callable[..., Any]]

_FACTORIES = {
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
    (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
}


def wrap_handler(handler: grpc.RpcMethodHandler | None, wrap: Wrap
                 ) -> grpc.RpcMethodHandler | None:
  """A handler of the same kind and (de)serializers whose behaviour is
  ``wrap(original_behaviour, response_streaming)``."""
  if handler is None:
    return None
  kind = (bool(handler.request_streaming), bool(handler.response_streaming))
  attr, factory = _FACTORIES[kind]
  behavior = getattr(handler, attr)
  return factory(wrap(behavior, kind[1]), request_deserializer=handler.request_deserializer,
                 response_serializer=handler.response_serializer)


def refuse(handler: grpc.RpcMethodHandler | None, code: grpc.StatusCode, message: str
           ) -> grpc.RpcMethodHandler | None:
  """A handler that ends the call with ``code`` without running the servicer.

  The request is never handed to the servicer: for a streaming request the
  server stops reading it, for a unary one it has already been parsed by the
  time any handler runs, and it is dropped.
  """

  def wrap(behavior, response_streaming):
    del behavior, response_streaming

    def deny(request, context):
      del request
      context.abort(code, message)
    return deny
  return wrap_handler(handler, wrap)


def guarded(handler: grpc.RpcMethodHandler | None,
            check: Callable[[grpc.ServicerContext], None]) -> grpc.RpcMethodHandler | None:
  """Runs ``check(context)`` (which aborts to refuse) before the servicer."""

  def wrap(behavior, response_streaming):
    if response_streaming:
      def run_stream(request, context) -> Iterator[Any]:
        check(context)
        yield from behavior(request, context)
      return run_stream

    def run(request, context):
      check(context)
      return behavior(request, context)
    return run
  return wrap_handler(handler, wrap)


def metadata_values(details: grpc.HandlerCallDetails, key: str) -> list[str]:
  """Every value of metadata ``key`` (lower-case) in the call's headers."""
  out = []
  for item in details.invocation_metadata or ():
    k, v = item
    if k == key:
      out.append(v.decode("latin-1") if isinstance(v, bytes) else v)
  return out


def matches(method: str, prefixes) -> bool:
  return any(method.startswith(p) for p in prefixes)
