"""Structured JSON logs with a request id that follows a request across regions.

One line per record::

  {"ts": "2026-12-02T16:30:01.123Z", "level": "INFO", "logger": "paas_jax.serving.broker",
   "server": "broker", "region": "B", "request_id": "9f1c...", "msg": "routed",
   "route": "prfaas"}

Where the request id comes from, in order: ``extra={"request_id": ...}`` /
``RequestLogger`` on the record, else the ``current_request_id`` context
variable, which ``RequestIdInterceptor`` sets from the ``x-request-id`` header
while a handler runs. Callers put the header on downstream calls with
``request_metadata(rid)`` (or let ``RequestIdClientInterceptor`` copy the
current id onto every call of a channel), so broker, prefill (region A) and
decode (region B) log the same id for the same request.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import json
import logging
import sys
from typing import Any, Iterator, MutableMapping

import grpc

from paas_jax.security import interceptors

REQUEST_ID_HEADER = "x-request-id"
MAX_REQUEST_ID_CHARS = 128

current_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "paas_jax_request_id", default=None)

# LogRecord attributes that are not user "extra" fields.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message", "asctime", "taskName"}


def _clean_id(value: str | None) -> str | None:
  """Request ids come from the network: keep them printable and bounded."""
  if not value:
    return None
  value = "".join(ch for ch in value[:MAX_REQUEST_ID_CHARS] if ch.isprintable())
  return value or None


class JsonFormatter(logging.Formatter):
  """Formats records as one JSON object per line.

  Args:
    static: fields added to every line (e.g. ``server``, ``region``).
  """

  def __init__(self, static: dict[str, Any] | None = None):
    super().__init__()
    self.static = dict(static or {})

  def format(self, record: logging.LogRecord) -> str:
    ts = datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
    out: dict[str, Any] = {
        "ts": ts.strftime("%Y-%m-%dT%H:%M:%S.") + f"{ts.microsecond // 1000:03d}Z",
        "level": record.levelname,
        "logger": record.name,
    }
    out.update(self.static)
    rid = getattr(record, "request_id", None) or current_request_id.get()
    if rid:
      out["request_id"] = rid
    out["msg"] = record.getMessage()
    for key, value in record.__dict__.items():
      if key not in _STANDARD and key not in out and not key.startswith("_"):
        out[key] = value
    if record.exc_info:
      out["exc"] = self.formatException(record.exc_info)
    return json.dumps(out, default=str, ensure_ascii=False)


class RequestLogger(logging.LoggerAdapter):
  """A logger bound to one request: ``RequestLogger(log, rid).info("routed",
  extra={"route": "prfaas"})`` logs ``request_id`` plus the extra fields."""

  def __init__(self, logger: logging.Logger, request_id: str, **fields: Any):
    super().__init__(logger, {"request_id": request_id, **fields})

  def process(self, msg: Any, kwargs: MutableMapping[str, Any]):
    kwargs["extra"] = {**self.extra, **(kwargs.get("extra") or {})}
    return msg, kwargs


def configure_json_logging(level: str | int = "INFO", *, stream=None,
                           **static: Any) -> logging.Handler:
  """Replaces the root handlers with one JSON handler; returns it."""
  handler = logging.StreamHandler(stream or sys.stderr)
  handler.setFormatter(JsonFormatter(static))
  root = logging.getLogger()
  for h in list(root.handlers):
    root.removeHandler(h)
  root.addHandler(handler)
  root.setLevel(level if isinstance(level, int) else getattr(logging, str(level).upper()))
  return handler


@contextlib.contextmanager
def request_context(request_id: str | None) -> Iterator[None]:
  """Sets ``current_request_id`` for the block."""
  token = current_request_id.set(_clean_id(request_id))
  try:
    yield
  finally:
    current_request_id.reset(token)


def request_metadata(request_id: str | None = None) -> tuple[tuple[str, str], ...]:
  """Call metadata carrying ``request_id`` (default: the current one)."""
  rid = _clean_id(request_id or current_request_id.get())
  return ((REQUEST_ID_HEADER, rid),) if rid else ()


class RequestIdInterceptor(grpc.ServerInterceptor):
  """Sets ``current_request_id`` from the ``x-request-id`` header while the
  handler runs (for a streaming response, around each message it produces)."""

  def intercept_service(self, continuation, handler_call_details):
    values = interceptors.metadata_values(handler_call_details, REQUEST_ID_HEADER)
    rid = _clean_id(values[0]) if values else None
    handler = continuation(handler_call_details)
    if rid is None or handler is None:
      return handler

    def wrap(behavior, response_streaming):
      if response_streaming:
        def run_stream(request, context):
          with request_context(rid):
            it = iter(behavior(request, context))
          while True:
            with request_context(rid):
              try:
                item = next(it)
              except StopIteration:
                return
            yield item
        return run_stream

      def run(request, context):
        with request_context(rid):
          return behavior(request, context)
      return run

    return interceptors.wrap_handler(handler, wrap)


class _ClientCallDetails(grpc.ClientCallDetails):

  def __init__(self, base: grpc.ClientCallDetails, metadata):
    self.method = base.method
    self.timeout = base.timeout
    self.metadata = metadata
    self.credentials = base.credentials
    self.wait_for_ready = getattr(base, "wait_for_ready", None)
    self.compression = getattr(base, "compression", None)


class RequestIdClientInterceptor(grpc.UnaryUnaryClientInterceptor,
                                 grpc.UnaryStreamClientInterceptor,
                                 grpc.StreamUnaryClientInterceptor,
                                 grpc.StreamStreamClientInterceptor):
  """Adds ``x-request-id: <current_request_id>`` to calls that lack one.

  ``channel = grpc.intercept_channel(channel, RequestIdClientInterceptor())``.
  """

  def _details(self, details):
    md = list(details.metadata or ())
    if any(k == REQUEST_ID_HEADER for k, _ in md):
      return details
    extra = request_metadata()
    if not extra:
      return details
    return _ClientCallDetails(details, md + list(extra))

  def intercept_unary_unary(self, continuation, client_call_details, request):
    return continuation(self._details(client_call_details), request)

  def intercept_unary_stream(self, continuation, client_call_details, request):
    return continuation(self._details(client_call_details), request)

  def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
    return continuation(self._details(client_call_details), request_iterator)

  def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
    return continuation(self._details(client_call_details), request_iterator)
