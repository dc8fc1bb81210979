"""Prefill and decode throughput of the tiny and ~100M hybrids vs dense baselines,
and sparse vs dense MoE dispatch on a many-expert, small-top-k MoE hybrid.

  python experiments/bench_model.py --json_out=runs/bench_model.json
  python experiments/bench_model.py --models= --moe_prompt_len=256  # MoE part only
  python experiments/bench_model.py --models= --nomoe --decode_model= --compile_model= \
      --insert_max_ctx=2048,8192,32768   # insert cost vs max_ctx only
  python experiments/bench_model.py --models= --nomoe --decode_model= --compile_model= \
      --kernel_models= --insert_model= --loop_models=tiny_gdn_gqa,hybrid_100m  # decode loop

Runs on whatever backend JAX finds. Compilation is excluded (one warm-up call
per shape); every timed call ends with ``block_until_ready``. The MoE part
times the same parameters with ``dispatch="dense"`` (every expert on every
token, the reference) and ``dispatch="sparse"`` (sort by expert + grouped
matmuls) side by side, and one MoE layer alone to show where the time goes.
"""

from __future__ import annotations

import os
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

from paas_jax.jsonutil import write_json
from tqdm import tqdm

from paas_jax.models import (AttentionConfig, GatedDeltaConfig, ModelConfig, MoEConfig, api,
                             load_config)
from paas_jax.models.layers import MoE
from paas_jax.serving.decode_engine import DecodeEngine
from paas_jax.serving.engine_config import EngineConfig
from paas_jax.serving.slot_pool import generate_step, insert_core
from paas_jax.serving.validation import RequestParams
from pallas_kernels import clear_impl_records, last_impl
from pallas_kernels.gated_delta import reference as gdn_reference

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["tiny_gdn_gqa", "tiny_dense_gqa", "hybrid_100m", "dense_100m"],
                  "Model configs to benchmark.")
flags.DEFINE_list("batch_sizes", ["1", "8"], "Batch sizes.")
flags.DEFINE_integer("prompt_len", 512, "Prefill length.")
flags.DEFINE_integer("decode_steps", 32, "Timed decode steps.")
flags.DEFINE_integer("repeats", 3, "Timed prefill repetitions (best is reported).")
flags.DEFINE_string("json_out", "runs/bench_model.json", "Output JSON.")
flags.DEFINE_bool("moe", True, "Also benchmark sparse vs dense MoE dispatch.")
flags.DEFINE_string("decode_model", "hybrid_100m",
                    "Model of the decode-overhead comparison (empty: skip).")
flags.DEFINE_integer("decode_overhead_steps", 16, "Timed steps per decode-overhead run.")
flags.DEFINE_string("compile_model", "hybrid_100m",
                    "Model of the cold-compile comparison (empty: skip).")
flags.DEFINE_integer("compile_prompt_len", 512, "First prefill shape of the compile comparison.")
flags.DEFINE_integer("moe_experts", 64, "Routed experts of the MoE benchmark model.")
flags.DEFINE_integer("moe_top_k", 4, "Experts per token of the MoE benchmark model.")
flags.DEFINE_integer("moe_prompt_len", 256, "Prefill length of the MoE benchmark.")
flags.DEFINE_list("moe_batch_sizes", ["1", "8"], "Decode batch sizes of the MoE benchmark.")
flags.DEFINE_integer("moe_decode_steps", 8, "Timed decode steps of the MoE benchmark.")
flags.DEFINE_list("kernel_models", ["tiny_gdn_gqa", "tiny_kda_mla", "tiny_mamba2_gqa",
                                    "tiny_swa_gqa"],
                  "Models run whole on --kernel_impl vs XLA (empty: skip).")
flags.DEFINE_string("kernel_impl", "pallas_interpret",
                    "Kernel path of the whole-model comparison: pallas_interpret on CPU, "
                    "pallas (compiled) on GPU/TPU.")
