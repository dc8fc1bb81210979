"""Side-by-side goodput of every way this repo can move a state's bytes.

Flag-free (``bench_transfer.py --planes`` drives it). For one encoded state,
each receiver in its own process (no shared GIL), one run measures:

* raw TCP (plain and TLS): the same bytes, length-prefixed, into a reused
  buffer: the ceiling;
* raw TCP into kept memory (plain and TLS): the same objects, each read into
  its own buffer that the receiver keeps until the whole state is in
  (``buffers.payload_buffer``, as the data plane does): what any receiver that
  hands the bytes to a decode step pays, with no protocol on top;
* the same with crc32c: each object checked against its crc32c as it arrives,
  with the data plane's own read (``buffers.recv_payload``): what integrity
  costs by itself, so that the data plane's rows against it are the price of
  its framing, acknowledgements and Begin/Commit alone;
* bare gRPC: one Push stream of prebuilt frames into a servicer that drops
  them: the floor of any gRPC-Python transport;
* the old gRPC path (StateSender plane="grpc", 1 and N streams);
* the data plane (plane="tcp", 1 and N connections, plain and TLS);
* CPU seconds per GB on each side (process CPU time of the sender and of the
  receiver process, divided by payload GB);
* fixed cost per transfer on a tiny state (Begin to committed), next to one
  raw TCP round trip and the receiver's commit check, for the old gRPC path,
  the data plane with Begin/Commit on gRPC (``plane_control=False``, the
  previous data plane) and the data plane carrying Begin/Commit itself, rounds
  interleaved.
"""

from __future__ import annotations

import multiprocessing as mp
import resource
import socket
import ssl
import statistics
import struct
import tempfile
import threading
import time

# -- child processes ------------------------------------------------------------------


def _usage() -> tuple[float, int]:
  """(CPU seconds, minor page faults) of this process so far."""
  return time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _cpu_loop(conn) -> None:
  """Answers "cpu" with ``_usage()`` until told to stop."""
  while True:
    msg = conn.recv()
    if msg == "cpu":
      conn.send(_usage())
    else:
      return


def _serve_receiver(conn, models: dict, pki_dir: str | None) -> None:
  from paas_jax.security.tls import TLSConfig
  from paas_jax.serving import common
  from paas_jax.transport import ReceiverOptions, StateReceiver, serve_receiver
  from paas_jax.transport.dataplane import tls as dp_tls

  def on_ready(received):
    received.release()

  receiver = StateReceiver(models=models, on_ready=on_ready,
                           options=ReceiverOptions(byte_budget=8 << 30))
  kw = {}
  if pki_dir:
    tls = TLSConfig.from_dir(pki_dir, "decode-0")
    kw = dict(credentials=tls.server(), data_ssl=dp_tls.server_context(tls),
              data_peers=["prefill*"])
  server = serve_receiver(receiver, "127.0.0.1:0", max_workers=64, data_plane=True, **kw)
  common.freeze_startup_heap()  # as a decode server does once it is up
  conn.send(server.port)
  _cpu_loop(conn)
  server.stop(0)


def serve_null(conn) -> None:
  """Child process: the transfer service with a Push that only drains frames."""
  from paas_jax.proto import transport_pb2, transport_pb2_grpc
  from paas_jax.transport import channels

  class Null(transport_pb2_grpc.StateTransferServicer):
    def Push(self, request_iterator, context):
      n = sum(1 for _ in request_iterator)
      return transport_pb2.PushSummary(chunks=n)

  server = channels.make_server(max_workers=8)
  transport_pb2_grpc.add_StateTransferServicer_to_server(Null(), server)
  port = channels.add_port(server, "127.0.0.1:0")
  server.start()
  conn.send(port)
  _cpu_loop(conn)
  server.stop(0)


# A raw ``keep`` payload's table: each object's size (and crc32c for ``check_crc``).
_KEPT_ROW = struct.Struct("<Q")
_KEPT_CRC_ROW = struct.Struct("<QI")


