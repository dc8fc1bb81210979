"""Benchmarks the decode-state codec and the gRPC transport.

For each model (default: the tiny hybrid, the ~100M hybrid and the ~100M dense
baseline), on a state produced by a real prefill of random-weight models:

* bytes_ratio: serialized bytes / analytic state bytes (``state_bytes``) for
  raw, zstd, blosc, int8 and fp8 KV; plus the logit error of the next decode
  step after restoring an int8 / fp8 state.
* encode / decode GB/s of the codec versus a plain ``ndarray.tobytes`` /
  ``np.frombuffer(...).copy()`` of the same live arrays.
* grpc_vs_tcp: goodput of StateSender -> StateReceiver over 127.0.0.1 versus a
  raw TCP socket sending the same bytes; both receivers run in a separate
  process so that sender and receiver do not share a GIL. grpc_vs_bare_grpc
  compares with one bare gRPC stream of the same bytes into a servicer that
  does nothing, which is the floor any gRPC-Python transport sits on.
* pipelined_vs_serial: prefill start to a restored state at the decode side,
  layer-wise (LayerwisePrefill -> send_layer, overlapping) versus
  store-then-send (the same LayerwisePrefill run to the end, encode
  everything, then send); below 1 means pipelining wins. Runs are
  interleaved and the median of paired ratios is reported, plus the same
  ratio for the tail after prefill ends (``ready_after_prefill_s``), which is
  what pipelining removes and which prefill-time noise does not swamp.

usage: python experiments/bench_transfer.py --json_out=/tmp/bench_transfer.json
"""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import struct
import sys
import time

from absl import app, flags

# Runnable as a script from the repository root.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position  (after the path fix above)
from experiments import transfer_planes

FLAGS = flags.FLAGS
flags.DEFINE_string("json_out", None, "Where to write the results (JSON).", required=True)
flags.DEFINE_list("models", ["tiny_gdn_gqa", "hybrid_100m", "dense_100m"], "Model configs.")
flags.DEFINE_list("tokens", ["512", "1024", "1024"],
                  "Prompt tokens per model (one value for all, or one per model).")
flags.DEFINE_integer("repeats", 3, "Timed repetitions per measurement (median reported).")
flags.DEFINE_integer("streams", 4, "Parallel gRPC streams.")
flags.DEFINE_string("pipeline_codec", "raw", "Codec of the time-to-ready runs.")
flags.DEFINE_bool("planes", False, "Only the transport table (experiments/transfer_planes.py): "
                  "raw TCP plain/TLS, bare gRPC, the gRPC path and the TCP data plane with 1 "
                  "and --lanes connections, CPU s/GB per side, fixed cost per transfer.")
flags.DEFINE_bool("fixed_cost", False, "Only the fixed cost per transfer (Begin to "
                  "committed, the first model's state at the first --tokens value; runs so "
                  "far used --tokens=4): raw TCP round trip, gRPC "
                  "path, data plane with gRPC control and with control on the plane (1 and "
                  "--lanes connections; where the library has BUNDLE frames also 1 "
                  "connection without them), --repeats rounds interleaved; mTLS rows with "
                  "--tls.")
flags.DEFINE_integer("bundle_bytes", -1, "SenderOptions.bundle_bytes of the data-plane rows "
                     "(--fixed_cost; -1: the library default; ignored by a tree without it).")
flags.DEFINE_integer("lanes", 4, "Data-plane connections of the N-connection rows; 0 (--wan "
                     "with --wan_rate_gbit): as many as the link needs, as "
                     "SenderOptions(lanes=0) picks them.", lower_bound=0)
flags.DEFINE_bool("tls", True, "Also measure the TLS rows (--planes).")
flags.DEFINE_bool("wan", False, "Only the emulated-WAN runs (experiments/wan_planes.py): the "
                  "relay's own ceiling, then data-plane utilization with 1 and --lanes "
                  "connections at --wan_rate_gbit and --wan_rtt_ms, and a tiny state's fixed cost "
                  "in round trips.")
flags.DEFINE_float("wan_rtt_ms", 30.0, "Round-trip time of the emulated link (--wan).")
flags.DEFINE_enum("wan_engine", "splice", ["splice", "asyncio"], "The relay's engine for the "
                  "link runs (--wan); the ceiling is measured for both.")
