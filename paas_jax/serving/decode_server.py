"""The PD-region server: continuous-batching decode plus local prefill (PD-P).

Two gRPC ports:

* control (``Decode`` service, health, stats): the broker registers requests
  here and reads their token streams;
* transfer (``paas_jax.transport`` ``StateTransfer``): prefill servers of the
  PrfaaS region stream states here (through the WAN link), and cached prefixes
  ("prefix:" transfer ids, ``prefix_transfer``) that go into PD-P's prefix cache.

  python -m paas_jax.serving.decode_server --port=50052 --transfer_port=50053 \
      --config=tiny_gdn_gqa --seed=0 --n_slots=8
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time

import grpc
from absl import app, flags

from paas_jax.proto import serving_pb2, serving_pb2_grpc
from paas_jax.serving import cli, common, handoff_probe, prefix_transfer
from paas_jax.serving.batching import (DecodeJob, DecodeScheduler, PrefillBatcher, PrefillJob,
                                       QueueFullError)
from paas_jax.serving.chunk_stream import SegmentId, is_segment_transfer, segment_template
from paas_jax.serving.commit_points import SegmentAssembler, resume_point
from paas_jax.serving.engine import (DecodeEngine, EngineConfig, EngineError, InvalidRequestError,
                                     PrefillEngine, PrefillInput, RequestParams,
                                     check_request_identity, make_sampling, validate_request)

log = logging.getLogger("paas_jax.serving.decode")

SERVICE = "paas_jax.serving.v1.Decode"
# Segments of a request whose attempt failed are kept this long for a resume.
SEGMENT_TTL_S = 300.0
# Also served on the control port: Prefill, for acting as PD-P of another PD node.
PREFILL_SERVICE = "paas_jax.serving.v1.Prefill"


def request_params(msg) -> RequestParams:
  """``RequestParams`` from a request message with sampling/seed/max_new_tokens/stop_tokens."""
  sampling = make_sampling(msg.sampling.temperature, msg.sampling.top_k, msg.sampling.top_p)
  return RequestParams(sampling=sampling, seed=int(msg.seed),
                       max_new_tokens=int(msg.max_new_tokens),
                       stop_tokens=tuple(int(t) for t in msg.stop_tokens))


class DecodeServicer(serving_pb2_grpc.DecodeServicer):
  """Registers requests with the scheduler and streams their events."""

  def __init__(self, model, engine_config: EngineConfig, *, max_queue: int = 64,
               batch_window_s: float = 0.005, name: str = "decode", metrics=None,
               channel_credentials: grpc.ChannelCredentials | None = None,
               logit_probe: bool = True, corrupt_state=None):
    """``logit_probe``: check every handed-off state against the prefill
    side's probe before decoding it (``handoff_probe``); ``corrupt_state``: a
    fault hook ``f(request_id, state) -> state`` run on received states before
    that check (demo and tests only)."""
    from paas_jax.state import abstract_state, round_up  # pylint: disable=g-import-not-at-top
    from paas_jax.transport import StateReceiver  # pylint: disable=g-import-not-at-top
    self.model = model
    self.config = model.config
    self.name = name
    self.engine = DecodeEngine(model, engine_config)
    self.prefill_engine = PrefillEngine(model, engine_config)
    self.batcher = PrefillBatcher(self.prefill_engine, batch_window_s, name="pdp")
    self.scheduler = DecodeScheduler(self.engine, max_queue=max_queue,
                                     on_local_prefill=self._local_prefill)
    # Remote states reach the scheduler only through the probe check.
    self.verifier = handoff_probe.HandoffVerifier(
        model, self.scheduler.provide_state, self.scheduler.fail, enabled=logit_probe,
        metrics=metrics, corrupt=corrupt_state)
    cfg = self.config
    # Cross-cluster prefix transfers: prefixes of region A's cache arrive on the
    # transfer port ("prefix:" ids) into PD-P's prefix cache; ExportPrefix ships
    # PD-P's prefixes to region A (the relay's B->A direction).
    from paas_jax.serving.prefix_transfer import PrefixExporter, PrefixImporter  # pylint: disable=g-import-not-at-top
    self.prefix_importer = PrefixImporter(cfg, self.prefill_engine, metrics=metrics,
                                          link="A->B")
    self.prefix_exporter = PrefixExporter(cfg, self.prefill_engine,
                                          credentials=channel_credentials, metrics=metrics,
                                          link="B->A")
    # PD-P for other PD nodes: the broker may call Prefill here with another PD
    # node's StateTransfer address. It shares this node's PrefillEngine,
    # batcher and prefix cache, so moving the node between PD-P and PD-D roles
    # needs no second copy of the weights or a restart.
    from paas_jax.serving.prefill_server import PrefillServicer  # pylint: disable=g-import-not-at-top
    self.pd_prefill = PrefillServicer(model, engine_config, max_queue=max_queue,
                                      channel_credentials=channel_credentials,
                                      metrics=metrics, engine=self.prefill_engine,
                                      batcher=self.batcher, link_label="B->B",
                                      prefix_exporter=self.prefix_exporter,
                                      prefix_importer=self.prefix_importer,
                                      logit_probe=logit_probe)

    # Chunk-streamed states ("seg:" ids, chunk_stream): committed segments are
    # assembled into commit points; the request's state is ready once its
    # commit point is the whole prompt. Segments of a request whose attempt
    # failed stay for SEGMENT_TTL_S, for a resume (Decode.resume_from).
    self.assembler = SegmentAssembler(cfg)
    self._seg_lock = threading.Lock()
    self._seg_prompt_len: dict[str, int] = {}   # remote request -> prompt tokens
    self._seg_seen: dict[str, float] = {}       # request -> last segment / use (monotonic)
    self._seg_done: set[str] = set()
    self.segments_in = 0
    self.resumes = 0
    self.resumed_tokens = 0

    def template(info):
      if prefix_transfer.is_prefix_transfer(info.transfer_id):
        return self.prefix_importer.template(info)
      if is_segment_transfer(info.transfer_id):
        seg = SegmentId.parse(info.transfer_id)
        if seg.end > self.engine.max_ctx:
          raise InvalidRequestError(f"segment {info.transfer_id} ends past the context of "
                                    f"{self.engine.max_ctx} tokens")
        return segment_template(cfg, seg), None
      return abstract_state(cfg, 1, round_up(max(info.token_count, 1))), None
    self.receiver = StateReceiver(
        models={cfg.name: cfg.fingerprint()}, template=template,
        on_ready=self._on_state, on_failure=self._on_transfer_failure)
    self.started = time.time()
    self.transfers_in = 0
    self.transfer_bytes_in = 0
    self.metrics = metrics  # paas_jax.observability.ServingMetrics or None
    if metrics is not None:
      metrics.track_queue("decode_wait", lambda: self.scheduler.stats().get("waiting", 0),
                          limit=max_queue)
      metrics.track_queue("decode_slots_busy",
                          lambda: self.scheduler.stats().get("slots_busy", 0),
                          limit=engine_config.n_slots)
      metrics.track_queue("pdp_prefill", lambda: self.batcher.queue_depth)
      metrics.track_queue("transfer_bytes_reserved", lambda: self.receiver.bytes_in_use,
                          limit=self.receiver.options.byte_budget)

  # -- wiring ---------------------------------------------------------------------

  def _local_prefill(self, job: DecodeJob) -> None:
    submitted = time.perf_counter()
    resume = None
    resume_from = job.info.pop("_resume_from", "")
    if resume_from:
      with self._seg_lock:
        earlier_len = self._seg_prompt_len.get(resume_from)
      resume = resume_point(self.assembler, resume_from, job.prompt, earlier_len)
      self.assembler.drop(resume_from)
      self._forget_segments(resume_from)
      job.info["resumed_tokens"] = resume[0] if resume else 0
      if resume:
        self.resumes += 1
        self.resumed_tokens += resume[0]

    def on_done(out):
      job.info["prefill_queue_s"] = max(0.0, out_started[0] - submitted)
      self.scheduler.prefilled(job, out)

    out_started = [submitted]
    pjob = PrefillJob(
        input=PrefillInput(job.request_id, job.prompt, job.params), on_done=on_done,
        on_error=lambda e: self.scheduler.fail(job.request_id, grpc.StatusCode.INTERNAL,
                                               f"local prefill failed: {e}"),
        resume=resume)
    pjob.on_start = lambda: out_started.__setitem__(0, time.perf_counter())
    job.info["_prefill_job"] = pjob
    self.batcher.submit(pjob)

  def _on_state(self, received) -> None:
    rid = received.info.transfer_id
    if prefix_transfer.is_prefix_transfer(rid):
      self.prefix_importer.on_ready(received)
      return
    if is_segment_transfer(rid):
      self._on_segment(received)
      return
    self.transfers_in += 1
    self.transfer_bytes_in += received.manifest.nbytes
    if self.metrics is not None:
      self.metrics.link_transfers.labels("A->B", "received").inc()
    self.verifier.state_arrived(rid, received.state, {"state_bytes": received.manifest.nbytes},
                                lossy=handoff_probe.lossy_manifest(received.manifest))

  def _on_segment(self, received) -> None:
    """A verified segment: keep it; hand the state over once the commit point is
    the whole prompt. A segment that does not match its id raises (the
    sender's Commit fails: that segment never counts)."""
    seg = self.assembler.add(received.info.transfer_id, received.state)
    rid = seg.request_id
    self.segments_in += 1
    self.transfer_bytes_in += received.manifest.nbytes
    with self._seg_lock:
      self._seg_seen[rid] = time.monotonic()
      prompt_len = self._seg_prompt_len.get(rid)
      complete = (prompt_len is not None and rid not in self._seg_done
                  and self.assembler.commit_point(rid) >= prompt_len)
      if complete:
        self._seg_done.add(rid)
    self._gc_segments()
    if not complete:
      return
    n, state = self.assembler.committed_state(rid)
    self.assembler.drop(rid)
    self.transfers_in += 1
    if self.metrics is not None:
      self.metrics.link_transfers.labels("A->B", "received").inc()
    self.verifier.state_arrived(rid, state, {"commit_point": n},
                                lossy=handoff_probe.lossy_manifest(received.manifest))

  def _forget_segments(self, rid: str) -> None:
    with self._seg_lock:
      self._seg_prompt_len.pop(rid, None)
      self._seg_seen.pop(rid, None)
      self._seg_done.discard(rid)

  def _gc_segments(self) -> None:
    """Drops the segments of requests idle past SEGMENT_TTL_S (no resume came)."""
    now = time.monotonic()
    with self._seg_lock:
      old = [r for r, t in self._seg_seen.items() if now - t > SEGMENT_TTL_S]
    for rid in old:
      self.assembler.drop(rid)
      self._forget_segments(rid)

  def _on_transfer_failure(self, transfer_id: str, code, message: str) -> None:
    if prefix_transfer.is_prefix_transfer(transfer_id):
      self.prefix_importer.on_failure(transfer_id, code, message)
      return
    if is_segment_transfer(transfer_id):
      # No commit point at or past it; the prefill side reports the failure
      # to the broker, which resumes from the last commit point (resume.py).
      self.assembler.reject(transfer_id)
      if self.metrics is not None:
        self.metrics.link_transfers.labels("A->B", "receive_failed").inc()
      return
    if self.metrics is not None:
      self.metrics.link_transfers.labels("A->B", "receive_failed").inc()
    self.verifier.forget(transfer_id)
    self.scheduler.fail(transfer_id, code, f"state transfer failed: {message}")

  def stop(self) -> None:
    self.pd_prefill.stop()  # also stops the shared batcher
    self.batcher.stop()
    self.scheduler.stop()
    self.receiver.close()
    self.prefix_exporter.close()
    self.verifier.close()

  def warmup(self) -> dict:
    return {"decode_s": self.engine.warmup(), "prefill_s": self.prefill_engine.warmup()}

  # -- RPCs -----------------------------------------------------------------------

  def Decode(self, request, context):
    try:
      check_request_identity(request, self.config, "decode server")
      params = request_params(request)
      if request.remote_prefill:
        prompt_len = int(request.prompt_len) or len(request.prompt_ids)
        prompt = tuple(request.prompt_ids) or (0,) * prompt_len
        validate_request(self.config, prompt, params, self.engine.max_ctx)
        job = DecodeJob(request.request_id, params, prompt_len, remote=True)
        with self._seg_lock:
          self._seg_prompt_len[request.request_id] = prompt_len
          self._seg_seen[request.request_id] = time.monotonic()
      else:
        prompt = tuple(int(t) for t in request.prompt_ids)
        validate_request(self.config, prompt, params, self.engine.max_ctx)
        job = DecodeJob(request.request_id, params, len(prompt), remote=False, prompt=prompt)
        if request.resume_from:
          job.info["_resume_from"] = request.resume_from
      position = self.scheduler.submit(job)
    except InvalidRequestError as e:
      context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    except QueueFullError as e:
      if self.metrics is not None:
        self.metrics.queue_rejections.labels("decode_wait").inc()
      context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
    except EngineError as e:
      context.abort(grpc.StatusCode.UNAVAILABLE, str(e))

    def on_rpc_done():
      if not job.done:
        self.scheduler.cancel(job.request_id)
        pjob = job.info.get("_prefill_job")
        if pjob is not None:
          pjob.cancelled = True
    context.add_callback(on_rpc_done)
    yield serving_pb2.DecodeEvent(accepted=True, queue_position=position)
    yield from self._stream(job, context)

  def _stream(self, job: DecodeJob, context):
    while True:
      try:
        ev = job.events.get(timeout=0.5)
      except queue.Empty:
        if not context.is_active():
          return
        continue
      out = serving_pb2.DecodeEvent()
      if ev.kind == "error":
        context.abort(ev.code or grpc.StatusCode.INTERNAL, ev.reason)
      if ev.kind == "slot":
        info = ev.info
        out.slot = int(info["slot"])
        out.queue_s = float(info.get("queue_s", 0.0))
        out.prefill_s = float(info.get("prefill_s", 0.0))
        out.prefill_queue_s = float(info.get("prefill_queue_s", 0.0))
        out.prefill_batch_size = int(info.get("prefill_batch_size", 0))
        out.prefill_cached_tokens = int(info.get("prefill_cached_tokens", 0))
        out.resumed_tokens = int(info.get("resumed_tokens", 0))
        yield out
        continue
      tokens = list(ev.tokens) if ev.kind == "tokens" else []
      finished = ev if ev.kind == "finished" else None
      # Coalesce whatever else is already queued into the same message.
      while finished is None:
        try:
          nxt = job.events.get_nowait()
        except queue.Empty:
          break
        if nxt.kind == "tokens":
          tokens.extend(nxt.tokens)
        elif nxt.kind == "finished":
          finished = nxt
        else:
          job.events.put(nxt)  # error/slot: handled on the next round
          break
      out.token_ids.extend(tokens)
      if finished is not None:
        out.finished = True
        out.finish_reason = finished.reason
        log.info("request finished", extra={"downstream_id": job.request_id,
                                            "remote_prefill": job.remote,
                                            "reason": finished.reason})
      yield out
      if finished is not None:
        return

  def Handoff(self, request, context):
    if not request.request_id:
      context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
    if not 0 <= request.first_token < self.config.vocab_size:
      context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                    f"first_token {request.first_token} outside the vocabulary")
    probe = None
    if request.HasField("probe"):
      try:
        probe = handoff_probe.from_proto(request.probe)
      except ValueError as e:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"probe: {e}")
      if probe.token != request.first_token:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                      f"probe.token {probe.token} is not first_token {request.first_token}")
    if not self.scheduler.provide_first_token(request.request_id, request.first_token):
      context.abort(grpc.StatusCode.NOT_FOUND,
                    f"request {request.request_id!r} is gone (cancelled or finished)")
    self.verifier.handoff_arrived(request.request_id, probe)
    return serving_pb2.HandoffResponse()

  def ExportPrefix(self, request, context):
    return self.prefix_exporter.serve(request, context)

  def GetStats(self, request, context):
    s = self.scheduler.stats()
    s.update(pdp_queue=self.batcher.queue_depth, pdp_batches=self.batcher.batches,
             pdp_prompts=self.batcher.prompts, pdp_tokens=self.batcher.tokens,
             pdp_busy_s=self.batcher.busy_s, transfers_in=self.transfers_in,
             transfer_bytes_in=self.transfer_bytes_in,
             receiver_bytes_in_use=self.receiver.bytes_in_use,
             receiver_active_transfers=len(self.receiver.active_transfers()),
             segments_in=self.segments_in, segment_requests=len(self.assembler.requests()),
             resumes=self.resumes, resumed_tokens=self.resumed_tokens,
             uptime_s=time.time() - self.started)
    s.update(common.probe_gauges(self.prefill_engine, request, context))
    s.update(self.prefix_importer.gauges())
    s.update(self.prefix_exporter.gauges())
    s.update(self.verifier.gauges())
    # Region B's own sends over the WAN: its prefix exports (B->A). The PD-P
    # role's state sends (B->B, region B's network) are not in these.
    s.update(self.prefix_exporter.link_counters.gauges())
    gauges = {k: float(v) for k, v in s.items()}
    extra = {"model": self.config.name, "fingerprint": self.config.fingerprint(),
             "config": self.config.to_dict(),
             "max_ctx": self.engine.max_ctx, "page_size": self.engine.page_size,
             "link": self.prefix_exporter.link_counters.report()}
    return serving_pb2.StatsResponse(server=self.name, gauges=gauges, json=json.dumps(extra))


