"""Region A's prefill server as a pod of P processes (one JAX program).

  python -m paas_jax.serving.pod_prefill_server --pod_processes=2 --config=tiny_gdn_gqa \\
      --port=50051 --insecure

Without ``--pod_process_id`` this is the pod's supervisor on one machine
(``pod_supervisor``): it starts the P processes (this module with
``--pod_process_id=p`` and a fresh coordinator), restarts all of them together
when one dies, and keeps the control and transfer ports. On several machines,
start each process yourself with ``--pod_process_id=p
--pod_coordinator=<process 0's host>:<port> --pod_processes=P`` (and a
process manager that restarts the whole pod).

Process 0 serves the ``Prefill`` service of ``serving.proto`` (plus GetLoad,
GetStats, ProbePrefix and the health service) and a StateTransfer port that
refuses prefix imports (the pod has no prefix cache). Every process loads the
model, places its shards (``pod.shard_model``) and runs each request in
lockstep (``pod_prefill``): sharded prefill, the first token sampled and its
logprob and logit probe as the single-process server computes them, then
each process streams its own shards to the decode server the broker chose.
Requests run one at a time (no batching); several decode regions share the
pod as they share a single-process region A (``--tenant_sharing=wfq|fifo``,
``--tenant_weights``, ``--tenant_quota(s)``; egress accounted per tenant).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import queue
import sys
import threading
import time

import grpc
from absl import app, flags

from paas_jax.codec import CodecOptions
from paas_jax.proto import serving_pb2, serving_pb2_grpc
from paas_jax.scheduling.tenant_queue import DEFAULT_TENANT, TenantPolicy
from paas_jax.security import cli as security_cli
from paas_jax.security.hooks import server_interceptors
from paas_jax.serving import child_process, common, control_plane, handoff_probe, logprobs
from paas_jax.serving import pod, pod_prefill, pod_supervisor, prefill_server_main, transfer_flags
from paas_jax.serving.prefill_rpc import TENANT_NAME
from paas_jax.serving.validation import (InvalidRequestError, RequestParams,
                                         check_request_identity, make_sampling,
                                         requested_logprobs, validate_request)
from paas_jax.transport import LinkCounters, SenderOptions, StateReceiver, serve_receiver
from paas_jax.transport.dataplane import tls as dp_tls

log = logging.getLogger("paas_jax.serving.pod_prefill")
FLAGS = flags.FLAGS
SERVICE = "paas_jax.serving.v1.Prefill"


@dataclasses.dataclass(frozen=True)
class _NoPrefixCache:
  """What control_plane reads of an engine: the pod keeps no prefix cache."""

  prefix_cache: None = None


MAX_SLICE_PROCESSES = 64


def decode_slice_of(request) -> tuple[tuple[str, ...], int]:
  """(slice targets by rank, devices per slice process) of a PrefillRequest
  (``((), 0)``: one decode process). Raises InvalidRequestError."""
  if not request.HasField("decode_slice"):
    return (), 0
  dslice = request.decode_slice
  targets = tuple(dslice.transfer_targets)
  if not 1 <= len(targets) <= MAX_SLICE_PROCESSES or not all(targets):
    raise InvalidRequestError(f"decode_slice needs 1 to {MAX_SLICE_PROCESSES} non-empty "
                              f"transfer_targets, got {len(targets)}")
  if not 1 <= dslice.devices_per_process <= 1024:
    raise InvalidRequestError("decode_slice.devices_per_process must be in [1, 1024], got "
                              f"{dslice.devices_per_process}")
  if targets[0] != request.decode_target:
    raise InvalidRequestError(f"decode_target {request.decode_target!r} is not the slice's "
                              f"process 0 ({targets[0]!r})")
  return targets, int(dslice.devices_per_process)


class PodPrefillServicer(serving_pb2_grpc.PrefillServicer):
  """Process 0's Prefill service in front of a ``pod_prefill.PodLeader``."""

  def __init__(self, config, leader: pod_prefill.PodLeader, *, max_ctx: int,
               max_queue: int = 64, codec: CodecOptions = CodecOptions(),
               logit_probe: bool = True, link_label: str = "A->B", metrics=None):
    self.config = config
    self.leader = leader
    self.max_ctx = max_ctx
    self.max_queue = max_queue
    self.codec = codec
    self.logit_probe = logit_probe
    self.link_label = link_label
    # The pod's processes send on their own; their bytes are counted here (and in
    # ``metrics``) when each request's transfers end, not while they are sent.
    self.link_counters = LinkCounters(link_label)
    self.metrics = metrics
    self.counters = collections.Counter()
    self.probe_s_total = 0.0
    self.started = time.time()

  def Prefill(self, request, context):
    try:
      check_request_identity(request, self.config, "prefill pod")
      if not request.decode_target:
        raise InvalidRequestError("decode_target is required")
      prompt = tuple(int(t) for t in request.prompt_ids)
      sampling = make_sampling(request.sampling.temperature, request.sampling.top_k,
                               request.sampling.top_p)
      params = RequestParams(sampling=sampling, seed=int(request.seed), max_new_tokens=1,
                             logprobs=requested_logprobs(request.logprobs,
                                                         request.top_logprobs))
      validate_request(self.config, prompt, params, self.max_ctx)
      if request.codec_json:
        CodecOptions.from_json(request.codec_json)
      slice_targets, slice_devices = decode_slice_of(request)
      if request.tenant and not TENANT_NAME.fullmatch(request.tenant):
        raise InvalidRequestError(f"tenant must match {TENANT_NAME.pattern}, got "
                                  f"{request.tenant[:40]!r}")
    except (InvalidRequestError, ValueError) as e:
      context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    tenant = request.tenant or DEFAULT_TENANT
    link = self.link_label if tenant == DEFAULT_TENANT else f"A->{tenant}"
    self.counters["requests"] += 1
    if self.leader.broken:
      context.abort(grpc.StatusCode.UNAVAILABLE, "the prefill pod is restarting")
    if self.leader.queue_depth >= self.max_queue:
      self.counters["rejected_queue_full"] += 1
      context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"prefill queue full ({self.max_queue} prompts waiting)")
    if not self.leader.admits(tenant):
      self.counters[f"rejected_quota:{tenant}"] += 1
      context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"tenant {tenant!r} has its quota of prompts waiting for prefill")
    events: queue.Queue = queue.Queue()
    cancelled = threading.Event()
    context.add_callback(cancelled.set)  # a job still queued then is skipped
    submitted = time.perf_counter()
    self.leader.submit(dict(
        request_id=request.request_id, prompt=prompt, decode_target=request.decode_target,
        temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
        seed=int(request.seed), logprobs=params.logprobs, codec_json=request.codec_json,
        slice_targets=slice_targets, slice_devices=slice_devices),
        events, cancelled, tenant)
    while True:
      try:
        kind, *rest = events.get(timeout=0.5)
      except queue.Empty:
        if not context.is_active():
          return  # The job still runs to its end on every process (lockstep).
        continue
      if kind == "error":
        self.counters["failed"] += 1
        if self.metrics is not None:
          self.metrics.observe_transfer(link, bytes_sent=0, state_bytes=0, seconds=0.0, ok=False)
        context.abort(grpc.StatusCode[rest[0]], rest[1])
      if kind == "first":
        out: pod_prefill.FirstOut = rest[0]
        self.counters["probes"] += int(out.probe is not None)
        self.probe_s_total += out.probe_s
        queued_s = time.perf_counter() - submitted - out.prefill_s - out.probe_s
        yield serving_pb2.PrefillEvent(first_token=serving_pb2.FirstToken(
            token_id=out.token, queue_s=queued_s,
            prefill_s=out.prefill_s, batch_size=1, cached_tokens=0,
            probe=None if out.probe is None else handoff_probe.to_proto(out.probe),
            logprob=(None if out.logprob is None else
                     logprobs.to_proto(out.logprob, serving_pb2.TokenLogprob))))
      elif kind == "done":
        d = rest[0]
        self.counters["transfers_ok"] += 1
        self.counters["bytes_sent"] += d["bytes_sent"]
        self.counters[f"egress_bytes:{tenant}"] += d["bytes_sent"]
        self.counters[f"egress_transfers:{tenant}"] += 1
        for p, n in enumerate(d["per_process_bytes"]):
          self.counters[f"pod_bytes_sent:{p}"] += n
        for p, n in enumerate(d["per_process_objects"]):
          self.counters[f"pod_objects_sent:{p}"] += n
        t = self.link_counters.begin(request.request_id, self.config.n_layers)
        t.queued_bytes(d["bytes_sent"])
        t.sent_bytes(d["bytes_sent"])
        t.end()
        if self.metrics is not None:
          self.metrics.observe_transfer(link, bytes_sent=d["bytes_sent"],
                                        state_bytes=d["state_bytes"], seconds=d["transfer_s"])
        yield serving_pb2.PrefillEvent(done=serving_pb2.TransferDone(
            state_bytes=d["state_bytes"], bytes_sent=d["bytes_sent"],
            transfer_s=d["transfer_s"], num_streams=len(d["per_process_bytes"])))
        return

  def GetLoad(self, request, context):
    return control_plane.load_report(
        control_plane.PREFILL, engine=_NoPrefixCache(), link_counters=self.link_counters,
        prefill_queue_depth=self.leader.queue_depth, prefill_queue_limit=self.max_queue)

  def ProbePrefix(self, request, context):
    return control_plane.probe_prefix(_NoPrefixCache(), request, context)

  def GetStats(self, request, context):
    s = dict(self.counters)
    region = self.leader.runner.region
    s.update(queue=self.leader.queue_depth, jobs_done=self.leader.jobs_done,
             jobs_failed=self.leader.jobs_failed, jobs_skipped=self.leader.jobs_skipped,
             pod_processes=region.num_processes,
             pod_tp=region.tp, probe_enabled=int(self.logit_probe),
             probe_mean_ms=1e3 * self.probe_s_total / max(self.counters["probes"], 1),
             uptime_s=time.time() - self.started)
    s.update(self.link_counters.gauges())
    s.update({f"tenant_queue:{t}": n for t, n in self.leader.tenant_depths().items()})
    s.update({f"tenant_prefill_tokens:{t}": n
              for t, n in self.leader.tenant_served_tokens().items()})
    return serving_pb2.StatsResponse(
        server="prefill", gauges={k: float(v) for k, v in s.items()},
        json=json.dumps({"model": self.config.name, "fingerprint": self.config.fingerprint(),
                         "codec": self.codec.to_dict(), "pod": region.to_dict()}))


