"""Chunk-pipelined vs store-then-send state transfer, on the real engine.

For each prompt length, a real ``PrefillEngine`` (default ``hybrid_100m``)
prefills a prompt and its state crosses a throttled link (the userspace netem
relay, bandwidth set so that sending the whole state takes about as long as the
prefill: ``--link_ratio``) over the real gRPC transport into a real receiver:

* pipelined: ``chunk_sink`` -> ``ChunkStreamer``: every chunk's layers leave as
  they are computed (segments, commit points; ``commit_points.SegmentAssembler``
  on the receiving side);
* store-then-send: prefill, then one transfer of the whole state.

The link is sized per case (``--link_sizing=per_case``): on the cold prefill,
except for the warm case, whose prefill computes only the uncached half and
whose link is sized on a timed warm prefill (``cold`` sizes every case on the
cold prefill; a warm case is then link-bound by construction: the link needs
``link_ratio`` cold prefills for bytes that a half-length prefill produces).

Both with the prefix cache off and on (cold: a prompt it has not seen; warm: a
prompt whose first half it holds, so the cached blocks are sent first; held:
the decode side's own cache holds the first half, so the pipelined stream
skips it, ``ChunkStreamer(held=)``, while store-then-send sends the whole state).

Reported per case, side by side in one run: ``ready_after_prefill_s`` (the
receiver holds the whole verified state, minus the end of prefill), the
whole transfer time (store-then-send: Begin to Commit of the one transfer),
and ``remaining_ratio`` = pipelined ready-after-prefill / store-then-send
whole transfer. Target: <= 0.2. ``remaining_ratio_link_bound``: the least
any pipelining could leave on this link (first byte + bytes / bandwidth -
prefill, over the whole transfer): when the pipelined prefill happens to run
faster than the prefill the link was sized on (noisy shared CPUs), or the
stream carries more bytes (the fixed-size state once per commit point: see
``--commit_every``), the link, not the pipelining, sets the remaining part.

Time to first token (TTFT), with and without the first token early, from the
measured parts of the real handoff: region A's first token and its logit probe
(``logit_probe.make_probe``, one decode step after prefill, timed), one link
crossing (rtt / 2) of the control message, and the decode side's probe check
of the received state (``logit_probe.check_state``, timed on the state the
receiver assembled):

* gated (the first token waits for the state): TTFT = prefill +
  max(ready after prefill, probe made + rtt/2) + probe check;
* first token early (``--first_token_early``, the default of the decode
  server): TTFT = prefill + probe made + rtt/2; token 2 still waits for the
  state and its check (the gated TTFT).

Before each length the bench projects its own run time on this machine (one
prefill chunk timed at the prompt's start and one at its end, from a resumed
state: the prefill is about the chunk count times their mean, and the run about
``1 + cases x (2 + link_ratio)`` prefills). A length projected past
``--budget_s`` is not run: its row records the projection and why. The load
average (``os.getloadavg``) is recorded before and after every length.

  .venv/bin/python experiments/bench_pipeline.py --lengths=2048,8192,32768
"""

from __future__ import annotations

import os
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
from paas_jax.serving.engine_config import EngineConfig
from paas_jax.serving.prefill_engine import PrefillEngine, PrefillInput
from paas_jax.serving.validation import RequestParams
from paas_jax.state import abstract_state, init_state, logit_probe, round_up
from paas_jax.transport import (ReceiverOptions, SenderOptions, StateReceiver, StateSender,
                                serve_receiver)

FLAGS = flags.FLAGS
flags.DEFINE_string("config", "hybrid_100m", "Model config (random init).")
flags.DEFINE_list("lengths", ["2048", "8192"], "Prompt lengths (tokens).")
flags.DEFINE_integer("chunk", 512, "Prefill chunk (tokens): the segment size.")
flags.DEFINE_integer("commit_every", 2, "Chunks per commit point.")
flags.DEFINE_integer("prefix_block", 256, "Prefix cache block (the 'on' cases).")
flags.DEFINE_list("cache", ["off", "cold", "warm"], "Prefix cache cases: off, cold, warm "
                  "(region A holds the first half) and held (the decode side holds it: not "
                  "sent, region A computes everything).")
flags.DEFINE_float("link_ratio", 1.0, "Whole-state transfer time / prefill time on the link.")
flags.DEFINE_enum("link_sizing", "per_case", ["per_case", "cold"],
                  "What --link_ratio is taken of: per_case, each case's own prefill (the "
                  "warm case's prefill computes only the uncached half, so its link is "
                  "sized on a timed warm prefill); cold, the cold prefill for every case.")
