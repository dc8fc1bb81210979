"""The aiohttp application: OpenAI routes in front of the broker.

  POST /v1/completions        text or token-id prompt
  POST /v1/chat/completions   messages rendered with the chat template
  GET  /v1/models             the served model
  GET  /health                200 when the broker answers SERVING, else 503
  GET  /metrics               Prometheus text (this gateway's registry)

``/v1/*`` need ``Authorization: Bearer <token>`` when the gateway has tokens
(the broker's token file): 401 without or with a malformed header, 403 with
an unknown token; the token then travels on to the broker. ``/health`` and
``/metrics`` are open, like the gRPC health service.

Status codes: 400 bad input, 404 unknown model, 429 overload (the gateway's
own ``max_inflight`` or the broker's RESOURCE_EXHAUSTED), 503 no capacity
(UNAVAILABLE), 504 deadline; bodies are OpenAI's error JSON. Errors before
the first token are HTTP statuses; once a stream has started, an error is
sent as a final ``data: {"error": ...}`` event before ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid

import grpc
import prometheus_client as prom
from aiohttp import web
from google.protobuf import json_format

from paas_jax.frontdoor import protocol
from paas_jax.frontdoor.backend import BrokerBackend, ModelInfo
from paas_jax.frontdoor.logprob_format import LogprobFormatter
from paas_jax.frontdoor.protocol import APIError, GenerationRequest
from paas_jax.frontdoor.tokenization import ChatTemplate, StopStrings, TemplateError

log = logging.getLogger("paas_jax.frontdoor")

MAX_BODY_BYTES = 32 << 20
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                   60.0, 120.0)


class GatewayMetrics:
  """``paas_http_*`` families on their own registry (never the global one)."""

  def __init__(self):
    self.registry = prom.CollectorRegistry()
    r = self.registry
    self.requests = prom.Counter("paas_http_requests", "HTTP requests by endpoint and status",
                                 ["endpoint", "status"], registry=r)
    self.duration = prom.Histogram("paas_http_request_duration_seconds",
                                   "Request to last byte", ["endpoint"],
                                   buckets=LATENCY_BUCKETS, registry=r)
    self.ttft = prom.Histogram("paas_http_ttft_seconds", "Request to first token",
                               ["route"], buckets=LATENCY_BUCKETS, registry=r)
    self.inflight = prom.Gauge("paas_http_requests_in_flight", "Generations in progress",
                               registry=r)
    self.prompt_tokens = prom.Counter("paas_http_prompt_tokens", "Prompt tokens served",
                                      registry=r)
    self.generated_tokens = prom.Counter("paas_http_generated_tokens", "Tokens generated",
                                         ["route"], registry=r)
    self.disconnects = prom.Counter("paas_http_client_disconnects",
                                    "Generations cancelled because the client went away",
                                    registry=r)


@dataclasses.dataclass
class GatewayConfig:
  """``tokens``: a ``paas_jax.security.TokenSet`` or None (no check);
  ``max_inflight``: concurrent generations before 429; ``model_name``:
  override of the broker's served model name."""

  tokens: object | None = None
  max_inflight: int = 256
  model_name: str = ""


