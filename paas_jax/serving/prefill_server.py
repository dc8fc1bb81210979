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
import runpy
import threading
import time
from concurrent import futures

import grpc

from paas_jax.codec import CodecOptions
from paas_jax.observability.health import FAST_RECONNECT
from paas_jax.proto import serving_pb2, serving_pb2_grpc
from paas_jax.security.hooks import server_interceptors
from paas_jax.serving import common, control_plane, handoff_probe
from paas_jax.serving.engine_config import EngineConfig
from paas_jax.serving.prefill_batcher import PrefillBatcher
from paas_jax.serving.prefill_engine import PrefillEngine
from paas_jax.serving.prefill_rpc import serve_prefill
from paas_jax.serving.prefix_transfer import PrefixExporter, PrefixImporter
from paas_jax.serving.resume_preempt import Preemption
from paas_jax.transport import (LinkCounters, SenderOptions, StateReceiver, StateSender,
                                serve_receiver)
from paas_jax.transport.channels import make_channels
from paas_jax.transport.dataplane import tls as dp_tls

log = logging.getLogger("paas_jax.serving.prefill")

SERVICE = "paas_jax.serving.v1.Prefill"


class PrefillServicer(serving_pb2_grpc.PrefillServicer):

  def __init__(self, model, engine_config: EngineConfig, *, batch_window_s: float = 0.005,
               sender_options=None, codec=None,
               channel_credentials: grpc.ChannelCredentials | None = None,
               max_queue: int = 64, metrics=None, faults=None, engine=None, batcher=None,
               link_label: str = "A->B", prefix_exporter=None, prefix_importer=None,
               stream_chunks: bool = True, commit_every: int = 2,
               logit_probe: bool = True, tenants=None):
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
    step). ``tenants`` (a ``TenantPolicy``; None: one FIFO): how the decode
    regions this pool serves share it."""
    self.model = model
    self.config = model.config
    if (engine is None) != (batcher is None):
      raise ValueError("give both engine and batcher, or neither")
    self.engine = engine if engine is not None else PrefillEngine(model, engine_config)
    self.batcher = (batcher if batcher is not None
                    else PrefillBatcher(self.engine, batch_window_s, name="prfaas",
                                        tenants=tenants))
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
    self.finishers = futures.ThreadPoolExecutor(max_workers=32,
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

  def sender_for(self, target: str):
    """The ``StateSender`` to ``target`` (one per decode server, reused)."""
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
    self.finishers.shutdown(wait=False, cancel_futures=True)
    self.prefix_exporter.close()
    with self._senders_lock:
      for s in self._senders.values():
        s.close()
      for c in self._channels:
        c.close()

  def warmup(self) -> dict:
    out = {"prefill_s": self.engine.warmup()}
    if self.logit_probe:
      out["probe_s"] = handoff_probe.warm(self.model, self.engine.max_ctx)
    return out

  # -- RPCs -----------------------------------------------------------------------

  def Prefill(self, request, context):
    yield from serve_prefill(self, request, context)

  def release_prefix(self, rid: str) -> None:
    if self.engine.prefix_cache is not None:
      self.engine.release_prefix(rid)  # bytes: gauge prefix_released_bytes

  def ExportPrefix(self, request, context):
    return self.prefix_exporter.serve(request, context)

  def GetLoad(self, request, context):
    # What this server's senders (states, and region A's prefix exports) have
    # on the link: the broker's live view measures the link from it.
    return control_plane.load_report(
        control_plane.PREFILL, engine=self.engine, link_counters=self.link_counters,
        prefill_queue_depth=self.batcher.queue_depth, prefill_queue_limit=self.max_queue)

  def ProbePrefix(self, request, context):
    return control_plane.probe_prefix(self.engine, request, context)

  def GetStats(self, request, context):
    s = dict(self.counters)
    s.update(queue=self.batcher.queue_depth, batches=self.batcher.batches,
             prompts=self.batcher.prompts, prompt_tokens=self.batcher.tokens,
             busy_s=self.batcher.busy_s, uptime_s=time.time() - self.started,
             probe_enabled=int(self.logit_probe),
             probe_mean_ms=1e3 * self.probe_s_total / max(self.counters["probes"], 1))
    s.update(common.prefix_cache_gauges(self.engine))
    # Per tenant (decode region): prompts waiting and prompt tokens prefilled.
    s.update({f"tenant_queue:{t}": n for t, n in self.batcher.tenant_depths().items()})
    s.update({f"tenant_prefill_tokens:{t}": n
              for t, n in self.batcher.tenant_served_tokens().items()})
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
          logit_probe: bool = True, tenants=None) -> PrefillServer:
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
  ``stream_chunks`` / ``commit_every`` / ``tenants``: see ``PrefillServicer``.
  """
  if security is not None:
    credentials = security.server_credentials()
    channel_credentials = security.channel_credentials()
    if sender_options is not None:
      sender_options = dp_tls.secured_sender(sender_options, security)
  servicer = PrefillServicer(model, engine_config, batch_window_s=batch_window_s, codec=codec,
                             sender_options=sender_options,
                             channel_credentials=channel_credentials, max_queue=max_queue,
                             metrics=metrics, faults=faults, stream_chunks=stream_chunks,
                             commit_every=commit_every, logit_probe=logit_probe,
                             tenants=tenants)
  control = common.start_server(
      f"{host}:{port}", lambda s: serving_pb2_grpc.add_PrefillServicer_to_server(servicer, s),
      credentials=credentials, services=[SERVICE], max_workers=128,
      interceptors=server_interceptors(security, metrics) + list(interceptors))
  transfer = None
  if transfer_port is not None:
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


if __name__ == "__main__":
  # ``python -m paas_jax.serving.prefill_server`` runs the launcher program (flags,
  # wiring: prefill_server_main.py, which imports this module; run, not imported, so
  # there is no import cycle and importing the server defines no flags).
  runpy.run_module("paas_jax.serving.prefill_server_main", run_name="__main__", alter_sys=True)
