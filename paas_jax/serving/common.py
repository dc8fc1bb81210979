"""Plumbing shared by the serving processes: gRPC servers and channels, health,
status codes, model loading, the JAX compilation cache and readiness files."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import os
import pathlib
import queue
import signal
import threading
import time
from concurrent import futures
from typing import Callable, Iterable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

log = logging.getLogger("paas_jax.serving")

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
# Control messages are small; state moves through paas_jax.transport, which
# sets its own limits. 64 MiB leaves room for very long prompts in one request.
MAX_MESSAGE_BYTES = 64 << 20
# Default deadline of a whole generation when the caller gave none.
DEFAULT_REQUEST_TIMEOUT_S = 600.0
# Deadline of small unary control RPCs (Handoff, GetStats, health).
CONTROL_TIMEOUT_S = 10.0


def message_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
  return [("grpc.max_send_message_length", max_message_bytes),
          ("grpc.max_receive_message_length", max_message_bytes)]


def make_channel(target: str, credentials: grpc.ChannelCredentials | None = None,
                 extra_options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
  options = message_options() + [
      # Broker <-> region links stay open for the life of the process.
      ("grpc.keepalive_time_ms", 30_000),
      ("grpc.keepalive_permit_without_calls", 1),
  ] + list(extra_options)
  if credentials is None:
    return grpc.insecure_channel(target, options=options)
  return grpc.secure_channel(target, credentials, options=options)


@dataclasses.dataclass
class RunningServer:
  """A started gRPC server with its health servicer."""

  server: grpc.Server
  port: int
  address: str
  health: health.HealthServicer

  def set_serving(self, services: Iterable[str], serving: bool = True) -> None:
    status = (health_pb2.HealthCheckResponse.SERVING if serving
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    for name in list(services) + [""]:
      self.health.set(name, status)

  def stop(self, grace: float | None = 1.0) -> None:
    self.health.enter_graceful_shutdown()
    self.server.stop(grace).wait()


def start_server(address: str, register: Callable[[grpc.Server], None], *,
                 credentials: grpc.ServerCredentials | None = None, max_workers: int = 64,
                 services: Sequence[str] = (),
                 interceptors: Sequence[grpc.ServerInterceptor] = (),
                 max_message_bytes: int = MAX_MESSAGE_BYTES) -> RunningServer:
  """Starts a sync gRPC server on ``address`` (port 0 picks one), NOT_SERVING until
  ``set_serving`` is called (e.g. after warm-up)."""
  # Each streaming RPC holds a worker thread; past max_workers concurrent RPCs a
  # caller gets RESOURCE_EXHAUSTED at once instead of waiting for a thread.
  server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                       options=message_options(max_message_bytes),
                       maximum_concurrent_rpcs=max_workers,
                       interceptors=list(interceptors))
  register(server)
  health_servicer = health.HealthServicer()
  health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
  for name in list(services) + [""]:
    health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
  if credentials is None:
    port = server.add_insecure_port(address)
  else:
    port = server.add_secure_port(address, credentials)
  if port == 0:
    raise OSError(f"could not bind a gRPC server to {address}")
  server.start()
  host = address.rsplit(":", 1)[0]
  return RunningServer(server=server, port=port, address=f"{host}:{port}",
                       health=health_servicer)


def wait_healthy(target: str, timeout_s: float, service: str = "",
                 credentials: grpc.ChannelCredentials | None = None) -> None:
  """Blocks until ``target`` reports SERVING; raises TimeoutError otherwise."""
  deadline = time.monotonic() + timeout_s
  channel = make_channel(target, credentials)
  stub = health_pb2_grpc.HealthStub(channel)
  last = "no answer"
  try:
    while time.monotonic() < deadline:
      try:
        r = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2.0)
        if r.status == health_pb2.HealthCheckResponse.SERVING:
          return
        last = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
      except grpc.RpcError as e:
        last = f"{e.code().name}: {e.details()}"
      time.sleep(0.1)
  finally:
    channel.close()
  raise TimeoutError(f"{target} not SERVING after {timeout_s:.0f} s (last: {last})")


def remaining_s(context: grpc.ServicerContext, default: float = DEFAULT_REQUEST_TIMEOUT_S
                ) -> float:
  """Seconds left of the caller's deadline (``default`` if it set none)."""
  left = context.time_remaining()
  if left is None or left > 1e8:
    return default
  return max(left, 0.0)