flags.DEFINE_string("insert_model", "hybrid_100m",
                    "Model of the insert-cost vs max_ctx comparison (empty: skip).")
flags.DEFINE_integer("insert_state_len", 1024, "Tokens of the inserted (transferred) state.")
flags.DEFINE_list("insert_max_ctx", ["2048", "8192", "32768"], "Decode pool max_ctx values.")
flags.DEFINE_integer("insert_repeats", 5, "Timed inserts per path and max_ctx (best kept).")
flags.DEFINE_list("loop_models", ["tiny_gdn_gqa", "hybrid_100m"],
                  "Models of the serving decode-loop comparison (empty: skip).")
flags.DEFINE_list("loop_windows", ["4", "16"], "Decode steps per device call compared.")
flags.DEFINE_integer("loop_steps", 32, "Timed decode steps per decode-loop path and repeat.")
flags.DEFINE_list("loop_sampling", ["greedy", "sampled"],
                  "Sampling of the decode-loop requests (greedy: temperature 0; sampled: "
                  "temperature 0.8, top-p 0.9).")
flags.DEFINE_integer("loop_repeats", 3, "Alternating repeats of the decode-loop paths (best).")

OPS = ("chunk_gated_delta", "gated_delta_step", "flash_attention", "paged_attention",
       "paged_mla_attention", "ssd", "ssd_step", "grouped_matmul")


def moe_bench_config(n_experts: int, top_k: int) -> ModelConfig:
  """A Qwen3-Next-shaped MoE hybrid (GDN : gated GQA 3:1, softmax top-k with a
  gated shared expert) with many small experts: 8 layers, d_model 512,
  experts 512 wide; ~56M parameters active per token at top-4 of 64."""
  return ModelConfig(
      name=f"moe_{n_experts}x{top_k}", vocab_size=32_000, d_model=512, n_layers=8,
      layer_pattern="GGGA", d_ff=1024,
      attention=AttentionConfig(n_heads=8, n_kv_heads=2, head_dim=64, output_gate=True,
                                qk_norm=True),
      gated_delta=GatedDeltaConfig(n_k_heads=4, n_v_heads=8, head_k_dim=64, head_v_dim=64),
      moe=MoEConfig(n_experts=n_experts, top_k=top_k, d_expert=512, n_shared_experts=1,
                    d_shared=512, shared_gate=True),
      max_seq_len=4096)


def _best_of(fn, repeats: int) -> float:
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    best = min(best, time.perf_counter() - t0)
  return best


def moe_layer_ms(model: api.Model, tokens: int, repeats: int) -> dict:
  """One MoE layer alone, dense vs sparse, on ``tokens`` random rows (ms)."""
  layer = next(b.ffn for b in model.module().blocks if isinstance(b.ffn, MoE))
  graphdef, params = nnx.split(layer)
  x = jax.random.normal(jax.random.key(0), (tokens, model.config.d_model), jnp.float32)
  out = {}
  for dispatch in ("dense", "sparse"):
    def call(p, v, dispatch=dispatch):
      mod = nnx.merge(graphdef, p)
      mod.dispatch = dispatch
      return mod(v)
    fn = jax.jit(call)
    jax.block_until_ready(fn(params, x))
    out[dispatch] = 1e3 * _best_of(lambda: fn(params, x), repeats)
  return out


