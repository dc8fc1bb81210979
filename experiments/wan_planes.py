"""Data plane over an emulated WAN: the relay's own ceiling, then link
utilization of 1 versus N connections at a rate below that ceiling and a
20-50 ms RTT. Flag-free (``bench_transfer.py --wan`` drives it).

The relay (``python -m paas_jax.netem``, ``--engine`` asyncio or splice) runs in
its own process; the receiver (gRPC port and data plane, the latter on another
loopback address so that the relay can take the announced port number) in
another; the sender here. The ceiling is measured for both relay engines next
to the same sender and receiver without a relay. On the link, what one
connection may have unacknowledged (``window_bytes``, the data plane's window)
stands in for one TCP connection's window on a long path, so one connection is
limited to about a window per RTT and N connections to N times that: the effect
the data plane's lanes are for. The asyncio relay also holds at most 1 MiB per
connection; the splice relay the link's one-way bandwidth-delay product.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from experiments import transfer_planes as tp

DATA_HOST = "127.0.0.3"


def _serve_receiver_at(conn, models: dict, data_host: str) -> None:
  from paas_jax.transport import ReceiverOptions, StateReceiver, serve_receiver
  receiver = StateReceiver(models=models, on_ready=lambda r: r.release(),
                           options=ReceiverOptions(byte_budget=8 << 30))
  server = serve_receiver(receiver, "127.0.0.1:0", max_workers=64, data_plane=True,
                          data_host=data_host)
  conn.send((server.port, server.data_plane.port))
  tp._cpu_loop(conn)
  server.stop(0)


class Relay:
  def __init__(self, rate_bps: float, rtt_s: float, routes: list[str],
               engine: str = "splice"):
    self.dir = tempfile.mkdtemp(prefix="wan-relay-")
    ready = os.path.join(self.dir, "ready.json")
    args = [sys.executable, "-m", "paas_jax.netem", f"--bandwidth={rate_bps or 0}",
            f"--rtt_ms={rtt_s * 1e3}", "--jitter_ms=0", f"--ready_file={ready}",
            f"--stats_file={os.path.join(self.dir, 'stats.json')}", f"--engine={engine}"]
    args += [f"--route={r}" for r in routes]
    self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    end = time.monotonic() + 120
    while not os.path.exists(ready):
      if time.monotonic() > end or self.proc.poll() is not None:
        raise RuntimeError("relay did not start")
      time.sleep(0.1)
    self.ports = json.load(open(ready))["ports"]

  def stop(self):
    self.proc.terminate()
    try:
      self.proc.wait(10)
    except subprocess.TimeoutExpired:
      self.proc.kill()


def _raw_rate(port: int, nbytes: int, n: int) -> float:
  """GB/s of raw TCP from ``n`` connections at once, ``nbytes`` in all."""
  socks = [tp._tcp_client(port, None) for _ in range(n)]
  per = memoryview(bytes(nbytes // n))
  threads = [threading.Thread(target=tp._tcp_send, args=(s, [per])) for s in socks]
  t0 = time.perf_counter()
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  dt = time.perf_counter() - t0
  for s in socks:
    s.close()
  return nbytes / dt / 1e9


def relay_ceiling(nbytes: int = 256 << 20, connections: int = 4, repeats: int = 3,
                  engines: tuple[str, ...] = ("asyncio", "splice")) -> dict:
  """Raw TCP through an unshaped, zero-delay relay of each engine, and straight
  to the same receiver (no relay), rounds interleaved: what the emulator itself
  carries. Best of ``repeats`` per row."""
  sink = tp.Child(tp._serve_tcp, None)
  relays = {e: Relay(0, 0.0, [f"sink=127.0.0.1:0->127.0.0.1:{sink.port}@a_to_b"], engine=e)
            for e in engines}
  ports = {"direct": sink.port, **{e: r.ports["sink"] for e, r in relays.items()}}
  try:
    runs = {row: {str(n): [] for n in sorted({1, connections})} for row in ports}
    for _ in range(repeats):
      for n in sorted({1, connections}):
        for row, port in ports.items():
          runs[row][str(n)].append(_raw_rate(port, nbytes, n))
    best = {row: {n: max(v) for n, v in by_n.items()} for row, by_n in runs.items()}
    return {"by_path": best, "runs": runs, "bytes": nbytes,
            "vs_direct": {row: {n: v / best["direct"][n] for n, v in by_n.items()}
                          for row, by_n in best.items()}}
  finally:
    for relay in relays.values():
      relay.stop()
    sink.stop()


@contextlib.contextmanager
def _receiver_behind_relay(config, rate_bps: float, rtt_s: float, engine: str,
                           extra_routes: list[str] = ()):
  """A receiver process for ``config`` whose gRPC port and data plane are
  reached through a relay of the emulated link (routes "control" and
  "dataplane", plus ``extra_routes``); yields the ``Relay``."""
  rx = tp.Child(_serve_receiver_at, {config.name: config.fingerprint()}, DATA_HOST)
  try:
    grpc_port, dp_port = rx.port
    relay = Relay(rate_bps, rtt_s,
                  [f"control=127.0.0.1:0->127.0.0.1:{grpc_port}@a_to_b",
                   f"dataplane=127.0.0.1:{dp_port}->{DATA_HOST}:{dp_port}@a_to_b",
                   *extra_routes], engine=engine)
    try:
      yield relay
    finally:
      relay.stop()
  finally:
    rx.stop()


def wan_utilization(config, tokens: int, rate_bps: float, rtt_s: float, lanes=(1, 4),
                    repeats: int = 2, window_bytes: int = 256 << 10,
                    engine: str = "splice") -> dict:
  """Goodput / link rate of the data plane with each lane count on the emulated link.

  ``window_bytes`` caps what one connection has unacknowledged, standing in
  for the TCP window of one connection on a long path (the relay cannot run at
  the rates where the kernel's own window would be the limit).
  """
  from paas_jax import codec
  from paas_jax.codec.testing import random_state
  from paas_jax.transport import SenderOptions, StateSender
  from paas_jax.transport.dataplane.tuning import Tuning

  state = random_state(config, [tokens], capacity=tokens, seed=0)
  groups = list(codec.encode_groups(state))
  payload = sum(len(b) for g in groups for b in g.blobs.values())
  out = {"rate_bytes_per_s": rate_bps / 8, "rtt_s": rtt_s, "payload_bytes": payload,
         "relay_engine": engine,
         "window_bytes_per_connection": window_bytes, "lanes": {}}
  with _receiver_behind_relay(config, rate_bps, rtt_s, engine) as relay:
    target = f"127.0.0.1:{relay.ports['control']}"
    for n in lanes:
      opts = SenderOptions(plane="tcp", lanes=n, window_bytes=window_bytes,
                           tuning=Tuning(rate_bytes_per_s=rate_bps / 8, rtt_s=rtt_s))
      with StateSender(target, options=opts) as sender:
        times = []
        for r in range(repeats + 1):
          result = tp._sender_send(sender, groups, model_id=config.name,
                                   fingerprint=config.fingerprint(),
                                   num_layers=config.n_layers, tokens=tokens)
          if r:
            tl = result.timeline
            times.append(tl.duration_s)
        best = min(times)
        out["lanes"][str(n)] = {
            "goodput_bytes_per_s": payload / best,
            # Begin to committed, so the fixed round trips count against it.
            "utilization": payload / best / (rate_bps / 8),
            "retransmits": sender.retransmits(), "runs_s": times}
  return out


def wan_fixed_cost(config, rate_bps: float, rtt_s: float, *, tokens: int = 4, lanes: int = 4,
                   repeats: int = 20, engine: str = "splice") -> dict:
  """Begin to committed for a tiny state (``tokens`` tokens) over the emulated
  link, next to one raw TCP round trip through the same relay: a warm
  transfer's fixed cost in round trips. Median of ``repeats`` after one
  cold and one warm-up transfer."""
  from paas_jax import codec
  from paas_jax.codec.testing import random_state
  from paas_jax.transport import SenderOptions, StateSender
  from paas_jax.transport.dataplane.tuning import Tuning

  groups = list(codec.encode_groups(random_state(config, [tokens], capacity=tokens, seed=1)))
  fingerprint = config.fingerprint()
  opts = SenderOptions(plane="tcp", lanes=lanes,
                       tuning=Tuning(rate_bytes_per_s=rate_bps / 8, rtt_s=rtt_s))
  times = []
  echo = tp.Child(tp._serve_tcp, None)
  try:
    with _receiver_behind_relay(config, rate_bps, rtt_s, engine, extra_routes=[
        f"echo=127.0.0.1:0->127.0.0.1:{echo.port}@a_to_b"]) as relay:
      sock = tp._tcp_client(relay.ports["echo"], None)
      try:
        raw_rtt = tp._tcp_rtt(sock, max(repeats, 5))
      finally:
        sock.close()
      with StateSender(f"127.0.0.1:{relay.ports['control']}", options=opts) as sender:
        for r in range(repeats + 2):
          t0 = time.perf_counter()
          tp._sender_send(sender, groups, model_id=config.name, fingerprint=fingerprint,
                          num_layers=config.n_layers, tokens=tokens)
          if r >= 2:
            times.append(time.perf_counter() - t0)
  finally:
    echo.stop()
  median = statistics.median(times)
  return {"tokens": tokens, "state_bytes": sum(len(b) for g in groups for b in g.blobs.values()),
          "rtt_s": rtt_s, "raw_tcp_rtt_s": raw_rtt, "median_s": median,
          "round_trips": median / raw_rtt, "runs_s": times}
