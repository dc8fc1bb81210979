"""The broker: the front door of the two-region deployment.

For each ``Generate`` call it validates the request, asks the routing policy
where to prefill (PD-P in the PD region, or PrfaaS in the prefill region),
registers the request with a decode server, drives the prefill, relays the
token stream back to the client and tracks the request's lifecycle. When the
client goes away (cancel, deadline, dropped connection) every downstream call
is cancelled, which frees the decode slot and aborts the state transfer.

Remote route, in order:
  1. ``Decode.Decode(remote_prefill)`` -> accepted (admission control first, so
     a full pool answers RESOURCE_EXHAUSTED before any prefill work);
  2. ``Prefill.Prefill(decode_target)``: region A prefills and streams the state
     to the decode server's StateTransfer port (over the WAN);
  3. on ``FirstToken``: ``Decode.Handoff(first_token)``; the decode server
     inserts the request once state and token are both there;
  4. tokens flow back on the Decode stream; ``TransferDone`` gives link bytes/time.

  python -m paas_jax.serving.broker --port=50050 --prefill=127.0.0.1:50051 \
      --decode=127.0.0.1:50052 --decode_transfer=127.0.0.1:50053 --threshold=128
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import logging
import os
import threading
import time
import uuid
from typing import Sequence

import grpc
from absl import app, flags

from paas_jax.proto import serving_pb2, serving_pb2_grpc
from paas_jax.serving import common
from paas_jax.serving.engine import (InvalidRequestError, RequestParams, make_sampling,
                                     validate_request)
from paas_jax.serving.routing import (PDP, PRFAAS, RouteDecision, RouteRequest, RoutingPolicy,
                                      StaticThresholdPolicy)
from paas_jax.serving.tokenizer import ByteTokenizer

log = logging.getLogger("paas_jax.serving.broker")

SERVICE = "paas_jax.serving.v1.Broker"
MAX_REQUEST_ID = 256
MAX_STOP_TOKENS = 1024
Code = grpc.StatusCode


@dataclasses.dataclass(frozen=True)
class DecodeTarget:
  """A decode server: its control address (from the broker) and the address of
  its StateTransfer port as the prefill region reaches it (e.g. via the WAN)."""

  control: str
  transfer: str


@dataclasses.dataclass
class RequestRecord:
  """One request's lifecycle at the broker."""

  request_id: str
  prompt_tokens: int
  max_new_tokens: int
  # Id of the request at the regions (decode job, transfer): unique per
  # attempt even when a client reuses its own request ids.
  downstream_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
  created: float = dataclasses.field(default_factory=time.time)
  t0: float = dataclasses.field(default_factory=time.perf_counter)
  phase: str = "received"
  route: str = ""
  route_reason: str = ""
  threshold: float = 0.0
  decode_server: str = ""
  prefill_server: str = ""
  first_token_s: float = 0.0
  prefill_s: float = 0.0
  prefill_queue_s: float = 0.0
  prefill_batch_size: int = 0
  transfer_s: float = 0.0
  decode_queue_s: float = 0.0
  link_bytes: int = 0
  state_bytes: int = 0
  generated: int = 0
  finish_reason: str = ""
  error: str = ""
  total_s: float = 0.0
  client_gone: bool = False
  prefill_error: tuple | None = None
  prefill_done: threading.Event = dataclasses.field(default_factory=threading.Event)

  def elapsed(self) -> float:
    return time.perf_counter() - self.t0

  def summary(self) -> serving_pb2.RequestSummary:
    return serving_pb2.RequestSummary(
        request_id=self.request_id, route=self.route, route_reason=self.route_reason,
        prompt_tokens=self.prompt_tokens, threshold_tokens=self.threshold,
        prefill_server=self.prefill_server, decode_server=self.decode_server,
        first_token_s=self.first_token_s, prefill_s=self.prefill_s,
        prefill_queue_s=self.prefill_queue_s, transfer_s=self.transfer_s,
        decode_queue_s=self.decode_queue_s, link_bytes=self.link_bytes,
        state_bytes=self.state_bytes, generated_tokens=self.generated,
        total_s=self.total_s, finish_reason=self.finish_reason,
        prefill_batch_size=self.prefill_batch_size)

  def to_dict(self) -> dict:
    d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
         if f.name not in ("t0", "prefill_done", "prefill_error")}
    d["prefill_error"] = None if self.prefill_error is None else (
        f"{self.prefill_error[0].name}: {self.prefill_error[1]}")
    return d


