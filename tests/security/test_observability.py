"""Metrics scraped over HTTP from a real gRPC server, and request ids in JSON logs
across two real servers (the "regions")."""

from __future__ import annotations

import io
import json
import logging
import re
import threading
import time
import urllib.request

import grpc
import pytest

from paas_jax.observability import (JsonFormatter, RequestIdClientInterceptor,
                                    RequestIdInterceptor, RequestLogger, ServingMetrics,
                                    current_request_id, request_context, request_metadata)
from paas_jax.security import BearerTokenInterceptor, TokenSet, generate_token, token_metadata

SERVICE = "paas_jax.test.Echo"
log = logging.getLogger("paas_jax.test.echo")


def _ident(x):
  return x


def echo_service(downstream: list | None = None):
  """A tiny generic service: Unary echoes, Stream yields the request 3 times,
  Fail aborts with RESOURCE_EXHAUSTED. Each handler logs; Unary calls
  ``downstream[0]`` (another server) when given, as the broker calls a region."""

  def unary(request, context):
    log.info("unary handled")
    if downstream:
      return downstream[0](request)
    return request

  def stream(request, context):
    for _ in range(3):
      log.info("stream item")
      yield request

  def fail(request, context):
    context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")

  handlers = {
      "Unary": grpc.unary_unary_rpc_method_handler(unary, _ident, _ident),
      "Stream": grpc.unary_stream_rpc_method_handler(stream, _ident, _ident),
      "Fail": grpc.unary_unary_rpc_method_handler(fail, _ident, _ident),
  }
  return lambda server: server.add_generic_rpc_handlers(
      (grpc.method_handlers_generic_handler(SERVICE, handlers),))


def scrape(port: int) -> str:
  with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
    assert r.status == 200
    return r.read().decode()


def value(text: str, name: str, **labels) -> float:
  want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
  for line in text.splitlines():
    m = re.fullmatch(rf"{name}(?:\{{(.*)\}})? (\S+)", line)
    if m and ",".join(sorted((m.group(1) or "").split(","))) == want:
      return float(m.group(2))
  raise KeyError(f"{name}{{{want}}} not in scrape")


def test_rpc_queue_and_auth_metrics_scraped_over_http(serve):
  metrics = ServingMetrics("broker")
  token = generate_token()
  auth = BearerTokenInterceptor(TokenSet([("t", token)]), on_result=metrics.on_auth)
  s = serve(echo_service(), interceptors=[metrics.interceptor(), auth])
  depth = [7]
  metrics.track_queue("decode_wait", lambda: depth[0], limit=64)
  metrics.observe_request("prfaas", "OK", ttft_s=0.2, tpot_s=0.01, total_s=1.0)
  metrics.observe_transfer("A->B", bytes_sent=3000, state_bytes=2500, seconds=0.5,
                           retried_chunks=2)
  metrics.observe_transfer("A->B", bytes_sent=100, state_bytes=0, seconds=0.1, ok=False)
  metrics.observe_route("prfaas", "prompt 300 > threshold 128: offload")
  port = metrics.serve(0)
  try:
    md = token_metadata(token)
    with grpc.insecure_channel(s.target) as ch:
      unary = ch.unary_unary(f"/{SERVICE}/Unary")
      stream = ch.unary_stream(f"/{SERVICE}/Stream")
      fail = ch.unary_unary(f"/{SERVICE}/Fail")
      assert unary(b"hi", timeout=5, metadata=md) == b"hi"
      assert list(stream(b"x", timeout=5, metadata=md)) == [b"x"] * 3
      with pytest.raises(grpc.RpcError):
        fail(b"", timeout=5, metadata=md)
      with pytest.raises(grpc.RpcError):
        unary(b"hi", timeout=5)  # no token
    text = scrape(port)
  finally:
    metrics.stop()
  assert value(text, "paas_rpcs_total", method="Echo/Unary", code="OK") == 1
  assert value(text, "paas_rpcs_total", method="Echo/Unary", code="UNAUTHENTICATED") == 1
  assert value(text, "paas_rpcs_total", method="Echo/Stream", code="OK") == 1
  assert value(text, "paas_rpcs_total", method="Echo/Fail", code="RESOURCE_EXHAUSTED") == 1
  assert value(text, "paas_rpcs_in_flight", method="Echo/Unary") == 0
  assert value(text, "paas_rpc_duration_seconds_count", method="Echo/Stream") == 1
  assert value(text, "paas_auth_refusals_total", check="token", code="UNAUTHENTICATED") == 1
  assert value(text, "paas_queue_depth", queue="decode_wait") == 7
  assert value(text, "paas_queue_limit", queue="decode_wait") == 64
  assert value(text, "paas_ttft_seconds_count", route="prfaas") == 1
  assert value(text, "paas_tpot_seconds_sum", route="prfaas") == pytest.approx(0.01)
  assert value(text, "paas_link_bytes_total", link="A->B") == 3100
  assert value(text, "paas_link_goodput_bytes_total", link="A->B") == 2500
  assert value(text, "paas_link_goodput_bytes_per_second", link="A->B") == 5000
  assert value(text, "paas_link_transfers_total", link="A->B", outcome="failed") == 1
  assert value(text, "paas_link_chunk_retries_total", link="A->B") == 2
  assert value(text, "paas_routing_decisions_total", route="prfaas", reason="prompt 300 > "
               "threshold 128") == 1
  assert value(text, "paas_server_info", server="broker") == 1
  assert value(text, "process_resident_memory_bytes") > 0