flags.DEFINE_float("rtt_ms", 10.0, "Link round-trip time.")
flags.DEFINE_integer("streams", 2, "Push streams per transfer.")
flags.DEFINE_string("json_out", "runs/bench_pipeline.json", "Where to write the JSON.")
flags.DEFINE_float("budget_s", 900.0, "A length whose projected run exceeds this is not run "
                   "(the row says why); 0: run every length.")


class Receiver:
  """Region B's StateTransfer port: whole states and segments."""

  def __init__(self, config):
    self.config = config
    self.assembler = SegmentAssembler(config)
    self.ready_s: dict[str, float] = {}
    self.states: dict[str, object] = {}
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
      self.states[tid] = received.state

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


def _first_token(model, out) -> tuple[logit_probe.LogitProbe, float]:
  """Region A's logit probe of its first token (what FirstToken carries), timed."""
  t0 = time.perf_counter()
  probe = logit_probe.make_probe(model, out.state, out.first_token)
  return probe, time.perf_counter() - t0


def _ttft(row: dict, model, state, probe) -> dict:
  """TTFT with and without the first token early (module docstring)."""
  t0 = time.perf_counter()
  check = logit_probe.check_state(model, state, probe)
  check_s = time.perf_counter() - t0
  assert check.ok, check  # the received state is the prefilled one
  token_at_b = row["probe_make_s"] + FLAGS.rtt_ms / 2e3
  gated = max(row["ready_after_prefill_s"], token_at_b) + check_s
  return {"probe_check_s": check_s, "ttft_gated_s": row["prefill_s"] + gated,
          "ttft_early_s": row["prefill_s"] + token_at_b,
          "ttft_gated_after_prefill_s": gated, "ttft_early_after_prefill_s": token_at_b}


def _link_bound(row: dict, bandwidth_bps: float) -> float:
  """The least a pipelined transfer can leave after prefill on this link: its
  bytes cannot all be across before first byte + bytes / bandwidth."""
  return max(0.0, row["first_byte_after_start_s"] + row["bytes_sent"] * 8 / bandwidth_bps
             - row["prefill_s"])


def run_pipelined(engine, sender, prompt, rid, receiver, held=None):
  """``held``: (n, batch-1 state of the prompt's first n tokens) the decode side
  holds in its own prefix cache: segment 0 there, never sent."""
  cfg = engine.model.config
  n_held = 0
  if held is not None:
    n_held, state = held
    receiver.assembler.add(SegmentId(rid, 0, 0, n_held, True).wire(), state)
  streamer = ChunkStreamer(sender, cfg, rid, len(prompt), chunk=FLAGS.chunk,
                           commit_every=FLAGS.commit_every, max_pending=256, held=n_held)

  def sink(layer, cache, start, n_valid):
    streamer.put(layer, cache, start, start + int(n_valid[0]))
  t0 = time.time()
  out = engine.prefill([PrefillInput(rid, prompt, RequestParams())], chunk_sink=sink)[0]
  t_end = time.time()
  # The probe is made on the prefill side while the stream's tail is sent.
  probe, probe_s = _first_token(engine.model, out)
  result = streamer.close()
  assert result.ok, result
  begins = [s.begin_s for s in result.segments if s.begin_s is not None]
  row = {"prefill_s": t_end - t0, "ready_after_prefill_s": result.last_commit_s - t_end,
         "transfer_s": result.last_commit_s - min(begins),
         "first_byte_after_start_s": result.first_byte_s - t0,
         "state_bytes": result.state_bytes, "bytes_sent": result.bytes_sent,
         "segments": len(result.segments), "cached_tokens": out.cached_tokens,
         "held_tokens": n_held, "probe_make_s": probe_s}
  n, state = receiver.assembler.committed_state(rid)
  assert n == len(prompt), (n, len(prompt))
  receiver.assembler.drop(rid)
  row.update(_ttft(row, engine.model, state, probe))
  return row


def run_store_then_send(engine, sender, prompt, rid, receiver):
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
  probe, probe_s = _first_token(engine.model, out)  # while the state crosses
  tl = tx.finish().timeline
  row = {"prefill_s": t_end - t0, "ready_after_prefill_s": tl.end_s - t_end,
         "transfer_s": tl.duration_s, "state_bytes": tl.state_bytes,
         "bytes_sent": tl.bytes_sent, "cached_tokens": out.cached_tokens,
         "probe_make_s": probe_s}
  row.update(_ttft(row, engine.model, receiver.states.pop(rid), probe))
  return row


