"""Region B's decode server as a slice of Q processes (one JAX program).

  python -m paas_jax.serving.slice_decode_server --slice_processes=2 --config=tiny_gdn_gqa \\
      --port=50061 --insecure

Without ``--slice_process_id`` this is the slice's supervisor on one machine
(``pod_supervisor``): it starts the Q processes, each on its own
StateTransfer port and TCP data-plane port (both fixed at the first start), restarts all of them together
when one dies, and writes the ready file (process 0's control port, every
process's transfer address in ``slice_transfer``). On several machines,
start each process yourself with ``--slice_process_id=q
--slice_coordinator=<process 0's host>:<port> --slice_processes=Q
--transfer_port=<its port>`` (and a process manager that restarts the whole
slice), each with its own certificate (``--tls_dir --tls_name=decode-slice<q>``).
The coordinator and the collectives between the processes are not TLS
(``jax.distributed`` has no TLS option): keep the slice's machines on a private
network.

Every process loads the model, places its shards over the slice's ``tp`` mesh
and takes the shard parts a prefill pod streams to it (``slice_decode``).
Process 0 serves the ``Decode`` service to the broker: GetModel announces the
slice (``ServedModel.slice``: its processes' transfer addresses and devices)
so that the broker asks the pod for per-process parts; Decode, Handoff,
GetLoad, GetStats and the health service work as on a single-process decode
server. With --prefix_block > 0 every process keeps a prefix cache of its own
shards for the slice's local prefills (``slice_prefix``; --prefix_cache_mb per
process; GetStats reports its hits as a decode server does). GetLoad announces
it and ProbePrefix answers from process 0's cache, so the broker routes by it;
it is not shipped: ExportPrefix answers FAILED_PRECONDITION, as does the
Prefill service (it is not served: a slice is not a PD-P node for another
node). Requests are continuously
batched: up to --slice_slots decode at once, in lockstep rounds that process
0 composes (``slice_leader``) and every process runs (``slice_batch``).
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

from paas_jax.proto import serving_pb2, serving_pb2_grpc
from paas_jax.security.faults import FaultPlan
from paas_jax.security.hooks import server_interceptors
from paas_jax.serving import child_process, cli, common, control_plane, handoff_probe, logprobs, pod
from paas_jax.serving import pod_supervisor
from paas_jax.serving.decode_server import SERVICE, request_params, request_prompt
from paas_jax.serving.slice_batch import ReadyBoard, SliceBatch, follow_rounds
from paas_jax.serving.slice_decode import SliceJob, SliceParts
from paas_jax.serving.slice_leader import SliceLeader, SliceRequest
from paas_jax.serving.slice_prefix import SlicePrefix
from paas_jax.serving.validation import (InvalidRequestError, check_request_identity,
                                         validate_request)
from paas_jax.transport import LinkCounters, StateReceiver, serve_receiver
from paas_jax.transport.dataplane import tls as dp_tls
from paas_jax.transport.receiver import ReceiverOptions

log = logging.getLogger("paas_jax.serving.slice_decode")
FLAGS = flags.FLAGS


@dataclasses.dataclass(frozen=True)
class _NoPrefixCache:
  """What control_plane reads of an engine without a prefix cache (--prefix_block=0)."""

  prefix_cache: None = None


# Why a slice answers ExportPrefix with FAILED_PRECONDITION.
NOT_SHIPPED = ("a decode slice's prefix cache (if any) serves only its own local prefills: "
               "it ships no prefixes (the broker probes it to route local requests there)")


def stream_slice_events(entry: SliceRequest, context, counters):
  """A slice's ``Decode`` stream after ``accepted``: ``entry``'s slot, tokens
  (coalesced) and finish in queue order; an error event counts in
  ``counters["failed"]`` and aborts the RPC."""
  events = common.StreamEvents(entry.events, context)
  while (ev := events.next()) is not None:
    kind, *rest = ev
    if kind == "error":
      counters["failed"] += 1
      context.abort(grpc.StatusCode[rest[0]], rest[1])
    if kind == "slot":
      info = rest[0]
      yield serving_pb2.DecodeEvent(
          slot=0, queue_s=time.perf_counter() - entry.submitted - info.get("prefill_s", 0.0),
          prefill_s=info.get("prefill_s", 0.0),
          prefill_cached_tokens=int(info.get("cached_tokens", 0)))
      continue
    out = serving_pb2.DecodeEvent()
    while ev is not None:  # coalesce what is already queued into one message
      kind, *rest = ev
      if kind == "token":
        out.token_ids.append(int(rest[0]))
        if rest[1] is not None:
          out.logprobs.append(logprobs.to_proto(rest[1], serving_pb2.TokenLogprob))
      elif kind == "finished":
        out.finished, out.finish_reason = True, rest[0]
        break
      else:  # a slot or an error: the next message
        events.unget(ev)
        break
      ev = events.next_queued()
    yield out
    if out.finished:
      return


class SliceDecodeServicer(serving_pb2_grpc.DecodeServicer):
  """Process 0's Decode service in front of a ``SliceLeader``.

  ``slice_info``: the ``DecodeSlice`` GetModel announces.
  """

  def __init__(self, config, leader: SliceLeader, slice_info: serving_pb2.DecodeSlice, *,
               max_ctx: int, max_queue: int = 64):
    self.config = config
    self.leader = leader
    self.slice_info = slice_info
    self.max_ctx = max_ctx
    self.max_queue = max_queue
    self.link_counters = LinkCounters("B->A")  # a slice exports no prefixes
    self._awaiting: dict[str, SliceRequest] = {}  # remote requests waiting for their Handoff
    self._lock = threading.Lock()
    self.counters = collections.Counter()
    self.started = time.time()

  def _waiting(self) -> int:
    with self._lock:
      return len(self._awaiting) + self.leader.queue_depth

  def Decode(self, request, context):
    rid = request.request_id
    try:
      check_request_identity(request, self.config, "decode slice")
      params = request_params(request)
      prompt = request_prompt(request)
      if request.resume_from:
        raise InvalidRequestError("a decode slice keeps no commit points (resume_from)")
      validate_request(self.config, prompt, params, self.max_ctx)
    except InvalidRequestError as e:
      context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    if self.leader.broken:
      context.abort(grpc.StatusCode.UNAVAILABLE, "the decode slice is restarting")
    if self._waiting() >= self.max_queue:
      self.counters["rejected_queue_full"] += 1
      context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"decode slice queue full ({self.max_queue} requests waiting)")
    self.counters["requests"] += 1
    entry = SliceRequest(rid, None, queue.Queue(), threading.Event(), time.perf_counter(),
                         params=params, prompt_len=len(prompt),
                         remote=request.remote_prefill)
    if request.remote_prefill:
      with self._lock:
        if rid in self._awaiting:
          context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {rid!r} is already waiting")
        self._awaiting[rid] = entry
    else:
      entry.make_job = lambda n: SliceJob.from_request(n, rid, len(prompt), params,
                                                      prompt=prompt)
      self.leader.submit(entry)

    def on_rpc_done():
      with self._lock:
        self._awaiting.pop(rid, None)
      if not entry.finished:
        self.leader.cancel(entry)
    context.add_callback(on_rpc_done)
    yield serving_pb2.DecodeEvent(accepted=True, queue_position=self._waiting())
    yield from stream_slice_events(entry, context, self.counters)

  def Handoff(self, request, context):
    rid = request.request_id
    try:
      probe = handoff_probe.handoff_probe_of(request, self.config.vocab_size)
    except ValueError as e:
      context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    with self._lock:
      entry = self._awaiting.get(rid)
    if entry is None:
      context.abort(grpc.StatusCode.NOT_FOUND,
                    f"request {rid!r} is not waiting here (cancelled, finished or unknown)")
    try:
      first_lp = logprobs.handoff_logprob(request, self.config.vocab_size,
                                          entry.params.logprobs)
    except logprobs.LogprobsError as e:
      context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"first_logprob: {e}")
    with self._lock:
      if self._awaiting.pop(rid, None) is None:
        context.abort(grpc.StatusCode.NOT_FOUND, f"request {rid!r} is gone")
    first = int(request.first_token)
    entry.events.put(("token", first, first_lp))  # streamed now; the probe gates the rest
    entry.make_job = lambda n: SliceJob.from_request(n, rid, entry.prompt_len, entry.params,
                                                    first_token=first, probe=probe)
    self.counters["handoffs"] += 1
    self.counters["probes" if probe is not None else "unverified"] += 1
    self.leader.submit(entry)
    return serving_pb2.HandoffResponse()

  def ExportPrefix(self, request, context):
    context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"ExportPrefix: {NOT_SHIPPED}")

  def GetLoad(self, request, context):
    return control_plane.load_report(
        control_plane.DECODE, engine=self._prefix, link_counters=self.link_counters,
        prefill_queue_depth=0, prefill_queue_limit=self.max_queue,
        decode_stats={"slots_total": self.leader.batch.slots,
                      "slots_busy": self.leader.rows_busy, "waiting": self._waiting()})

  def ProbePrefix(self, request, context):
    return control_plane.probe_prefix(self._prefix, request, context)

  @property
  def _prefix(self):
    """Process 0's ``SlicePrefix`` (what ``control_plane`` reads of an engine)."""
    return self.leader.batch.prefix or _NoPrefixCache()

  def GetModel(self, request, context):
    served = control_plane.served_model(self.config, max_model_len=self.max_ctx)
    served.slice.CopyFrom(self.slice_info)
    return served

  def GetStats(self, request, context):
    s = dict(self.counters)
    s.update(self.leader.counters)
    batch = self.leader.batch
    region = batch.region
    s.update(queue=self._waiting(), busy=int(self.leader.busy),
             slots_total=batch.slots, slots_busy=self.leader.rows_busy,
             mean_batch=s.get("row_steps", 0) / max(1, s.get("steps", 0)),
             slice_processes=region.num_processes, slice_tp=region.tp,
             slice_parts_in=batch.parts.parts_in,
             slice_parts_pending=batch.parts.pending(),
             uptime_s=time.time() - self.started)
    s.update(common.prefix_cache_gauges(self._prefix))
    return serving_pb2.StatsResponse(
        server="decode", gauges={k: float(v) for k, v in s.items()},
        json=json.dumps({"model": self.config.name, "fingerprint": self.config.fingerprint(),
                         "config": self.config.to_dict(), "max_ctx": self.max_ctx,
                         "slice": region.to_dict(),
                         "slice_transfer": list(self.slice_info.transfer_targets)}))