def rpc_code(e: BaseException) -> grpc.StatusCode:
  code = e.code() if isinstance(e, grpc.RpcError) and hasattr(e, "code") else None
  return code or grpc.StatusCode.UNKNOWN


def rpc_details(e: BaseException) -> str:
  if isinstance(e, grpc.RpcError) and hasattr(e, "details"):
    return e.details() or str(e)
  return str(e)


# -- process setup ------------------------------------------------------------------

class StreamEvents:
  """Reads one request's event queue for a server stream, in queue order.

  A stream coalesces what is already queued into one message; an event read
  ahead that ends the message (a slot, an error) is ``unget`` and comes back
  first. Put back on the queue instead, it would go behind the tokens and the
  finish queued after it, and the broker would see a finish before the slot.
  """

  def __init__(self, events: queue.Queue, context: grpc.ServicerContext,
               poll_s: float = 0.5):
    self._events, self._context, self._poll_s = events, context, poll_s
    self._held = None

  def next(self):
    """The next event, waiting for one; None once the RPC is no longer active."""
    if self._held is not None:
      ev, self._held = self._held, None
      return ev
    while True:
      try:
        return self._events.get(timeout=self._poll_s)
      except queue.Empty:
        if not self._context.is_active():
          return None

  def next_queued(self):
    """The next event if one is already queued, else None (never waits)."""
    if self._held is not None:
      ev, self._held = self._held, None
      return ev
    try:
      return self._events.get_nowait()
    except queue.Empty:
      return None

  def unget(self, ev) -> None:
    """Hands ``ev`` back: the next read returns it."""
    self._held = ev


def setup_logging(level: str = "INFO") -> None:
  logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                      format="%(asctime)s %(name)s %(levelname)s %(message)s")


def default_compilation_cache() -> str:
  return (os.environ.get("PAAS_JAX_COMPILATION_CACHE")
          or os.environ.get("JAX_COMPILATION_CACHE_DIR")
          or str(REPO_ROOT / "runs" / ".jax_cache"))


