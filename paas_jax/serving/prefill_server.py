"""The PrfaaS-region server: batched, chunked prefill that streams states away.

For each request: queue for a prefill batch -> open a transfer to the decode
server the broker chose (``paas_jax.transport.StateSender``, transfer id =
request id) -> prefill; every layer of the last chunk is handed to the
transfer as soon as it is computed (``LayerwisePrefill``), so sending layer i
overlaps computing layer i+1 -> report the first token -> commit the transfer
-> report its bytes and time. Nothing of the request is kept afterwards.

``--transfer_port`` opens a StateTransfer port that takes only cross-cluster
prefix transfers from PD nodes (``prefix_transfer``: PD-P's cached prefixes
for requests the broker offloads); ``ExportPrefix`` ships this server's cached
prefixes to a PD node.

  python -m paas_jax.serving.prefill_server --port=50051 --config=tiny_gdn_gqa --seed=0
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import queue
import threading
import time
from concurrent import futures

import grpc
from absl import app, flags

from paas_jax.proto import serving_pb2, serving_pb2_grpc
from paas_jax.serving import cli, common, handoff_probe
from paas_jax.serving.prefix_transfer import PrefixExporter, PrefixImporter
from paas_jax.serving.batching import PrefillBatcher, PrefillJob
from paas_jax.serving.chunk_stream import ChunkStreamer, StreamResult
from paas_jax.serving.resume_preempt import Preemption, PreemptedError
from paas_jax.serving.engine import (EngineConfig, EngineError, InvalidRequestError,
                                     PrefillEngine, PrefillInput, RequestParams,
                                     check_request_identity, make_sampling, validate_request)

log = logging.getLogger("paas_jax.serving.prefill")

SERVICE = "paas_jax.serving.v1.Prefill"


class PrefillServicer(serving_pb2_grpc.PrefillServicer):

  def __init__(self, model, engine_config: EngineConfig, *, batch_window_s: float = 0.005,
               sender_options=None, codec=None,
               channel_credentials: grpc.ChannelCredentials | None = None,
               max_queue: int = 64, metrics=None, faults=None, engine=None, batcher=None,
               link_label: str = "A->B", prefix_exporter=None, prefix_importer=None,
               stream_chunks: bool = True, commit_every: int = 2,
               logit_probe: bool = True):
    """``engine``/``batcher``: serve Prefill from an existing PrefillEngine and
    its PrefillBatcher (a PD node acting as PD-P for another PD node shares its
    own engine and prefix cache instead of loading a second copy). ``link_label``
    names the link in the transfer metrics ("B->B" for intra-region PD-P).
    ``prefix_exporter``/``prefix_importer``: the owner's pair for the same
    engine (a PD node has one already); None builds region A's, whose
    exporter shares this servicer's link gauges (``link_counters``: every
    sender of this servicer reports what it has pending on and has sent over
    ``link_label``; GetStats ``link_*``). ``stream_chunks``: every prefill
    chunk leaves as a segment as soon as it is computed (``chunk_stream``),
    with a commit point every ``commit_every`` chunks; False: one transfer
    whose layers leave while the last chunk is computed. ``logit_probe``: send a
    probe of each state with its first token (``handoff_probe``; one decode
    step)."""
    from paas_jax.codec import CodecOptions  # pylint: disable=g-import-not-at-top
    from paas_jax.transport import LinkCounters, SenderOptions  # pylint: disable=g-import-not-at-top
    self.model = model
    self.config = model.config
    if (engine is None) != (batcher is None):
      raise ValueError("give both engine and batcher, or neither")
    self.engine = engine if engine is not None else PrefillEngine(model, engine_config)
    self.batcher = (batcher if batcher is not None
                    else PrefillBatcher(self.engine, batch_window_s, name="prfaas"))
    self.link_label = link_label
    if commit_every < 1:
      raise ValueError(f"commit_every must be >= 1, got {commit_every}")
    self.stream_chunks = stream_chunks
    self.commit_every = commit_every
    self.logit_probe = logit_probe
    self.probe_s_total = 0.0
    # A preemption notice (SIGTERM with a grace period) hands in-flight
    # requests to the broker's resume path (resume_preempt.py).
    self.preemption = Preemption()
    self.link_counters = LinkCounters(link_label)
    self.codec = codec or CodecOptions()
    self.sender_options = sender_options or SenderOptions(num_streams=2,
                                                          credentials=channel_credentials)
    self._senders: dict[str, object] = {}
    self._channels: list[grpc.Channel] = []
    self._senders_lock = threading.Lock()
    # Commits wait for the link; they must not hold up the next prefill batch.
    self._finishers = futures.ThreadPoolExecutor(max_workers=32,
                                                 thread_name_prefix="prefill-commit")
    self.counters = collections.Counter()
    self.started = time.time()
    # Prompts waiting for a prefill batch; past it, RESOURCE_EXHAUSTED.
    self.max_queue = max_queue
    self.metrics = metrics  # paas_jax.observability.ServingMetrics or None
    self.faults = faults    # paas_jax.security.faults.FaultPlan or None (tests, demo)
    # Cross-cluster prefix transfers (paas_jax.serving.prefix_transfer):
    # ExportPrefix ships this engine's cached prefixes to a PD node; the
    # importer takes PD nodes' prefixes from the transfer port start() opens.
    self.prefix_exporter = prefix_exporter or PrefixExporter(
        self.config, self.engine, codec=self.codec, credentials=channel_credentials,
        metrics=metrics, link=link_label, link_counters=self.link_counters)
    self.prefix_importer = prefix_importer or PrefixImporter(self.config, self.engine,
                                                             metrics=metrics, link="B->A")
    if metrics is not None:
      metrics.track_queue("prefill_wait", lambda: self.batcher.queue_depth, limit=max_queue)

  def _sender(self, target: str):
    from paas_jax.observability.health import FAST_RECONNECT  # pylint: disable=g-import-not-at-top
    from paas_jax.transport import StateSender  # pylint: disable=g-import-not-at-top
    from paas_jax.transport.channels import make_channels  # pylint: disable=g-import-not-at-top
    with self._senders_lock:
      sender = self._senders.get(target)
      if sender is None:
        # Short reconnect back-off: after a WAN outage the next transfer should
        # not wait out gRPC's default exponential back-off (up to minutes).
        opts = self.sender_options
        chans = make_channels(target, opts.num_connections,
                              max_message_bytes=opts.max_message_bytes,
                              credentials=opts.credentials, extra_options=FAST_RECONNECT)
        self._channels.extend(chans)
        if self.faults is not None and self.faults.interceptors():
          chans = [grpc.intercept_channel(c, *self.faults.interceptors()) for c in chans]
          # The fault interceptors act on gRPC Push frames: keep the bytes there.
          opts = dataclasses.replace(opts, plane="grpc")
        # target: where the data plane is dialled (its host, the announced port).
        sender = StateSender(target, channels_=chans, options=opts,
                             counters=self.link_counters)
        self._senders[target] = sender
      return sender

  def stop(self) -> None:
    self.batcher.stop()
    self._finishers.shutdown(wait=False, cancel_futures=True)
    self.prefix_exporter.close()
    with self._senders_lock:
      for s in self._senders.values():
        s.close()
      for c in self._channels:
        c.close()

  def warmup(self) -> dict:
    return {"prefill_s": self.engine.warmup()}

  # -- RPCs -----------------------------------------------------------------------

  def Prefill(self, request, context):
    from paas_jax.codec import CodecOptions  # pylint: disable=g-import-not-at-top
    from paas_jax.transport import TransferError  # pylint: disable=g-import-not-at-top
    try:
      check_request_identity(request, self.config, "prefill server")
      if not request.decode_target:
        raise InvalidRequestError("decode_target is required")
      prompt = tuple(int(t) for t in request.prompt_ids)
      params = RequestParams(
          sampling=make_sampling(request.sampling.temperature, request.sampling.top_k,
                                 request.sampling.top_p),
          seed=int(request.seed), max_new_tokens=1)
      validate_request(self.config, prompt, params, self.engine.max_ctx)
      codec = CodecOptions.from_json(request.codec_json) if request.codec_json else self.codec
    except (InvalidRequestError, ValueError) as e:
      context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    events: queue.Queue = queue.Queue()
    holder: dict = {}
    submitted = time.perf_counter()
    rid = request.request_id
    cfg = self.config

    def on_start():
      if self.faults is not None:
        holder["transfer_no"] = self.faults.transfer_started()
      sender = self._sender(request.decode_target)
      if self.stream_chunks:
        holder["tx"] = ChunkStreamer(sender, cfg, rid, len(prompt),
                                     chunk=self.engine.config.prefill_chunk,
                                     commit_every=self.commit_every, codec=codec,
                                     on_commit=on_commit)
      else:
        holder["tx"] = sender.begin(model_id=cfg.name, config_fingerprint=cfg.fingerprint(),
                                    num_layers=cfg.n_layers, lengths=[len(prompt)],
                                    codec=codec, transfer_id=rid)
      holder["queue_s"] = time.perf_counter() - submitted

    def layer_fault():
      if self.faults is not None:
        holder["layers_sent"] = holder.get("layers_sent", 0) + 1
        self.faults.on_layer(holder["transfer_no"], holder["layers_sent"])

    def on_layer(i, cache):
      holder["tx"].send_layer(i, cache)
      layer_fault()

    def on_chunk(i, cache, start, end, row):
      holder["tx"].put(i, cache, start, end, row)
      layer_fault()

    def on_commit(tokens):
      holder["commits"] = holder.get("commits", 0) + 1
      events.put(("commit", tokens, holder["commits"]))
      if self.faults is not None and tokens < len(prompt):
        holder["partial_commits"] = holder.get("partial_commits", 0) + 1
        self.faults.on_commit(holder["transfer_no"], holder["partial_commits"])

    def on_done(out):
      events.put(("first", out))
      self._finishers.submit(finish)

    def finish():
      tx = holder.get("tx")
      try:
        try:
          if self.stream_chunks:
            result = _stream_outcome(tx.close(), request.decode_target)
          else:
            result = tx.finish()
        finally:
          # Prefix-cache entries made only for this transfer go once it is over.
          self._release_prefix(rid)
      except TransferError as e:
        self.counters["transfers_failed"] += 1
        if self.metrics is not None:
          tl = tx.timeline()
          self.metrics.observe_transfer(self.link_label, bytes_sent=tl.bytes_sent,
                                        state_bytes=0, seconds=0.0, ok=False,
                                        retried_chunks=tl.resent_chunks)
        events.put(("error", e.code, f"state transfer to {request.decode_target} failed: "
                                     f"{e.message}"))
        return
      except Exception as e:  # pylint: disable=broad-except
        self.counters["transfers_failed"] += 1
        events.put(("error", grpc.StatusCode.INTERNAL, f"state transfer failed: {e!r}"))
        return
      self.counters["transfers_ok"] += 1
      self.counters["bytes_sent"] += result.timeline.bytes_sent
      self.counters["resent_chunks"] += result.timeline.resent_chunks
      if self.metrics is not None:
        tl = result.timeline
        self.metrics.observe_transfer(self.link_label, bytes_sent=tl.bytes_sent,
                                      state_bytes=tl.state_bytes, seconds=tl.duration_s or 0.0,
                                      retried_chunks=tl.resent_chunks)
      events.put(("done", result))

    def on_error(e):
      tx = holder.get("tx")
      if isinstance(tx, ChunkStreamer):
        tx.abort()
      elif tx is not None:
        tx.abort(f"prefill failed: {e!r}")
      if isinstance(e, TransferError):
        self.counters["transfers_failed"] += 1
        if self.metrics is not None:
          tl = tx.timeline() if tx is not None else None
          self.metrics.observe_transfer(
              self.link_label, bytes_sent=tl.bytes_sent if tl else 0, state_bytes=0,
              seconds=0.0, ok=False, retried_chunks=tl.resent_chunks if tl else 0)
      self._release_prefix(rid)
      if isinstance(e, TransferError):
        events.put(("error", e.code, f"could not open a transfer to "
                                     f"{request.decode_target}: {e.message}"))
      elif isinstance(e, InvalidRequestError):
        events.put(("error", grpc.StatusCode.INVALID_ARGUMENT, str(e)))
      elif isinstance(e, PreemptedError):
        events.put(("error", grpc.StatusCode.UNAVAILABLE, str(e)))
      else:
        events.put(("error", grpc.StatusCode.INTERNAL, f"prefill failed: {e!r}"))

    owner = (rid if self.engine.prefix_cache is not None and not self.stream_chunks
             else None)
    job = PrefillJob(input=PrefillInput(rid, prompt, params, cache_owner=owner),
                     on_done=on_done, on_error=on_error, on_start=on_start,
                     on_layer=None if self.stream_chunks else on_layer,
                     on_chunk=on_chunk if self.stream_chunks else None)

    def on_rpc_done():
      if "finished" not in holder:
        job.cancelled = True
        tx = holder.get("tx")
        if isinstance(tx, ChunkStreamer):
          tx.abort()
        elif tx is not None:
          tx.abort("the broker cancelled the request")
        self.counters["cancelled"] += 1
    context.add_callback(on_rpc_done)

    def hand_over() -> int:
      """Preempted: end this request's stream at its commit point (the broker
      resumes from it); returns the commit point."""
      job.cancelled = True
      tx = holder.get("tx")
      point = tx.commit_point if isinstance(tx, ChunkStreamer) else 0
      if isinstance(tx, ChunkStreamer):
        tx.abort()
      elif tx is not None:
        tx.abort("prefill node preempted")
      self.counters["preempted_handed_over"] += 1
      events.put(("error", grpc.StatusCode.UNAVAILABLE,
                  f"prefill node preempted; the decode side holds commit point {point} of "
                  f"{len(prompt)} tokens"))
      return point
    try:
      self.preemption.track(rid, hand_over)
    except PreemptedError as e:
      holder["finished"] = True
      context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
    try:
      yield from self._events(rid, events, holder, job, context, request)
    finally:
      self.preemption.done(rid)

  def _events(self, rid, events, holder, job, context, request):
    """Queues the job, then streams its events (``Prefill``)."""
    self.counters["requests"] += 1
    if self.batcher.queue_depth >= self.max_queue:
      self.counters["rejected_queue_full"] += 1
      if self.metrics is not None:
        self.metrics.queue_rejections.labels("prefill_wait").inc()
      holder["finished"] = True
      context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"prefill queue full ({self.max_queue} prompts waiting)")
    try:
      self.batcher.submit(job)
    except EngineError as e:
      context.abort(grpc.StatusCode.UNAVAILABLE, str(e))

    while True:
      try:
        kind, *rest = events.get(timeout=0.5)
      except queue.Empty:
        if not context.is_active():
          return
        continue
      if kind == "error":
        holder["finished"] = True
        context.abort(rest[0], rest[1])
      if kind == "commit":
        yield serving_pb2.PrefillEvent(commit=serving_pb2.CommitPoint(tokens=rest[0],
                                                                      segments=rest[1]))
      elif kind == "first":
        out = rest[0]
        probe = self._probe(out, context) if self.logit_probe else None
        if self.faults is not None:
          self.faults.before_first_token()
        yield serving_pb2.PrefillEvent(first_token=serving_pb2.FirstToken(
            token_id=out.first_token, queue_s=holder.get("queue_s", 0.0),
            prefill_s=out.prefill_s, batch_size=out.batch_size,
            cached_tokens=out.cached_tokens, probe=probe))
      elif kind == "done":
        t = rest[0].timeline
        holder["finished"] = True
        log.info("state transfer committed", extra={
            "transfer_id": rid, "decode_target": request.decode_target,
            "state_bytes": t.state_bytes, "bytes_sent": t.bytes_sent,
            "resent_chunks": t.resent_chunks, "transfer_s": round(t.duration_s or 0.0, 4)})
        yield serving_pb2.PrefillEvent(done=serving_pb2.TransferDone(
            state_bytes=t.state_bytes, bytes_sent=t.bytes_sent,
            transfer_s=t.duration_s or 0.0, receiver_ready_s=t.receiver_ready_s or 0.0,
            num_streams=t.num_streams))
        return

  def _probe(self, out, context):
    """The probe of ``out``'s state (one decode step, in this RPC's thread: it
    overlaps the state transfer, not the next prefill batch)."""
    t0 = time.perf_counter()
    try:
      probe = handoff_probe.make(self.model, out)
    except Exception as e:  # pylint: disable=broad-except
      log.exception("logit probe of %s failed", out.request_id)
      context.abort(grpc.StatusCode.INTERNAL, f"computing the logit probe failed: {e!r}")
    self.probe_s_total += time.perf_counter() - t0
    self.counters["probes"] += 1
    return probe

  def _release_prefix(self, rid: str) -> None:
    if self.engine.prefix_cache is not None:
      self.engine.release_prefix(rid)  # bytes: gauge prefix_released_bytes

  def ExportPrefix(self, request, context):
    return self.prefix_exporter.serve(request, context)

  def GetStats(self, request, context):
    s = dict(self.counters)
    s.update(queue=self.batcher.queue_depth, batches=self.batcher.batches,
             prompts=self.batcher.prompts, prompt_tokens=self.batcher.tokens,
             busy_s=self.batcher.busy_s, uptime_s=time.time() - self.started,
             probe_enabled=int(self.logit_probe),
             probe_mean_ms=1e3 * self.probe_s_total / max(self.counters["probes"], 1))
    s.update(common.probe_gauges(self.engine, request, context))
    s.update(self.prefix_importer.gauges())
    s.update(self.prefix_exporter.gauges())
    # What this server's senders (states, and region A's prefix exports) have
    # outstanding on the link now: the broker's live view measures the link's
    # backlog and utilization from these instead of estimating them.
    s.update(self.link_counters.gauges())
    return serving_pb2.StatsResponse(
        server="prefill", gauges={k: float(v) for k, v in s.items()},
        json=json.dumps({"model": self.config.name, "fingerprint": self.config.fingerprint(),
                         "codec": self.codec.to_dict(), "link": self.link_counters.report()}))


@dataclasses.dataclass(frozen=True)
class _StreamOutcome:
  """A whole chunk-streamed prompt as one transfer (what TransferDone reports)."""

  timeline: StreamResult


def _stream_outcome(result: StreamResult, target: str) -> _StreamOutcome:
  """Raises ``TransferError`` (the first failed segment's code) unless every
  segment committed, i.e. the decode side holds the whole prompt."""
  from paas_jax.transport import TransferError  # pylint: disable=g-import-not-at-top
  if result.ok:
    return _StreamOutcome(result)
  failed = [r for r in result.segments if not r.ok]
  code = grpc.StatusCode[failed[0].code] if failed and failed[0].code else (
      grpc.StatusCode.UNAVAILABLE)
  why = failed[0].error if failed else "the stream ended before the last segment"
  raise TransferError(code, f"segment stream to {target} stopped at commit point "
                      f"{result.commit_point} of {result.prompt_len} tokens: {why}")


class PrefillServer:
  """A running prefill server: the control port and, if started with one, the
  transfer port (``transfer``, a ``ReceiverServer``) that imports PD nodes'
  prefixes."""

  def __init__(self, servicer: PrefillServicer, control: common.RunningServer,
               transfer=None):
    self.servicer = servicer
    self.control = control
    self.transfer = transfer

  @property
  def address(self) -> str:
    return self.control.address

  def stop(self) -> None:
    self.control.stop(0.5)
    if self.transfer is not None:
      self.transfer.stop(0.5)
    self.servicer.stop()

  def preempt_and_stop(self, grace_s: float) -> None:
    """A preemption notice: NOT_SERVING, hand in-flight requests to resume
    within ``grace_s`` (``resume_preempt``), then stop."""
    self.control.set_serving([SERVICE], False)
    if grace_s > 0:
      report = self.servicer.preemption.run(grace_s, self.servicer.batcher.drain)
      log.warning("preemption: %s", report)
    self.stop()


def start(model, engine_config: EngineConfig, *, host: str = "127.0.0.1", port: int = 0,
          batch_window_s: float = 0.005, codec=None, sender_options=None,
          credentials: grpc.ServerCredentials | None = None, interceptors=(),
          channel_credentials: grpc.ChannelCredentials | None = None,
          security=None, metrics=None, faults=None, max_queue: int = 64,
          warmup: bool = True, transfer_port: int | None = None,
          stream_chunks: bool = True, commit_every: int = 2,
          logit_probe: bool = True) -> PrefillServer:
  """Starts the Prefill service.

  ``security`` (a ``paas_jax.security.ServiceSecurity`` of role prefill)
  gives the port mutual TLS and the prefill peer rule (only brokers call it),
  and the state transfers to region B this server's client certificate; it
  overrides ``credentials`` / ``channel_credentials`` and the credentials of
  ``sender_options``. ``metrics`` records RPCs, the queue and every transfer;
  ``faults`` (``FaultPlan``) injects faults for tests and the demo.
  ``transfer_port`` (None: none) opens a StateTransfer port that only takes
  cross-cluster prefix transfers ("prefix:" ids) into the prefix cache; with
  ``security``, only decode servers may push there (``service_rules``).
  ``stream_chunks`` / ``commit_every``: see ``PrefillServicer``.
  """
  from paas_jax.security.hooks import server_interceptors  # pylint: disable=g-import-not-at-top
  if security is not None:
    credentials = security.server_credentials()
    channel_credentials = security.channel_credentials()
    if sender_options is not None:
      fields = {"credentials": channel_credentials}
      if sender_options.plane == "tcp" and sender_options.data_ssl is None:
        # One replace: TLS credentials without data_ssl is refused on its own.
        from paas_jax.transport.dataplane import tls as dp_tls  # pylint: disable=g-import-not-at-top
        fields.update(dp_tls.sender_fields(security, sender_options.lanes))
      sender_options = dataclasses.replace(sender_options, **fields)
  servicer = PrefillServicer(model, engine_config, batch_window_s=batch_window_s, codec=codec,
                             sender_options=sender_options,
                             channel_credentials=channel_credentials, max_queue=max_queue,
                             metrics=metrics, faults=faults, stream_chunks=stream_chunks,
                             commit_every=commit_every, logit_probe=logit_probe)
  control = common.start_server(
      f"{host}:{port}", lambda s: serving_pb2_grpc.add_PrefillServicer_to_server(servicer, s),
      credentials=credentials, services=[SERVICE], max_workers=128,
      interceptors=server_interceptors(security, metrics) + list(interceptors))
  transfer = None
  if transfer_port is not None:
    from paas_jax.transport import StateReceiver, serve_receiver  # pylint: disable=g-import-not-at-top
    cfg = servicer.config
    importer = servicer.prefix_importer
    receiver = StateReceiver(models={cfg.name: cfg.fingerprint()}, template=importer.template,
                             on_ready=importer.on_ready, on_failure=importer.on_failure)
    transfer = serve_receiver(receiver, f"{host}:{transfer_port}", credentials=credentials,
                              interceptors=server_interceptors(security, metrics)
                              + list(interceptors))
  if warmup:
    log.info("prefill server warm: %s", servicer.warmup())
  control.set_serving([SERVICE])
  return PrefillServer(servicer, control, transfer)


FLAGS = flags.FLAGS


def main(argv):
  del argv
  from paas_jax.codec import CodecOptions  # pylint: disable=g-import-not-at-top
  from paas_jax.transport import SenderOptions  # pylint: disable=g-import-not-at-top
  t0 = time.time()
  from paas_jax.security.faults import FaultPlan  # pylint: disable=g-import-not-at-top
  model, security, metrics, metrics_port = cli.setup_process("prefill")
  faults = FaultPlan.parse(FLAGS.faults)
  if faults.active:
    log.warning("FAULT INJECTION enabled: %s", faults)
  engine_config = EngineConfig(
      n_slots=1, max_ctx=FLAGS.max_ctx,
      prefill_buckets=tuple(int(b) for b in FLAGS.prefill_buckets),
      prefill_max_batch=FLAGS.prefill_max_batch, prefix_block=FLAGS.prefix_block,
      prefix_cache_bytes=FLAGS.prefix_cache_mb << 20)
  server = start(model, engine_config, host=FLAGS.host, port=FLAGS.port,
                 batch_window_s=FLAGS.batch_window_ms / 1e3,
                 codec=CodecOptions(compression=FLAGS.codec_compression),
                 sender_options=SenderOptions(num_streams=FLAGS.transfer_streams,
                                              plane=FLAGS.transfer_plane,
                                              lanes=FLAGS.transfer_lanes),
                 security=security, metrics=metrics,
                 faults=faults if faults.active else None, max_queue=FLAGS.max_queue,
                 transfer_port=FLAGS.transfer_port, stream_chunks=FLAGS.stream_chunks,
                 commit_every=FLAGS.commit_every, logit_probe=FLAGS.logit_probe)
  common.write_ready_file(FLAGS.ready_file, {
      "pid": os.getpid(), "port": server.control.port, "model": model.config.name,
      "transfer_port": server.transfer.port,
      "metrics_port": metrics_port,
      "startup_s": time.time() - t0})
  log.info("prefill server on %s, model %s", server.address, model.config.name)
  common.wait_for_termination(lambda: server.preempt_and_stop(FLAGS.preempt_grace_s))


if __name__ == "__main__":
  cli.define_server_flags("prefill")
  flags.DEFINE_integer("max_queue", 64, "Prompts allowed to wait for a prefill batch.")
  flags.DEFINE_enum("codec_compression", "raw", ["raw", "zstd", "blosc"],
                    "State codec compression on the link.")
  flags.DEFINE_integer("transfer_streams", 2, "Parallel Push streams per transfer.")
  flags.DEFINE_enum("transfer_plane", "tcp", ["tcp", "grpc"], "What carries state bytes to "
                    "decode servers: tcp (the data plane, when the receiver announces one) or "
                    "grpc (Push streams). Begin/Commit/Abort stay on gRPC either way.")
  flags.DEFINE_integer("transfer_lanes", 2, "Data-plane connections per transfer "
                       "(transfer_plane=tcp).")
  flags.DEFINE_integer("transfer_port", 0, "StateTransfer port for prefixes shipped from PD "
                       "nodes (cross-cluster prefix cache; 0: pick a free one).")
  flags.DEFINE_bool("stream_chunks", True, "Stream every prefill chunk as a segment as soon "
                    "as it is computed (commit points, resume); false: one transfer per "
                    "prompt, layers of the last chunk pipelined.")
  flags.DEFINE_integer("commit_every", 2, "Chunks per commit point (stream_chunks).")
  flags.DEFINE_float("preempt_grace_s", 5.0, "On SIGTERM (a preemption notice): stop taking "
                     "work and let running prefills commit for up to this long, then hand "
                     "the rest to the broker's resume path (0: stop at once).")
  app.run(main)
