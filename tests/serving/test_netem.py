"""The WAN emulator: link arithmetic, the userspace relay, network namespaces."""

from __future__ import annotations

import math
import socket
import subprocess
import sys
import time

import pytest

from paas_jax.netem import (BandwidthTrace, Link, LinkSpec, NetnsLink, Relay, Route,
                            netns_available, parse_rate)
from paas_jax.netem.splice_relay import splice_supported
from tests.serving.conftest import thread_server


def test_parse_rate():
  assert parse_rate("100mbit") == 100e6
  assert parse_rate("1.5gbps") == 1.5e9
  assert parse_rate("250k") == 250e3
  assert parse_rate(12.0) == 12.0
  with pytest.raises(ValueError):
    parse_rate("fast")


def test_trace_integrates_rate_over_segments():
  tr = BandwidthTrace.parse("0:8mbit,1:0,2:16mbit,period=3")
  assert tr.rate_at(0.5) == 8e6 and tr.rate_at(1.5) == 0 and tr.rate_at(3.2) == 8e6
  # 1 MB from t=0.5: 0.5 s at 8 Mbit (0.5 MB), outage until 2, then 0.25 s at 16 Mbit.
  assert tr.finish_time(0.5, 8e6) == pytest.approx(2.25)
  # Looping: the same from one period later.
  assert tr.finish_time(3.5, 8e6) == pytest.approx(5.25)
  once = BandwidthTrace(((0.0, 8e6), (1.0, 0.0)), loop=False)
  assert once.finish_time(0.9, 8e6) == math.inf


def test_direction_serializes_and_accounts():
  link = Link(LinkSpec(bandwidth_bps=8e6, rtt_s=0.1), epoch=0.0)
  d = link.direction(Link.A_TO_B)
  end1, deliver1 = d.schedule(1_000_000, now=0.0)  # 1 s on the wire
  end2, _ = d.schedule(500_000, now=0.2)  # queues behind the first
  assert end1 == pytest.approx(1.0) and deliver1 == pytest.approx(1.05)
  assert end2 == pytest.approx(1.5)
  s = d.stats()
  assert s["bytes"] == 1_500_000 and s["utilization"] == pytest.approx(1.0)
  assert sum(s["timeline_bytes"].values()) == pytest.approx(1_500_000, abs=20)
  assert link.direction(Link.B_TO_A).stats()["bytes"] == 0


def test_route_parse():
  r = Route.parse("transfer=127.0.0.1:0->127.0.0.1:5000@b_to_a")
  assert (r.name, r.listen, r.target, r.direction) == ("transfer", "127.0.0.1:0",
                                                       "127.0.0.1:5000", "b_to_a")
  with pytest.raises(ValueError):
    Route.parse("nonsense")


@pytest.fixture
def sink_server():
  """Counts bytes; answers b'pong' whenever what it received ends with b'ping'."""
  def handle(c):
    with c:
      while True:
        d = c.recv(1 << 16)
        if not d:
          return
        if d.endswith(b"ping"):
          c.sendall(b"pong")

  srv, port = thread_server(handle)
  yield port
  srv.close()


def test_relay_applies_rtt_and_bandwidth(sink_server):
  spec = LinkSpec(bandwidth_bps=16e6, rtt_s=0.06, jitter_s=0.0)
  relay = Relay(spec, [Route("x", "127.0.0.1:0", f"127.0.0.1:{sink_server}")]).start()
  try:
    with socket.create_connection(("127.0.0.1", relay.ports["x"])) as s:
      t0 = time.monotonic()
      s.sendall(b"ping")
      assert s.recv(4) == b"pong"
      rtt = time.monotonic() - t0
      assert 0.055 < rtt < 0.5
      t0 = time.monotonic()
      s.sendall(b"x" * 2_000_000 + b"ping")  # 1 s at 16 Mbit/s
      assert s.recv(4) == b"pong"
      took = time.monotonic() - t0
      assert 0.95 < took < 3.0
    stats = relay.stats()
    assert stats["a_to_b"]["bytes"] == 2_000_008
    assert stats["b_to_a"]["bytes"] == 8
    assert stats["a_to_b"]["utilization"] > 0.5
    assert stats["connections"] == {"x": 1}
  finally:
    relay.stop()


@pytest.mark.parametrize("engine", ["asyncio", "splice"])
def test_relay_process_cli(sink_server, tmp_path, engine):
  if engine == "splice" and not splice_supported():
    pytest.skip("needs Linux splice")
  ready, stats = tmp_path / "ready.json", tmp_path / "stats.json"
  proc = subprocess.Popen([sys.executable, "-m", "paas_jax.netem", "--bandwidth=0",
                           "--rtt_ms=10", f"--route=c=127.0.0.1:0->127.0.0.1:{sink_server}",
                           f"--ready_file={ready}", f"--stats_file={stats}",
                           f"--engine={engine}"])
  try:
    deadline = time.monotonic() + 30
    while not ready.exists():
      assert proc.poll() is None and time.monotonic() < deadline
      time.sleep(0.05)
    import json
    port = json.loads(ready.read_text())["ports"]["c"]
    with socket.create_connection(("127.0.0.1", port)) as s:
      s.sendall(b"ping")
      assert s.recv(4) == b"pong"
  finally:
    proc.terminate()
    proc.wait(10)
  final = json.loads(stats.read_text())
  assert final["a_to_b"]["bytes"] == 4
  assert final["engine"] == engine


_NETNS = netns_available()


@pytest.mark.skipif(not _NETNS[0], reason=f"network namespaces: {_NETNS[1]}")
def test_netns_link_shapes_with_tbf():
  with NetnsLink(LinkSpec(bandwidth_bps=16e6, rtt_s=0.0)) as link:
    code = ("import socket;s=socket.socket();s.bind(('%s',5999));s.listen();c,_=s.accept();"
            "n=0\nwhile n<2000000:\n  n+=len(c.recv(65536))\nc.sendall(b'ok')" % link.a_ip)
    server = subprocess.Popen([*link.exec_prefix(), sys.executable, "-c", code])
    try:
      deadline = time.monotonic() + 10
      while True:
        try:
          s = socket.create_connection((link.a_ip, 5999), timeout=1)
          break
        except OSError:
          assert time.monotonic() < deadline
          time.sleep(0.1)
      with s:
        t0 = time.monotonic()
        s.sendall(b"x" * 2_000_000)
        assert s.recv(2) == b"ok"
        took = time.monotonic() - t0
      assert 0.7 < took < 5.0  # ~1 s at 16 Mbit/s
    finally:
      server.kill()
      server.wait()
  assert subprocess.run(["ip", "netns", "list"], capture_output=True,
                        text=True).stdout.count(link.ns) == 0
