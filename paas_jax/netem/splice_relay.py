"""The WAN relay with kernel-side forwarding (Linux ``splice``), for high rates.

``relay.Relay`` copies every chunk through an asyncio event loop in user space:
on this project's 2-core machine it tops out at ~0.2 GB/s on one connection and
~0.4 GB/s on eight (docs/transport.md), too slow to emulate the 10 Gbit/s links
of a PrfaaS deployment. ``SpliceRelay`` keeps the same link model (``Link``: a
FIFO wire per direction shared by every connection, delivery one-way delay
after a chunk's last bit left) and the same routes, but the bytes never enter
user space: a reader moves what the socket holds into a pipe
(``splice(socket -> pipe)``, page references, no copy to Python), reserves the
wire for it (``Direction.schedule``) and queues (delivery time, byte count);
a deliverer waits for each chunk's delivery time and moves its bytes from the
pipe to the other socket (``splice(pipe -> socket)``).

A chunk waiting for its delivery time sits in its pipe, so the relay holds the
link's bandwidth-delay product in pipes. Each pump (one direction of one
connection) holds at most ``max_queued_bytes`` (then the reader stops reading
and TCP flow control pushes back on the sender), in as many pipes as that
takes (each enlarged to ``PIPE_BYTES`` where the kernel allows; a pipe is full
when its page slots are, which may be before its byte size). Every pump runs
two threads on non-blocking sockets: each waits in ``poll`` (GIL released),
never inside ``splice``, which would hold the pipe's lock while it waits and
so stall the other thread on that pipe. Python only runs per chunk
(``chunk_bytes``: about 1 ms of wire time, 16-256 KiB), not per byte.

Linux only (``os.splice``, Python 3.10+). Same public surface as ``Relay``:

  relay = SpliceRelay(LinkSpec(bandwidth_bps=10e9, rtt_s=0.03),
                      [Route("transfer", "127.0.0.1:0", "127.0.0.1:50053")]).start()
"""

from __future__ import annotations

import collections
import fcntl
import logging
import os
import select
import socket
import threading
import time

from paas_jax.netem.link import Direction, Link, LinkSpec, reverse
from paas_jax.netem.relay import RelayReport, Route, split_address

log = logging.getLogger("paas_jax.netem")

PIPE_BYTES = 1 << 20
# How long a pump thread waits in poll before it looks at its connection again.
_POLL_MS = 200
MIN_CHUNK_BYTES, MAX_CHUNK_BYTES = 16 << 10, 256 << 10
_MOVE = getattr(os, "SPLICE_F_MOVE", 1)
_NONBLOCK = getattr(os, "SPLICE_F_NONBLOCK", 2)
# An upstream that does not accept within this fails the relayed connection.
CONNECT_TIMEOUT_S = 10.0


def default_max_queued_bytes(spec: LinkSpec) -> int:
  """What one pump may hold: the one-way bandwidth-delay product of the link
  (at least 1 MiB), so that a single connection can fill the emulated wire."""
  rate = spec.bandwidth_bps
  if rate <= 0 or rate == float("inf"):
    return 4 << 20
  delay = spec.rtt_s / 2 + 4 * spec.jitter_s
  return max(1 << 20, int(rate / 8 * delay * 1.25))


def default_chunk_bytes(spec: LinkSpec) -> int:
  """The most one splice takes: about 1 ms of the link's wire time, 16-256 KiB.
  A chunk is delivered after its last bit, so a larger one makes a slow link
  burstier; a smaller one costs Python per byte at high rates."""
  rate = spec.bandwidth_bps
  if rate <= 0 or rate == float("inf"):
    return MAX_CHUNK_BYTES
  return max(MIN_CHUNK_BYTES, min(MAX_CHUNK_BYTES, int(rate / 8 * 1e-3)))


def splice_supported() -> bool:
  return hasattr(os, "splice") and hasattr(fcntl, "F_SETPIPE_SZ")


def default_engine() -> str:
  """The relay engine the launcher and the relay process use unless told:
  ``splice`` where Linux has it, else the portable ``asyncio``."""
  return "splice" if splice_supported() else "asyncio"