def bench_moe(repeats: int) -> dict:
  """Dense vs sparse dispatch of the same MoE model: prefill and decode tokens/s."""
  config = moe_bench_config(FLAGS.moe_experts, FLAGS.moe_top_k)
  sparse = api.Model.create(config)
  models = {"dense": sparse.with_moe_dispatch("dense"), "sparse": sparse}
  moe_params = sum(int(np.prod(x.shape)) for path, x in jax.tree_util.tree_leaves_with_path(
      sparse.params) if any(getattr(k, "key", None) in ("w_gate", "w_up", "w_down")
                            for k in path))
  active = sparse.n_params - moe_params * (1 - config.moe.top_k / config.moe.n_experts)
  rows = []
  for batch in [int(b) for b in FLAGS.moe_batch_sizes]:
    # Prefill is compared at batch 1; larger batches measure decode after a
    # short prompt (dense prefill of batch x prompt tokens would dominate the run).
    prompt = FLAGS.moe_prompt_len if batch == 1 else 32
    for dispatch, model in models.items():
      r = bench(model, batch, prompt, FLAGS.moe_decode_steps, repeats)
      rows.append({"dispatch": dispatch, "batch": batch, "prompt_len": prompt, **r})
      print(f"  moe {dispatch:6s} batch {batch}: prefill {r['prefill_tokens_per_s']:9.0f} tok/s, "
            f"decode {r['decode_tokens_per_s']:8.1f} tok/s", flush=True)
  by = {(r["dispatch"], r["batch"]): r for r in rows}
  ratios = {f"batch{b}": {
      "prefill_sparse_over_dense": by["sparse", b]["prefill_tokens_per_s"]
                                   / by["dense", b]["prefill_tokens_per_s"],
      "decode_sparse_over_dense": by["sparse", b]["decode_tokens_per_s"]
                                  / by["dense", b]["decode_tokens_per_s"]}
      for b in sorted({r["batch"] for r in rows})}
  layer = moe_layer_ms(sparse, FLAGS.moe_prompt_len, repeats)
  return {"config": config.name, "n_experts": config.moe.n_experts, "top_k": config.moe.top_k,
          "n_params": sparse.n_params, "active_params": int(active),
          "prompt_len": FLAGS.moe_prompt_len, "rows": rows, "ratios": ratios,
          "one_moe_layer_ms": layer, "grouped_matmul_impl": last_impl("grouped_matmul"),
          "backend": jax.default_backend()}


def bench(model: api.Model, batch: int, prompt_len: int, steps: int, repeats: int) -> dict:
  rng = np.random.RandomState(0)
  tokens = rng.randint(0, model.config.vocab_size, size=(batch, prompt_len)).astype(np.int32)
  logits, state = api.prefill(model, tokens)  # compile
  jax.block_until_ready(logits)
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    logits, state = api.prefill(model, tokens)
    jax.block_until_ready(logits)
    best = min(best, time.perf_counter() - t0)
  # Room for every decode step up front, so no step pays for growing the cache.
  state = state.grow(prompt_len + steps + 64)
  next_tokens = np.argmax(np.asarray(logits[:, -1]), -1).astype(np.int32)
  logits, warm = api.decode_step(model, state, next_tokens)  # compile
  jax.block_until_ready(logits)
  t0 = time.perf_counter()
  for _ in range(steps):
    logits, state = api.decode_step(model, state, next_tokens)
  jax.block_until_ready(logits)
  decode_s = time.perf_counter() - t0
  return {"prefill_tokens_per_s": batch * prompt_len / best,
          "decode_tokens_per_s": batch * steps / decode_s,
          "decode_step_ms": decode_s / steps * 1e3, "prefill_s": best}


def decode_overhead(name: str, steps: int) -> dict:
  """Decode tokens/s of the pre-#17 step (host sync per step, graphdef hashed
  per call, state copied) vs the current one (no sync, donated state), side
  by side at batch 1 and 8, alternating twice and keeping the best."""
  model = api.Model.create(load_config(name))
  out = {"model": name, "steps": steps}
  for batch in (1, 8):
    tokens = np.random.RandomState(0).randint(0, model.config.vocab_size, (batch, 64))
    logits, state = api.prefill(model, tokens.astype(np.int32))
    state = state.grow(64 + 4 * steps + 64)
    feed = jax.device_put(np.argmax(np.asarray(logits[:, -1]), -1).astype(np.int32))
    paths = {"host_synced": lambda s: api.decode_step_host_synced(model, s, feed),
             "no_sync_donated": lambda s: api.decode_step(model, s, feed, donate=True)}
    best = {}
    for _ in range(2):
      for label, step in paths.items():
        s = jax.tree_util.tree_map(jnp.copy, state)
        logits, s = step(s)  # compile / warm
        jax.block_until_ready(logits)
        t0 = time.perf_counter()
        for _ in range(steps):
          logits, s = step(s)
        jax.block_until_ready(logits)
        best[label] = min(best.get(label, float("inf")), time.perf_counter() - t0)
    out[f"batch{batch}"] = {f"{k}_tokens_per_s": batch * steps / v for k, v in best.items()}
    out[f"batch{batch}"]["speedup"] = best["host_synced"] / best["no_sync_donated"]
  return out


