"""Fuzzing the gRPC APIs of a real broker + prefill + decode deployment.

Random bytes, malformed protobuf wire data, wrong wire types, huge fields and
out-of-range values are sent to the broker's public API (and random bytes to
the region servers' APIs). Every call must end with a definite status that
describes the caller's mistake -- never UNKNOWN (an unhandled exception in a
servicer), never a hang -- and afterwards every server must still be healthy
and serve a normal request with the same tokens as before.
"""

from __future__ import annotations

import random
import struct
import threading
from concurrent import futures

import grpc
import pytest

from paas_jax.proto import serving_pb2

Code = grpc.StatusCode
GENERATE = "/paas_jax.serving.v1.Broker/Generate"
# What a refused or accepted request may end with.
ALLOWED = {Code.OK, Code.INVALID_ARGUMENT, Code.RESOURCE_EXHAUSTED}
# ... plus INTERNAL for bytes that are not a protobuf message at all: gRPC's own
# "Exception deserializing request!" answer, before any servicer runs.
ALLOWED_RAW = ALLOWED | {Code.INTERNAL}
TIMEOUT_S = 20.0
PROMPT = [5, 17, 42, 99, 3, 250, 7, 64, 128, 11] * 3


@pytest.fixture(scope="module")
def stack():
  """Decode (region B), prefill (region A) and broker servers in this process."""
  from paas_jax.serving import broker, common, decode_server, prefill_server
  from paas_jax.serving.engine_config import EngineConfig
  from paas_jax.serving.routing import StaticThresholdPolicy
  model, _ = common.load_model("tiny_gdn_gqa", 0)
  ec = EngineConfig(n_slots=4, max_ctx=256, prefill_buckets=(64,), prefill_max_batch=2)
  d = decode_server.start(model, ec, max_queue=8)
  p = prefill_server.start(model, ec)
  b = broker.start(model.config, StaticThresholdPolicy(16), prefill_targets=[p.address],
                   decode_targets=[broker.DecodeTarget(d.address, d.transfer_address)])
  channel = grpc.insecure_channel(b.address, options=[
      ("grpc.max_send_message_length", 128 << 20),
      ("grpc.max_receive_message_length", 128 << 20)])
  st = {"broker": b, "prefill": p, "decode": d, "channel": channel}
  st["reference"] = {route: generate_ok(channel, route) for route in (1, 2)}
  assert st["reference"][1] == st["reference"][2]  # local and remote prefill agree
  yield st
  channel.close()
  b.stop()
  p.stop()
  d.stop()


def generate_ok(channel, route=0) -> list[int]:
  req = serving_pb2.GenerateRequest(prompt_ids=PROMPT, max_new_tokens=6, route=route)
  tokens = []
  for msg in channel.unary_stream(GENERATE, request_serializer=lambda m: m.SerializeToString(),
                                  response_deserializer=serving_pb2.GenerateResponse.FromString)(
                                      req, timeout=TIMEOUT_S):
    tokens.extend(msg.token_ids)
  return tokens


def raw_call(channel, method: str, payload: bytes, streaming: bool = True,
             timeout: float = TIMEOUT_S) -> tuple[Code, str]:
  ident = lambda b: b
  try:
    if streaming:
      for _ in channel.unary_stream(method, request_serializer=ident,
                                    response_deserializer=ident)(payload, timeout=timeout):
        pass
    else:
      channel.unary_unary(method, request_serializer=ident, response_deserializer=ident)(
          payload, timeout=timeout)
    return Code.OK, ""
  except grpc.RpcError as e:
    return e.code(), e.details() or ""


def assert_healthy(stack) -> None:
  from grpc_health.v1 import health_pb2, health_pb2_grpc
  for name in ("broker", "prefill", "decode"):
    with grpc.insecure_channel(stack[name].address) as ch:
      status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
      assert status.status == health_pb2.HealthCheckResponse.SERVING, name
  for route in (1, 2):
    assert generate_ok(stack["channel"], route) == stack["reference"][route]


# -- protobuf wire helpers ------------------------------------------------------------

def varint(n: int) -> bytes:
  n &= (1 << 64) - 1
  out = bytearray()
  while True:
    b = n & 0x7F
    n >>= 7
    out.append(b | (0x80 if n else 0))
    if not n:
      return bytes(out)


def field(num: int, wire: int, payload: bytes) -> bytes:
  return varint(num << 3 | wire) + payload


def ld(num: int, data: bytes) -> bytes:  # length-delimited
  return field(num, 2, varint(len(data)) + data)


def valid_base() -> bytes:
  return serving_pb2.GenerateRequest(prompt_ids=PROMPT[:8], max_new_tokens=2).SerializeToString()