class _Abort(Exception):
  def __init__(self, code: grpc.StatusCode, message: str):
    super().__init__(message)
    self.code, self.message = code, message


class BrokerServicer(serving_pb2_grpc.BrokerServicer):
  """Routes, drives and relays requests; see the module docstring."""

  def __init__(self, model_config, policy: RoutingPolicy, *, prefill_targets: Sequence[str],
               decode_targets: Sequence[DecodeTarget], tokenizer=None,
               channel_credentials: grpc.ChannelCredentials | None = None,
               codec_json: str = "", recent_kept: int = 512):
    if not decode_targets:
      raise ValueError("the broker needs at least one decode server")
    self.config = model_config
    self.policy = policy
    self.codec_json = codec_json
    self.tokenizer = tokenizer
    if self.tokenizer is None and model_config.vocab_size >= 256:
      self.tokenizer = ByteTokenizer(model_config.vocab_size)
    self.prefill_targets = list(prefill_targets)
    self.decode_targets = list(decode_targets)
    self._prefill_stubs = [serving_pb2_grpc.PrefillStub(common.make_channel(t, channel_credentials))
                           for t in self.prefill_targets]
    self._decode_stubs = [serving_pb2_grpc.DecodeStub(common.make_channel(t.control,
                                                                          channel_credentials))
                          for t in self.decode_targets]
    self._lock = threading.Lock()
    self._inflight: dict[str, RequestRecord] = {}
    self._load = collections.Counter()  # (kind, index) -> in-flight requests
    self._recent: collections.deque[RequestRecord] = collections.deque(maxlen=recent_kept)
    self.counters = collections.Counter()
    self._rr = itertools.count()
    self.started = time.time()

  # -- helpers --------------------------------------------------------------------

  def _pick(self, kind: str, n: int) -> int:
    with self._lock:
      start = next(self._rr)
      order = [(start + i) % n for i in range(n)]
      best = min(order, key=lambda i: self._load[(kind, i)])
      self._load[(kind, best)] += 1
      return best

  def _release(self, kind: str, index: int) -> None:
    with self._lock:
      self._load[(kind, index)] -= 1

  def _parse(self, request) -> tuple[list[int], RequestParams]:
    if request.model and request.model != self.config.name:
      raise InvalidRequestError(f"unknown model {request.model!r}; this broker serves "
                                f"{self.config.name!r}")
    if request.prompt_ids and request.prompt:
      raise InvalidRequestError("give prompt_ids or prompt, not both")
    if request.prompt:
      if self.tokenizer is None:
        raise InvalidRequestError("this model has no tokenizer; send prompt_ids")
      prompt = self.tokenizer.encode(request.prompt)
    else:
      prompt = [int(t) for t in request.prompt_ids]
    if len(request.request_id) > MAX_REQUEST_ID or not request.request_id.isprintable():
      raise InvalidRequestError(f"request_id must be at most {MAX_REQUEST_ID} printable "
                                "characters")
    if len(request.stop_tokens) > MAX_STOP_TOKENS:
      raise InvalidRequestError(f"at most {MAX_STOP_TOKENS} stop_tokens, got "
                                f"{len(request.stop_tokens)}")
    if request.route not in (serving_pb2.ROUTE_AUTO, serving_pb2.ROUTE_LOCAL,
                             serving_pb2.ROUTE_REMOTE):
      raise InvalidRequestError(f"unknown route {request.route}")
    params = RequestParams(
        sampling=make_sampling(request.sampling.temperature, request.sampling.top_k,
                               request.sampling.top_p),
        seed=int(request.seed), max_new_tokens=int(request.max_new_tokens),
        stop_tokens=tuple(int(t) for t in request.stop_tokens))
    validate_request(self.config, prompt, params)
    return prompt, params

  def _decide(self, request, prompt_len: int) -> RouteDecision:
    if request.route == serving_pb2.ROUTE_LOCAL:
      return RouteDecision(PDP, "forced:local", -1.0)
    if request.route == serving_pb2.ROUTE_REMOTE:
      if not self.prefill_targets:
        raise InvalidRequestError("route=REMOTE but this broker has no prefill region")
      return RouteDecision(PRFAAS, "forced:remote", -1.0)
    if not self.prefill_targets:
      return RouteDecision(PDP, "no_prefill_region", float("inf"))
    return self.policy.decide(RouteRequest(prompt_tokens=prompt_len))

  @staticmethod
  def _sampling_msg(params: RequestParams) -> serving_pb2.SamplingParams:
    s = params.sampling
    return serving_pb2.SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)

  # -- Generate -------------------------------------------------------------------

  def Generate(self, request, context):
    try:
      prompt, params = self._parse(request)
    except InvalidRequestError as e:
      self.counters["invalid"] += 1
      context.abort(Code.INVALID_ARGUMENT, str(e))
    rid = request.request_id or uuid.uuid4().hex
    rec = RequestRecord(request_id=rid, prompt_tokens=len(prompt),
                        max_new_tokens=params.max_new_tokens)
    with self._lock:
      if rid in self._inflight:
        self.counters["invalid"] += 1
        context.abort(Code.INVALID_ARGUMENT, f"request_id {rid!r} is already in flight")
      self._inflight[rid] = rec
    calls: dict[str, grpc.Future] = {}

    def on_rpc_done():
      # Runs when the Generate RPC ends for any reason; if the client went
      # away first, cancel every downstream call (decode slot, transfer).
      if rec.phase not in ("finished", "failed"):
        rec.client_gone = True
        rec.phase = "cancelled"
        for call in list(calls.values()):
          call.cancel()
    context.add_callback(on_rpc_done)
    self.counters["requests"] += 1
    try:
      try:
        decision = self._decide(request, len(prompt))
      except InvalidRequestError as e:
        raise _Abort(Code.INVALID_ARGUMENT, str(e)) from None
      rec.route, rec.route_reason = decision.route, decision.reason
      rec.threshold = decision.threshold_tokens
      rec.phase = "routed"
      self.counters[f"route_{decision.route}"] += 1
      if decision.route == PRFAAS:
        yield from self._remote(rec, prompt, params, calls, context)
      else:
        yield from self._local(rec, prompt, params, calls, context)
    except _Abort as e:
      rec.error = f"{e.code.name}: {e.message}"
      if not rec.client_gone:
        rec.phase = "failed"
        self.counters["failed"] += 1
        context.abort(e.code, e.message)
    except Exception as e:  # pylint: disable=broad-except
      # A bug, not a request error: report it as INTERNAL with a message
      # instead of a bare traceback.
      log.exception("request %s failed", rid)
      rec.error = f"INTERNAL: {e!r}"
      rec.phase = "failed"
      self.counters["failed"] += 1
      context.abort(Code.INTERNAL, f"broker error: {e!r}")
    finally:
      rec.total_s = rec.elapsed()
      with self._lock:
        self._inflight.pop(rid, None)
        self._recent.append(rec)
      if rec.client_gone:
        self.counters["cancelled"] += 1

  def _decode_request(self, rec, prompt, params, remote: bool,
                      downstream_id: str | None = None) -> serving_pb2.DecodeRequest:
    return serving_pb2.DecodeRequest(
        request_id=downstream_id or rec.downstream_id, model=self.config.name,
        prompt_ids=[] if remote else prompt, remote_prefill=remote, prompt_len=len(prompt),
        sampling=self._sampling_msg(params), seed=params.seed,
        max_new_tokens=params.max_new_tokens, stop_tokens=list(params.stop_tokens))

  def _local(self, rec, prompt, params, calls, context, downstream_id: str | None = None):
    di = self._pick("decode", len(self._decode_stubs))
    try:
      rec.decode_server = self.decode_targets[di].control
      rec.prefill_server = rec.decode_server
      rec.phase = "prefilling"
      dcall = self._decode_stubs[di].Decode(
          self._decode_request(rec, prompt, params, False, downstream_id),
          timeout=common.remaining_s(context))
      calls["decode"] = dcall
      if rec.client_gone:
        dcall.cancel()
      yield from self._relay(rec, dcall, context)
    finally:
      self._release("decode", di)

  def _remote(self, rec, prompt, params, calls, context):
    """PrfaaS route; falls back to PD-P if region A is unreachable before any token."""
    try:
      yield from self._remote_once(rec, prompt, params, calls, context)
    except _Abort as e:
      unreachable = (rec.prefill_error is not None
                     and rec.prefill_error[0] == Code.UNAVAILABLE)
      if not unreachable or rec.generated or rec.client_gone:
        raise
      log.warning("request %s: prefill region unreachable (%s); prefilling locally",
                  rec.request_id, e.message)
      self.counters["fallback_pdp"] += 1
      calls.clear()
      rec.route = PDP
      rec.route_reason += ";fallback:prefill_region_unavailable"
      rec.prefill_error = None
      rec.prefill_done.set()
      # A fresh downstream id: the cancelled remote registration may still be
      # draining at the decode server.
      yield from self._local(rec, prompt, params, calls, context,
                             downstream_id=f"{rec.downstream_id}~pdp")

  def _remote_once(self, rec, prompt, params, calls, context):
    di = self._pick("decode", len(self._decode_stubs))
    pi = self._pick("prefill", len(self._prefill_stubs))
    follower = None
    try:
      target = self.decode_targets[di]
      rec.decode_server = target.control
      rec.prefill_server = self.prefill_targets[pi]
      dcall = self._decode_stubs[di].Decode(self._decode_request(rec, prompt, params, True),
                                            timeout=common.remaining_s(context))
      calls["decode"] = dcall
      try:
        accepted = next(dcall)  # admission control before any prefill work
      except grpc.RpcError as e:
        raise self._downstream_error(rec, e, "decode server") from None
      except StopIteration:
        raise _Abort(Code.INTERNAL, "decode server closed the stream before accepting")
      if not accepted.accepted:
        raise _Abort(Code.INTERNAL, "decode server answered without accepting the request")
      rec.phase = "prefilling"
      preq = serving_pb2.PrefillRequest(
          request_id=rec.downstream_id, model=self.config.name, prompt_ids=prompt,
          sampling=self._sampling_msg(params), seed=params.seed,
          decode_target=target.transfer, codec_json=self.codec_json)
      pcall = self._prefill_stubs[pi].Prefill(preq, timeout=common.remaining_s(context))
      calls["prefill"] = pcall
      if rec.client_gone:
        pcall.cancel()
        dcall.cancel()
      follower = threading.Thread(target=self._follow_prefill,
                                  args=(rec, pcall, dcall, self._decode_stubs[di]),
                                  name=f"prefill-{rec.request_id[:8]}", daemon=True)
      follower.start()
      yield from self._relay(rec, dcall, context)
    finally:
      self._release("decode", di)
      self._release("prefill", pi)

  def _follow_prefill(self, rec: RequestRecord, pcall, dcall, dstub) -> None:
    """Reads the Prefill stream: hands the first token over, records link stats."""
    try:
      for ev in pcall:
        if ev.HasField("first_token"):
          ft = ev.first_token
          rec.prefill_s, rec.prefill_queue_s = ft.prefill_s, ft.queue_s
          rec.prefill_batch_size = ft.batch_size
          rec.phase = "transferring"
          dstub.Handoff(serving_pb2.HandoffRequest(request_id=rec.downstream_id,
                                                   first_token=ft.token_id),
                        timeout=common.CONTROL_TIMEOUT_S)
        elif ev.HasField("done"):
          d = ev.done
          rec.transfer_s, rec.link_bytes, rec.state_bytes = (d.transfer_s, d.bytes_sent,
                                                             d.state_bytes)
    except grpc.RpcError as e:
      if not rec.client_gone and rec.phase not in ("finished", "failed"):
        rec.prefill_error = (common.rpc_code(e), common.rpc_details(e))
        dcall.cancel()  # wakes the relay, which reports prefill_error
    finally:
      rec.prefill_done.set()

  def _downstream_error(self, rec: RequestRecord, e: grpc.RpcError, who: str) -> _Abort:
    code, details = common.rpc_code(e), common.rpc_details(e)
    if code == Code.CANCELLED and rec.prefill_error is not None:
      pcode, pdetails = rec.prefill_error
      return _Abort(pcode, f"prefill server: {pdetails}")
    return _Abort(code, f"{who}: {details}")

  def _relay(self, rec: RequestRecord, dcall, context):
    """Forwards the decode stream to the client."""
    decoder = self.tokenizer.decoder() if self.tokenizer is not None else None
    first = True
    try:
      for ev in dcall:
        if ev.accepted:
          continue
        if not ev.token_ids and not ev.finished:  # the request got its slot
          rec.decode_queue_s = ev.queue_s
          if rec.route == PDP:
            rec.prefill_s, rec.prefill_queue_s = ev.prefill_s, ev.prefill_queue_s
            rec.prefill_batch_size = ev.prefill_batch_size
          continue
        out = serving_pb2.GenerateResponse(request_id=rec.request_id)
        out.token_ids.extend(ev.token_ids)
        rec.generated += len(ev.token_ids)
        if decoder is not None and ev.token_ids:
          out.text = decoder.feed(list(ev.token_ids))
        if first and ev.token_ids:
          first = False
          rec.first_token_s = rec.elapsed()
          rec.phase = "decoding"
          out.summary.CopyFrom(rec.summary())
        if ev.finished:
          rec.finish_reason = ev.finish_reason
          if rec.route == PRFAAS:
            rec.prefill_done.wait(timeout=10.0)
          rec.total_s = rec.elapsed()
          rec.phase = "finished"
          self.counters["finished"] += 1
          out.finished = True
          out.finish_reason = ev.finish_reason
          out.summary.CopyFrom(rec.summary())
        yield out
        if ev.finished:
          return
    except grpc.RpcError as e:
      if rec.client_gone:
        return
      raise self._downstream_error(rec, e, "decode server") from None
    if rec.client_gone:
      return
    raise _Abort(Code.INTERNAL, "decode stream ended without finishing the request")

  # -- stats ----------------------------------------------------------------------

  def GetStats(self, request, context):
    with self._lock:
      inflight = [r.to_dict() for r in self._inflight.values()]
      recent = [r.to_dict() for r in self._recent]
      phases = collections.Counter(r["phase"] for r in inflight)
    gauges = {k: float(v) for k, v in self.counters.items()}
    gauges.update({f"inflight_{p}": float(n) for p, n in phases.items()})
    gauges["inflight"] = float(len(inflight))
    gauges["uptime_s"] = time.time() - self.started
    return serving_pb2.StatsResponse(server="broker", gauges=gauges, json=json.dumps({
        "model": self.config.name, "prefill": self.prefill_targets,
        "decode": [dataclasses.asdict(t) for t in self.decode_targets],
        "inflight": inflight, "recent": recent}))