def cold_compile(name: str, prompt_len: int) -> dict:
  """Seconds to compile the first prefill shape with the old (unrolled) and
  the new (blocked, rolled) gated-delta chunk inverse, jit caches cleared
  before each; compile = first call - a warm call."""

  model = api.Model.create(load_config(name))
  tokens = np.random.RandomState(0).randint(0, model.config.vocab_size, (1, prompt_len))
  out = {"model": name, "prompt_len": prompt_len}
  try:
    for variant in ("unrolled", "blocked"):
      gdn_reference.set_chunk_inverse(variant)
      jax.clear_caches()
      t0 = time.perf_counter()
      jax.block_until_ready(api.prefill(model, tokens.astype(np.int32))[0])
      first = time.perf_counter() - t0
      warm = _best_of(lambda: api.prefill(model, tokens.astype(np.int32))[0], 2)
      out[variant] = {"first_call_s": first, "warm_s": warm, "compile_s": first - warm}
      print(f"  cold compile {name} prompt {prompt_len}, {variant} inverse: "
            f"{first - warm:.1f} s", flush=True)
  finally:
    gdn_reference.set_chunk_inverse("blocked")
  out["compile_ratio_new_over_old"] = out["blocked"]["compile_s"] / out["unrolled"]["compile_s"]
  return out


def model_on_kernels(name: str, impl: str, prompt_len: int = 48, steps: int = 4) -> dict:
  """The whole model's prefill and greedy decode on ``impl`` vs on XLA: the path each op
  took, the largest logit difference and whether the tokens agree."""
  xla = api.Model.create(load_config(name)).with_kernel_impl("xla")
  tokens = np.random.RandomState(0).randint(0, xla.config.vocab_size, prompt_len)
  out = {"model": name, "impl": impl, "prompt_len": prompt_len, "steps": steps}
  runs = {}
  for label, model in (("xla", xla), (impl, xla.with_kernel_impl(impl))):
    clear_impl_records()  # ops this model does not use stay None
    t0 = time.perf_counter()
    logits, state = api.prefill(model, tokens.astype(np.int32))
    got, seen = [np.asarray(logits[0, -1])], [int(np.argmax(logits[0, -1]))]
    state = state.grow(prompt_len + steps + 64)
    for _ in range(steps):
      step, state = api.decode_step(model, state, np.array([seen[-1]], np.int32))
      got.append(np.asarray(step[0]))
      seen.append(int(np.argmax(step[0])))
    runs[label] = (np.stack(got), seen)
    out[f"{label}_impl_by_op"] = {op: last_impl(op) for op in OPS if last_impl(op)}
    out[f"{label}_s"] = time.perf_counter() - t0
  out["max_abs_logit_diff"] = float(np.abs(runs["xla"][0] - runs[impl][0]).max())
  out["tokens_equal"] = runs["xla"][1] == runs[impl][1]
  print(f"  {name} on {impl}: max |logit diff| {out['max_abs_logit_diff']:.2e}, tokens equal "
        f"{out['tokens_equal']}, {out[f'{impl}_s']:.0f} s", flush=True)
  return out