MALFORMED = {
    "empty": b"",
    "truncated_varint": b"\x20\xff\xff",
    "truncated_length": ld(3, b"hello")[:-2],
    "length_past_end": field(3, 2, varint(1 << 20)) + b"abc",
    "invalid_utf8_string": ld(3, b"\xff\xfe\xfd"),
    "wire_type_6": field(4, 6, b"\x01"),
    "field_number_0": field(0, 0, varint(1)),
    "prompt_ids_as_fixed64": valid_base() + field(2, 1, struct.pack("<q", 7)),
    "max_new_tokens_as_string": valid_base() + ld(4, b"ten"),
    "sampling_as_varint": valid_base() + field(5, 0, varint(3)),
    "sampling_garbage": valid_base() + ld(5, b"\xff\xff\xff\xff"),
    "route_unknown_enum": serving_pb2.GenerateRequest(prompt_ids=PROMPT[:8], max_new_tokens=2,
                                                      route=77).SerializeToString(),
    "packed_ids_odd_bytes": ld(2, b"\x80"),
    "many_empty_unknowns": b"".join(ld(99, b"") for _ in range(5000)),
    "nested_unknown_groups": field(9, 3, b"") * 500 + field(9, 4, b"") * 500,
    "repeated_sampling": ld(5, ld(1, b"")) * 1000 + valid_base(),
    "unknown_fields_only": ld(1000, b"x" * 100) + field(2000, 0, varint(1 << 62)),
    "negative_int32_varint": field(4, 0, varint(-5)),
    "huge_varint_into_int32": field(4, 0, varint(1 << 40)) + ld(2, varint(1)),
    "end_group_without_start": field(7, 4, b""),
    "start_group": field(7, 3, b"") + field(7, 4, b""),
}


def test_malformed_wire_data_gets_a_definite_status(stack):
  results = {name: raw_call(stack["channel"], GENERATE, data) for name, data in MALFORMED.items()}
  bad = {n: r for n, r in results.items() if r[0] not in ALLOWED_RAW}
  assert not bad, bad
  # Well-formed messages with bad values are the broker's call, and it names the problem.
  assert results["empty"][0] == Code.INVALID_ARGUMENT
  assert results["negative_int32_varint"][0] == Code.INVALID_ARGUMENT
  assert results["invalid_utf8_string"][0] in (Code.INTERNAL, Code.INVALID_ARGUMENT)
  assert_healthy(stack)


def test_random_bytes(stack):
  rng = random.Random(1234)
  payloads = [bytes(rng.randrange(256) for _ in range(rng.choice([1, 5, 20, 200, 2000])))
              for _ in range(150)]
  # Random mutations of a valid request: flip, insert, delete, truncate.
  base = bytearray(serving_pb2.GenerateRequest(
      prompt_ids=PROMPT, max_new_tokens=4, sampling=serving_pb2.SamplingParams(top_k=3),
      stop_tokens=[1, 2], request_id="fuzz").SerializeToString())
  for _ in range(150):
    b = bytearray(base)
    for _ in range(rng.randint(1, 4)):
      op, i = rng.randrange(4), rng.randrange(len(b))
      if op == 0:
        b[i] ^= 1 << rng.randrange(8)
      elif op == 1:
        b.insert(i, rng.randrange(256))
      elif op == 2 and len(b) > 1:
        del b[i]
      else:
        b = b[:i]
      if not b:
        b = bytearray(b"\x00")
    payloads.append(bytes(b))
  with futures.ThreadPoolExecutor(8) as pool:
    results = list(pool.map(lambda p: raw_call(stack["channel"], GENERATE, p), payloads))
  bad = [(p[:40], r) for p, r in zip(payloads, results) if r[0] not in ALLOWED_RAW]
  assert not bad, bad
  assert_healthy(stack)


def _edge(rng: random.Random):
  ints = [0, 1, -1, 2, 7, 255, 256, 1000, 2**31 - 1, -2**31]
  floats = [0.0, 0.5, 1.0, 1.5, -1.0, float("nan"), float("inf"), float("-inf"), 1e-30, 3.4e38]
  strings = ["", "x", "tiny_gdn_gqa", "../../etc/passwd", "\u202e\u0000\n\r", "\U0001f600" * 10,
             "a" * 5000, "%s%n{}"]
  n = rng.choice([0, 1, 3, 40, 300, 5000])
  return serving_pb2.GenerateRequest(
      model=rng.choice(strings), prompt_ids=[rng.choice(ints + [rng.randrange(256)] * 6)
                                             for _ in range(n)],
      prompt=rng.choice(["", "", "hello", "\u00e9\u00e8" * 100, "\x00" * 10, "z" * 3000]),
      max_new_tokens=rng.choice(ints),
      sampling=serving_pb2.SamplingParams(temperature=rng.choice(floats),
                                          top_k=rng.choice(ints), top_p=rng.choice(floats)),
      seed=rng.choice([0, 1, -1, 2**63 - 1, -2**63, 2**32]),
      stop_tokens=[rng.choice(ints) for _ in range(rng.choice([0, 1, 5, 1000]))],
      request_id=rng.choice(strings), route=rng.choice([0, 1, 2, 3, -1, 2**31 - 1]))