def test_registries_are_per_server():
  a, b = ServingMetrics("prefill"), ServingMetrics("decode")
  a.observe_route("pdp", "short")
  assert "paas_routing_decisions_total" in a.text()
  assert 'route="pdp"' not in b.text()
  import prometheus_client
  assert b"paas_routing" not in prometheus_client.generate_latest()


def test_json_lines_carry_the_request_id_across_regions(serve):
  buf = io.StringIO()
  handler = logging.StreamHandler(buf)
  handler.setFormatter(JsonFormatter({"server": "test"}))
  log.addHandler(handler)
  log.setLevel(logging.INFO)
  try:
    # "Region A" server, and a "broker" server that calls it while handling.
    region = serve(echo_service(), interceptors=[RequestIdInterceptor()])
    region_ch = grpc.intercept_channel(grpc.insecure_channel(region.target),
                                       RequestIdClientInterceptor())
    downstream = [lambda req: region_ch.unary_unary(f"/{SERVICE}/Unary")(req, timeout=5)]
    broker = serve(echo_service(downstream), interceptors=[RequestIdInterceptor()])
    with grpc.insecure_channel(broker.target) as ch:
      ch.unary_unary(f"/{SERVICE}/Unary")(b"a", timeout=5, metadata=request_metadata("req-1"))
      list(ch.unary_stream(f"/{SERVICE}/Stream")(b"b", timeout=5,
                                                metadata=request_metadata("req-2\n")))
      ch.unary_unary(f"/{SERVICE}/Unary")(b"c", timeout=5)  # no id
    region_ch.close()
    RequestLogger(log, "req-3", route="prfaas").warning("done", extra={"tokens": 4})
    with request_context("req-4"):
      log.info("in context")
      assert request_metadata() == (("x-request-id", "req-4"),)
    assert current_request_id.get() is None
  finally:
    log.removeHandler(handler)
  lines = [json.loads(l) for l in buf.getvalue().splitlines()]
  ids = [l.get("request_id") for l in lines]
  # req-1 logged by the broker and by the region it called; then 3 stream items.
  assert ids == ["req-1", "req-1", "req-2", "req-2", "req-2", None, None, "req-3", "req-4"]
  assert all(l["server"] == "test" and l["logger"] == log.name for l in lines)
  assert lines[7]["route"] == "prfaas" and lines[7]["tokens"] == 4
  assert lines[7]["level"] == "WARNING" and lines[7]["msg"] == "done"
  assert lines[0]["ts"].endswith("Z")


def test_metrics_interceptor_counts_cancelled_streams(serve):
  metrics = ServingMetrics("decode", process=False)
  seen = threading.Event()

  def slow(request, context):
    yield b"1"
    seen.set()
    # Go on only once the server has seen the cancel: a handler that finished
    # before the cancel arrived would be an OK call (the race made this flaky).
    deadline = time.monotonic() + 5
    while context.is_active() and time.monotonic() < deadline:
      time.sleep(0.01)
    yield b"2"

  handlers = {"Slow": grpc.unary_stream_rpc_method_handler(slow, _ident, _ident)}
  s = serve(lambda srv: srv.add_generic_rpc_handlers(
      (grpc.method_handlers_generic_handler(SERVICE, handlers),)),
      interceptors=[metrics.interceptor()])
  with grpc.insecure_channel(s.target) as ch:
    call = ch.unary_stream(f"/{SERVICE}/Slow")(b"", timeout=5)
    assert next(call) == b"1"
    seen.wait(5)
    call.cancel()
  for _ in range(100):
    text = metrics.text()
    if 'code="CANCELLED"' in text:
      break
    threading.Event().wait(0.05)
  assert value(text, "paas_rpcs_total", method="Echo/Slow", code="CANCELLED") == 1
  assert value(text, "paas_rpcs_in_flight", method="Echo/Slow") == 0