def _insert_padded_to_max_ctx(engine: DecodeEngine, prefix, slot: int, token: int,
                              params: RequestParams) -> None:
  """The pre-#17 insert (before 9c22c2c): the state's growing caches padded on the
  host to the pool's ``max_ctx`` and every page of the slot's table row written."""
  length = int(np.asarray(prefix.lengths).reshape(-1)[0])
  pages = engine._slot_pages[slot]  # pylint: disable=protected-access
  row = np.full((engine.max_pages,), engine.num_pages, np.int32)
  row[:len(pages)] = pages
  src = tuple(engine._pad_layer(c, engine.max_ctx)  # pylint: disable=protected-access
              for c in prefix.layers)
  s = params.sampling
  engine.pool = insert_core(engine.pool, src, jnp.int32(length), jnp.int32(slot),
                            jnp.asarray(row), jnp.asarray(row), jnp.int32(token),
                            jnp.uint32(params.seed), jnp.float32(s.temperature),
                            jnp.int32(s.top_k), jnp.float32(s.top_p))


def insert_cost(name: str, state_len: int, max_ctxs: list[int], repeats: int) -> dict:
  """Milliseconds to insert one transferred ``state_len``-token state into a decode
  pool of each ``max_ctx``: the current insert (the slot's own pages, power-of-two
  bucket) vs the pre-#17 one (padded to max_ctx), side by side, best of ``repeats``
  after a compile call. Target: the current cost independent of max_ctx."""
  model = api.Model.create(load_config(name))
  tokens = np.random.RandomState(0).randint(0, model.config.vocab_size, (1, state_len))
  _, prefix = api.prefill(model, tokens.astype(np.int32))
  jax.block_until_ready(prefix)
  params = RequestParams()
  rows = []
  for max_ctx in max_ctxs:
    engine = DecodeEngine(model, EngineConfig(n_slots=1, max_ctx=max_ctx))
    paths = {"padded_to_max_ctx": lambda slot: _insert_padded_to_max_ctx(
                 engine, prefix, slot, 1, params),
             "own_pages": lambda slot: engine.insert(prefix, slot, 1, params)}
    best = {}
    for label, insert in paths.items():
      for i in range(repeats + 1):  # the first call compiles
        slot = engine.reserve(state_len + 1)
        t0 = time.perf_counter()
        insert(slot)
        jax.block_until_ready(engine.pool)
        if i:
          best[label] = min(best.get(label, float("inf")), time.perf_counter() - t0)
        engine.free(slot)
    row = {"max_ctx": max_ctx, **{f"{k}_ms": 1e3 * v for k, v in best.items()},
           "speedup": best["padded_to_max_ctx"] / best["own_pages"]}
    rows.append(row)
    print(f"  insert {state_len}-token state, max_ctx {max_ctx}: padded "
          f"{row['padded_to_max_ctx_ms']:.1f} ms, own pages {row['own_pages_ms']:.1f} ms",
          flush=True)
  own = [r["own_pages_ms"] for r in rows]
  padded = [r["padded_to_max_ctx_ms"] for r in rows]
  return {"model": name, "state_len": state_len, "rows": rows,
          "own_pages_largest_over_smallest_max_ctx": own[-1] / own[0],
          "padded_largest_over_smallest_max_ctx": padded[-1] / padded[0],
          "target": "own-pages insert cost independent of max_ctx"}


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def _old_generate_core(graphdef, params, pool):
  """The engine step before issue #17: the graph definition hashed as a plain jit
  static argument on every call, and every row's vocabulary sorted by the
  sampler, greedy rows too (``api.sample_tokens_sorted``)."""
  return generate_step(nnx.merge(graphdef, params), pool, sampler=api.sample_tokens_sorted)


def _fill_engine(engine: DecodeEngine, prefix, params: RequestParams) -> None:
  """Every slot of ``engine`` freed, then holding a copy of ``prefix`` (same positions
  and sampling settings for every path)."""
  for slot in list(engine._slot_pages):  # pylint: disable=protected-access
    engine.free(slot)
  for _ in range(engine.n_slots):
    engine.insert(prefix, engine.reserve(engine.max_ctx), 1, params)


