"""Chunk-pipelined vs store-then-send state transfer, on the real engine.

For each prompt length, a real ``PrefillEngine`` (default ``hybrid_100m``)
prefills a prompt and its state crosses a throttled link (the userspace netem
relay, bandwidth set so that sending the whole state takes about as long as the
prefill: ``--link_ratio``) over the real gRPC transport into a real receiver:

* pipelined: ``chunk_sink`` -> ``ChunkStreamer``: every chunk's layers leave as
  they are computed (segments, commit points; ``commit_points.SegmentAssembler``
  on the receiving side);
* store-then-send: prefill, then one transfer of the whole state.

Both with the prefix cache off and on (cold: a prompt it has not seen; warm: a
prompt whose first half it holds, so the cached blocks are sent first).

Reported per case, side by side in one run: ``ready_after_prefill_s`` (the
receiver holds the whole verified state, minus the end of prefill), the
whole transfer time (store-then-send: Begin to Commit of the one transfer),
and ``remaining_ratio`` = pipelined ready-after-prefill / store-then-send
whole transfer. Target: <= 0.2.

  .venv/bin/python experiments/bench_pipeline.py --lengths=2048,8192
"""

from __future__ import annotations

import time

import jax
import numpy as np
from absl import app, flags

from paas_jax.jsonutil import write_json
from paas_jax.netem.link import Link, LinkSpec
from paas_jax.netem.relay import Relay, Route
from paas_jax.serving import common
from paas_jax.serving.chunk_stream import (GROWING_CACHES, ChunkStreamer, SegmentId,
                                           segment_template, slice_chunk)
from paas_jax.serving.commit_points import SegmentAssembler
from paas_jax.serving.engine import EngineConfig, PrefillEngine, PrefillInput, RequestParams
from paas_jax.state import abstract_state, round_up
from paas_jax.transport import (ReceiverOptions, SenderOptions, StateReceiver, StateSender,
                                serve_receiver)

FLAGS = flags.FLAGS
flags.DEFINE_string("config", "hybrid_100m", "Model config (random init).")
flags.DEFINE_list("lengths", ["2048", "8192"], "Prompt lengths (tokens).")
flags.DEFINE_integer("chunk", 512, "Prefill chunk (tokens): the segment size.")
flags.DEFINE_integer("commit_every", 2, "Chunks per commit point.")
flags.DEFINE_integer("prefix_block", 256, "Prefix cache block (the 'on' cases).")
flags.DEFINE_list("cache", ["off", "cold", "warm"], "Prefix cache cases.")
flags.DEFINE_float("link_ratio", 1.0, "Whole-state transfer time / prefill time on the link.")
flags.DEFINE_float("rtt_ms", 10.0, "Link round-trip time.")
flags.DEFINE_integer("streams", 2, "Push streams per transfer.")
flags.DEFINE_string("json_out", "runs/bench_pipeline.json", "Where to write the JSON.")


class Receiver:
  """Region B's StateTransfer port: whole states and segments."""

  def __init__(self, config):
    self.config = config
    self.assembler = SegmentAssembler(config)
    self.ready_s: dict[str, float] = {}
    self.receiver = StateReceiver(
        models={config.name: config.fingerprint()}, template=self._template,
        on_ready=self._ready, options=ReceiverOptions(byte_budget=4 << 30))
    self.server = serve_receiver(self.receiver)

  def _template(self, info):
    if info.transfer_id.startswith("seg:"):
      return segment_template(self.config, SegmentId.parse(info.transfer_id)), None
    return abstract_state(self.config, 1, round_up(max(info.token_count, 1))), None

  def _ready(self, received):
    tid = received.info.transfer_id
    if tid.startswith("seg:"):
      self.assembler.add(tid, received.state)
    else:
      self.ready_s[tid] = time.time()

  def stop(self):
    self.server.stop(0)


def _prompt(n: int, salt: int, vocab: int) -> tuple[int, ...]:
  return tuple(int(t) for t in np.random.default_rng(salt).integers(0, vocab, n))


def _slice_only(model):
  """A chunk sink that slices and copies like ChunkStreamer.put, sending nothing
  (warm-up: compiles the slices)."""
  def sink(layer, cache, start, n_valid):
    del layer
    jax.block_until_ready(slice_chunk(cache, 0, start, start + int(n_valid[0])))
  return sink


def _state_bytes(state, length: int) -> int:
  """Bytes of a batch-1 state's live part (growing caches cut to ``length``)."""
  total = 0
  for cache in state.layers:
    growing = isinstance(cache, GROWING_CACHES)
    for x in jax.tree_util.tree_leaves(cache):
      total += x[:, :length].nbytes if growing else x.nbytes
  return total


def run_pipelined(engine, sender, prompt, rid):
  cfg = engine.model.config
  streamer = ChunkStreamer(sender, cfg, rid, len(prompt), chunk=FLAGS.chunk,
                           commit_every=FLAGS.commit_every, max_pending=256)

  def sink(layer, cache, start, n_valid):
    streamer.put(layer, cache, start, start + int(n_valid[0]))
  t0 = time.time()
  out = engine.prefill([PrefillInput(rid, prompt, RequestParams())], chunk_sink=sink)[0]
  t_end = time.time()
  result = streamer.close()
  assert result.ok, result
  begins = [s.begin_s for s in result.segments if s.begin_s is not None]
  return {"prefill_s": t_end - t0, "ready_after_prefill_s": result.last_commit_s - t_end,
          "transfer_s": result.last_commit_s - min(begins),
          "first_byte_after_start_s": result.first_byte_s - t0,
          "state_bytes": result.state_bytes, "bytes_sent": result.bytes_sent,
          "segments": len(result.segments), "cached_tokens": out.cached_tokens}


