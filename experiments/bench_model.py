"""Prefill and decode throughput of the tiny and ~100M hybrids vs dense baselines,
and sparse vs dense MoE dispatch on a many-expert, small-top-k MoE hybrid.

  python experiments/bench_model.py --json_out=runs/bench_model.json
  python experiments/bench_model.py --models= --moe_prompt_len=256  # MoE part only

Runs on whatever backend JAX finds. Compilation is excluded (one warm-up call
per shape); every timed call ends with ``block_until_ready``. The MoE part
times the same parameters with ``dispatch="dense"`` (every expert on every
token, the reference) and ``dispatch="sparse"`` (sort by expert + grouped
matmuls) side by side, and one MoE layer alone to show where the time goes.
"""

from __future__ import annotations

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
from pallas_kernels import last_impl
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
  write_json(FLAGS.json_out, result)


if __name__ == "__main__":
  app.run(main)