def _sender_options(security) -> SenderOptions:
  opts = transfer_flags.sender_options()
  if security is None or security.insecure:
    return opts
  return dp_tls.secured_sender(opts, security)


def _fault_plan() -> dict | None:
  if not FLAGS.pod_fault:
    return None
  parts = FLAGS.pod_fault.split(":")
  if len(parts) not in (2, 3) or parts[1] not in ("prefill", "transfer") or not all(
      p.isdigit() for p in parts[:1] + parts[2:]):
    raise app.UsageError("--pod_fault is <process>:prefill|transfer[:<request number>], got "
                         f"{FLAGS.pod_fault!r}")
  return {"process": int(parts[0]), "at": parts[1],
          "job": int(parts[2]) if len(parts) == 3 else 1}


def process_main() -> None:
  """One process of the pod (``--pod_process_id`` given)."""
  t0 = time.time()
  region = pod.RegionSpec(FLAGS.pod_coordinator, FLAGS.pod_processes, FLAGS.pod_process_id,
                          FLAGS.pod_devices, FLAGS.pod_timeout_s)
  pod.initialize_region(region)
  pid = region.process_id
  security_cli.setup_logging(f"prefill-pod{pid}", FLAGS.log_level)
  security = security_cli.security_from_flags("prefill")
  metrics, metrics_port = (security_cli.start_metrics("prefill") if pid == 0 else (None, None))
  common.enable_compilation_cache(FLAGS.compilation_cache or common.default_compilation_cache())
  model, _ = common.load_model(FLAGS.config, FLAGS.seed, FLAGS.checkpoint, FLAGS.dtype)
  mesh = pod.region_mesh()
  model = pod.shard_model(model, mesh)
  codec = CodecOptions(compression=FLAGS.codec_compression)
  sender_options = _sender_options(security)
  runner = pod_prefill.PodPrefillRunner(
      model, mesh, region, sender_options=sender_options, codec=codec,
      logit_probe=FLAGS.logit_probe, fault=_fault_plan())
  # A prompt just under each --prefill_buckets size compiles that bucket's programs.
  warm_s = runner.warmup(sorted({max(1, min(int(b), FLAGS.max_ctx or int(b)) - 1)
                                 for b in FLAGS.prefill_buckets}))
  if pid != 0:
    log.info("pod process %d warm in %.1fs, following jobs", pid, warm_s)
    pod_prefill.follow_jobs(runner)
    return

  def broken():  # answer the failed request first, then let the supervisor restart the pod
    threading.Timer(0.5, os._exit, (1,)).start()
  leader = pod_prefill.PodLeader(
      runner, on_broken=broken,
      tenants=TenantPolicy.parse(FLAGS.tenant_weights, FLAGS.tenant_quotas,
                                 fair=FLAGS.tenant_sharing == "wfq",
                                 default_quota=FLAGS.tenant_quota))
  servicer = PodPrefillServicer(model.config, leader, max_ctx=FLAGS.max_ctx or 10**9,
                                max_queue=FLAGS.max_queue, codec=codec,
                                logit_probe=FLAGS.logit_probe, metrics=metrics)
  credentials = security.server_credentials()
  control = common.start_server(
      f"{FLAGS.host}:{FLAGS.port}",
      lambda s: serving_pb2_grpc.add_PrefillServicer_to_server(servicer, s),
      credentials=credentials, services=[SERVICE], max_workers=64,
      interceptors=server_interceptors(security, metrics))

  def no_prefixes(info):
    raise InvalidRequestError("this prefill pod keeps no prefix cache; it takes no "
                              f"prefix transfers ({info.transfer_id})")
  receiver = StateReceiver(models={model.config.name: model.config.fingerprint()},
                           template=no_prefixes)
  transfer = serve_receiver(receiver, f"{FLAGS.host}:{FLAGS.transfer_port}",
                            credentials=credentials,
                            interceptors=server_interceptors(security, metrics))
  control.set_serving([SERVICE])
  common.announce_ready(FLAGS.ready_file, {
      "pid": os.getpid(), "port": control.port, "transfer_port": transfer.port,
      "metrics_port": metrics_port, "model": model.config.name, "warmup_s": warm_s,
      **transfer_flags.announced(sender_options),
      "pod": region.to_dict(), "startup_s": time.time() - t0})
  log.info("prefill pod process 0 on %s:%d (P=%d, TP=%d)", FLAGS.host, control.port,
           region.num_processes, region.tp)

  def stop():
    control.stop(0.5)
    transfer.stop(0.5)
  common.wait_for_termination(stop)
  os._exit(0)  # the followers wait in the key-value store; the supervisor stops them


def define_flags() -> None:
  prefill_server_main.define_flags()
  pod_supervisor.define_region_flags("pod")
  flags.DEFINE_string("pod_fault", "", "Fault injection, '<process>:prefill|transfer[:<n>]': "
                      "that pod process exits mid-way through the pod's n-th request "
                      "(default 1; first incarnation only; tests and the demo).")


def main(argv):
  del argv
  child_process.die_with_parent()
  if FLAGS.tp != 1:
    raise app.UsageError("--tp is the single-process server's; a pod's TP is "
                         "--pod_processes x --pod_devices")
  if FLAGS.faults:
    raise app.UsageError("--faults is the single-process server's; use --pod_fault")
  if FLAGS.pod_process_id < 0:
    sys.exit(pod_supervisor.supervise(sys.argv[1:]))
  process_main()


if __name__ == "__main__":
  define_flags()
  app.run(main)