flags.DEFINE_integer("wan_window_kib", 256, "Unacknowledged KiB per data-plane connection "
                     "(--wan): one connection's window on the long path.")
flags.DEFINE_float("wan_rate_gbit", 0.0, "Rate of the emulated link in Gbit/s (--wan); 0: half "
                   "of the relay's measured ceiling.")


# -- receivers in child processes ---------------------------------------------------

def _serve_grpc(conn, models: dict, template_model: str | None) -> None:
  """Child process: a StateReceiver; restores into templates when asked to."""
  from paas_jax.transport import ReceiverOptions, StateReceiver, serve_receiver
  template = None
  if template_model is not None:
    from paas_jax.models import load_config
    from paas_jax.state import abstract_state, round_up
    config = load_config(template_model)
    template = lambda info: (abstract_state(config, 1, round_up(info.token_count + 64)), None)

  def on_ready(received):
    if received.state is not None:
      import jax
      jax.block_until_ready(received.state)
    received.release()

  receiver = StateReceiver(models=models, template=template, on_ready=on_ready,
                           options=ReceiverOptions(byte_budget=8 << 30))
  server = serve_receiver(receiver, "127.0.0.1:0", max_workers=64)
  conn.send(server.port)
  conn.recv()  # Parent says stop.
  server.stop(0)


def _bare_grpc_send(port: int, groups) -> float:
  """Seconds for one Push stream of prebuilt frames on a fresh channel."""
  channel, push = transfer_planes.bare_grpc(port, groups, timeout_s=120)
  try:
    t0 = time.perf_counter()
    push()
    return time.perf_counter() - t0
  finally:
    channel.close()


def _serve_tcp(conn) -> None:
  """Child process: receives length-prefixed payloads and acknowledges each."""
  listener = socket.socket()
  listener.bind(("127.0.0.1", 0))
  listener.listen(4)
  conn.send(listener.getsockname()[1])
  buf = bytearray(4 << 20)
  while True:
    sock, _ = listener.accept()
    header = sock.recv(8, socket.MSG_WAITALL)
    if len(header) < 8:
      sock.close()
      break
    (total,) = struct.unpack("<Q", header)
    got = 0
    while got < total:
      n = sock.recv_into(buf, min(len(buf), total - got))
      if n == 0:
        break
      got += n
    sock.sendall(b"k")
    sock.close()


def _tcp_send(port: int, blobs: list[bytes]) -> float:
  total = sum(len(b) for b in blobs)
  t0 = time.perf_counter()
  with socket.create_connection(("127.0.0.1", port)) as sock:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(struct.pack("<Q", total))
    for b in blobs:
      sock.sendall(b)
    if sock.recv(1) != b"k":
      raise RuntimeError("TCP receiver did not acknowledge")
  return time.perf_counter() - t0


# -- measurements -------------------------------------------------------------------------

def _median_time(fn, repeats: int) -> float:
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def _logit_error(model, state, next_token, options):
  import jax
  import numpy as np
  from paas_jax import codec
  from paas_jax.models.api import decode_step
  ref, _ = decode_step(model, state, next_token)
  store = codec.MemoryStore()
  codec.encode_state(state, store, model_id="m", config_fingerprint="f", options=options)
  restored = codec.decode_state(store, like=jax.eval_shape(lambda: state))
  got, _ = decode_step(model, restored, next_token)
  ref, got = np.asarray(ref), np.asarray(got)
  d = got - ref
  return {"rel_l2": float(np.linalg.norm(d) / np.linalg.norm(ref)),
          "max_abs": float(np.abs(d).max()),
          "top1_agree": bool((ref.argmax(-1) == got.argmax(-1)).all())}


