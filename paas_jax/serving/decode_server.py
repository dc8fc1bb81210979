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
import runpy
import time

import grpc

from paas_jax.proto import serving_pb2, serving_pb2_grpc
from paas_jax.security.hooks import server_interceptors
from paas_jax.serving import common, control_plane, handoff_probe, logprobs
from paas_jax.serving.decode_engine import DecodeEngine
from paas_jax.serving.decode_scheduler import (DecodeJob, DecodeScheduler, EventKind,
                                               QueueFullError)
from paas_jax.serving.engine_config import EngineConfig
from paas_jax.serving.ports import free_port
from paas_jax.serving.prefill_batcher import PrefillBatcher, PrefillJob
from paas_jax.serving.prefill_engine import PrefillEngine, PrefillInput
from paas_jax.serving.prefill_server import PrefillServicer
from paas_jax.serving.prefix_transfer import PrefixExporter, PrefixImporter
from paas_jax.serving.state_intake import StateIntake
from paas_jax.serving.validation import (EngineError, InvalidRequestError, RequestParams,
                                         check_request_identity, make_sampling,
                                         requested_logprobs, validate_request)
from paas_jax.transport import StateReceiver, serve_receiver
from paas_jax.transport.dataplane import tls as dp_tls

log = logging.getLogger("paas_jax.serving.decode")

SERVICE = "paas_jax.serving.v1.Decode"
# Also served on the control port: Prefill, for acting as PD-P of another PD node.
PREFILL_SERVICE = "paas_jax.serving.v1.Prefill"


def request_params(msg) -> RequestParams:
  """``RequestParams`` from a Decode request (sampling, seed, limits, stops, logprobs)."""
  sampling = make_sampling(msg.sampling.temperature, msg.sampling.top_k, msg.sampling.top_p)
  return RequestParams(sampling=sampling, seed=int(msg.seed),
                       max_new_tokens=int(msg.max_new_tokens),
                       stop_tokens=tuple(int(t) for t in msg.stop_tokens),
                       logprobs=requested_logprobs(msg.logprobs, msg.top_logprobs))


def request_prompt(msg) -> tuple[int, ...]:
  """The prompt a Decode request stands for: its ``prompt_ids``, or for a remote
  request without them ``prompt_len`` placeholders (what validation needs).
  Raises InvalidRequestError for a remote request whose two disagree."""
  if not msg.remote_prefill:
    return tuple(int(t) for t in msg.prompt_ids)
  prompt_len = int(msg.prompt_len) or len(msg.prompt_ids)
  if msg.prompt_ids and len(msg.prompt_ids) != prompt_len:
    raise InvalidRequestError(f"prompt_len {prompt_len} != {len(msg.prompt_ids)} prompt_ids")
  return tuple(int(t) for t in msg.prompt_ids) or (0,) * prompt_len


def stream_events(job: DecodeJob, context):
  """The ``Decode`` stream's events after ``accepted``: ``job``'s slot, its
  tokens (whatever is queued coalesced into one message) and its finish, in
  the order the scheduler queued them; an error event aborts the RPC."""
  events = common.StreamEvents(job.events, context)
  while (ev := events.next()) is not None:
    out = serving_pb2.DecodeEvent()
    if ev.kind == EventKind.ERROR:
      context.abort(ev.code or grpc.StatusCode.INTERNAL, ev.reason)
    if ev.kind == EventKind.SLOT:
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
    tokens = list(ev.tokens) if ev.kind == EventKind.TOKENS else []
    lps = list(ev.logprobs) if ev.kind == EventKind.TOKENS else []
    finished = ev if ev.kind == EventKind.FINISHED else None
    # Coalesce whatever else is already queued into the same message.
    while finished is None and (nxt := events.next_queued()) is not None:
      if nxt.kind == EventKind.TOKENS:
        tokens.extend(nxt.tokens)
        lps.extend(nxt.logprobs)
      elif nxt.kind == EventKind.FINISHED:
        finished = nxt
      else:  # a slot or an error: the next message
        events.unget(nxt)
        break
    out.token_ids.extend(tokens)
    out.logprobs.extend(logprobs.to_proto(lp, serving_pb2.TokenLogprob) for lp in lps)
    if finished is not None:
      out.finished = True
      out.finish_reason = finished.reason
      log.info("request finished", extra={"downstream_id": job.request_id,
                                          "remote_prefill": job.remote,
                                          "reason": finished.reason})
    yield out
    if finished is not None:
      return


