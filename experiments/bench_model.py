"""Prefill and decode throughput of the tiny and ~100M hybrids vs dense baselines.

  python experiments/bench_model.py --json_out=runs/bench_model.json

Runs on whatever backend JAX finds. Compilation is excluded (one warm-up call
per shape); every timed call ends with ``block_until_ready``.
"""

from __future__ import annotations

import time

import jax
import numpy as np
from absl import app, flags

from paas_jax.jsonutil import write_json
from tqdm import tqdm

from paas_jax.models import api, load_config

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["tiny_gdn_gqa", "tiny_dense_gqa", "hybrid_100m", "dense_100m"],
                  "Model configs to benchmark.")
flags.DEFINE_list("batch_sizes", ["1", "8"], "Batch sizes.")
flags.DEFINE_integer("prompt_len", 512, "Prefill length.")
flags.DEFINE_integer("decode_steps", 32, "Timed decode steps.")
flags.DEFINE_integer("repeats", 3, "Timed prefill repetitions (best is reported).")
flags.DEFINE_string("json_out", "runs/bench_model.json", "Output JSON.")


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
  write_json(FLAGS.json_out, rows)


if __name__ == "__main__":
  app.run(main)