def bench_model(name: str, n_tokens: int, progress) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from paas_jax import codec
  from paas_jax.codec.layout import layer_leaves, live_extent, split_state
  from paas_jax.models import load_config
  from paas_jax.models.api import LayerwisePrefill, Model, prefill
  from paas_jax.state import state_bytes
  from paas_jax.transport import SenderOptions, StateSender

  config = load_config(name)
  model = Model.create(config, seed=0)
  tokens = np.random.default_rng(0).integers(0, config.vocab_size, n_tokens)
  _, state = prefill(model, tokens)
  jax.block_until_ready(state)
  analytic = state_bytes(config, n_tokens).total
  fingerprint = config.fingerprint()
  out: dict = {"model": name, "tokens": n_tokens, "params": model.n_params,
               "layer_kinds": "".join(config.layer_kinds), "analytic_state_bytes": analytic}
  repeats = FLAGS.repeats

  # Bytes and logit error per codec.
  variants = {"raw": codec.CodecOptions(), "zstd": codec.CodecOptions(compression="zstd"),
              "blosc": codec.CodecOptions(compression="blosc"),
              "int8": codec.CodecOptions(quantization="int8"),
              "fp8": codec.CodecOptions(quantization="fp8")}
  out["serialized_bytes"], out["bytes_ratio"] = {}, {}
  for label, options in variants.items():
    manifest = codec.build_manifest(
        [g.entry for g in codec.encode_groups(state, options=options)], model_id=name,
        config_fingerprint=fingerprint, token_count=n_tokens, batch=1, options=options)
    out["serialized_bytes"][label] = manifest.nbytes
    out["bytes_ratio"][label] = manifest.nbytes / analytic
  progress.update()
  next_token = jnp.array([int(tokens[-1])], jnp.int32)
  out["logit_error"] = {q: _logit_error(model, state, next_token, variants[q])
                        for q in ("int8", "fp8")}
  progress.update()

  # Encode / decode throughput against a plain bytes copy of the live arrays.
  layers, rest = split_state(state)
  live = []
  for i, layer in enumerate(layers):
    for _, leaf, role in layer_leaves(i, layer):
      a = np.asarray(leaf)
      if role.token_axis is not None:
        n = live_extent(role, a.shape[role.token_axis], n_tokens)
        a = np.take(a, np.arange(n), axis=role.token_axis)
      live.append(a)
  live += [np.asarray(leaf) for _, leaf in rest]
  live_bytes = sum(a.nbytes for a in live)
  raw_bytes = [a.tobytes() for a in live]
  t_tobytes = _median_time(lambda: [a.tobytes() for a in live], repeats)
  t_frombuffer = _median_time(
      lambda: [np.frombuffer(b, a.dtype).reshape(a.shape).copy() for a, b in zip(live, raw_bytes)],
      repeats)
  like = jax.eval_shape(lambda: state)
  out["encode_gbps"], out["decode_gbps"] = {}, {}
  for label in ("raw", "zstd", "blosc"):
    options = variants[label]
    t_enc = _median_time(lambda: list(codec.encode_groups(state, options=options)), repeats)
    store = codec.MemoryStore()
    codec.encode_state(state, store, model_id=name, config_fingerprint=fingerprint,
                       options=options)
    t_dec = _median_time(lambda: jax.block_until_ready(codec.decode_state(store, like=like)),
                         repeats)
    out["encode_gbps"][label] = live_bytes / t_enc / 1e9
    out["decode_gbps"][label] = live_bytes / t_dec / 1e9
  out["encode_gbps"]["baseline_tobytes"] = live_bytes / t_tobytes / 1e9
  out["decode_gbps"]["baseline_frombuffer"] = live_bytes / t_frombuffer / 1e9
  out["encode_vs_baseline"] = out["encode_gbps"]["raw"] / out["encode_gbps"]["baseline_tobytes"]
  out["decode_vs_baseline"] = (out["decode_gbps"]["raw"]
                               / out["decode_gbps"]["baseline_frombuffer"])
  progress.update()

  # gRPC goodput versus raw TCP, same bytes, receiver in another process.
  groups = list(codec.encode_groups(state))
  blobs = [b for g in groups for b in g.blobs.values()]
  payload = sum(len(b) for b in blobs)
  rx = transfer_planes.Child(_serve_grpc, {name: fingerprint}, None)
  tcp = transfer_planes.Child(_serve_tcp)
  null = transfer_planes.Child(transfer_planes.serve_null)
  try:
    _bare_grpc_send(null.port, groups)
    t_bare = statistics.median(_bare_grpc_send(null.port, groups) for _ in range(repeats))
    grpc_runs = {}
    for streams in sorted({1, FLAGS.streams}):
      sender = StateSender(f"127.0.0.1:{rx.port}",
                           options=SenderOptions(num_streams=streams, num_connections=streams))
      durations, example = [], None
      for r in range(repeats + 1):  # first run warms up channels
        with sender.begin(model_id=name, config_fingerprint=fingerprint,
                          num_layers=config.n_layers, lengths=[n_tokens]) as tx:
          for g in groups:
            tx.send_encoded(g)
          result = tx.finish()
        if r:
          durations.append(result.timeline.duration_s)
          example = result.timeline
      sender.close()
      grpc_runs[streams] = {"goodput_gbps": payload / statistics.median(durations) / 1e9,
                            "timeline": example.to_dict()}
    _tcp_send(tcp.port, blobs)
    t_tcp = statistics.median(_tcp_send(tcp.port, blobs) for _ in range(repeats))
  finally:
    rx.stop()
    null.stop()
    try:
      socket.create_connection(("127.0.0.1", tcp.port)).close()
    except OSError:
      pass
    tcp.stop()
  best = max(v["goodput_gbps"] for v in grpc_runs.values())
  out["transfer_payload_bytes"] = payload
  out["grpc_goodput_gbps"] = {str(k): v["goodput_gbps"] for k, v in grpc_runs.items()}
  out["tcp_goodput_gbps"] = payload / t_tcp / 1e9
  out["grpc_vs_tcp"] = best / out["tcp_goodput_gbps"]
  # Same bytes as one bare gRPC stream into a servicer that does nothing:
  # separates gRPC-Python's own cost from this protocol's (Begin, descriptors,
  # verification, Commit).
  out["bare_grpc_goodput_gbps"] = payload / t_bare / 1e9
  out["grpc_vs_bare_grpc"] = best / out["bare_grpc_goodput_gbps"]
  out["grpc_timeline_example"] = grpc_runs[FLAGS.streams]["timeline"]
  progress.update()

  # Time to a restored state at the decode side: layer-wise versus store-then-send.
  options = codec.CodecOptions(compression=FLAGS.pipeline_codec)
  rx = transfer_planes.Child(_serve_grpc, {name: fingerprint}, name)
  sender = StateSender(f"127.0.0.1:{rx.port}",
                       options=SenderOptions(num_streams=FLAGS.streams,
                                             num_connections=FLAGS.streams))
  begin = lambda: sender.begin(model_id=name, config_fingerprint=fingerprint,
                               num_layers=config.n_layers, lengths=[n_tokens], codec=options)

  # Both paths run the same per-layer prefill, so the difference is the overlap alone.
  def serial():
    run = LayerwisePrefill(model, tokens)
    for _ in run:
      pass
    jax.block_until_ready(run.state)
    t_prefill = time.perf_counter()
    encoded = list(codec.encode_groups(run.state, options=options))
    with begin() as tx:
      for g in encoded:
        tx.send_encoded(g)
      return t_prefill, tx.finish()

  def pipelined():
    run = LayerwisePrefill(model, tokens)
    with begin() as tx:
      tx.send_layers(run)
      jax.block_until_ready(run.state)
      t_prefill = time.perf_counter()
      return t_prefill, tx.finish()

  try:
    serial(), pipelined()  # compile and warm up both paths
    runs = {"serial": [], "pipelined": []}
    # Interleaved, so that load from other processes hits both paths alike.
    for _ in range(repeats):
      for label, fn in (("serial", serial), ("pipelined", pipelined)):
        t0 = time.perf_counter()
        t_prefill, result = fn()
        t_ready = time.perf_counter()
        runs[label].append((t_ready - t0, t_prefill - t0, result.timeline))
  finally:
    sender.close()
    rx.stop()
  med = lambda xs: statistics.median(xs)
  out["time_to_ready_s"] = {k: med([r[0] for r in v]) for k, v in runs.items()}
  out["prefill_s"] = {k: med([r[1] for r in v]) for k, v in runs.items()}
  # What pipelining removes: the wait between the end of prefill and a
  # restored state at the decode side.
  out["ready_after_prefill_s"] = {k: med([r[0] - r[1] for r in v]) for k, v in runs.items()}
  out["pipelined_vs_serial"] = med([p[0] / s_[0] for p, s_ in zip(runs["pipelined"],
                                                                     runs["serial"])])
  out["pipelined_vs_serial_after_prefill"] = (out["ready_after_prefill_s"]["pipelined"]
                                              / out["ready_after_prefill_s"]["serial"])
  out["pipelined_timeline_example"] = runs["pipelined"][-1][2].to_dict()
  progress.update()
  return out


