"""Throughput of the kernel ops: XLA paths on CPU; Pallas vs XLA vs reference on accelerators.

For every op (prefill flash attention, paged decode attention, paged MLA, the
chunked gated delta rule with both gates, the chunked SSD scan) and every impl
requested, reports the median wall time over ``--iters`` jitted calls, tokens/s,
achieved GFLOP/s and GB/s from an analytic model of the op (useful work only:
causal halves are not counted, chunk padding is), and the fraction of the
roofline bound max(flops / peak_flops, bytes / peak_bw) reached. The roofline
is only meaningful on an accelerator; the peaks default to an H200 (989 dense
bf16 TFLOP/s, 4.8 TB/s).

Defaults are small so the CPU run finishes in well under a minute.

usage:
  python experiments/bench_kernels.py --json_out=/tmp/bench_kernels.json
  python experiments/bench_kernels.py --impls=pallas,xla,reference --scale=8 --json_out=...
"""

from __future__ import annotations

import functools
import json
import os
import platform
import statistics
import sys
import time
from typing import Callable

from absl import app, flags

# Runnable as a script from the repository root.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FLAGS = flags.FLAGS
flags.DEFINE_string("json_out", None, "Where to write the results (JSON).", required=True)
flags.DEFINE_list("ops", ["flash_attention", "paged_attention", "paged_mla", "gated_delta_gdn",
                          "gated_delta_kda", "ssd"], "Ops to benchmark.")
flags.DEFINE_list("impls", None,
                  "Impls to time (default: xla on CPU; pallas,xla,reference elsewhere).")
flags.DEFINE_integer("scale", 1, "Multiplies the sequence / context lengths of the default sizes.")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Activation / cache dtype.")
flags.DEFINE_integer("iters", 5, "Timed calls per measurement (median reported).")
flags.DEFINE_float("peak_tflops", 989.0, "Peak dense TFLOP/s of the accelerator (H200 bf16).")
flags.DEFINE_float("peak_gbps", 4800.0, "Peak HBM GB/s of the accelerator (H200).")
flags.DEFINE_integer("max_reference_tokens", 4096,
                     "Skip the token-by-token reference above this many tokens (it is slow).")