def enable_compilation_cache(path: str | None) -> None:
  """Persistent XLA compilation cache shared by all processes ("" or "none": off).

  Compiling the tiny models takes seconds per shape on a small CPU; with the
  cache, a restarted or second process with the same model loads them instead.
  """
  # Deferred, as every JAX import in this module: the broker and the front door
  # import this module and must not load JAX (tests/test_layering.py).
  import jax  # pylint: disable=g-import-not-at-top
  if not path or path == "none":
    return
  pathlib.Path(path).mkdir(parents=True, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def load_model(config_name: str, seed: int = 0, checkpoint: str | None = None,
               dtype: str | None = None, tp: int = 1):
  """(Model, tokenizer or None): a checkpoint, or random init from ``seed``.

  Random init is deterministic, so every process given the same config and
  seed holds the same weights. ``dtype`` ("bfloat16", "float32"): serve in
  that dtype (``with_dtype``) whatever the source's. ``tp`` > 1: parameters
  sharded over that many local devices (``tensor_parallel.py``); a checkpoint
  is restored straight into its shards.
  """
  # Deferred: JAX (see enable_compilation_cache).
  from paas_jax.models import api, load_config  # pylint: disable=g-import-not-at-top
  from paas_jax.serving import tensor_parallel  # pylint: disable=g-import-not-at-top
  mesh = tensor_parallel.local_mesh(tp) if tp > 1 else None
  if checkpoint:
    # Deferred: JAX (see enable_compilation_cache).
    from paas_jax.checkpoints import load_checkpoint  # pylint: disable=g-import-not-at-top
    loaded = load_checkpoint(checkpoint, mesh=mesh, axis=tensor_parallel.TP_AXIS if mesh else None)
    model, tokenizer = loaded if isinstance(loaded, tuple) else (loaded, None)
  else:
    model, tokenizer = api.Model.create(load_config(config_name), seed=seed), None
  model = with_dtype(model, dtype) if dtype else model
  if mesh is not None and tensor_parallel.tp_degree(model) != tp:
    model = tensor_parallel.shard_model(model, mesh)
  return model, tokenizer


def with_dtype(model, dtype: str):
  """The same weights served in ``dtype``: parameters, activations and the KV
  cache in ``dtype``; recurrent states stay f32 (``paas_jax.state``), and so
  do parameters the model keeps in f32 whatever its dtype. Weights are cast
  from the loaded ones (not re-initialised), so a bf16 deployment of a
  random-init config serves the f32 deployment's weights, rounded.
  """
  # Deferred: JAX (see enable_compilation_cache).
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from flax import nnx, traverse_util  # pylint: disable=g-import-not-at-top
  from paas_jax.checkpoints.hf_import import abstract_params, model_from_params  # pylint: disable=g-import-not-at-top
  if dtype not in ("float32", "bfloat16", "float16"):
    raise ValueError(f"unsupported serving dtype {dtype!r} (float32 | bfloat16 | float16)")
  config = model.config
  if config.dtype == dtype and config.param_dtype == dtype:
    return model
  config = dataclasses.replace(config, dtype=dtype, param_dtype=dtype)
  _, abstract = abstract_params(config)
  want = traverse_util.flatten_dict(nnx.to_pure_dict(abstract))
  have = traverse_util.flatten_dict(nnx.to_pure_dict(model.params))
  return model_from_params(config, {k: jnp.asarray(v).astype(want[k].dtype)
                                    for k, v in have.items()})


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
  """Writes ``text`` to a temporary file renamed over ``path``: a reader, or a
  process killed mid-write, sees the old content or the new, never a part."""
  p = pathlib.Path(path)
  p.parent.mkdir(parents=True, exist_ok=True)
  tmp = p.with_name(p.name + f".{os.getpid()}.tmp")
  tmp.write_text(text)
  os.replace(tmp, p)


def freeze_startup_heap() -> int:
  """Collects, then moves every object alive now (modules, the model, the
  servers) out of the garbage collector's generations (``gc.freeze``);
  returns how many objects were frozen. A server process calls it once it
  is up, before it says it is ready.

  Why: a full (generation 2) collection walks every tracked object. With
  jax and a model loaded that is ~170k objects and ~95 ms with the GIL held;
  moving 100 MB states, a data-plane receiver and sender each ran one every
  20-40 transfers, which stalled the transfer in flight (slowest of 40
  transfers 142-155 ms against a median of 35-38) and cost the receiver ~10%
  of its CPU on average (bench_transfer, interleaved A/B). Objects made later
  are still collected; frozen ones stay alive, as startup objects do anyway.
  """
  gc.collect()
  gc.freeze()
  return gc.get_freeze_count()


def write_ready_file(path: str | None, info: dict) -> None:
  """Atomically writes ``info`` (ports, pid) as JSON: the parent's readiness signal."""
  if path:
    write_text_atomic(path, json.dumps(info))


def announce_ready(path: str | None, info: dict) -> None:
  """A server process is up: freezes its startup heap (``freeze_startup_heap``),
  then writes ``info`` plus ``gc_frozen_objects`` as its ready file."""
  write_ready_file(path, {"gc_frozen_objects": freeze_startup_heap(), **info})


def wait_for_termination(on_stop: Callable[[], None]) -> None:
  """Blocks until SIGTERM/SIGINT, then runs ``on_stop``."""
  stop = threading.Event()
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda *_: stop.set())
  while not stop.wait(0.5):
    pass
  with contextlib.suppress(Exception):
    on_stop()


def prefix_cache_gauges(engine) -> dict:
  """GetStats gauges of a ``PrefillEngine``'s prefix cache (for people and
  Prometheus; the broker probes with the typed ``ProbePrefix``)."""
  cache = getattr(engine, "prefix_cache", None)
  if cache is None:
    return {"prefix_cache_enabled": 0.0}
  st = cache.stats
  # Hits are counted per prompt by the engine (what reuse actually saved);
  # the cache's lookup counters are kept as prefix_lookup_*.
  prompts = int(getattr(engine, "prefix_prompts", 0))
  hit = int(getattr(engine, "prefix_prompts_hit", 0))
  return {"prefix_cache_enabled": 1.0, "prefix_block": float(cache.block_size),
          "prefix_blocks": float(st.blocks), "prefix_checkpoints": float(st.checkpoints),
          "prefix_bytes": float(st.nbytes), "prefix_hits": float(hit),
          "prefix_misses": float(prompts - hit),
          "prefix_hit_tokens": float(getattr(engine, "prefix_reused_tokens", 0)),
          "prefix_lookup_hits": float(st.hits), "prefix_lookup_misses": float(st.misses),
          "prefix_lookup_hit_tokens": float(st.hit_tokens),
          "prefix_released_bytes": float(getattr(engine, "prefix_released_bytes", 0))}