def _serve_tcp(conn, pki_dir: str | None, keep: bool = False, check_crc: bool = False) -> None:
  """Length-prefixed payloads into one reused buffer, acknowledged with one byte;
  a zero-length payload is a ping (the round trip). ``keep``: each payload is
  a list of object sizes and then the objects, each read into its own buffer,
  all kept until the last one is in. ``check_crc`` (with ``keep``): the list
  gives each object's crc32c too, and each object is read and checked as the
  data plane's receiver does (``buffers.recv_payload``: crc32c piece by piece
  while in cache); a mismatch is answered ``x``, not ``k``."""
  from paas_jax.transport.dataplane import buffers, frames
  if keep:
    buffers.retain_freed_memory()
  ctx = None
  if pki_dir:
    from paas_jax.security.tls import TLSConfig
    from paas_jax.transport.dataplane import tls as dp_tls
    ctx = dp_tls.server_context(TLSConfig.from_dir(pki_dir, "decode-0"))
  listener = socket.create_server(("127.0.0.1", 0))
  buf = bytearray(4 << 20)
  view = memoryview(buf)

  def handle(sock):
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if ctx is not None:
      sock = ctx.wrap_socket(sock, server_side=True)
    with sock:
      header = bytearray(8)
      while True:
        got = 0
        while got < 8:
          n = sock.recv_into(memoryview(header)[got:])
          if not n:
            return
          got += n
        (total,) = struct.unpack("<Q", header)
        if keep and total:
          row = _KEPT_CRC_ROW if check_crc else _KEPT_ROW
          table = bytearray(row.size * total)
          frames.recv_exact(sock, memoryview(table), waitall=ctx is None)
          objects = list(row.iter_unpack(table))
          kept = [buffers.payload_buffer(entry[0]) for entry in objects]
          intact = True
          for dest, entry in zip(kept, objects):
            if check_crc:
              intact &= buffers.recv_payload(sock, memoryview(dest), ctx is None) == entry[1]
            else:
              frames.recv_exact(sock, memoryview(dest), waitall=ctx is None)
          del kept
          sock.sendall(b"k" if intact else b"x")
          continue
        got = 0
        while got < total:
          # MSG_WAITALL on plaintext (the data plane reads objects the same way),
          # so the ceiling is not lowered by one wakeup per segment.
          want = min(len(buf), total - got)
          n = (sock.recv_into(view, want) if ctx is not None
               else sock.recv_into(view, want, socket.MSG_WAITALL))
          if n == 0:
            return
          got += n
        sock.sendall(b"k")

  def accept_loop():
    while True:
      try:
        sock, _ = listener.accept()
      except OSError:
        return
      threading.Thread(target=handle, args=(sock,), daemon=True).start()

  threading.Thread(target=accept_loop, daemon=True).start()
  conn.send(listener.getsockname()[1])
  _cpu_loop(conn)
  listener.close()


class Child:
  """A spawned receiver process: ``target(conn, *args)`` sends its listening port
  first, then answers "cpu" and "stop" on the pipe."""

  def __init__(self, target, *args):
    ctx = mp.get_context("spawn")
    self.conn, child_conn = ctx.Pipe()
    self.proc = ctx.Process(target=target, args=(child_conn, *args), daemon=True)
    self.proc.start()
    if not self.conn.poll(180):
      raise RuntimeError(f"{target.__name__} did not start")
    self.port = self.conn.recv()

  def cpu(self) -> tuple[float, int]:
    """(CPU seconds, minor page faults) of the child so far."""
    self.conn.send("cpu")
    return self.conn.recv()

  def stop(self):
    try:
      self.conn.send("stop")
    except (BrokenPipeError, OSError):
      pass
    self.proc.join(10)
    if self.proc.is_alive():
      self.proc.kill()


# -- measurements -----------------------------------------------------------------------


