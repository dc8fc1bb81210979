"""HealthMonitor against real health servers that die, restart and degrade."""

from __future__ import annotations

import socket
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from paas_jax.observability.health import HealthMonitor


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def start_health_server(port: int):
  server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
  h = health.HealthServicer()
  h.set("", health_pb2.HealthCheckResponse.SERVING)
  health_pb2_grpc.add_HealthServicer_to_server(h, server)
  assert server.add_insecure_port(f"127.0.0.1:{port}") == port
  server.start()
  return server, h


def wait_for(pred, timeout=10.0):
  end = time.monotonic() + timeout
  while time.monotonic() < end:
    if pred():
      return True
    time.sleep(0.05)
  return False


def test_dead_server_leaves_and_rejoins_after_restart():
  port_a, port_b = free_port(), free_port()
  a, _ = start_health_server(port_a)
  b, hb = start_health_server(port_b)
  ta, tb = f"127.0.0.1:{port_a}", f"127.0.0.1:{port_b}"
  changes = []
  monitor = HealthMonitor([ta, tb], interval_s=0.2, timeout_s=0.5,
                          on_change=lambda t, ok, why: changes.append((t, ok))).start()
  try:
    assert wait_for(lambda: monitor.snapshot()[ta]["probes"] >= 1)
    assert monitor.healthy() == [ta, tb]
    a.stop(0)  # killed
    assert wait_for(lambda: not monitor.is_healthy(ta))
    assert monitor.healthy() == [tb]
    hb.set("", health_pb2.HealthCheckResponse.NOT_SERVING)  # draining
    assert wait_for(lambda: not monitor.is_healthy(tb))
    assert "NOT_SERVING" in monitor.snapshot()[tb]["reason"]
    a, _ = start_health_server(port_a)  # restarted on the same address
    assert wait_for(lambda: monitor.is_healthy(ta), timeout=5)
    hb.set("", health_pb2.HealthCheckResponse.SERVING)
    assert wait_for(lambda: monitor.is_healthy(tb))
    assert changes == [(ta, False), (tb, False), (ta, True), (tb, True)]
  finally:
    monitor.stop()
    a.stop(0)
    b.stop(0)


def test_mark_down_is_immediate_and_a_probe_brings_it_back():
  port = free_port()
  server, _ = start_health_server(port)
  target = f"127.0.0.1:{port}"
  monitor = HealthMonitor([target], interval_s=30.0, timeout_s=0.5).start()
  try:
    assert monitor.wait_healthy(target, 5)
    monitor.mark_down(target, "UNAVAILABLE: connection reset")
    assert not monitor.is_healthy(target)
    assert monitor.snapshot()[target]["reason"].startswith("observed")
    # mark_down wakes the prober: the live server is back long before 30 s.
    assert wait_for(lambda: monitor.is_healthy(target), timeout=5)
    monitor.mark_down("10.0.0.1:1", "unknown targets are ignored")
  finally:
    monitor.stop()
    server.stop(0)


def test_unreachable_target_is_unhealthy_and_nothing_hangs():
  target = f"127.0.0.1:{free_port()}"  # nothing listens
  monitor = HealthMonitor([target], interval_s=0.1, timeout_s=0.3, initially_healthy=False)
  started = time.monotonic()
  assert monitor.probe(target) is False
  assert time.monotonic() - started < 2
  assert monitor.snapshot()[target]["reason"].startswith(("UNAVAILABLE", "DEADLINE_EXCEEDED"))
  monitor.stop()  # never started: stop is still safe