def _time(fn: Callable, args, iters: int) -> float:
  """Median seconds per call of an already-jitted fn (after one warm-up/compile call)."""
  import jax  # pylint: disable=g-import-not-at-top
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def _cases(dtype, scale):
  """Yields dicts: name, shape, tokens, flops, bytes, make(impl) -> jitted fn, args."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from pallas_kernels.flash_attention import flash_attention  # pylint: disable=g-import-not-at-top
  from pallas_kernels.gated_delta import chunk_gated_delta  # pylint: disable=g-import-not-at-top
  from pallas_kernels.paged_attention import paged_attention, paged_mla_attention  # pylint: disable=g-import-not-at-top
  from pallas_kernels.ssd import ssd  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(0)
  item = jnp.dtype(dtype).itemsize

  def rand(*shape, dt=dtype):
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32), dt)

  # Prefill attention: causal GQA.
  b, t, hq, hkv, d = 1, 512 * scale, 8, 2, 128
  q, k, v = rand(b, t, hq, d), rand(b, t, hkv, d), rand(b, t, hkv, d)
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  yield dict(
      name="flash_attention", shape=f"b={b} t={t} hq={hq} hkv={hkv} d={d} causal",
      tokens=b * t, flops=4 * b * hq * d * t * (t + 1) / 2,
      bytes=item * (q.size * 2 + k.size + v.size),
      make=lambda impl: jax.jit(functools.partial(flash_attention, q_positions=pos,
                                                  kv_positions=pos, impl=impl)),
      args=(q, k, v))

  # Paged decode: ragged contexts over shuffled pages.
  b, n, hq, hkv, d, ps = 8, 1, 16, 2, 128, 16
  ctx = 512 * scale
  lengths = jnp.asarray(np.linspace(ctx // 4, ctx, b).astype(np.int32))
  max_pages = ctx // ps
  num_pages = b * max_pages
  table = jnp.asarray(rng.permutation(num_pages).reshape(b, max_pages).astype(np.int32))
  kp, vp = rand(num_pages, ps, hkv, d), rand(num_pages, ps, hkv, d)
  qd = rand(b, n, hq, d)
  keys_read = int(jnp.sum(lengths))
  yield dict(
      name="paged_attention", shape=f"b={b} n={n} hq={hq} hkv={hkv} d={d} ctx<={ctx} ps={ps}",
      tokens=b * n, flops=4 * n * hq * d * keys_read,
      bytes=item * (2 * keys_read * hkv * d + 2 * qd.size),
      make=lambda impl: jax.jit(functools.partial(paged_attention, impl=impl)),
      args=(qd, kp, vp, lengths, table))

  # Paged absorbed MLA decode (DeepSeek-like latent 512 + rope 64).
  h, r, dr = 16, 512, 64
  lat, rope = rand(num_pages, ps, r), rand(num_pages, ps, dr)
  ql, qr = rand(b, n, h, r), rand(b, n, h, dr)
  yield dict(
      name="paged_mla", shape=f"b={b} n={n} h={h} r={r} dr={dr} ctx<={ctx} ps={ps}",
      tokens=b * n, flops=2 * n * h * (2 * r + dr) * keys_read,
      bytes=item * (keys_read * (r + dr) + 2 * ql.size + qr.size),
      make=lambda impl: jax.jit(functools.partial(paged_mla_attention, sm_scale=0.07,
                                                  impl=impl)),
      args=(ql, qr, lat, rope, lengths, table))

  # Chunked gated delta rule, both gates.
  b, t, h, dk, dv, c = 1, 512 * scale, 4, 128, 128, 64
  for gate in ("gdn", "kda"):
    qg = rand(b, t, h, dk)
    kg = rand(b, t, h, dk)
    kg = kg / jnp.linalg.norm(kg.astype(jnp.float32), axis=-1, keepdims=True).astype(dtype)
    vg = rand(b, t, h, dv)
    g_shape = (b, t, h) if gate == "gdn" else (b, t, h, dk)
    g = -jnp.asarray(rng.uniform(0.0, 0.5, g_shape).astype(np.float32))
    beta = jnp.asarray(rng.uniform(0.0, 1.0, (b, t, h)).astype(np.float32), dtype)
    s0 = jnp.zeros((b, h, dk, dv), jnp.float32)
    # Per token: decayed Grams A and P (2 * 2C dk), the triangular solve
    # (C (dk + dv)), W_k S / Q S / K_end^T U (3 * 2 dk dv) and P U (2 C dv).
    per_tok = 4 * c * dk + c * (dk + dv) + 6 * dk * dv + 2 * c * dv
    yield dict(
        name=f"gated_delta_{gate}", shape=f"b={b} t={t} h={h} dk={dk} dv={dv} C={c}",
        tokens=b * t, flops=b * h * t * per_tok,
        bytes=item * (qg.size + kg.size + 2 * vg.size) + 4 * (g.size + 2 * s0.size),
        make=lambda impl: jax.jit(lambda *xs: chunk_gated_delta(*xs[:5], initial_state=xs[5],
                                                                impl=impl)),
        args=(qg, kg, vg, g, beta, s0))

  # Chunked SSD (Mamba2-like: head_dim 64, state 128, one group).
  b, t, h, p, g, n, c = 1, 512 * scale, 16, 64, 1, 128, 64
  x = rand(b, t, h, p)
  dt = jnp.asarray(np.log1p(np.exp(rng.standard_normal((b, t, h)) - 1)).astype(np.float32))
  a = -jnp.asarray(np.exp(rng.uniform(-1, 1, (h,))).astype(np.float32))
  bm, cm = rand(b, t, g, n), rand(b, t, g, n)
  s0 = jnp.zeros((b, h, p, n), jnp.float32)
  # Per token and head: C.B^T row (2 C n), intra-chunk output (2 C p), state
  # read-out and update (2 * 2 p n).
  yield dict(
      name="ssd", shape=f"b={b} t={t} h={h} p={p} g={g} n={n} C={c}",
      tokens=b * t, flops=b * h * t * (2 * c * n + 2 * c * p + 4 * p * n),
      bytes=item * (2 * x.size + bm.size + cm.size) + 4 * (dt.size + 2 * s0.size),
      make=lambda impl: jax.jit(
          lambda *xs: ssd(*xs[:5], initial_state=xs[5], impl=impl)),
      args=(x, dt, a, bm, cm, s0))


def main(argv):
  del argv
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  backend = jax.default_backend()
  on_accel = backend != "cpu"
  impls = FLAGS.impls or (["pallas", "xla", "reference"] if on_accel else ["xla"])
  dtype = jnp.bfloat16 if FLAGS.dtype == "bfloat16" else jnp.float32
  peak_flops, peak_bw = FLAGS.peak_tflops * 1e12, FLAGS.peak_gbps * 1e9

  rows = []
  for case in _cases(dtype, FLAGS.scale):
    if case["name"] not in FLAGS.ops:
      continue
    for impl in impls:
      row = dict(op=case["name"], impl=impl, shape=case["shape"], tokens=case["tokens"],
                 flops=case["flops"], bytes=case["bytes"])
      if impl == "reference" and case["tokens"] > FLAGS.max_reference_tokens:
        row["skipped"] = "reference too slow at this size"
        rows.append(row)
        continue
      try:
        fn = case["make"](impl)
        secs = _time(fn, case["args"], FLAGS.iters)
      except ValueError as e:  # e.g. impl=pallas on CPU: report, do not hide
        row["error"] = str(e)
        rows.append(row)
        continue
      row.update(seconds=secs, tokens_per_s=case["tokens"] / secs,
                 gflops=case["flops"] / secs / 1e9, gbps=case["bytes"] / secs / 1e9)
      if on_accel:
        bound = max(case["flops"] / peak_flops, case["bytes"] / peak_bw)
        row.update(roofline_fraction=bound / secs,
                   bound="compute" if case["flops"] / peak_flops >= case["bytes"] / peak_bw
                   else "memory")
      rows.append(row)

  # speedup_vs_xla: how many times faster than the XLA path of the same op.
  xla_secs = {r["op"]: r["seconds"] for r in rows if r["impl"] == "xla" and "seconds" in r}
  for r in rows:
    if "seconds" in r and r["op"] in xla_secs:
      r["speedup_vs_xla"] = xla_secs[r["op"]] / r["seconds"]

  header = (f"{'op':<17} {'impl':<16} {'ms':>9} {'tok/s':>11} {'GFLOP/s':>9} {'GB/s':>8} "
            f"{'vs xla':>7}" + (f" {'roofline':>8}" if on_accel else "") + "  shape")
  print(f"backend={backend} devices={jax.devices()} dtype={FLAGS.dtype} scale={FLAGS.scale}")
  print(header)
  for r in rows:
    if "seconds" not in r:
      print(f"{r['op']:<17} {r['impl']:<16} {r.get('error') or r.get('skipped')}")
      continue
    vs_xla = f"{r['speedup_vs_xla']:6.2f}x" if "speedup_vs_xla" in r else f"{'-':>7}"
    line = (f"{r['op']:<17} {r['impl']:<16} {r['seconds'] * 1e3:9.3f} {r['tokens_per_s']:11.1f} "
            f"{r['gflops']:9.2f} {r['gbps']:8.2f} {vs_xla}")
    if on_accel:
      line += f" {r['roofline_fraction']:8.1%}"
    print(line + "  " + r["shape"])

  out = dict(backend=backend, device=str(jax.devices()[0]), jax=jax.__version__,
             host=platform.node(), dtype=FLAGS.dtype, scale=FLAGS.scale, iters=FLAGS.iters,
             peak_tflops=FLAGS.peak_tflops, peak_gbps=FLAGS.peak_gbps, results=rows)
  with open(FLAGS.json_out, "w") as f:
    json.dump(out, f, indent=1)
  print(f"wrote {FLAGS.json_out}")


if __name__ == "__main__":
  app.run(main)
