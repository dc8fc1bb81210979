"""Fault injection for the demo and the fault tests.

* ``FlakyLink``: a TCP proxy (e.g. in front of a decode server's
  StateTransfer port, i.e. the WAN link) that can go down on command:
  ``cut`` resets every connection and refuses new ones for the outage (a
  link or router failure); ``blackhole`` holds every byte until it comes
  back (a stall: connections stay up, nothing moves).
* ``ChunkCorrupter``: a gRPC client interceptor for a StateSender's channels
  that flips one byte in some chunk frames, after their crc32c was computed
  (bit rot on the wire that TCP checksums missed, or a buggy middlebox).
* ``FaultPlan``: the faults a server process injects into itself, parsed
  from a flag, e.g. ``--faults=kill_after_layers=2,corrupt_chunks=1``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import re
import threading
import time
from typing import Iterator, Sequence

import grpc

log = logging.getLogger("paas_jax.faults")


def _split(address: str) -> tuple[str, int]:
  host, _, port = address.rpartition(":")
  return host or "127.0.0.1", int(port)


class FlakyLink:
  """A TCP proxy ``listen`` -> ``target`` with injectable outages.

  Runs its own event loop on a daemon thread::

    link = FlakyLink("127.0.0.1:50053").start()
    sender = StateSender(link.address, ...)
    link.outage(3.0, mode="cut")        # returns at once; the link is back in 3 s
  """

  CUT, BLACKHOLE = "cut", "blackhole"

  def __init__(self, target: str, listen: str = "127.0.0.1:0", *, chunk_bytes: int = 64 << 10):
    self.target = target
    self.listen = listen
    self.chunk_bytes = chunk_bytes
    self.port = 0
    self.connections = 0
    self.resets = 0
    self.refused = 0
    self.bytes = 0
    self._mode: str | None = None
    self._loop: asyncio.AbstractEventLoop | None = None
    self._thread: threading.Thread | None = None
    self._server: asyncio.AbstractServer | None = None
    self._writers: set[asyncio.StreamWriter] = set()
    self._up: asyncio.Event | None = None
    self._started = threading.Event()
    self._timer: threading.Timer | None = None

  @property
  def address(self) -> str:
    return f"{_split(self.listen)[0]}:{self.port}"

  @property
  def is_down(self) -> bool:
    return self._mode is not None

  def start(self, timeout_s: float = 10.0) -> "FlakyLink":
    self._thread = threading.Thread(target=self._run, name="flaky-link", daemon=True)
    self._thread.start()
    if not self._started.wait(timeout_s):
      raise TimeoutError("FlakyLink did not start")
    return self

  def _run(self) -> None:
    loop = asyncio.new_event_loop()
    self._loop = loop
    asyncio.set_event_loop(loop)
    self._up = asyncio.Event()
    self._up.set()
    host, port = _split(self.listen)
    self._server = loop.run_until_complete(asyncio.start_server(self._handle, host, port))
    self.port = self._server.sockets[0].getsockname()[1]
    self._started.set()
    loop.run_forever()
    self._server.close()
    pending = [t for t in asyncio.all_tasks(loop)]
    for t in pending:
      t.cancel()
    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.close()

  def _abort_all(self) -> None:
    for w in list(self._writers):
      transport = w.transport
      if transport is not None and not transport.is_closing():
        transport.abort()  # RST, like a dead router
        self.resets += 1
    self._writers.clear()

  def down(self, mode: str = CUT) -> None:
    """Takes the link down until ``up()``."""
    if mode not in (self.CUT, self.BLACKHOLE):
      raise ValueError(f"mode must be {self.CUT!r} or {self.BLACKHOLE!r}, got {mode!r}")

    def apply():
      self._mode = mode
      self._up.clear()
      if mode == self.CUT:
        self._abort_all()
    self._call(apply)
    log.warning("link to %s DOWN (%s)", self.target, mode)

  def up(self) -> None:
    def apply():
      self._mode = None
      self._up.set()
    self._call(apply)
    log.warning("link to %s UP", self.target)

  def outage(self, seconds: float, mode: str = CUT) -> None:
    """Down now, up again after ``seconds`` (returns at once)."""
    self.down(mode)
    self._timer = threading.Timer(seconds, self.up)
    self._timer.daemon = True
    self._timer.start()

  def _call(self, fn) -> None:
    if self._loop is None:
      raise RuntimeError("FlakyLink is not started")
    done = threading.Event()

    def run():
      try:
        fn()
      finally:
        done.set()
    self._loop.call_soon_threadsafe(run)
    done.wait(5)

  async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    if self._mode == self.CUT:
      self.refused += 1
      writer.transport.abort()
      return
    try:
      up_r, up_w = await asyncio.open_connection(*_split(self.target))
    except OSError:
      writer.transport.abort()
      return
    self.connections += 1
    self._writers.update((writer, up_w))
    try:
      await asyncio.gather(self._pump(reader, up_w), self._pump(up_r, writer))
    except (ConnectionError, asyncio.IncompleteReadError, OSError, asyncio.CancelledError):
      pass  # reset by an outage, closed by a peer, or the link is shutting down
    finally:
      for w in (writer, up_w):
        self._writers.discard(w)
        if w.transport is not None and not w.transport.is_closing():
          w.close()

  async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
      data = await reader.read(self.chunk_bytes)
      if not data:
        if writer.can_write_eof():
          writer.write_eof()
        return
      while not self._up.is_set():
        await self._up.wait()
      if writer.transport is None or writer.transport.is_closing():
        return
      writer.write(data)
      self.bytes += len(data)
      await writer.drain()

  def stop(self) -> None:
    if self._timer is not None:
      self._timer.cancel()
    if self._loop is not None and self._loop.is_running():
      self._call(self._abort_all)
      self._loop.call_soon_threadsafe(self._loop.stop)
    if self._thread is not None:
      self._thread.join(timeout=5)


class FlakyLinks:
  """One WAN link in front of several addresses (a decode slice's processes,
  each region A sends its own parts): a ``FlakyLink`` per address, taken down
  and up together, as one link between two regions fails for all of them.
  ``address`` is the first one's (the node's process 0)."""

  def __init__(self, targets: Sequence[str]):
    if not targets:
      raise ValueError("FlakyLinks needs at least one target")
    self.links = [FlakyLink(t) for t in targets]

  @property
  def address(self) -> str:
    return self.links[0].address

  @property
  def addresses(self) -> list[str]:
    return [link.address for link in self.links]

  def start(self) -> "FlakyLinks":
    for link in self.links:
      link.start()
    return self

  def down(self, mode: str = FlakyLink.CUT) -> None:
    for link in self.links:
      link.down(mode)

  def up(self) -> None:
    for link in self.links:
      link.up()

  def outage(self, seconds: float, mode: str = FlakyLink.CUT) -> None:
    for link in self.links:
      link.outage(seconds, mode)

  def stop(self) -> None:
    for link in self.links:
      link.stop()


class ChunkCorrupter(grpc.StreamUnaryClientInterceptor):
  """Flips one byte in the data of chunk frames on StateTransfer ``Push`` streams.

  Args:
    times: chunks to corrupt in total (None: every one, so a transfer fails
      with DATA_LOSS once the receiver's retry limit is reached).
    match: only chunks whose key contains this string.
    skip: let this many matching chunks through untouched first.
    transfer: only chunks of transfers whose id matches this regular
      expression (``re.search``; e.g. ``^seg:1:.*:victim`` for one segment of
      one chunk-streamed request); "": every transfer.
  """

  def __init__(self, times: int | None = 1, *, match: str = "", skip: int = 0,
               transfer: str = ""):
    self.times, self.match, self.skip = times, match, skip
    self.transfer = re.compile(transfer) if transfer else None
    self.seen = 0
    self.corrupted = 0
    self._lock = threading.Lock()

  def _hit(self) -> bool:
    with self._lock:
      self.seen += 1
      if self.seen <= self.skip or (self.times is not None and self.corrupted >= self.times):
        return False
      self.corrupted += 1
      return True

  def _frames(self, frames) -> Iterator:
    for frame in frames:
      if (frame.WhichOneof("body") == "chunk" and self.match in frame.chunk.key
          and frame.chunk.data
          and (self.transfer is None or self.transfer.search(frame.chunk.transfer_id))
          and self._hit()):
        bad = type(frame)()
        bad.CopyFrom(frame)
        data = bytearray(bad.chunk.data)
        data[len(data) // 2] ^= 0x5A
        bad.chunk.data = bytes(data)
        log.warning("fault: corrupted chunk %s (attempt %d)", frame.chunk.key,
                    frame.chunk.attempt)
        frame = bad
      yield frame

  def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
    if client_call_details.method.endswith("/Push"):
      request_iterator = self._frames(request_iterator)
    return continuation(client_call_details, request_iterator)


@dataclasses.dataclass
class FaultPlan:
  """Faults one process injects into itself (demo and test flags).

  Attributes:
    kill_after_layers: exit the process (``os._exit``, no cleanup, like a
      preempted machine) once this many layers of one transfer were handed
      to the sender; 0: never.
    kill_on_transfer: ... during the n-th transfer (1-based) of the process.
    corrupt_chunks: corrupt this many chunk frames on the wire (see
      ``ChunkCorrupter``); the receiver detects and the sender resends them.
    corrupt_transfer: ... only chunks of transfers whose id matches this
      regular expression (no commas; "": any transfer).
    delay_first_token_s: sleep before reporting the first token (widens the
      window for fault tests).
    layer_delay_s: sleep after handing each layer to the sender, so a
      transfer spans a known time (a slow prefill; room to cut the link
      mid-transfer).
    kill_after_commits: exit the process once this many partial commit points
      (short of the whole prompt) of one chunk-streamed transfer were
      acknowledged by the decode side (region A dies after a commit point: the
      request resumes from it); 0: never. With ``kill_on_transfer=0``: in
      whichever transfer gets there first.
    corrupt_states: (decode side) damage this many received states after the
      transport verified them (``paas_jax.state.sensitivity.damage``): what a
      bug behind the checksums would do; the logit probe must catch each one.
    exit_code: status of the killed process.
  """

  kill_after_layers: int = 0
  kill_on_transfer: int = 1
  corrupt_chunks: int = 0
  corrupt_transfer: str = ""
  delay_first_token_s: float = 0.0
  layer_delay_s: float = 0.0
  kill_after_commits: int = 0
  corrupt_states: int = 0
  exit_code: int = 137
  _transfers: int = dataclasses.field(default=0, repr=False)
  _states_corrupted: int = dataclasses.field(default=0, repr=False)
  _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)
  _corrupter: ChunkCorrupter | None = dataclasses.field(default=None, repr=False)

  @classmethod
  def parse(cls, text: str | None) -> "FaultPlan":
    """'kill_after_layers=2,corrupt_chunks=1' (empty: no faults)."""
    plan = cls()
    fields = {f.name: f.type for f in dataclasses.fields(cls) if not f.name.startswith("_")}
    for item in filter(None, (p.strip() for p in (text or "").split(","))):
      key, sep, value = item.partition("=")
      if not sep or key not in fields:
        raise ValueError(f"bad fault {item!r}; known: {sorted(fields)}")
      if fields[key] == "str":
        setattr(plan, key, value)
      else:
        setattr(plan, key, float(value) if key.endswith("_s") else int(value))
    return plan

  @property
  def active(self) -> bool:
    return bool(self.kill_after_layers or self.corrupt_chunks or self.delay_first_token_s
                or self.layer_delay_s or self.kill_after_commits
                or self.corrupt_states)

  @property
  def corrupter(self) -> ChunkCorrupter:
    """The one ChunkCorrupter of this plan (tests read its counters or arm
    more corruption: ``plan.corrupter.times = plan.corrupter.corrupted + 2``)."""
    with self._lock:
      if self._corrupter is None:
        self._corrupter = ChunkCorrupter(self.corrupt_chunks, transfer=self.corrupt_transfer)
      return self._corrupter

  def interceptors(self) -> list[grpc.StreamUnaryClientInterceptor]:
    """Client interceptors for the process's StateSender channels."""
    return [self.corrupter] if self.corrupt_chunks else []

  def transfer_started(self) -> int:
    with self._lock:
      self._transfers += 1
      return self._transfers

  def on_layer(self, transfer_number: int, layers_sent: int) -> None:
    """Call after handing a layer to the sender; may end the process."""
    if self.layer_delay_s:
      time.sleep(self.layer_delay_s)
    if (self.kill_after_layers and transfer_number == self.kill_on_transfer
        and layers_sent >= self.kill_after_layers):
      log.error("fault: killing this process mid-transfer (transfer %d, %d layers sent)",
                transfer_number, layers_sent)
      logging.shutdown()
      os._exit(self.exit_code)  # pylint: disable=protected-access

  def on_commit(self, transfer_number: int, commit_points: int) -> None:
    """Call when a partial commit point of a chunk-streamed transfer is
    acknowledged (``commit_points``: how many so far in this transfer)."""
    if (self.kill_after_commits and self.kill_on_transfer in (0, transfer_number)
        and commit_points >= self.kill_after_commits):
      log.error("fault: killing this process after commit point %d of transfer %d",
                commit_points, transfer_number)
      logging.shutdown()
      os._exit(self.exit_code)  # pylint: disable=protected-access

  def take_state_corruption(self) -> bool:
    """True for the first ``corrupt_states`` calls (one per received state)."""
    with self._lock:
      if self._states_corrupted >= self.corrupt_states:
        return False
      self._states_corrupted += 1
      return True

  def before_first_token(self) -> None:
    if self.delay_first_token_s:
      time.sleep(self.delay_first_token_s)
