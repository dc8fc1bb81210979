"""Health of downstream servers, as the broker sees them.

``HealthMonitor`` probes each target's ``grpc.health.v1.Health/Check`` every
``interval_s`` and keeps a healthy / unhealthy verdict per target. A failure
the caller observes on a real call (``mark_down``) takes effect at once;
only a later successful probe brings the target back, which is how a
restarted server rejoins: as soon as it answers SERVING again.

Channels to a server that went away back off exponentially (gRPC's default
grows to minutes); ``FAST_RECONNECT`` keeps the back-off short so both the
probes and the data channels notice a restarted server within about a second.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

log = logging.getLogger("paas_jax.health")

FAST_RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


@dataclasses.dataclass
class TargetHealth:
  target: str
  healthy: bool = False
  reason: str = "not probed yet"
  since: float = dataclasses.field(default_factory=time.time)
  probes: int = 0
  failures: int = 0
  changes: int = 0


class HealthMonitor:
  """Background health probes of ``targets``.

  Args:
    targets: ``host:port`` of each server.
    credentials: channel credentials for the probes (mTLS), None: plaintext.
    service: health service name to ask about ("" = the whole server).
    interval_s: probe period; timeout_s: deadline of one probe.
    on_change: ``f(target, healthy, reason)`` on every verdict change.
    initially_healthy: verdict before the first probe (True lets traffic flow
      while the first probes are in flight).
    channels: target -> an existing channel to probe over (e.g. the one real
      calls use, so a successful probe also means that channel has
      reconnected); the caller keeps owning them. Others get their own.
  """

  def __init__(self, targets: Sequence[str], *,
               credentials: grpc.ChannelCredentials | None = None, service: str = "",
               interval_s: float = 1.0, timeout_s: float = 1.0,
               on_change: Callable[[str, bool, str], None] | None = None,
               initially_healthy: bool = True, channel_options: Sequence = (),
               channels: dict | None = None):
    self.service = service
    self.interval_s = interval_s
    self.timeout_s = timeout_s
    self._on_change = on_change
    self._lock = threading.Lock()
    self._state = {t: TargetHealth(t, healthy=initially_healthy,
                                   reason="assumed healthy until probed" if initially_healthy
                                   else "not probed yet") for t in targets}
    options = list(FAST_RECONNECT) + list(channel_options)
    given = dict(channels or {})
    self._channels = {t: (grpc.insecure_channel(t, options=options) if credentials is None
                          else grpc.secure_channel(t, credentials, options=options))
                      for t in targets if t not in given}
    self._stubs = {t: health_pb2_grpc.HealthStub(given.get(t) or self._channels[t])
                   for t in targets}
    self._stop = threading.Event()
    self._wake = threading.Event()
    self._thread = threading.Thread(target=self._loop, name="health-monitor", daemon=True)

  def start(self) -> "HealthMonitor":
    self._thread.start()
    return self

  def stop(self) -> None:
    self._stop.set()
    self._wake.set()
    if self._thread.is_alive():
      self._thread.join(timeout=self.timeout_s + 5)
    for c in self._channels.values():
      c.close()

  # -- verdicts ---------------------------------------------------------------------

  def _set(self, target: str, healthy: bool, reason: str) -> None:
    with self._lock:
      st = self._state[target]
      st.probes += 1
      if not healthy:
        st.failures += 1
      changed = st.healthy != healthy
      if changed:
        st.healthy, st.since, st.changes = healthy, time.time(), st.changes + 1
      st.reason = reason
    if changed:
      (log.info if healthy else log.warning)("%s is %s (%s)", target,
                                             "healthy" if healthy else "UNHEALTHY", reason)
      if self._on_change is not None:
        try:
          self._on_change(target, healthy, reason)
        except Exception:  # pylint: disable=broad-except
          log.exception("health on_change hook raised")

  def is_healthy(self, target: str) -> bool:
    with self._lock:
      st = self._state.get(target)
      return st is not None and st.healthy

  def healthy(self, targets: Sequence[str] | None = None) -> list[str]:
    """The healthy ones among ``targets`` (default: all), in the given order."""
    with self._lock:
      order = list(self._state) if targets is None else list(targets)
      return [t for t in order if t in self._state and self._state[t].healthy]

  def mark_down(self, target: str, reason: str) -> None:
    """A real call to ``target`` failed in a way that says it is gone."""
    if target in self._state:
      self._set(target, False, f"observed: {reason}")
      self._wake.set()  # probe soon, so a blip does not keep it out for long

  def snapshot(self) -> dict[str, dict]:
    with self._lock:
      return {t: dataclasses.asdict(s) for t, s in self._state.items()}

  def wait_healthy(self, target: str, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
      if self.is_healthy(target):
        return True
      self._wake.set()
      time.sleep(0.05)
    return self.is_healthy(target)

  # -- probing ----------------------------------------------------------------------

  def probe(self, target: str) -> bool:
    """One probe now; updates and returns the verdict."""
    try:
      r = self._stubs[target].Check(health_pb2.HealthCheckRequest(service=self.service),
                                    timeout=self.timeout_s)
      ok = r.status == health_pb2.HealthCheckResponse.SERVING
      reason = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
    except grpc.RpcError as e:
      ok, reason = False, f"{e.code().name}: {(e.details() or '')[:160]}"
    except ValueError as e:  # channel closed during shutdown
      ok, reason = False, str(e)
    if not self._stop.is_set():
      self._set(target, ok, reason)
    return ok

  def _loop(self) -> None:
    while not self._stop.is_set():
      for target in list(self._state):
        if self._stop.is_set():
          return
        self.probe(target)
      self._wake.wait(self.interval_s)
      self._wake.clear()