class _Pipe:
  """A non-blocking pipe and the bytes it holds."""

  def __init__(self):
    self.r, self.w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    try:
      fcntl.fcntl(self.w, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    except OSError:  # over fs.pipe-max-size or the user's pipe pages: the default size
      pass
    self.held = 0
    self.full = False

  def close(self) -> None:
    for fd in (self.r, self.w):
      try:
        os.close(fd)
      except OSError:
        pass


class _SplicePump:
  """One direction of one relayed connection: ``src`` -> pipes -> ``dst``.

  ``on_exit(error)`` runs once per thread (reader, deliverer) as it ends,
  ``error`` None on a clean end; the connection closes the sockets and pipes
  only after all of its threads ended, so no descriptor is closed (and its
  number reused) under a thread still using it."""

  def __init__(self, src: socket.socket, dst: socket.socket, direction: Direction,
               chunk_bytes: int, max_queued: int, on_exit, on_bytes=None):
    self.src, self.dst = src, dst
    self.direction = direction
    self.chunk_bytes = chunk_bytes
    self.max_queued = max_queued
    self.on_bytes, self.on_exit = on_bytes, on_exit
    self.pipes: collections.deque[_Pipe] = collections.deque([_Pipe()])
    self.spent: list[_Pipe] = []  # emptied pipes, reused, closed with the connection
    # (delivery time, bytes, pipe) in arrival order; FIFO even under jitter.
    self.chunks: collections.deque = collections.deque()
    self.queued = 0
    self.eof = False
    self.failed = False
    self.cv = threading.Condition()

  def start(self, name: str) -> None:
    for target, suffix in ((self._read_loop, "in"), (self._deliver_loop, "out")):
      threading.Thread(target=target, name=f"{name}-{suffix}", daemon=True).start()

  def _tail(self) -> _Pipe:
    """The pipe to splice into next: once the last is full, an emptied one
    (so a long-lived connection keeps as many pipes as it ever held at once),
    else a new one."""
    pipe = self.pipes[-1]
    if pipe.full:
      pipe = self.spent.pop() if self.spent else _Pipe()
      self.pipes.append(pipe)
    return pipe

  def _read_loop(self) -> None:
    fd, error = self.src.fileno(), None
    try:
      while True:
        with self.cv:
          while self.queued >= self.max_queued and not self.failed:
            self.cv.wait()
          if self.failed:
            return
          pipe = self._tail()
          room = min(self.chunk_bytes, self.max_queued - self.queued)
        try:
          n = os.splice(fd, pipe.w, room, flags=_MOVE | _NONBLOCK)
        except BlockingIOError:
          # Data waiting means the pipe's slots are full; an empty pipe never is
          # (the data arrived after splice looked).
          if _ready(fd, select.POLLIN, 0) and pipe.held:
            with self.cv:
              pipe.full = True
          else:
            _ready(fd, select.POLLIN, _POLL_MS)
          continue
        if n == 0:
          return
        if self.on_bytes is not None:
          self.on_bytes(n)
        _, deliver = self.direction.schedule(n)
        with self.cv:
          if self.chunks:
            deliver = max(deliver, self.chunks[-1][0])
          pipe.held += n
          self.chunks.append((deliver, n, pipe))
          self.queued += n
          self.cv.notify_all()
    except OSError as e:
      error = e
    finally:
      with self.cv:
        self.eof = True
        self.cv.notify_all()
      self.on_exit(error)

  def _deliver_loop(self) -> None:
    fd, error = self.dst.fileno(), None
    try:
      while True:
        with self.cv:
          while not self.chunks and not self.eof and not self.failed:
            self.cv.wait()
          if self.failed or (not self.chunks and self.eof):
            break
          deliver, n, pipe = self.chunks[0]
        wait = deliver - time.monotonic()
        if wait > 0:
          time.sleep(wait)
        _send(pipe, n, fd, lambda: not self.failed)
        with self.cv:
          self.chunks.popleft()
          self.queued -= n
          pipe.held -= n
          if pipe.held == 0:
            pipe.full = False
            if pipe is not self.pipes[-1]:  # emptied and not being filled: reuse it
              self.pipes.remove(pipe)
              self.spent.append(pipe)
          self.cv.notify_all()
      if not self.failed:
        self.dst.shutdown(socket.SHUT_WR)  # the sender's EOF, once everything arrived
    except OSError as e:
      error = e
    finally:
      self.on_exit(error)

  def fail(self) -> None:
    """Wakes both threads to end (the connection is going away)."""
    with self.cv:
      self.failed = True
      self.cv.notify_all()

  def close_pipes(self) -> None:
    for pipe in [*self.pipes, *self.spent]:
      pipe.close()
    self.pipes.clear()
    self.spent.clear()


def _send(pipe: _Pipe, n: int, fd: int, alive=lambda: True) -> None:
  """Moves ``n`` bytes from ``pipe`` to the socket ``fd``, waiting for room
  while ``alive()``."""
  while n > 0:
    try:
      moved = os.splice(pipe.r, fd, n, flags=_MOVE | _NONBLOCK)
    except BlockingIOError:  # the socket's send buffer is full
      if not alive():
        raise ConnectionError("relayed connection closing") from None
      _ready(fd, select.POLLOUT, _POLL_MS)
      continue
    if moved == 0:
      raise ConnectionError(f"pipe ran dry with {n} bytes to go")
    n -= moved


def _ready(fd: int, event: int, timeout_ms: int) -> bool:
  """Whether ``fd`` has ``event`` (or an error or hang-up) within ``timeout_ms``."""
  poller = select.poll()
  poller.register(fd, event)
  return bool(poller.poll(timeout_ms))


class _Connection:
  """A relayed connection's two sockets and pumps; closes them once all four
  pump threads ended. A pump thread that fails shuts both sockets down and
  fails both pumps, which wakes the others from ``poll`` or their wait."""

  THREADS = 4

  def __init__(self, client: socket.socket, upstream: socket.socket, on_closed):
    self.sockets = (client, upstream)
    self.pumps: tuple[_SplicePump, ...] = ()
    self.on_closed = on_closed
    self._lock = threading.Lock()
    self._live = self.THREADS
    self._broken = False

  def thread_ended(self, error: BaseException | None) -> None:
    with self._lock:
      self._live -= 1
      last = self._live == 0
      breaks = error is not None and not self._broken
      self._broken |= breaks
    if breaks:
      log.debug("relayed connection breaks: %s", error)
      self.shutdown()
    if last:
      for pump in self.pumps:
        pump.close_pipes()
      for s in self.sockets:
        s.close()
      self.on_closed(self)

  def shutdown(self) -> None:
    for pump in self.pumps:
      pump.fail()
    for s in self.sockets:
      try:
        s.shutdown(socket.SHUT_RDWR)
      except OSError:
        pass


class SpliceRelay(RelayReport):
  """Runs routes over one link, forwarding in the kernel (see module docstring)."""

  ENGINE = "splice"

  def __init__(self, spec: LinkSpec, routes: list[Route], *, chunk_bytes: int | None = None,
               max_queued_bytes: int | None = None):
    if not splice_supported():
      raise OSError("SpliceRelay needs Linux splice (os.splice, Python 3.10+)")
    self.link = Link(spec)
    self.routes = list(routes)
    self.chunk_bytes = chunk_bytes or default_chunk_bytes(spec)
    self.max_queued_bytes = max_queued_bytes or default_max_queued_bytes(spec)
    self.ports: dict[str, int] = {}
    self.connections = collections.Counter()
    self.route_bytes = collections.Counter()
    self._lock = threading.Lock()
    self._listeners: list[socket.socket] = []
    self._open: set[_Connection] = set()
    self._stopping = threading.Event()

  def start(self) -> "SpliceRelay":
    try:
      for route in self.routes:
        host, port = split_address(route.listen)
        server = socket.create_server((host, port), backlog=128, reuse_port=False)
        self._listeners.append(server)
        self.ports[route.name] = server.getsockname()[1]
    except OSError:
      self.stop()
      raise
    for route, server in zip(self.routes, self._listeners):
      threading.Thread(target=self._accept_loop, args=(route, server),
                       name=f"relay-{route.name}", daemon=True).start()
    return self

  def _accept_loop(self, route: Route, server: socket.socket) -> None:
    while not self._stopping.is_set():
      try:
        client, _ = server.accept()
      except OSError:
        return  # closed by stop()
      threading.Thread(target=self._relay, args=(route, client),
                       name=f"relay-{route.name}-open", daemon=True).start()

  def _relay(self, route: Route, client: socket.socket) -> None:
    try:
      upstream = socket.create_connection(split_address(route.target),
                                          timeout=CONNECT_TIMEOUT_S)
    except OSError as e:
      log.warning("relay %s: cannot reach %s: %s", route.name, route.target, e)
      client.close()
      return
    for s in (client, upstream):
      s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
      # Never block inside splice: a splice that waits for a socket holds its
      # pipe's lock, and the other thread's splice on that pipe would wait for
      # it (an answer held back until the next request arrives). poll waits.
      s.setblocking(False)
    conn = _Connection(client, upstream, on_closed=self._closed)
    conn.pumps = (
        _SplicePump(client, upstream, self.link.direction(route.direction),
                    self.chunk_bytes, self.max_queued_bytes, conn.thread_ended,
                    on_bytes=lambda n: self._count(route.name, n)),
        _SplicePump(upstream, client, self.link.direction(reverse(route.direction)),
                    self.chunk_bytes, self.max_queued_bytes, conn.thread_ended))
    with self._lock:
      if self._stopping.is_set():
        client.close()
        upstream.close()
        return
      self._open.add(conn)
      self.connections[route.name] += 1
    conn.pumps[0].start(f"relay-{route.name}-fwd")
    conn.pumps[1].start(f"relay-{route.name}-back")

  def _closed(self, conn: _Connection) -> None:
    with self._lock:
      self._open.discard(conn)

  def _count(self, name: str, n: int) -> None:
    with self._lock:
      self.route_bytes[name] += n

  def stop(self) -> None:
    self._stopping.set()
    for server in self._listeners:
      try:
        server.shutdown(socket.SHUT_RDWR)  # wakes its accept thread
      except OSError:
        pass
      server.close()
    with self._lock:
      conns = list(self._open)
    for conn in conns:
      conn.shutdown()