class BrokerServer:

  def __init__(self, servicer: BrokerServicer, control: common.RunningServer):
    self.servicer = servicer
    self.control = control

  @property
  def address(self) -> str:
    return self.control.address

  def stop(self) -> None:
    self.control.stop(0.5)


def start(model_config, policy: RoutingPolicy, *, prefill_targets: Sequence[str],
          decode_targets: Sequence[DecodeTarget], host: str = "127.0.0.1", port: int = 0,
          credentials: grpc.ServerCredentials | None = None, interceptors=(),
          channel_credentials: grpc.ChannelCredentials | None = None, tokenizer=None,
          codec_json: str = "", max_workers: int = 256) -> BrokerServer:
  servicer = BrokerServicer(model_config, policy, prefill_targets=prefill_targets,
                            decode_targets=decode_targets, tokenizer=tokenizer,
                            channel_credentials=channel_credentials, codec_json=codec_json)
  control = common.start_server(
      f"{host}:{port}", lambda s: serving_pb2_grpc.add_BrokerServicer_to_server(servicer, s),
      credentials=credentials, services=[SERVICE], max_workers=max_workers,
      interceptors=interceptors)
  control.set_serving([SERVICE])
  return BrokerServer(servicer, control)


FLAGS = flags.FLAGS


def model_config_from_decode(target: str):
  """The served model's config as a decode server reports it (for checkpoints)."""
  from paas_jax.models import ModelConfig  # pylint: disable=g-import-not-at-top
  with common.make_channel(target) as ch:
    r = serving_pb2_grpc.DecodeStub(ch).GetStats(serving_pb2.StatsRequest(),
                                                 timeout=common.CONTROL_TIMEOUT_S)
  return ModelConfig.from_dict(json.loads(r.json)["config"])