class DecodeServer:
  """A running decode server (control + transfer ports)."""

  def __init__(self, servicer: DecodeServicer, control: common.RunningServer,
               transfer_server):
    self.servicer = servicer
    self.control = control
    self.transfer = transfer_server

  @property
  def address(self) -> str:
    return self.control.address

  @property
  def transfer_address(self) -> str:
    return self.transfer.address

  def stop(self) -> None:
    self.control.stop(0.5)
    self.transfer.stop(0.5)
    self.servicer.stop()


def start(model, engine_config: EngineConfig, *, host: str = "127.0.0.1", port: int = 0,
          transfer_port: int = 0, max_queue: int = 64, batch_window_s: float = 0.005,
          credentials: grpc.ServerCredentials | None = None, interceptors=(),
          security=None, metrics=None, warmup: bool = True, logit_probe: bool = True,
          corrupt_state=None, data_plane: bool = True,
          data_plane_host: str | None = None) -> DecodeServer:
  """Starts the control and transfer ports.

  ``security`` (a ``paas_jax.security.ServiceSecurity`` of role decode) gives
  both ports mutual TLS and the decode peer rules (only brokers register
  requests, only prefill servers push states) and overrides ``credentials``;
  ``metrics`` (``paas_jax.observability.ServingMetrics``) records RPCs, queues
  and transfers. Explicit ``interceptors`` run after those. ``logit_probe`` and
  ``corrupt_state``: see ``DecodeServicer``.
  ``data_plane``: the transfer port also opens the TCP data plane
  (``paas_jax.transport.dataplane``; TLS and peer rules from ``security``), bound
  on ``data_plane_host`` (default: ``host``).
  """
  from paas_jax.security.hooks import server_interceptors  # pylint: disable=g-import-not-at-top
  from paas_jax.transport import serve_receiver  # pylint: disable=g-import-not-at-top
  channel_credentials = None
  if security is not None:
    credentials = security.server_credentials()
    channel_credentials = security.channel_credentials()
  servicer = DecodeServicer(model, engine_config, max_queue=max_queue,
                            batch_window_s=batch_window_s, metrics=metrics,
                            channel_credentials=channel_credentials,
                            logit_probe=logit_probe, corrupt_state=corrupt_state)
  stack = server_interceptors(security, metrics) + list(interceptors)
  control = common.start_server(
      f"{host}:{port}", lambda s: (
          serving_pb2_grpc.add_DecodeServicer_to_server(servicer, s),
          serving_pb2_grpc.add_PrefillServicer_to_server(servicer.pd_prefill, s)),
      credentials=credentials, services=[SERVICE, PREFILL_SERVICE],
      interceptors=stack,
      # Every registered request holds one Decode stream (and its thread); past
      # that, admission control answers RESOURCE_EXHAUSTED before threads run out.
      # Prefill streams (PD-P for another node) are capped by max_queue too.
      max_workers=engine_config.n_slots + 2 * max_queue + 32)
  from paas_jax.transport.dataplane import tls as dp_tls  # pylint: disable=g-import-not-at-top
  plane = (dp_tls.receiver_kwargs(security, "decode", credentials, data_plane_host)
           if data_plane else {})
  transfer = serve_receiver(servicer.receiver, f"{host}:{transfer_port}",
                            credentials=credentials, interceptors=stack, **plane)
  if warmup:
    t = servicer.warmup()
    log.info("decode server warm: %s", t)
  control.set_serving([SERVICE, PREFILL_SERVICE])
  return DecodeServer(servicer, control, transfer)


