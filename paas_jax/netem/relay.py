"""A userspace TCP relay that puts a ``Link`` between two regions.

Each ``Route`` listens on a local address and forwards every accepted
connection to a target; bytes flowing from the listening side cross the link
in the route's ``direction`` and the answers cross it in the reverse one. A
pump reads at most ``chunk_bytes`` at a time, reserves the shared wire
(``Direction.schedule``) and writes the chunk out when it is delivered;
per-pump queues are bounded, so a slow link pushes back on the sender through
TCP flow control instead of buffering without limit.

Works anywhere (no privileges). Runs on its own event-loop thread:

  relay = Relay(LinkSpec(bandwidth_bps=50e6, rtt_s=0.03, jitter_s=0.002),
                [Route("transfer", "127.0.0.1:0", "127.0.0.1:50053", Link.A_TO_B)])
  relay.start(); port = relay.ports["transfer"]; ...; relay.stop()
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time

from paas_jax.netem.link import Link, LinkSpec, reverse

log = logging.getLogger("paas_jax.netem")


@dataclasses.dataclass(frozen=True)
class Route:
  """``listen`` ("host:port", port 0 = any) forwards to ``target``; data from
  the listening side travels in ``direction`` (Link.A_TO_B or Link.B_TO_A)."""

  name: str
  listen: str
  target: str
  direction: str = Link.A_TO_B

  @classmethod
  def parse(cls, text: str) -> "Route":
    """'name=listen_host:port->target_host:port[@a_to_b|b_to_a]'."""
    name, _, rest = text.partition("=")
    rest, _, direction = rest.partition("@")
    listen, _, target = rest.partition("->")
    if not (name and listen and target):
      raise ValueError(f"bad route {text!r}; use name=host:port->host:port@a_to_b")
    direction = direction or Link.A_TO_B
    if direction not in (Link.A_TO_B, Link.B_TO_A):
      raise ValueError(f"route direction must be a_to_b or b_to_a, got {direction!r}")
    return cls(name, listen, target, direction)


def split_address(address: str) -> tuple[str, int]:
  host, _, port = address.rpartition(":")
  return host or "127.0.0.1", int(port)


class _Pump:
  """One direction of one connection."""

  def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
               direction, chunk_bytes: int, max_queued: int, on_bytes=None):
    self.reader, self.writer = reader, writer
    self.on_bytes = on_bytes
    self.direction = direction
    self.chunk_bytes = chunk_bytes
    self.max_queued = max_queued
    self.queue: collections.deque = collections.deque()
    self.queued = 0
    self.cv = asyncio.Condition()
    self.eof = False

  async def read_loop(self) -> None:
    try:
      while True:
        data = await self.reader.read(self.chunk_bytes)
        if not data:
          break
        if self.on_bytes is not None:
          self.on_bytes(len(data))
        _, deliver = self.direction.schedule(len(data))
        async with self.cv:
          while self.queued + len(data) > self.max_queued and self.queue:
            await self.cv.wait()
          # FIFO per connection even when jitter would reorder.
          if self.queue:
            deliver = max(deliver, self.queue[-1][0])
          self.queue.append((deliver, data))
          self.queued += len(data)
          self.cv.notify_all()
    except (ConnectionError, asyncio.IncompleteReadError, OSError):
      pass
    finally:
      async with self.cv:
        self.eof = True
        self.cv.notify_all()

  async def write_loop(self) -> None:
    try:
      while True:
        async with self.cv:
          while not self.queue and not self.eof:
            await self.cv.wait()
          if not self.queue and self.eof:
            break
          deliver, data = self.queue[0]
        wait = deliver - time.monotonic()
        if wait > 0:
          await asyncio.sleep(wait)
        self.writer.write(data)
        await self.writer.drain()
        async with self.cv:
          self.queue.popleft()
          self.queued -= len(data)
          self.cv.notify_all()
      if self.writer.can_write_eof():
        self.writer.write_eof()
    except (ConnectionError, OSError):
      pass


class RelayReport:
  """What both relay engines (``Relay``, ``splice_relay.SpliceRelay``) share:
  their routes' addresses and statistics. Needs ``link``, ``routes``, ``ports``,
  ``connections`` and ``route_bytes`` (Counters; a ``dict`` copy is atomic under
  the GIL, so reading them takes no lock) and ``ENGINE``."""

  ENGINE = ""

  def address(self, name: str, host: str | None = None) -> str:
    route = next(r for r in self.routes if r.name == name)
    return f"{host or split_address(route.listen)[0]}:{self.ports[name]}"

  def stats(self) -> dict:
    out = self.link.stats()
    out["connections"] = dict(self.connections)
    out["route_bytes"] = dict(self.route_bytes)
    out["routes"] = [dataclasses.asdict(r) | {"port": self.ports.get(r.name)}
                     for r in self.routes]
    out["engine"] = self.ENGINE
    return out


class Relay(RelayReport):
  """Runs routes over one link on a background event loop."""

  ENGINE = "asyncio"

  def __init__(self, spec: LinkSpec, routes: list[Route], *, chunk_bytes: int = 16 << 10,
               max_queued_bytes: int = 1 << 20):
    self.link = Link(spec)
    self.routes = list(routes)
    self.chunk_bytes = chunk_bytes
    self.max_queued_bytes = max_queued_bytes
    self.ports: dict[str, int] = {}
    self.connections = collections.Counter()
    # Bytes each route carried from its listening side (e.g. state bytes A->B).
    self.route_bytes = collections.Counter()
    self._loop: asyncio.AbstractEventLoop | None = None
    self._thread: threading.Thread | None = None
    self._servers: list[asyncio.AbstractServer] = []
    self._started = threading.Event()
    self._error: BaseException | None = None

  def start(self, timeout_s: float = 10.0) -> "Relay":
    self._thread = threading.Thread(target=self._run, name="netem-relay", daemon=True)
    self._thread.start()
    if not self._started.wait(timeout_s):
      raise TimeoutError("relay did not start")
    if self._error is not None:
      raise self._error
    return self


  def _run(self) -> None:
    self._loop = asyncio.new_event_loop()
    asyncio.set_event_loop(self._loop)
    try:
      self._loop.run_until_complete(self._open())
    except BaseException as e:  # pylint: disable=broad-except
      self._error = e
      self._started.set()
      return
    self._started.set()
    self._loop.run_forever()
    for s in self._servers:
      s.close()
    self._loop.run_until_complete(self._shutdown())
    self._loop.close()

  async def _shutdown(self) -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
      t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)

  async def _open(self) -> None:
    for route in self.routes:
      host, port = split_address(route.listen)
      server = await asyncio.start_server(
          lambda r, w, route=route: self._handle(route, r, w), host, port)
      self._servers.append(server)
      self.ports[route.name] = server.sockets[0].getsockname()[1]

  async def _handle(self, route: Route, client_r, client_w) -> None:
    host, port = split_address(route.target)
    try:
      up_r, up_w = await asyncio.open_connection(host, port)
    except OSError as e:
      log.warning("relay %s: cannot reach %s: %s", route.name, route.target, e)
      client_w.close()
      return
    self.connections[route.name] += 1
    fwd = _Pump(client_r, up_w, self.link.direction(route.direction), self.chunk_bytes,
                self.max_queued_bytes,
                on_bytes=lambda n, name=route.name: self.route_bytes.update({name: n}))
    back = _Pump(up_r, client_w, self.link.direction(reverse(route.direction)),
                 self.chunk_bytes, self.max_queued_bytes)
    try:
      await asyncio.gather(fwd.read_loop(), fwd.write_loop(), back.read_loop(),
                           back.write_loop())
    except asyncio.CancelledError:
      pass  # relay shutting down
    finally:
      for w in (client_w, up_w):
        try:
          w.close()
        except Exception:  # pylint: disable=broad-except
          pass


  def stop(self) -> None:
    if self._loop is not None and self._loop.is_running():
      self._loop.call_soon_threadsafe(self._loop.stop)
    if self._thread is not None:
      self._thread.join(timeout=5)