class Gateway:
  """Request handlers; one per process."""

  def __init__(self, backend: BrokerBackend, config: GatewayConfig):
    self.backend = backend
    self.config = config
    self.metrics = GatewayMetrics()
    self.info: ModelInfo | None = None
    self.template = ChatTemplate()
    self._inflight = 0

  async def load_model_info(self) -> ModelInfo:
    self.info = await self.backend.model_info(self.config.model_name)
    self.template = ChatTemplate(self.info.chat_template, self.info.special)
    return self.info

  # -- helpers ------------------------------------------------------------------------

  def _token(self, request: web.Request) -> str | None:
    """Checks the bearer token (when configured); returns it for the broker."""
    if self.config.tokens is None:
      return None
    values = request.headers.getall("Authorization", [])
    verdict = self.config.tokens.check_header(values)
    if not verdict.ok:
      status = 401 if verdict.code == grpc.StatusCode.UNAUTHENTICATED else 403
      raise APIError(status, {"missing": "missing credentials: send 'Authorization: Bearer "
                                         "<token>'",
                              "malformed": "malformed Authorization header",
                              "wrong": "the bearer token is not valid for this service"}
                     [verdict.reason],
                     err_type="authentication_error" if status == 401 else "permission_error",
                     code="invalid_api_key")
    return values[0].split(None, 1)[1].strip()

  async def _body(self, request: web.Request):
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
      raise APIError(413, f"request body over {MAX_BODY_BYTES} bytes")
    return protocol.parse_json(await request.read())

  def _error(self, endpoint: str, e: APIError) -> web.Response:
    self.metrics.requests.labels(endpoint, str(e.status)).inc()
    return web.json_response(e.body(), status=e.status)

  # -- routes -------------------------------------------------------------------------

  async def models(self, request: web.Request) -> web.Response:
    try:
      self._token(request)
    except APIError as e:
      return self._error("models", e)
    info = self.info
    self.metrics.requests.labels("models", "200").inc()
    return web.json_response({"object": "list", "data": [{
        "id": info.name, "object": "model", "created": 0, "owned_by": "paas-jax",
        "max_model_len": info.max_model_len}]})

  async def health(self, request: web.Request) -> web.Response:
    del request
    ok = await self.backend.healthy()
    return web.json_response({"status": "ok" if ok else "broker unavailable"},
                             status=200 if ok else 503)

  async def metrics_text(self, request: web.Request) -> web.Response:
    del request
    return web.Response(body=prom.generate_latest(self.metrics.registry),
                        headers={"Content-Type": prom.CONTENT_TYPE_LATEST})

  async def completions(self, request: web.Request) -> web.StreamResponse:
    return await self._generate(request, chat=False)

  async def chat_completions(self, request: web.Request) -> web.StreamResponse:
    return await self._generate(request, chat=True)

  async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
    endpoint = "chat" if chat else "completions"
    started = time.perf_counter()
    try:
      token = self._token(request)
      body = await self._body(request)
      if chat:
        fields, messages = protocol.parse_chat(body, self.info.name)
        try:
          req = protocol.chat_request(fields, self.template.render(messages))
        except TemplateError as e:
          raise protocol.bad(str(e), "messages") from None
      else:
        req = protocol.parse_completion(body, self.info.name)
      if self._inflight >= self.config.max_inflight:
        raise APIError(429, f"over {self.config.max_inflight} requests in flight; retry "
                       "later", err_type="rate_limit_error", code="overloaded")
    except APIError as e:
      return self._error(endpoint, e)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    self._inflight += 1
    self.metrics.inflight.inc()
    call = self.backend.generate(req, rid, token)
    try:
      return await self._run(request, req, rid, call, endpoint, started)
    except (asyncio.CancelledError, ConnectionResetError):
      # The HTTP client went away: the broker cancels the decode slot and the
      # state transfer when this call is cancelled.
      self.metrics.disconnects.inc()
      self.metrics.requests.labels(endpoint, "499").inc()
      raise
    finally:
      call.cancel()
      self._inflight -= 1
      self.metrics.inflight.dec()
      self.metrics.duration.labels(endpoint).observe(time.perf_counter() - started)

  async def _run(self, request, req: GenerationRequest, rid: str, call, endpoint: str,
                 started: float) -> web.StreamResponse:
    stops = StopStrings(req.stop)
    messages = aiter_messages(call)
    try:
      first = await anext(messages, None)
    except APIError as e:
      return self._error(endpoint, e)
    if first is None:
      return self._error(endpoint, APIError(502, "the broker ended the stream early",
                                            err_type="internal_error"))
    summary = _summary(first)
    self.metrics.ttft.labels(summary.get("route", "none")).observe(
        time.perf_counter() - started)
    if req.stream:
      return await self._stream(request, req, rid, first, messages, stops, summary, endpoint)
    tokens: list[int] = []
    text: list[str] = []
    lps: list = []
    reason = ""
    msg = first
    try:
      while msg is not None:
        tokens.extend(msg.token_ids)
        lps.extend(msg.logprobs)
        piece, stopped = stops.feed(msg.text)
        text.append(piece)
        if msg.HasField("summary"):
          summary = _summary(msg)
        if stopped:
          reason = "stop"
          break
        if msg.finished:
          reason = protocol.finish_reason(msg.finish_reason)
          text.append(stops.flush())
          break
        msg = await anext(messages, None)
    except APIError as e:
      return self._error(endpoint, e)
    if not reason:
      return self._error(endpoint, APIError(502, "the broker ended the stream early",
                                            err_type="internal_error"))
    prompt_tokens = int(summary.get("prompt_tokens", 0))
    self._count(summary, prompt_tokens, len(tokens))
    self.metrics.requests.labels(endpoint, "200").inc()
    body = protocol.completion_body(
        req, rid, "".join(text), tokens, reason, prompt_tokens, summary,
        LogprobFormatter(req.chat).format(lps) if req.logprobs >= 0 else None)
    return web.json_response(body, headers=protocol.headers(summary))

  async def _stream(self, request, req, rid, first, messages, stops, summary,
                    endpoint) -> web.StreamResponse:
    resp = web.StreamResponse(headers={
        "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
        **protocol.headers(summary)})
    await resp.prepare(request)
    created = int(time.time())
    n_tokens = 0
    reason = None
    msg = first
    is_first = True
    lp_format = LogprobFormatter(req.chat) if req.logprobs >= 0 else None
    try:
      while msg is not None:
        n_tokens += len(msg.token_ids)
        piece, stopped = stops.feed(msg.text)
        if msg.HasField("summary"):
          summary = _summary(msg)
        if stopped:
          reason = "stop"
        elif msg.finished:
          reason = protocol.finish_reason(msg.finish_reason)
          piece += stops.flush()
        if piece or msg.token_ids or is_first:
          await resp.write(protocol.sse(protocol.stream_chunk(
              req, rid, created, text=piece, token_ids=list(msg.token_ids), reason=None,
              first=is_first, logprobs=(lp_format.format(msg.logprobs)
                                        if lp_format is not None and msg.token_ids else None))))
          is_first = False
        if reason is not None:
          break
        msg = await anext(messages, None)
      if reason is None:
        raise APIError(502, "the broker ended the stream early", err_type="internal_error")
    except APIError as e:
      self.metrics.requests.labels(endpoint, str(e.status)).inc()
      await resp.write(protocol.sse(e.body()))
      await resp.write(protocol.sse("[DONE]"))
      await resp.write_eof()
      return resp
    prompt_tokens = int(summary.get("prompt_tokens", 0))
    final = protocol.stream_chunk(req, rid, created, text=None if req.chat else "",
                                  token_ids=[], reason=reason)
    final["paas_jax"] = protocol.extension(summary)
    await resp.write(protocol.sse(final))
    if req.include_usage:
      await resp.write(protocol.sse({"id": rid, "object": final["object"],
                                     "created": created, "model": req.model, "choices": [],
                                     "usage": protocol.usage(prompt_tokens, n_tokens)}))
    await resp.write(protocol.sse("[DONE]"))
    await resp.write_eof()
    self._count(summary, prompt_tokens, n_tokens)
    self.metrics.requests.labels(endpoint, "200").inc()
    return resp

  def _count(self, summary: dict, prompt_tokens: int, generated: int) -> None:
    self.metrics.prompt_tokens.inc(prompt_tokens)
    self.metrics.generated_tokens.labels(summary.get("route", "none")).inc(generated)


def _summary(msg) -> dict:
  if not msg.HasField("summary"):
    return {}
  return json_format.MessageToDict(msg.summary, preserving_proto_field_name=True,
                                   always_print_fields_with_no_presence=True)


async def aiter_messages(call):
  """The call's messages; gRPC errors become ``APIError``."""
  try:
    async for msg in call:
      yield msg
  except grpc.aio.AioRpcError as e:
    raise APIError.from_grpc(e.code().name, e.details() or "") from None


def make_app(gateway: Gateway) -> web.Application:
  app = web.Application(client_max_size=MAX_BODY_BYTES)
  app.router.add_post("/v1/completions", gateway.completions)
  app.router.add_post("/v1/chat/completions", gateway.chat_completions)
  app.router.add_get("/v1/models", gateway.models)
  app.router.add_get("/health", gateway.health)
  app.router.add_get("/metrics", gateway.metrics_text)
  app["gateway"] = gateway
  return app