def run_store_then_send(engine, sender, prompt, rid):
  cfg = engine.model.config
  t0 = time.time()
  out = engine.prefill([PrefillInput(rid, prompt, RequestParams())])[0]
  t_end = time.time()
  host = jax.tree_util.tree_map(np.asarray, out.state)
  tx = sender.begin(model_id=cfg.name, config_fingerprint=cfg.fingerprint(),
                    num_layers=cfg.n_layers, lengths=[len(prompt)], transfer_id=rid,
                    token_count=len(prompt))
  for i, cache in enumerate(host.layers):
    tx.send_layer(i, cache)
  tl = tx.finish().timeline
  return {"prefill_s": t_end - t0, "ready_after_prefill_s": tl.end_s - t_end,
          "transfer_s": tl.duration_s, "state_bytes": tl.state_bytes,
          "bytes_sent": tl.bytes_sent, "cached_tokens": out.cached_tokens}


def bench_length(model, length: int, receiver: Receiver, cases) -> dict:
  vocab = model.config.vocab_size
  max_ctx = -(-(length + 1) // FLAGS.chunk) * FLAGS.chunk + FLAGS.chunk
  base = dict(n_slots=1, max_ctx=max_ctx, prefill_buckets=(FLAGS.chunk,), prefill_max_batch=1)
  off = PrefillEngine(model, EngineConfig(**base))
  cached = EngineConfig(**base, prefix_block=FLAGS.prefix_block, prefix_cache_bytes=4 << 30)
  # Compile every path (plain, chunk-streamed, cached, cached-streamed, a cache
  # hit), then measure the prefill alone, to size the link.
  # Compiled shapes depend on the chunk and the engine's capacity, not on the
  # prompt: short warm-up prompts (a few chunks) compile them.
  warm = _prompt(length, 1, vocab)
  short = warm[:min(length, 3 * FLAGS.chunk)]
  off.prefill([PrefillInput("w", short, RequestParams())])
  off.prefill([PrefillInput("w", short, RequestParams())], chunk_sink=_slice_only(model))
  if set(cases) - {"off"}:
    e = PrefillEngine(model, cached)
    e.prefill([PrefillInput("w", short, RequestParams())])
    e.prefill([PrefillInput("w", short[:len(short) // 2] + _prompt(len(short) - len(short) // 2,
                                                                   2, vocab),
                            RequestParams())], chunk_sink=_slice_only(model))
  t0 = time.perf_counter()
  ref = off.prefill([PrefillInput("w", warm, RequestParams())])[0]
  prefill_s = time.perf_counter() - t0
  host = jax.tree_util.tree_map(np.asarray, ref.state)
  state_bytes = _state_bytes(host, length)
  bandwidth = state_bytes * 8 / (prefill_s * FLAGS.link_ratio)
  link = LinkSpec(bandwidth_bps=bandwidth, rtt_s=FLAGS.rtt_ms / 1e3)
  relay = Relay(link, [Route("t", "127.0.0.1:0", receiver.server.target, Link.A_TO_B)]).start()
  out = {"length": length, "prefill_alone_s": prefill_s, "state_bytes_est": state_bytes,
         "link_bandwidth_bps": bandwidth, "cases": {}}
  try:
    # Begin of a segment waits behind the bytes already queued on the link; on
    # this CPU bench the link is slow (sized to a slow prefill), so the control
    # RPC deadline is raised from the default 10 s.
    options = SenderOptions(num_streams=FLAGS.streams, rpc_timeout_s=600.0)
    with StateSender(relay.address("t"), options=options) as s:
      for case in cases:
        row = {}
        for method, fn in (("store_then_send", run_store_then_send),
                           ("pipelined", run_pipelined)):
          # A fresh engine (and empty prefix cache) per run; compiled code is shared.
          engine = off if case == "off" else PrefillEngine(model, cached)
          prompt = _prompt(length, hash((length, case, method)) % 10_000, vocab)
          if case == "warm":  # the first half cached: its blocks are sent, not recomputed
            engine.prefill([PrefillInput("seed", prompt[:length // 2] + (0,),
                                         RequestParams())])
          row[method] = fn(engine, s, prompt, f"{case}-{method}-{length}")
          print(f"L={length} cache={case} {method}: {row[method]}", flush=True)
        whole = row["store_then_send"]["transfer_s"]
        row["remaining_ratio"] = row["pipelined"]["ready_after_prefill_s"] / whole
        row["ready_speedup"] = (row["store_then_send"]["ready_after_prefill_s"]
                                / max(row["pipelined"]["ready_after_prefill_s"], 1e-6))
        out["cases"][case] = row
        print(f"L={length} cache={case}: remaining after prefill / whole transfer = "
              f"{row['remaining_ratio']:.3f} (target <= 0.2)", flush=True)
  finally:
    relay.stop()
  return out


def main(argv):
  del argv
  common.enable_compilation_cache(common.default_compilation_cache())
  model, _ = common.load_model(FLAGS.config, 0)
  receiver = Receiver(model.config)
  results = {"config": FLAGS.config, "chunk": FLAGS.chunk, "commit_every": FLAGS.commit_every,
             "prefix_block": FLAGS.prefix_block, "link_ratio": FLAGS.link_ratio,
             "rtt_ms": FLAGS.rtt_ms, "devices": [str(d) for d in jax.devices()],
             "target_remaining_ratio": 0.2, "lengths": []}
  try:
    for length in (int(x) for x in FLAGS.lengths):
      results["lengths"].append(bench_length(model, length, receiver, FLAGS.cache))
      write_json(FLAGS.json_out, results)  # partial results survive a timeout
  finally:
    receiver.stop()
  print(f"wrote {FLAGS.json_out}")


if __name__ == "__main__":
  app.run(main)