class DecodeServicer(serving_pb2_grpc.DecodeServicer):
  """Registers requests with the scheduler and streams their events."""

  def __init__(self, model, engine_config: EngineConfig, *, max_queue: int = 64,
               batch_window_s: float = 0.005, name: str = "decode", metrics=None,
               channel_credentials: grpc.ChannelCredentials | None = None,
               logit_probe: bool = True, corrupt_state=None, first_token_early: bool = True):
    """``logit_probe``: check every handed-off state against the prefill
    side's probe before decoding it (``handoff_probe``); ``corrupt_state``: a
    fault hook ``f(request_id, state) -> state`` run on received states before
    that check (demo and tests only); ``first_token_early``: stream a remote
    request's first token at its Handoff, before its state lands (the probe
    still gates token 2 onwards; ``decode_scheduler``)."""
    self.model = model
    self.config = model.config
    self.name = name
    self.first_token_early = first_token_early
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
    self.prefix_importer = PrefixImporter(cfg, self.prefill_engine, metrics=metrics,
                                          link="A->B")
    self.prefix_exporter = PrefixExporter(cfg, self.prefill_engine,
                                          credentials=channel_credentials, metrics=metrics,
                                          link="B->A")
    # PD-P for other PD nodes: the broker may call Prefill here with another PD
    # node's StateTransfer address. It shares this node's PrefillEngine,
    # batcher and prefix cache, so moving the node between PD-P and PD-D roles
    # needs no second copy of the weights or a restart.
    self.pd_prefill = PrefillServicer(model, engine_config, max_queue=max_queue,
                                      channel_credentials=channel_credentials,
                                      metrics=metrics, engine=self.prefill_engine,
                                      batcher=self.batcher, link_label="B->B",
                                      prefix_exporter=self.prefix_exporter,
                                      prefix_importer=self.prefix_importer,
                                      logit_probe=logit_probe)

    # What arrives on the transfer port (prefixes, chunk-streamed segments,
    # whole states) and where it goes: state_intake.py.
    self.intake = StateIntake(cfg, max_ctx=self.engine.max_ctx, verifier=self.verifier,
                              fail=self.scheduler.fail, prefix_importer=self.prefix_importer,
                              metrics=metrics)
    self.resumes = 0
    self.resumed_tokens = 0
    self.receiver = StateReceiver(
        models={cfg.name: cfg.fingerprint()}, template=self.intake.template,
        on_ready=self.intake.on_state, on_failure=self.intake.on_transfer_failure)
    self.started = time.time()
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
      resume = self.intake.take_resume(resume_from, job.prompt)
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

  def stop(self) -> None:
    self.pd_prefill.stop()  # also stops the shared batcher
    self.batcher.stop()
    self.scheduler.stop()
    self.receiver.close()
    self.prefix_exporter.close()
    self.verifier.close()

  def warmup(self) -> dict:
    out = {"decode_s": self.engine.warmup(), "prefill_s": self.prefill_engine.warmup()}
    if self.verifier.enabled:
      out["probe_s"] = handoff_probe.warm(self.model, self.engine.max_ctx)
    return out

  # -- RPCs -----------------------------------------------------------------------

  def Decode(self, request, context):
    try:
      check_request_identity(request, self.config, "decode server")
      params = request_params(request)
      prompt = request_prompt(request)
      if request.remote_prefill:
        validate_request(self.config, prompt, params, self.engine.max_ctx)
        job = DecodeJob(request.request_id, params, len(prompt), remote=True)
        self.intake.expect(request.request_id, len(prompt))
      else:
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
    # A remote request that brought its prompt: the prefix this node's cache
    # holds is set aside for it and not sent by the prefill side (state_intake).
    held = (self.intake.hold(request.request_id, prompt)
            if request.remote_prefill and request.prompt_ids else 0)

    def on_rpc_done():
      if not job.done:
        self.scheduler.cancel(job.request_id)
        if job.remote:  # parts a prefill pod sent for it (pod_intake)
          self.intake.pods.drop(job.request_id)
        pjob = job.info.get("_prefill_job")
        if pjob is not None:
          pjob.cancelled = True
    context.add_callback(on_rpc_done)
    yield serving_pb2.DecodeEvent(accepted=True, queue_position=position, held_tokens=held)
    yield from stream_events(job, context)

  def Handoff(self, request, context):
    try:
      probe = handoff_probe.handoff_probe_of(request, self.config.vocab_size)
    except ValueError as e:
      context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    try:
      first_lp = logprobs.handoff_logprob(request, self.config.vocab_size,
                                          self.scheduler.wanted_logprobs(request.request_id))
    except logprobs.LogprobsError as e:
      context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"first_logprob: {e}")
    if not self.scheduler.provide_first_token(request.request_id, request.first_token,
                                              first_lp, early=self.first_token_early):
      context.abort(grpc.StatusCode.NOT_FOUND,
                    f"request {request.request_id!r} is gone (cancelled or finished)")
    self.verifier.handoff_arrived(request.request_id, probe)
    return serving_pb2.HandoffResponse()

  def ExportPrefix(self, request, context):
    return self.prefix_exporter.serve(request, context)

  def GetLoad(self, request, context):
    # Region B's own WAN sends are its prefix exports (B->A); the PD-P role's
    # state sends (B->B, region B's network) are not in its link.
    return control_plane.load_report(
        control_plane.DECODE, engine=self.prefill_engine,
        link_counters=self.prefix_exporter.link_counters,
        prefill_queue_depth=self.batcher.queue_depth,
        prefill_queue_limit=self.pd_prefill.max_queue, decode_stats=self.scheduler.stats())

  def ProbePrefix(self, request, context):
    return control_plane.probe_prefix(self.prefill_engine, request, context)

  def GetModel(self, request, context):
    return control_plane.served_model(self.config, max_model_len=self.engine.max_ctx)

  def GetStats(self, request, context):
    s = self.scheduler.stats()
    s.update(pdp_queue=self.batcher.queue_depth, pdp_batches=self.batcher.batches,
             pdp_prompts=self.batcher.prompts, pdp_tokens=self.batcher.tokens,
             pdp_busy_s=self.batcher.busy_s, transfers_in=self.intake.transfers_in,
             transfer_bytes_in=self.intake.transfer_bytes_in,
             sharded_arrays_in=self.intake.sharded_arrays_in,
             receiver_bytes_in_use=self.receiver.bytes_in_use,
             receiver_active_transfers=len(self.receiver.active_transfers()),
             segments_in=self.intake.segments_in, segment_requests=self.intake.segment_requests(),
             held_requests=self.intake.held_requests, held_tokens=self.intake.held_tokens,
             hold_busy=self.intake.hold_busy,
             resumes=self.resumes, resumed_tokens=self.resumed_tokens,
             pod_states_in=self.intake.pods.states_in, pod_parts_in=self.intake.pods.parts_in,
             pod_parts_pending=self.intake.pods.pending(),
             pod_states_refused=self.intake.pods.refused,
             uptime_s=time.time() - self.started)
    s.update(common.prefix_cache_gauges(self.prefill_engine))
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
          data_plane_host: str | None = None, first_token_early: bool = True) -> DecodeServer:
  """Starts the control and transfer ports.

  ``security`` (a ``paas_jax.security.ServiceSecurity`` of role decode) gives
  both ports mutual TLS and the decode peer rules (only brokers register
  requests, only prefill servers push states) and overrides ``credentials``;
  ``metrics`` (``paas_jax.observability.ServingMetrics``) records RPCs, queues
  and transfers. Explicit ``interceptors`` run after those. ``logit_probe``,
  ``corrupt_state`` and ``first_token_early``: see ``DecodeServicer``.
  ``data_plane``: the transfer port also opens the TCP data plane
  (``paas_jax.transport.dataplane``; TLS and peer rules from ``security``), bound
  on ``data_plane_host`` (default: ``host``).
  """
  channel_credentials = None
  if security is not None:
    credentials = security.server_credentials()
    channel_credentials = security.channel_credentials()
  servicer = DecodeServicer(model, engine_config, max_queue=max_queue,
                            batch_window_s=batch_window_s, metrics=metrics,
                            channel_credentials=channel_credentials,
                            logit_probe=logit_probe, corrupt_state=corrupt_state,
                            first_token_early=first_token_early)
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
  plane = (dp_tls.receiver_kwargs(security, "decode", credentials, data_plane_host)
           if data_plane else {})
  if data_plane and data_plane_host and data_plane_host != host:
    # A relay will listen on ``host`` at the port this data plane binds on
    # data_plane_host: a port the kernel picks could meanwhile be an outgoing
    # connection's local port on ``host``.
    plane["data_port"] = free_port(host)
  transfer = serve_receiver(servicer.receiver, f"{host}:{transfer_port}",
                            credentials=credentials, interceptors=stack, **plane)
  if warmup:
    t = servicer.warmup()
    log.info("decode server warm: %s", t)
  control.set_serving([SERVICE, PREFILL_SERVICE])
  return DecodeServer(servicer, control, transfer)


if __name__ == "__main__":
  # ``python -m paas_jax.serving.decode_server`` runs the launcher program (flags,
  # wiring: decode_server_main.py, which imports this module; run, not imported, so
  # there is no import cycle and importing the server defines no flags).
  runpy.run_module("paas_jax.serving.decode_server_main", run_name="__main__", alter_sys=True)