def _measure_interleaved(rows: list, repeats: int, payload: int) -> dict:
  """Times every (name, fn, receiver child) once per round, ``repeats`` rounds,
  so that load from other processes on a shared machine hits all rows alike;
  the median run and CPU seconds per GB of each side are reported."""
  for _, fn, _ in rows:
    fn()  # warm-up: connections, TLS sessions, code paths
  times = {name: [] for name, _, _ in rows}
  # Per row: CPU seconds and minor page faults of the sender, then the receiver.
  cpu = {name: [0.0, 0, 0.0, 0] for name, _, _ in rows}
  for _ in range(repeats):
    for name, fn, rx in rows:
      tx0, rx0 = _usage(), rx.cpu()
      t0 = time.perf_counter()
      fn()
      times[name].append(time.perf_counter() - t0)
      tx1, rx1 = _usage(), rx.cpu()
      for i, d in enumerate((tx1[0] - tx0[0], tx1[1] - tx0[1], rx1[0] - rx0[0], rx1[1] - rx0[1])):
        cpu[name][i] += d
  gb = payload * repeats / 1e9
  out = {}
  for name in times:
    t = statistics.median(times[name])
    out[name] = {"goodput_gbps": payload / t / 1e9, "median_s": t, "runs_s": times[name],
                 "mean_s": statistics.mean(times[name]), "max_s": max(times[name]),
                 "cpu_s_per_gb_sender": cpu[name][0] / gb,
                 "cpu_s_per_gb_receiver": cpu[name][2] / gb,
                 "page_faults_per_gb_sender": cpu[name][1] / gb,
                 "page_faults_per_gb_receiver": cpu[name][3] / gb}
  return out


def _tcp_client(port: int, ctx: ssl.SSLContext | None):
  sock = socket.create_connection(("127.0.0.1", port))
  sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
  return ctx.wrap_socket(sock, server_hostname="127.0.0.1") if ctx is not None else sock


def _tcp_send(sock, views, keep: bool = False, crcs: list[int] | None = None) -> None:
  """``keep``: to a ``_serve_tcp(keep=True)`` receiver (object sizes first);
  ``crcs``: each object's crc32c, for one with ``check_crc`` (as the data
  plane's sender, the crc32c come from the encoder, not computed here)."""
  total = len(views) if keep else sum(len(v) for v in views)
  sock.sendall(struct.pack("<Q", total))
  if keep:
    sock.sendall(b"".join(_KEPT_ROW.pack(len(v)) for v in views) if crcs is None else
                 b"".join(_KEPT_CRC_ROW.pack(len(v), c) for v, c in zip(views, crcs)))
  for v in views:
    sock.sendall(v)
  reply = sock.recv(1)
  if reply != b"k":
    raise RuntimeError("TCP receiver found an object's crc32c wrong" if reply == b"x"
                       else "TCP receiver did not acknowledge")


def _tcp_rtt(sock, repeats: int) -> float:
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    _tcp_send(sock, [])
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def bare_grpc(port: int, groups, timeout_s: float = 300):
  """(channel, push): one Push stream of prebuilt frames, the gRPC floor."""
  from paas_jax.proto import transport_pb2, transport_pb2_grpc
  from paas_jax.transport import channels
  frames = [transport_pb2.Frame(chunk=transport_pb2.Chunk(key=k, data=v, nbytes=len(v)))
            for g in groups for k, v in g.blobs.items()]
  channel = channels.make_channels(f"127.0.0.1:{port}", 1)[0]
  stub = transport_pb2_grpc.StateTransferStub(channel)
  return channel, lambda: stub.Push(iter(frames), timeout=timeout_s)


def _sender_send(sender, groups, *, model_id, fingerprint, num_layers, tokens):
  with sender.begin(model_id=model_id, config_fingerprint=fingerprint, num_layers=num_layers,
                    lengths=[tokens]) as tx:
    for g in groups:
      tx.send_encoded(g)
    return tx.finish()