# -- CLI ------------------------------------------------------------------------------

FLAGS = flags.FLAGS


def main(argv):
  del argv
  t0 = time.time()
  from paas_jax.security.faults import FaultPlan  # pylint: disable=g-import-not-at-top
  model, security, metrics, metrics_port = cli.setup_process("decode")
  faults = FaultPlan.parse(FLAGS.faults)
  if faults.active:
    log.warning("FAULT INJECTION enabled: %s", faults)
  engine_config = EngineConfig(
      n_slots=FLAGS.n_slots, max_ctx=FLAGS.max_ctx, page_size=FLAGS.page_size,
      num_pages=FLAGS.num_pages, prefill_buckets=tuple(int(b) for b in FLAGS.prefill_buckets),
      prefill_max_batch=FLAGS.prefill_max_batch, prefix_block=FLAGS.prefix_block,
      prefix_cache_bytes=FLAGS.prefix_cache_mb << 20)
  server = start(model, engine_config, host=FLAGS.host, port=FLAGS.port,
                 transfer_port=FLAGS.transfer_port, max_queue=FLAGS.max_queue,
                 batch_window_s=FLAGS.batch_window_ms / 1e3, security=security,
                 metrics=metrics, logit_probe=FLAGS.logit_probe,
                 corrupt_state=handoff_probe.fault_hook(faults, model.config),
                 data_plane=FLAGS.transfer_plane == "tcp",
                 data_plane_host=FLAGS.data_plane_host or None)
  common.write_ready_file(FLAGS.ready_file, {
      "pid": __import__("os").getpid(), "port": server.control.port,
      "transfer_port": server.transfer.port, "model": model.config.name,
      "data_plane_port": (server.transfer.data_plane.port
                          if server.transfer.data_plane is not None else 0),
      "metrics_port": metrics_port,
      "startup_s": time.time() - t0})
  log.info("decode server on %s (transfer %s), model %s", server.address,
           server.transfer_address, model.config.name)
  common.wait_for_termination(server.stop)


if __name__ == "__main__":
  cli.define_server_flags("decode")
  flags.DEFINE_integer("transfer_port", 0, "StateTransfer port (0: pick a free one).")
  flags.DEFINE_enum("transfer_plane", "tcp", ["tcp", "grpc"], "tcp: the transfer port also "
                    "opens the TCP data plane (announced in BeginResponse); grpc: gRPC only.")
  flags.DEFINE_string("data_plane_host", "", "Bind the data plane on this address instead "
                      "of --host (the launcher puts a WAN relay on the announced port).")
  flags.DEFINE_integer("n_slots", 8, "Decode slots.")
  flags.DEFINE_integer("page_size", 16, "KV page size (positions).")
  flags.DEFINE_integer("num_pages", 0, "KV pages (0: n_slots * max_ctx / page_size).")
  flags.DEFINE_integer("max_queue", 64, "Requests allowed to wait for a slot.")
  app.run(main)