def main(argv):
  del argv
  from paas_jax.models import load_config  # pylint: disable=g-import-not-at-top
  from paas_jax.serving.tokenizer import WrappedTokenizer  # pylint: disable=g-import-not-at-top
  common.setup_logging(FLAGS.log_level)
  if len(FLAGS.decode) != len(FLAGS.decode_transfer):
    raise app.UsageError("--decode and --decode_transfer need the same number of entries")
  targets = [DecodeTarget(c, t) for c, t in zip(FLAGS.decode, FLAGS.decode_transfer)]
  threshold = float("inf") if FLAGS.threshold < 0 else FLAGS.threshold
  creds = common.load_server_credentials(FLAGS.tls_cert, FLAGS.tls_key, FLAGS.tls_client_ca)
  for target in list(FLAGS.prefill) + list(FLAGS.decode):
    common.wait_healthy(target, FLAGS.wait_s)
  config = (load_config(FLAGS.config) if FLAGS.config
            else model_config_from_decode(FLAGS.decode[0]))
  tokenizer = None
  if FLAGS.tokenizer:
    from tokenizers import Tokenizer  # pylint: disable=g-import-not-at-top
    tokenizer = WrappedTokenizer(Tokenizer.from_file(FLAGS.tokenizer))
  server = start(config, StaticThresholdPolicy(threshold),
                 prefill_targets=FLAGS.prefill, decode_targets=targets, host=FLAGS.host,
                 port=FLAGS.port, credentials=creds, codec_json=FLAGS.codec_json,
                 tokenizer=tokenizer)
  common.write_ready_file(FLAGS.ready_file, {"pid": os.getpid(), "port": server.control.port})
  log.info("broker on %s: prefill %s, decode %s, threshold %s", server.address,
           FLAGS.prefill, targets, threshold)
  common.wait_for_termination(server.stop)