def run(config, tokens: int, *, lanes: int, streams: int, repeats: int, tls: bool = True,
        fixed_repeats: int = 30, progress=print) -> dict:
  """Every row of the table for ``config``'s state at ``tokens`` (random content)."""
  from paas_jax import codec
  from paas_jax.codec.testing import random_state
  from paas_jax.security import ca as ca_lib
  from paas_jax.security.tls import TLSConfig
  from paas_jax.serving import common
  from paas_jax.transport import SenderOptions, StateSender
  from paas_jax.transport.dataplane import tls as dp_tls

  state = random_state(config, [tokens], capacity=tokens, seed=0)
  groups = list(codec.encode_groups(state))
  views = [memoryview(b) for g in groups for b in g.blobs.values()]
  crc_of = {c.key: c.crc32c for g in groups for _, c in g.entry.chunks()}
  crcs = [crc_of[key] for g in groups for key in g.blobs]
  payload = sum(len(v) for v in views)
  models = {config.name: config.fingerprint()}
  fingerprint = config.fingerprint()
  send = lambda s: _sender_send(s, groups, model_id=config.name, fingerprint=fingerprint,
                                num_layers=config.n_layers, tokens=tokens)
  out: dict = {"payload_bytes": payload, "chunks": len(views), "rows": {}}
  rows = out["rows"]
  pki = tempfile.mkdtemp(prefix="bench-pki-")
  ca_lib.make_certs(pki, ("prefill-0", "decode-0"))
  prefill_tls = TLSConfig.from_dir(pki, "prefill-0")
  settings = [("plain", None)] + ([("tls", pki)] if tls else [])
  for label, pki_dir in settings:
    client_ctx = dp_tls.client_context(prefill_tls) if pki_dir else None
    creds = prefill_tls.client() if pki_dir else None
    children = [Child(_serve_tcp, pki_dir), Child(_serve_receiver, models, pki_dir),
                Child(_serve_tcp, pki_dir, True), Child(_serve_tcp, pki_dir, True, True)]
    tcp, rx, tcp_kept, tcp_crc = children
    closers = []
    try:
      sock = _tcp_client(tcp.port, client_ctx)
      closers.append(sock.close)
      kept_sock = _tcp_client(tcp_kept.port, client_ctx)
      closers.append(kept_sock.close)
      crc_sock = _tcp_client(tcp_crc.port, client_ctx)
      closers.append(crc_sock.close)
      plan = [(f"raw_tcp_{label}", lambda sock=sock: _tcp_send(sock, views), tcp),
              (f"raw_tcp_kept_{label}",
               lambda sock=kept_sock: _tcp_send(sock, views, keep=True), tcp_kept),
              (f"raw_tcp_kept_crc_{label}",
               lambda sock=crc_sock: _tcp_send(sock, views, keep=True, crcs=crcs), tcp_crc)]
      if label == "plain":
        out["raw_tcp_rtt_s"] = _tcp_rtt(sock, fixed_repeats * 3)
        null = Child(serve_null)
        children.append(null)
        channel, fn = bare_grpc(null.port, groups)
        closers.append(channel.close)
        plan.append(("bare_grpc_plain", fn, null))
      target = f"127.0.0.1:{rx.port}"
      senders = {}
      kinds = [("grpc", 1), ("grpc", streams)] if label == "plain" else [("grpc", streams)]
      kinds += [("tcp", 1), ("tcp", lanes)]
      for plane, n in dict.fromkeys(kinds):
        opts = SenderOptions(plane=plane, num_streams=n, num_connections=n, lanes=n,
                             credentials=creds, data_ssl=client_ctx)
        sender = StateSender(target, options=opts)
        closers.append(sender.close)
        senders[(plane, n)] = sender
        plan.append((f"{plane}_{n}_{label}", lambda sender=sender: send(sender), rx))
      common.freeze_startup_heap()  # as a prefill server does once it is up
      rows.update(_measure_interleaved(plan, repeats, payload))
      progress(f"{label} rows done")
      grpc_control = StateSender(target, options=SenderOptions(
          plane="tcp", lanes=1, credentials=creds, data_ssl=client_ctx, plane_control=False))
      closers.append(grpc_control.close)
      fixed = {"tcp_1_grpc_control": grpc_control, "tcp_1": senders[("tcp", 1)],
               f"tcp_{lanes}": senders[("tcp", lanes)]}
      if label == "plain":
        fixed = {"grpc_path_1": senders[("grpc", 1)], **fixed}
      out.setdefault("fixed_cost", {})[label] = _fixed_costs(fixed, config, fixed_repeats)
      progress(f"{label} fixed cost done")
      if label == "plain":
        for plane, n in (("grpc", 1), ("tcp", lanes)):
          key = "grpc_path_1" if plane == "grpc" else f"tcp_{lanes}"
          rows[f"{plane}_{n}_plain"]["fixed_cost"] = out["fixed_cost"]["plain"]["rows"][key]
    finally:
      for close in closers:
        close()
      for child in children:
        child.stop()
  base = {lbl: rows[f"raw_tcp_{lbl}"]["goodput_gbps"] for lbl, _ in settings}
  kept = {lbl: rows[f"raw_tcp_kept_{lbl}"]["goodput_gbps"] for lbl, _ in settings}
  checked = {lbl: rows[f"raw_tcp_kept_crc_{lbl}"]["goodput_gbps"] for lbl, _ in settings}
  for name, row in rows.items():
    label = name.rsplit("_", 1)[1]
    row["vs_raw_tcp"] = row["goodput_gbps"] / base[label]
    row["vs_raw_tcp_kept"] = row["goodput_gbps"] / kept[label]
    row["vs_raw_tcp_kept_crc"] = row["goodput_gbps"] / checked[label]
  old = max(rows[f"grpc_{n}_plain"]["goodput_gbps"] for n in {1, streams})
  new = max(rows[f"tcp_{n}_plain"]["goodput_gbps"] for n in {1, lanes})
  out["tcp_vs_grpc_path"] = new / old
  rtt = out["raw_tcp_rtt_s"]
  for cost in out["fixed_cost"].values():
    cost["raw_tcp_rtt_s"] = rtt
    cost["target_s"] = 3 * rtt + cost["commit_check_s"]
    for row in cost["rows"].values():
      row["vs_target"] = row["median_s"] / cost["target_s"]
  return out