def _auto_lanes() -> int:
  """--lanes=0 with --wan: the connections ``SenderOptions(lanes=0)`` picks
  for the emulated link and --wan_window_kib."""
  from paas_jax.transport import SenderOptions
  from paas_jax.transport.dataplane.tuning import Tuning
  if FLAGS.wan_rate_gbit <= 0:
    raise app.UsageError("--lanes=0 needs --wan_rate_gbit (the link it is sized for)")
  link = Tuning(rate_bytes_per_s=FLAGS.wan_rate_gbit * 1e9 / 8, rtt_s=FLAGS.wan_rtt_ms / 1e3)
  lanes = SenderOptions(plane="tcp", lanes=0, window_bytes=FLAGS.wan_window_kib << 10,
                        tuning=link).lanes
  print(f"--lanes=0: {lanes} connections for this link", flush=True)
  return lanes


def main(argv):
  del argv
  if FLAGS.lanes == 0 and not FLAGS.wan:
    raise app.UsageError("--lanes=0 (from the link) is for --wan runs")
  from tqdm import tqdm
  models = FLAGS.models
  tokens = [int(t) for t in FLAGS.tokens]
  if len(tokens) == 1:
    tokens = tokens * len(models)
  if len(tokens) != len(models):
    raise app.UsageError("--tokens needs one value or one per model")
  results = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                         "python": platform.python_version(),
                         "load_average_at_start": os.getloadavg()},
             "flags": {"models": models, "tokens": tokens, "repeats": FLAGS.repeats,
                       "streams": FLAGS.streams, "pipeline_codec": FLAGS.pipeline_codec},
             "models": {}}
  if FLAGS.wan:
    from experiments import wan_planes
    from paas_jax.models import load_config
    n_lanes = FLAGS.lanes or _auto_lanes()
    ceiling = wan_planes.relay_ceiling(connections=n_lanes)
    best = max(ceiling["by_path"][FLAGS.wan_engine].values())
    rate_bps = FLAGS.wan_rate_gbit * 1e9 if FLAGS.wan_rate_gbit > 0 else best * 8e9 / 2
    results["flags"].update(wan=True, wan_rtt_ms=FLAGS.wan_rtt_ms, wan_rate_bps=rate_bps,
                            lanes=n_lanes, lanes_from_link=not FLAGS.lanes,
                            wan_engine=FLAGS.wan_engine, wan_window_kib=FLAGS.wan_window_kib)
    results["relay_ceiling"] = ceiling
    for path, by_n in ceiling["by_path"].items():
      print(f"raw TCP {path:>8} (GB/s by connections): "
            + ", ".join(f"{n}: {v:.2f} (x{ceiling['vs_direct'][path][n]:.2f} direct)"
                        for n, v in by_n.items()), flush=True)
    for name, n in zip(models, tokens):
      r = wan_planes.wan_utilization(load_config(name), n, rate_bps, FLAGS.wan_rtt_ms / 1e3,
                                     lanes=sorted({1, n_lanes}), repeats=FLAGS.repeats,
                                     window_bytes=FLAGS.wan_window_kib << 10,
                                     engine=FLAGS.wan_engine)
      results["models"][name] = r
      for lanes, v in r["lanes"].items():
        print(f"{name}: link {rate_bps / 1e9:.2f} Gbit/s rtt {FLAGS.wan_rtt_ms:g} ms, "
              f"{lanes} connection(s): goodput {v['goodput_bytes_per_s'] / 1e6:.0f} MB/s, "
              f"utilization {100 * v['utilization']:.0f}%, retransmits {v['retransmits']}")
      fixed = r["fixed_cost"] = wan_planes.wan_fixed_cost(
          load_config(name), rate_bps, FLAGS.wan_rtt_ms / 1e3, lanes=n_lanes,
          repeats=max(FLAGS.repeats, 10), engine=FLAGS.wan_engine)
      print(f"{name}: fixed cost of a {fixed['tokens']}-token state over the link: "
            f"{fixed['median_s'] * 1e3:.1f} ms = {fixed['round_trips']:.2f} raw TCP round "
            f"trips ({fixed['raw_tcp_rtt_s'] * 1e3:.1f} ms)", flush=True)
    with open(FLAGS.json_out, "w") as f:
      json.dump(results, f, indent=2)
    return
  if FLAGS.fixed_cost:
    from paas_jax.models import load_config
    results["flags"].update(fixed_cost=True, lanes=FLAGS.lanes, tls=FLAGS.tls)
    name = models[0]
    results["flags"].update(bundle_bytes=FLAGS.bundle_bytes)
    r = results["models"][name] = transfer_planes.run_fixed_cost(
        load_config(name), lanes=FLAGS.lanes, repeats=FLAGS.repeats, tls=FLAGS.tls,
        tokens=tokens[0], bundle_bytes=None if FLAGS.bundle_bytes < 0 else FLAGS.bundle_bytes)
    results["machine"]["load_average_at_end"] = os.getloadavg()
    with open(FLAGS.json_out, "w") as f:
      json.dump(results, f, indent=2)
    for label, cost in r["fixed_cost"].items():
      print(f"{name} fixed cost ({label}, {cost['state_bytes']} B in {cost['objects']} "
            f"objects; raw TCP rtt {cost['raw_tcp_rtt_s'] * 1e6:.0f} us, target "
            f"{cost['target_s'] * 1e3:.2f} ms): " + ", ".join(
                f"{row} {v['median_s'] * 1e3:.2f} ms" for row, v in cost["rows"].items()))
    return
  if FLAGS.planes:
    from paas_jax.models import load_config
    results["flags"].update(planes=True, lanes=FLAGS.lanes, tls=FLAGS.tls)
    for name, n in zip(models, tokens):
      results["models"][name] = transfer_planes.run(
          load_config(name), n, lanes=FLAGS.lanes, streams=FLAGS.streams,
          repeats=FLAGS.repeats, tls=FLAGS.tls, progress=lambda m: print(m, flush=True))
      with open(FLAGS.json_out, "w") as f:
        json.dump(results, f, indent=2)
    for name, r in results["models"].items():
      print(name, r["payload_bytes"], "bytes")
      for row, v in r["rows"].items():
        print(f"  {row:22s} {v['goodput_gbps']:6.2f} GB/s  (mean {v['mean_s'] * 1e3:.1f} ms, "
              f"slowest {v['max_s'] * 1e3:.1f})  x{v['vs_raw_tcp']:.2f} raw  "
              f"x{v['vs_raw_tcp_kept']:.2f} raw kept  x{v['vs_raw_tcp_kept_crc']:.2f} +crc  "
              f"cpu s/GB tx {v['cpu_s_per_gb_sender']:.3f} rx {v['cpu_s_per_gb_receiver']:.3f}  "
              f"faults/GB tx {v['page_faults_per_gb_sender']:.0f} "
              f"rx {v['page_faults_per_gb_receiver']:.0f}"
              + (f"  fixed {v['fixed_cost']['median_s'] * 1e3:.2f} ms"
                 if "fixed_cost" in v else ""))
      print(f"  raw TCP rtt {r['raw_tcp_rtt_s'] * 1e6:.0f} us; tcp plane vs gRPC path "
            f"x{r['tcp_vs_grpc_path']:.2f}")
      for label, cost in r["fixed_cost"].items():
        print(f"  fixed cost ({label}, {cost['state_bytes']} B, target "
              f"{cost['target_s'] * 1e3:.2f} ms): " + ", ".join(
                  f"{name} {v['median_s'] * 1e3:.2f} ms" for name, v in cost["rows"].items()))
    return
  with tqdm(total=5 * len(models), desc="bench_transfer") as progress:
    for name, n in zip(models, tokens):
      progress.set_postfix_str(name)
      results["models"][name] = bench_model(name, n, progress)
      with open(FLAGS.json_out, "w") as f:
        json.dump(results, f, indent=2)
  summary = {name: {k: r[k] for k in ("bytes_ratio", "grpc_vs_tcp", "grpc_vs_bare_grpc",
                                      "pipelined_vs_serial",
                                      "pipelined_vs_serial_after_prefill",
                                      "encode_vs_baseline", "decode_vs_baseline")}
             for name, r in results["models"].items()}
  print(json.dumps(summary, indent=2))


if __name__ == "__main__":
  app.run(main)