LOOP_SAMPLING = {"greedy": api.SamplingParams(0.0, 0, 1.0),
                 "sampled": api.SamplingParams(0.8, 0, 0.9)}


def decode_loop(name: str, batches: list[int], steps: int, windows: list[int],
                repeats: int, samplings: list[str]) -> dict:
  """The serving decode loop (``DecodeEngine`` over the paged pool), per token and per
  step, side by side and alternating: the pre-#17 engine step (``_old_generate_core``,
  tokens read back every step), the current one-step call (pre-hashed graph,
  argmax only when every row is greedy, tokens read back every step) and
  ``generate_steps(k)`` (k steps in one device call, one read-back per k tokens).
  The largest window approximates the device-only cost; both samplers are timed
  alone on the step's logits. Every new path's tokens must equal the one-step call's
  (and the old path's too when greedy: the old sampler draws over the sorted order)."""
  model = api.Model.create(load_config(name))
  tokens = np.random.RandomState(0).randint(0, model.config.vocab_size, (1, 64))
  _, prefix = api.prefill(model, tokens.astype(np.int32))
  prefix = jax.tree_util.tree_map(np.asarray, prefix)
  out = {"model": name, "steps": steps, "windows": windows, "rows": []}
  for sampling in samplings:
    params = RequestParams(LOOP_SAMPLING[sampling], seed=3)
    for batch in batches:
      engine = DecodeEngine(model, EngineConfig(n_slots=batch, max_ctx=64 + steps + 64))

      def old(engine=engine):
        got = []
        for _ in range(steps):
          engine.pool, tok, _ = _old_generate_core(model.graphdef, model.params, engine.pool)
          got.append(np.asarray(tok))
        return np.stack(got)

      paths = {"old_engine_step": old,
               "engine_step": lambda engine=engine: np.stack(
                   [engine.generate() for _ in range(steps)])}
      for k in windows:
        paths[f"window_{k}"] = lambda engine=engine, k=k: np.concatenate(
            [engine.generate_steps(k) for _ in range(steps // k)])
      best, seen = {}, {}
      for rep in range(repeats + 1):  # the first round compiles
        for label, run in paths.items():
          _fill_engine(engine, prefix, params)
          jax.block_until_ready(engine.pool)
          t0 = time.perf_counter()
          got = run()
          elapsed = time.perf_counter() - t0
          seen[label] = got
          if rep:
            best[label] = min(best.get(label, float("inf")), elapsed)
      s = LOOP_SAMPLING[sampling]
      logits = jax.random.normal(jax.random.key(0), (batch, model.config.vocab_size))
      args = (logits, api.sampling_keys(np.arange(batch, dtype=np.uint32),
                                        jnp.ones((batch,), jnp.int32)),
              jnp.full((batch,), s.temperature), jnp.full((batch,), s.top_k, jnp.int32),
              jnp.full((batch,), s.top_p))
      row = {"sampling": sampling, "batch": batch,
             **{f"{k}_ms_per_step": 1e3 * v / steps for k, v in best.items()},
             **{f"{k}_tokens_per_s": batch * steps / v for k, v in best.items()},
             "speedup_over_old": {k: best["old_engine_step"] / v for k, v in best.items()},
             "sampler_ms": 1e3 * _best_of(lambda: api.sample_tokens(*args), 3),
             "old_sampler_ms": 1e3 * _best_of(lambda: api.sample_tokens_sorted(*args), 3),
             # The old sampler draws over the sorted order: same kept sets and
             # distribution, other tokens for the same keys (greedy: the same).
             "tokens_equal": all(np.array_equal(v, seen["engine_step"]) for v in seen.values()
                                 if sampling == "greedy" or v is not seen["old_engine_step"])}
      out["rows"].append(row)
      print(f"  decode loop {name} {sampling} batch {batch}: " + ", ".join(
          f"{k} {row[f'{k}_ms_per_step']:.2f} ms/step ({row['speedup_over_old'][k]:.2f}x)"
          for k in best) + f"; sampler {row['sampler_ms']:.2f} ms (old "
          f"{row['old_sampler_ms']:.2f}); tokens equal {row['tokens_equal']}", flush=True)
  return out


def main(argv):
  del argv
  rows = []
  jobs = [(m, int(b)) for m in FLAGS.models for b in FLAGS.batch_sizes]
  models = {}
  for name, batch in tqdm(jobs, desc="bench_model"):
    if name not in models:
      models[name] = api.Model.create(load_config(name))
    model = models[name]
    row = {"model": name, "n_params": model.n_params, "batch": batch,
           "prompt_len": FLAGS.prompt_len, "backend": jax.default_backend(),
           **bench(model, batch, FLAGS.prompt_len, FLAGS.decode_steps, FLAGS.repeats)}
    rows.append(row)
  print(f"{'model':16s} {'params':>9s} {'batch':>5s} {'prefill tok/s':>14s} "
        f"{'decode tok/s':>13s}")
  for r in rows:
    print(f"{r['model']:16s} {r['n_params'] / 1e6:8.1f}M {r['batch']:5d} "
          f"{r['prefill_tokens_per_s']:14.0f} {r['decode_tokens_per_s']:13.1f}")
  result = {"models": rows, "impl_by_op": {op: last_impl(op) for op in OPS}}
  if FLAGS.moe:
    moe = bench_moe(FLAGS.repeats)
    result["moe_dispatch"] = moe
    for b, r in moe["ratios"].items():
      print(f"MoE {moe['config']} {b}: sparse/dense prefill {r['prefill_sparse_over_dense']:.2f}x, "
            f"decode {r['decode_sparse_over_dense']:.2f}x")
    print(f"one MoE layer, {moe['prompt_len']} tokens: dense {moe['one_moe_layer_ms']['dense']:.1f} ms,"
          f" sparse {moe['one_moe_layer_ms']['sparse']:.1f} ms")
  if FLAGS.decode_model:
    dec = decode_overhead(FLAGS.decode_model, FLAGS.decode_overhead_steps)
    result["decode_overhead"] = dec
    for b in (1, 8):
      r = dec[f"batch{b}"]
      print(f"decode {dec['model']} batch {b}: {r['host_synced_tokens_per_s']:.1f} -> "
            f"{r['no_sync_donated_tokens_per_s']:.1f} tok/s ({r['speedup']:.2f}x)")
  if FLAGS.compile_model:
    comp = cold_compile(FLAGS.compile_model, FLAGS.compile_prompt_len)
    result["cold_compile"] = comp
    print(f"cold compile {comp['model']}: {comp['unrolled']['compile_s']:.1f} s -> "
          f"{comp['blocked']['compile_s']:.1f} s ({comp['compile_ratio_new_over_old']:.2f}x)")
  if FLAGS.kernel_models:
    result["model_on_kernels"] = [model_on_kernels(m, FLAGS.kernel_impl)
                                  for m in FLAGS.kernel_models]
  if FLAGS.insert_model:
    ins = insert_cost(FLAGS.insert_model, FLAGS.insert_state_len,
                      [int(c) for c in FLAGS.insert_max_ctx], FLAGS.insert_repeats)
    result["insert_cost"] = ins
    print(f"insert {ins['state_len']} tokens: own pages at the largest / smallest max_ctx "
          f"{ins['own_pages_largest_over_smallest_max_ctx']:.2f}x (padded: "
          f"{ins['padded_largest_over_smallest_max_ctx']:.2f}x)")
  if FLAGS.loop_models:
    result["decode_loop"] = [decode_loop(m, [int(b) for b in FLAGS.batch_sizes],
                                         FLAGS.loop_steps, [int(k) for k in FLAGS.loop_windows],
                                         FLAGS.loop_repeats, FLAGS.loop_sampling)
                               for m in FLAGS.loop_models]
  result["load_average"] = os.getloadavg()
  write_json(FLAGS.json_out, result)


if __name__ == "__main__":
  app.run(main)