def process_main() -> None:
  """One process of the slice (``--slice_process_id`` given)."""
  t0 = time.time()
  region = pod.RegionSpec(FLAGS.slice_coordinator, FLAGS.slice_processes,
                          FLAGS.slice_process_id, FLAGS.slice_devices, FLAGS.slice_timeout_s)
  pod.initialize_region(region)
  pid = region.process_id
  kv = pod.kv_client() if region.num_processes > 1 else None
  # Peer rules of a decode server (only brokers call Decode, only prefill or decode
  # peers push state) under this process's own name and, with --slice_tls_names,
  # its own certificate.
  model, security, metrics, metrics_port = cli.setup_process(
      "decode", name=f"decode-slice{pid}", tls_name=slice_tls_name(pid))
  mesh = pod.region_mesh()
  model = pod.shard_model(model, mesh)
  max_ctx = FLAGS.max_ctx or model.config.max_seq_len
  board = ReadyBoard(kv)
  parts = SliceParts(pid, on_status=lambda rid, verdict: board.post(rid, pid, verdict))
  credentials = security.server_credentials()
  receiver = StateReceiver(
      models={model.config.name: model.config.fingerprint()}, template=lambda info: None,
      on_ready=parts.on_state, on_failure=parts.on_failure,
      options=ReceiverOptions(transfer_timeout_s=FLAGS.slice_receive_timeout_s))
  plane = (dp_tls.receiver_kwargs(security, "decode", credentials,
                                  FLAGS.data_plane_host or None)
           if FLAGS.transfer_plane == "tcp" else {})
  if plane:
    plane["data_port"] = FLAGS.data_plane_port
  transfer = serve_receiver(receiver, f"{FLAGS.host}:{FLAGS.transfer_port}",
                            credentials=credentials,
                            interceptors=server_interceptors(security, metrics), **plane)
  data_plane_port = transfer.data_plane.port if transfer.data_plane is not None else 0
  prefix = (SlicePrefix(model.config, mesh, FLAGS.prefix_block, FLAGS.prefix_cache_mb << 20)
            if FLAGS.prefix_block > 0 else None)
  faults = FaultPlan.parse(FLAGS.faults)
  if faults.active:
    log.warning("FAULT INJECTION enabled: %s", faults)
  batch = SliceBatch(model, mesh, region, parts, slots=FLAGS.slice_slots, kv=kv,
                     prefix=prefix, faults=faults)
  precompile_s = time.time()
  programs = batch.precompile(max_ctx) if FLAGS.slice_precompile else 0
  precompile_s = time.time() - precompile_s
  log.info("slice process %d compiled %d programs in %.1f s", pid, programs, precompile_s)
  address = f"{FLAGS.advertise_host or FLAGS.host}:{transfer.port}"
  if kv is not None:  # process 0 announces every process's transfer address
    kv.key_value_set(f"slice/transfer/{pid}", address)
    # Where the data plane is bound: behind a relay, the relay forwards to it there.
    kv.key_value_set(f"slice/data_plane/{pid}",
                     f"{FLAGS.data_plane_host or FLAGS.host}:{data_plane_port}")
  if pid != 0:
    log.info("slice process %d receiving on %s, following rounds", pid, address)
    follow_rounds(batch, kv)
    return
  # The others announce once their own precompile is done: on a loaded host that
  # may take far longer than the region's deadline (as at a barrier after a compile).
  announce_ms = int(max(region.timeout_s, pod.COMPILE_SKEW_S) * 1000)
  addresses = [address] + [kv.blocking_key_value_get(f"slice/transfer/{q}", announce_ms)
                           for q in range(1, region.num_processes)]
  data_plane_binds = [f"{FLAGS.data_plane_host or FLAGS.host}:{data_plane_port}"] + [
      kv.blocking_key_value_get(f"slice/data_plane/{q}", announce_ms)
      for q in range(1, region.num_processes)]
  data_plane_hosts = [b.rpartition(":")[0] for b in data_plane_binds]
  data_plane_ports = [int(b.rpartition(":")[2]) for b in data_plane_binds]
  slice_info = serving_pb2.DecodeSlice(transfer_targets=addresses,
                                       devices_per_process=region.local_devices)

  def broken():  # answer the failed request first, then let the supervisor restart the slice
    threading.Timer(0.5, os._exit, (1,)).start()
  leader = SliceLeader(batch, board, kv=kv, steps_per_round=FLAGS.slice_steps_per_round,
                       receive_timeout_s=FLAGS.slice_receive_timeout_s,
                       round_timeout_s=FLAGS.slice_round_timeout_s, on_broken=broken)
  servicer = SliceDecodeServicer(model.config, leader, slice_info, max_ctx=max_ctx,
                                 max_queue=FLAGS.max_queue)
  control = common.start_server(
      f"{FLAGS.host}:{FLAGS.port}",
      lambda s: serving_pb2_grpc.add_DecodeServicer_to_server(servicer, s),
      credentials=credentials, services=[SERVICE], max_workers=2 * FLAGS.max_queue + 32,
      interceptors=server_interceptors(security, metrics))
  control.set_serving([SERVICE])
  common.announce_ready(FLAGS.ready_file, {
      "pid": os.getpid(), "port": control.port, "transfer_port": transfer.port,
      "data_plane_port": data_plane_port, "slice_data_plane_ports": data_plane_ports,
      "slice_data_plane_hosts": data_plane_hosts,
      "slice_transfer": addresses, "metrics_port": metrics_port, "model": model.config.name,
      "slice": region.to_dict(), "precompiled_programs": programs,
      "precompile_s": precompile_s, "startup_s": time.time() - t0})
  log.info("decode slice process 0 on %s:%d (Q=%d, TP=%d), transfer %s", FLAGS.host,
           control.port, region.num_processes, region.tp, addresses)

  def stop():
    control.stop(0.5)
    transfer.stop(0.5)
  common.wait_for_termination(stop)
  os._exit(0)  # the followers wait in the key-value store; the supervisor stops them