def _time_warm_prefill(model, cached: EngineConfig, length: int, vocab: int) -> float:
  """Seconds of a warm prefill (a fresh prefix cache holding the prompt's first
  half, as in the warm case), on a prompt of its own."""
  engine = PrefillEngine(model, cached)
  prompt = _prompt(length, 9_999, vocab)
  engine.prefill([PrefillInput("size", prompt[:length // 2] + (0,), RequestParams())])
  t0 = time.perf_counter()
  engine.prefill([PrefillInput("size", prompt, RequestParams())])
  return time.perf_counter() - t0


def _load() -> list[float]:
  return [round(x, 2) for x in os.getloadavg()]


def _time_chunk(engine, prompt, n: int) -> float:
  """Seconds to prefill ``prompt``'s chunk after position ``n`` (from a zero
  state holding n tokens: the same compute as a real one at that position)."""
  cfg = engine.model.config
  state = init_state(cfg, 1, round_up(n))
  state = jax.tree_util.tree_map(np.asarray, state.replace(lengths=np.asarray([n], np.int32)))
  t0 = time.perf_counter()
  engine.prefill([PrefillInput("est", prompt, RequestParams())], resume=(n, state))
  return time.perf_counter() - t0


def project(engine, length: int, cases, vocab: int) -> dict:
  """Projected prefill and bench time of ``length`` on this machine (docstring)."""
  chunk = FLAGS.chunk
  prompt = _prompt(length, 7, vocab)
  ends = (min(2 * chunk, length), length)
  for end in ends:  # compiles (and warms) both
    _time_chunk(engine, prompt[:end], end - min(chunk, end - 1))
  first, last = (_time_chunk(engine, prompt[:end], end - min(chunk, end - 1)) for end in ends)
  prefill_s = -(-length // chunk) * (first + last) / 2
  runs = 1 + len(cases) * (2 + FLAGS.link_ratio)
  if "warm" in cases and FLAGS.link_sizing == "per_case":
    runs += 1  # the timed warm prefill that sizes the warm case's link (and its seed)
  return {"first_chunk_s": first, "last_chunk_s": last, "prefill_s": prefill_s,
          "prefills_per_run": runs, "run_s": prefill_s * runs}


def bench_length(model, length: int, receiver: Receiver, cases) -> dict:
  vocab = model.config.vocab_size
  max_ctx = -(-(length + 1) // FLAGS.chunk) * FLAGS.chunk + FLAGS.chunk
  base = dict(n_slots=1, max_ctx=max_ctx, prefill_buckets=(FLAGS.chunk,), prefill_max_batch=1)
  if length >= model.config.max_seq_len:
    return {"length": length, "skipped": True, "load_avg_before": _load(),
            "why": f"not run: {FLAGS.config} prefills at most {model.config.max_seq_len - 1} "
                   f"tokens (max_seq_len {model.config.max_seq_len})"}
  off = PrefillEngine(model, EngineConfig(**base))
  load_before = _load()
  projected = project(off, length, cases, vocab)
  print(f"L={length}: projected prefill {projected['prefill_s']:.0f} s, run "
        f"{projected['run_s']:.0f} s (load {load_before})", flush=True)
  if FLAGS.budget_s and projected["run_s"] > FLAGS.budget_s:
    return {"length": length, "skipped": True, "projected": projected,
            "load_avg_before": load_before, "load_avg_after": _load(),
            "why": (f"not run: projected {projected['run_s'] / 60:.0f} min on this machine "
                    f"(a {length}-token prefill ~{projected['prefill_s'] / 60:.1f} min from two "
                    f"timed chunks, x{projected['prefills_per_run']:.1f} prefills and "
                    f"transfers for {len(cases)} cache cases) > --budget_s="
                    f"{FLAGS.budget_s:.0f} s, at load {load_before[0]}")}
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
  # Compiles the probe's decode step (the same capacity as every run below).
  assert logit_probe.check_state(model, host, _first_token(model, ref)[0]).ok
  state_bytes = _state_bytes(host, length)
  bandwidth = state_bytes * 8 / (prefill_s * FLAGS.link_ratio)
  out = {"length": length, "prefill_alone_s": prefill_s, "state_bytes_est": state_bytes,
         "link_bandwidth_bps": bandwidth, "link_sizing": FLAGS.link_sizing,
         "projected": projected, "load_avg_before": load_before, "cases": {}}
  # Begin of a segment waits behind the bytes already queued on the link; on
  # this CPU bench the link is slow (sized to a slow prefill), so the control
  # RPC deadline is raised from the default 10 s.
  options = SenderOptions(num_streams=FLAGS.streams, rpc_timeout_s=600.0)
  for case in cases:
    case_bandwidth, sized_on = bandwidth, {"prefill_s": prefill_s, "what": "cold prefill"}
    if case == "warm" and FLAGS.link_sizing == "per_case":
      warm_s = _time_warm_prefill(model, cached, length, vocab)
      case_bandwidth = state_bytes * 8 / (warm_s * FLAGS.link_ratio)
      sized_on = {"prefill_s": warm_s, "what": "warm prefill (first half cached)"}
    link = LinkSpec(bandwidth_bps=case_bandwidth, rtt_s=FLAGS.rtt_ms / 1e3)
    relay = Relay(link, [Route("t", "127.0.0.1:0", receiver.server.target,
                               Link.A_TO_B)]).start()
    try:
      with StateSender(relay.address("t"), options=options) as s:
        row = {"link_bandwidth_bps": case_bandwidth, "link_sized_on": sized_on}
        for method, fn in (("store_then_send", run_store_then_send),
                           ("pipelined", run_pipelined)):
          # A fresh engine (and empty prefix cache) per run; compiled code is shared.
          engine = off if case == "off" else PrefillEngine(model, cached)
          prompt = _prompt(length, hash((length, case, method)) % 10_000, vocab)
          if case == "warm":  # the first half cached: its blocks are sent, not recomputed
            engine.prefill([PrefillInput("seed", prompt[:length // 2] + (0,),
                                         RequestParams())])
          kw = {}
          if case == "held" and method == "pipelined":
            # The decode side's own prefix cache holds the first half (region A's
            # does not): region A computes everything, sends only the rest.
            engine = off
            decode_cache = PrefillEngine(model, cached)
            decode_cache.prefill([PrefillInput("seed", prompt[:length // 2] + (0,),
                                               RequestParams())])
            kw["held"] = decode_cache.export_prefix(prompt)
          elif case == "held":
            engine = off  # store-then-send sends the whole state
          row[method] = fn(engine, s, prompt, f"{case}-{method}-{length}", receiver, **kw)
          print(f"L={length} cache={case} {method}: {row[method]}", flush=True)
        whole = row["store_then_send"]["transfer_s"]
        row["remaining_ratio"] = row["pipelined"]["ready_after_prefill_s"] / whole
        row["remaining_ratio_link_bound"] = (_link_bound(row["pipelined"], case_bandwidth)
                                             / whole)
        row["ready_speedup"] = (row["store_then_send"]["ready_after_prefill_s"]
                                / max(row["pipelined"]["ready_after_prefill_s"], 1e-6))
        for method in ("store_then_send", "pipelined"):
          r = row[method]
          row[f"ttft_early_over_gated_{method}"] = r["ttft_early_s"] / r["ttft_gated_s"]
        row["ttft_pipelined_gated_over_store_then_send"] = (
            row["pipelined"]["ttft_gated_s"] / row["store_then_send"]["ttft_gated_s"])
        out["cases"][case] = row
        print(f"L={length} cache={case}: remaining after prefill / whole transfer = "
              f"{row['remaining_ratio']:.3f} (target <= 0.2); TTFT early/gated "
              f"{row['ttft_early_over_gated_pipelined']:.3f} (pipelined), "
              f"{row['ttft_early_over_gated_store_then_send']:.3f} (store-then-send)", flush=True)
    finally:
      relay.stop()
  out["load_avg_after"] = _load()
  return out


def main(argv):
  del argv
  common.enable_compilation_cache(common.default_compilation_cache())
  model, _ = common.load_model(FLAGS.config, 0)
  receiver = Receiver(model.config)
  results = {"config": FLAGS.config, "chunk": FLAGS.chunk, "commit_every": FLAGS.commit_every,
             "prefix_block": FLAGS.prefix_block, "link_ratio": FLAGS.link_ratio,
             "rtt_ms": FLAGS.rtt_ms, "devices": [str(d) for d in jax.devices()],
             "target_remaining_ratio": 0.2, "cpu_count": os.cpu_count(),
             "budget_s": FLAGS.budget_s, "lengths": []}
  try:
    for length in (int(x) for x in FLAGS.lengths):
      results["lengths"].append(bench_length(model, length, receiver, FLAGS.cache))
      write_json(FLAGS.json_out, results)  # partial results survive a timeout
  finally:
    receiver.stop()
  print(f"wrote {FLAGS.json_out}")


if __name__ == "__main__":
  app.run(main)