def run_fixed_cost(config, *, lanes: int, repeats: int, tls: bool = False, tokens: int = 4,
                   bundle_bytes: int | None = None, progress=print) -> dict:
  """Only the fixed-cost rows of ``run`` (Begin to committed, tiny state), for
  quick old-vs-new comparisons: one raw TCP round trip, then the gRPC path,
  the data plane with Begin/Commit on gRPC and carrying them itself (1 and
  ``lanes`` connections), rounds interleaved; mTLS rows too with ``tls``.
  ``tokens``: the state's length. Where the library has BUNDLE frames
  (``SenderOptions.bundle_bytes``), the data-plane rows use
  ``bundle_bytes`` (None: the library default) and a ``tcp_1_streamed`` row
  (bundle_bytes=0: the per-frame path) runs beside them; an older tree runs
  the other rows only, so the same command compares old and new."""
  from paas_jax.security import ca as ca_lib
  from paas_jax.security.tls import TLSConfig
  from paas_jax.serving import common
  from paas_jax.transport import SenderOptions, StateSender
  from paas_jax.transport.dataplane import tls as dp_tls
  models = {config.name: config.fingerprint()}
  out: dict = {"fixed_cost": {}}
  pki = tempfile.mkdtemp(prefix="bench-pki-")
  ca_lib.make_certs(pki, ("prefill-0", "decode-0"))
  prefill_tls = TLSConfig.from_dir(pki, "prefill-0")
  for label, pki_dir in [("plain", None)] + ([("tls", pki)] if tls else []):
    client_ctx = dp_tls.client_context(prefill_tls) if pki_dir else None
    creds = prefill_tls.client() if pki_dir else None
    children = [Child(_serve_tcp, None), Child(_serve_receiver, models, pki_dir)]
    tcp, rx = children
    closers = []
    try:
      if label == "plain":
        sock = _tcp_client(tcp.port, None)
        closers.append(sock.close)
        out["raw_tcp_rtt_s"] = _tcp_rtt(sock, repeats * 3)
      senders = {}
      kinds = [("grpc_path_1", "grpc", 1, True)] if label == "plain" else []
      kinds += [("tcp_1_grpc_control", "tcp", 1, False), ("tcp_1", "tcp", 1, True),
                (f"tcp_{lanes}", "tcp", lanes, True)]
      bundles = "bundle_bytes" in SenderOptions.__dataclass_fields__
      if bundles:
        kinds.append(("tcp_1_streamed", "tcp", 1, True))
      for name, plane, n, control in kinds:
        extra = {}
        if bundles and name == "tcp_1_streamed":
          extra["bundle_bytes"] = 0
        elif bundles and bundle_bytes is not None:
          extra["bundle_bytes"] = bundle_bytes
        sender = StateSender(f"127.0.0.1:{rx.port}", options=SenderOptions(
            plane=plane, num_streams=n, num_connections=n, lanes=n, credentials=creds,
            data_ssl=client_ctx, plane_control=control, **extra))
        closers.append(sender.close)
        senders[name] = sender
      common.freeze_startup_heap()  # as in run(): a prefill server's heap once it is up
      out["fixed_cost"][label] = _fixed_costs(senders, config, repeats, tokens)
      progress(f"{label} fixed cost done")
    finally:
      for close in closers:
        close()
      for child in children:
        child.stop()
  for cost in out["fixed_cost"].values():
    cost["raw_tcp_rtt_s"] = out["raw_tcp_rtt_s"]
    cost["target_s"] = 3 * out["raw_tcp_rtt_s"] + cost["commit_check_s"]
    for row in cost["rows"].values():
      row["vs_target"] = row["median_s"] / cost["target_s"]
  return out