def slice_tls_name(pid: int) -> str | None:
  """Process ``pid``'s identity in --tls_dir (None: --tls_name, shared by all)."""
  return FLAGS.slice_tls_names[pid] if FLAGS.slice_tls_names else None


def check_tls_flags() -> None:
  """--slice_tls_names names one certificate per process, in --tls_dir."""
  names = FLAGS.slice_tls_names
  if not names:
    return
  if len(names) != FLAGS.slice_processes:
    raise app.UsageError(f"--slice_tls_names names {len(names)} certificates for "
                         f"--slice_processes={FLAGS.slice_processes}")
  if not FLAGS.tls_dir:
    raise app.UsageError("--slice_tls_names names certificates in --tls_dir: pass --tls_dir")


def define_flags() -> None:
  cli.define_server_flags("decode")
  flags.DEFINE_list("slice_tls_names", [], "One identity in --tls_dir per process "
                    "(e.g. decode-slice0,decode-slice1): process q presents the q-th "
                    "certificate (its own key on its own machine; the launcher issues "
                    "these). Empty: every process presents --tls_name. Either way the peer "
                    "rules are a decode server's.")
  flags.DEFINE_integer("transfer_port", 0, "This process's StateTransfer port (0: any).")
  flags.DEFINE_enum("transfer_plane", "tcp", ["tcp", "grpc"], "tcp: the transfer port also "
                    "opens the TCP data plane; grpc: gRPC only.")
  flags.DEFINE_string("advertise_host", "", "The host the prefill pod dials for this "
                      "process's transfer port (default --host).")
  flags.DEFINE_string("data_plane_host", "", "Bind this process's TCP data plane there "
                      "instead of --host (e.g. behind a relay that listens on its port).")
  flags.DEFINE_integer("data_plane_port", 0, "This process's TCP data-plane port (0: any; "
                       "the supervisor fixes one per process for the slice's lifetime, so "
                       "that a relay's routes stay valid across restarts).")
  flags.DEFINE_integer("max_queue", 64, "Requests allowed to wait (for a Handoff or a turn).")
  pod_supervisor.define_region_flags("slice")
  flags.DEFINE_float("slice_receive_timeout_s", 300.0, "How long a request waits for its "
                     "state parts after its Handoff.")
  flags.DEFINE_float("slice_round_timeout_s", 300.0, "How long process 0's own part of a "
                     "round may run before the slice gives up on it (its requests fail "
                     "UNAVAILABLE and the slice restarts): a round stuck in a collective.")
  flags.DEFINE_integer("slice_slots", 4, "Requests the slice decodes at once (rows of its "
                       "batched state).")
  flags.DEFINE_integer("slice_steps_per_round", 4, "Decode steps per lockstep round while "
                       "no request waits (a waiting request joins after one step).")
  flags.DEFINE_bool("slice_precompile", True, "Compile the decode step and row insert of "
                    "every batch width and context octave up to --max_ctx before serving "
                    "(SliceBatch.precompile); off, the first rounds compile them in lockstep "
                    "while requests wait.")


def main(argv):
  del argv
  child_process.die_with_parent()
  if FLAGS.tp != 1:
    raise app.UsageError("--tp is the single-process server's; a slice's TP is "
                         "--slice_processes x --slice_devices")
  check_tls_flags()
  if FLAGS.slice_process_id < 0:
    sys.exit(pod_supervisor.supervise(sys.argv[1:], pod_supervisor.RegionProcesses(
        module="paas_jax.serving.slice_decode_server", kind="slice",
        processes=FLAGS.slice_processes, devices=FLAGS.slice_devices,
        max_restarts=FLAGS.max_slice_restarts, own_transfer_ports=True,
        own_data_plane_ports=FLAGS.transfer_plane == "tcp")))
  process_main()


if __name__ == "__main__":
  define_flags()
  app.run(main)