def test_random_structured_requests(stack):
  rng = random.Random(99)
  reqs = [_edge(rng) for _ in range(200)]
  payloads = [r.SerializeToString() for r in reqs]
  with futures.ThreadPoolExecutor(8) as pool:
    results = list(pool.map(lambda p: raw_call(stack["channel"], GENERATE, p), payloads))
  bad = [(str(r)[:300], res) for r, res in zip(reqs, results) if res[0] not in ALLOWED]
  assert not bad, bad
  assert any(r[0] == Code.INVALID_ARGUMENT for r in results)
  assert_healthy(stack)


@pytest.mark.parametrize("name,request_fn,code", [
    ("million_tokens", lambda: serving_pb2.GenerateRequest(prompt_ids=[7] * 1_000_000,
                                                           max_new_tokens=4),
     Code.INVALID_ARGUMENT),
    ("8MB_text", lambda: serving_pb2.GenerateRequest(prompt="x" * (8 << 20), max_new_tokens=4),
     Code.INVALID_ARGUMENT),
    ("1MB_request_id", lambda: serving_pb2.GenerateRequest(prompt_ids=PROMPT, max_new_tokens=2,
                                                           request_id="r" * (1 << 20)),
     Code.INVALID_ARGUMENT),
    ("200k_stop_tokens", lambda: serving_pb2.GenerateRequest(prompt_ids=PROMPT, max_new_tokens=2,
                                                             stop_tokens=[300] * 200_000),
     Code.INVALID_ARGUMENT),
    ("100MB_message", lambda: serving_pb2.GenerateRequest(prompt="y" * (100 << 20)),
     Code.RESOURCE_EXHAUSTED),
])
def test_huge_fields_are_refused(stack, name, request_fn, code):
  got, details = raw_call(stack["channel"], GENERATE, request_fn().SerializeToString())
  assert got == code, (name, got, details[:200])
  assert_healthy(stack)


def test_duplicate_request_ids_in_flight(stack):
  req = serving_pb2.GenerateRequest(prompt_ids=PROMPT, max_new_tokens=24, request_id="dup")
  data = req.SerializeToString()
  results = []
  lock = threading.Lock()

  def call():
    r = raw_call(stack["channel"], GENERATE, data)
    with lock:
      results.append(r)
  threads = [threading.Thread(target=call) for _ in range(6)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert {r[0] for r in results} <= {Code.OK, Code.INVALID_ARGUMENT}
  assert any(r[0] == Code.OK for r in results)
  assert_healthy(stack)


# ProbePrefix may also answer FAILED_PRECONDITION: these servers have no prefix cache.
_NO_CACHE = frozenset({Code.FAILED_PRECONDITION})


@pytest.mark.parametrize("method,streaming,also", [
    ("/paas_jax.serving.v1.Decode/Decode", True, frozenset()),
    ("/paas_jax.serving.v1.Decode/Handoff", False, frozenset()),
    ("/paas_jax.serving.v1.Prefill/Prefill", True, frozenset()),
    ("/paas_jax.serving.v1.Broker/GetStats", False, frozenset()),
    ("/paas_jax.serving.v1.Prefill/GetLoad", False, frozenset()),
    ("/paas_jax.serving.v1.Prefill/ProbePrefix", False, _NO_CACHE),
    ("/paas_jax.serving.v1.Decode/GetLoad", False, frozenset()),
    ("/paas_jax.serving.v1.Decode/ProbePrefix", False, _NO_CACHE),
])
def test_region_apis_survive_random_bytes(stack, method, streaming, also):
  target = {"Decode": stack["decode"].address, "Prefill": stack["prefill"].address,
            "Broker": stack["broker"].address}[method.split(".")[-1].split("/")[0]]
  rng = random.Random(hash(method) & 0xFFFF)
  with grpc.insecure_channel(target) as ch:
    for _ in range(60):
      data = bytes(rng.randrange(256) for _ in range(rng.choice([0, 3, 30, 300])))
      # A random message can be a valid request (e.g. a decode waiting for a state
      # that never comes); it then ends at the caller's deadline.
      code, details = raw_call(ch, method, data, streaming, timeout=3.0)
      assert code in ALLOWED_RAW | {Code.NOT_FOUND, Code.DEADLINE_EXCEEDED} | also, (
          data[:40], code, details)
  assert_healthy(stack)