if __name__ == "__main__":
  flags.DEFINE_string("config", "tiny_gdn_gqa", "Model config served (vocabulary, context); "
                      "empty: ask the first decode server (e.g. when serving a checkpoint).")
  flags.DEFINE_string("tokenizer", None, "tokenizer.json for --prompt text (default: "
                      "byte-level when the vocabulary has >= 256 ids).")
  flags.DEFINE_string("host", "127.0.0.1", "Address to bind.")
  flags.DEFINE_integer("port", 0, "Port (0: pick a free one).")
  flags.DEFINE_list("prefill", [], "Prefill servers (PrfaaS region), host:port.")
  flags.DEFINE_list("decode", [], "Decode servers' control addresses, host:port.")
  flags.DEFINE_list("decode_transfer", [],
                    "Each decode server's StateTransfer address as reached from the prefill "
                    "region (e.g. the WAN relay).")
  flags.DEFINE_float("threshold", 128, "Selective offloading: prompts longer than this many "
                     "tokens are prefilled remotely (<0: never).")
  flags.DEFINE_string("codec_json", "", "CodecOptions JSON for the link (empty: server default).")
  flags.DEFINE_float("wait_s", 300, "How long to wait for the regions to become healthy.")
  flags.DEFINE_string("ready_file", None, "Write port/pid as JSON here once serving.")
  flags.DEFINE_string("tls_cert", None, "PEM server certificate (enables TLS).")
  flags.DEFINE_string("tls_key", None, "PEM server key.")
  flags.DEFINE_string("tls_client_ca", None, "PEM CA for client certificates (mTLS).")
  flags.DEFINE_string("log_level", "INFO", "Logging level.")
  app.run(main)