def _fixed_costs(senders: dict, config, repeats: int, tokens: int = 4) -> dict:
  """Begin to committed for a tiny state (``tokens`` tokens) through each sender,
  one transfer per sender per round (so that machine load hits all alike),
  median of ``repeats`` rounds after 3 warm-up rounds."""
  from paas_jax import codec
  from paas_jax.codec.testing import random_state
  state = random_state(config, [tokens], capacity=tokens, seed=1)
  groups = list(codec.encode_groups(state))
  nbytes = sum(len(b) for g in groups for b in g.blobs.values())
  times = {name: [] for name in senders}
  checks = []
  fingerprint = config.fingerprint()  # a server knows it; not part of a transfer
  for i in range(repeats + 3):
    for name, sender in senders.items():
      t0 = time.perf_counter()
      result = _sender_send(sender, groups, model_id=config.name, fingerprint=fingerprint,
                            num_layers=config.n_layers, tokens=tokens)
      if i >= 3:
        times[name].append(time.perf_counter() - t0)
    if i >= 3:
      checks.append(_commit_check_s(result))
  return {"state_bytes": nbytes, "objects": sum(len(g.blobs) for g in groups),
          "commit_check_s": statistics.median(checks),
          "rows": {name: {"state_bytes": nbytes, "median_s": statistics.median(t),
                          "runs_s": t} for name, t in times.items()}}


def _commit_check_s(result) -> float:
  """What the receiver's Commit does on top of the round trip, timed in
  process: parse the manifest JSON and compare every group and chunk with
  what arrived (here: with the sender's own entries)."""
  from paas_jax.codec.manifest import StateManifest
  text = result.manifest.to_json()
  t0 = time.perf_counter()
  manifest = StateManifest.from_json(text)
  keys = {c.key for g in manifest.groups for _, c in g.chunks()}
  missing = [c.key for g in result.manifest.groups for _, c in g.chunks() if c.key not in keys]
  assert not missing
  return time.perf_counter() - t0
