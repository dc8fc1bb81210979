"""Shared helpers for the kernel tests (random inputs, error metric, tolerances)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# RMS relative error bounds: the kernels and chunked forms compute in f32, so
# the f32 bound is set by reassociation; bf16 inputs/outputs add one rounding
# of the output (2^-8 relative) on top of the bf16-rounded inputs, which both
# sides see identically.
TOL = {np.dtype(np.float32): 2e-5, np.dtype(jnp.bfloat16): 1.5e-2}


def rms_rel_err(actual, expected) -> float:
  """sqrt(mean((a - e)^2)) / sqrt(mean(e^2)), computed in f64 on host."""
  a = np.asarray(actual).astype(np.float64)
  e = np.asarray(expected).astype(np.float64)
  assert a.shape == e.shape, (a.shape, e.shape)
  assert np.all(np.isfinite(a)), "non-finite values in result"
  denom = np.sqrt(np.mean(e ** 2))
  return float(np.sqrt(np.mean((a - e) ** 2)) / max(denom, 1e-30))


def assert_close(actual, expected, dtype=np.float32, tol=None, what=""):
  tol = TOL[np.dtype(dtype)] if tol is None else tol
  err = rms_rel_err(actual, expected)
  assert err <= tol, f"{what} rms relative error {err:.3e} > {tol:.1e}"


# Inputs are generated with numpy: eager jax ops would each be compiled on
# first use, which dominates the runtime of small CPU tests.


def _cast(x, dtype):
  return np.asarray(x, np.float32).astype(dtype)


def _normal(rng, shape):
  return rng.standard_normal(shape, dtype=np.float32)


def gated_delta_inputs(seed, b, t, h, dk, dv, *, per_channel, g_min, dtype=np.float32):
  """Unit-norm q/k (as the models feed them), beta in (0, 1), g in [g_min, 0]."""
  rng = np.random.default_rng(seed)
  q = _normal(rng, (b, t, h, dk))
  k = _normal(rng, (b, t, h, dk))
  q /= np.linalg.norm(q, axis=-1, keepdims=True)
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  v = _normal(rng, (b, t, h, dv))
  g_shape = (b, t, h, dk) if per_channel else (b, t, h)
  g = rng.uniform(g_min, 0.0, g_shape).astype(np.float32)
  beta = rng.uniform(0.0, 1.0, (b, t, h))
  s0 = _normal(rng, (b, h, dk, dv))
  return _cast(q, dtype), _cast(k, dtype), _cast(v, dtype), g, _cast(beta, dtype), s0


def ssd_inputs(seed, b, t, h, p, g, n, dtype=np.float32):
  """dt = softplus(N(-1, 1)), A = -exp(U(-1, 1.5)) (Mamba2's ranges), Gaussian x/B/C/state."""
  rng = np.random.default_rng(seed)
  x = _normal(rng, (b, t, h, p))
  dt = np.logaddexp(0.0, _normal(rng, (b, t, h)) - 1.0).astype(np.float32)
  a = -np.exp(rng.uniform(-1.0, 1.5, (h,))).astype(np.float32)
  bm = _normal(rng, (b, t, g, n))
  cm = _normal(rng, (b, t, g, n))
  s0 = _normal(rng, (b, h, p, n))
  return _cast(x, dtype), dt, a, _cast(bm, dtype), _cast(cm, dtype), s0


def attention_inputs(seed, b, t, s, hq, hkv, d, dv=None, dtype=np.float32):
  rng = np.random.default_rng(seed)
  dv = d if dv is None else dv
  return (_cast(_normal(rng, (b, t, hq, d)), dtype), _cast(_normal(rng, (b, s, hkv, d)), dtype),
          _cast(_normal(rng, (b, s, hkv, dv)), dtype))


def attention_numpy(q, k, v, q_pos, kv_pos, window=None, q_seg=None, kv_seg=None, scale=None):
  """Loop-over-rows attention in f64 numpy: the mask rule spelled out literally."""
  q, k, v = (np.asarray(x).astype(np.float64) for x in (q, k, v))
  q_pos, kv_pos = np.asarray(q_pos), np.asarray(kv_pos)
  b, t, hq, d = q.shape
  s, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
  scale = d ** -0.5 if scale is None else scale
  out = np.zeros((b, t, hq, dv))
  for bi in range(b):
    for i in range(t):
      vis = [j for j in range(s)
             if kv_pos[bi, j] >= 0 and kv_pos[bi, j] <= q_pos[bi, i]
             and (window is None or q_pos[bi, i] - kv_pos[bi, j] < window)
             and (q_seg is None or q_seg[bi, i] == kv_seg[bi, j])]
      if not vis:
        continue
      for h in range(hq):
        kh = h // (hq // hkv)
        sc = np.array([q[bi, i, h] @ k[bi, j, kh] for j in vis]) * scale
        p = np.exp(sc - sc.max())
        p /= p.sum()
        out[bi, i, h] = p @ v[bi, vis, kh]
  return out


def scatter_to_pages(seed, kv, page_size, num_pages, *, extra_table_cols=1):
  """Writes contiguous per-sequence caches [b, s, ...] into randomly permuted pages.

  Returns (pages [num_pages, page_size, ...], page_table [b, max_pages]). Unused
  pages hold random junk and unused table slots point at arbitrary pages, so a
  kernel that reads past a sequence's length or ignores the table is caught.
  """
  kv = np.asarray(kv)
  b, s = kv.shape[:2]
  rng = np.random.default_rng(seed)
  per_seq = -(-s // page_size)
  max_pages = per_seq + extra_table_cols
  assert num_pages >= b * per_seq
  perm = rng.permutation(num_pages)
  pages = (rng.standard_normal((num_pages, page_size, *kv.shape[2:])) * 10).astype(kv.dtype)
  table = rng.integers(0, num_pages, size=(b, max_pages)).astype(np.int32)
  for bi in range(b):
    for pi in range(per_seq):
      page = perm[bi * per_seq + pi]
      table[bi, pi] = page
      chunk = kv[bi, pi * page_size:(pi + 1) * page_size]
      pages[page, :chunk.shape[0]] = chunk
  return pages, table


class PallasCase:
  """Mixin for the "INTERPRET = True subclass" pattern.

  A test class mixing this in runs its kernel compiled on the matching
  accelerator (FORM "tpu" or "gpu") and is skipped elsewhere; its subclass
  with INTERPRET = True runs the same tests through the Pallas interpreter on
  any backend, which is what CI on CPU exercises.
  """

  INTERPRET = False
  FORM = "tpu"

  @property
  def IMPL(self):  # pylint: disable=invalid-name
    return f"pallas_{self.FORM}_interpret" if self.INTERPRET else "pallas"

  @property
  def PATH(self):  # pylint: disable=invalid-name
    """The path ``last_impl`` must report after a call."""
    return f"pallas_{self.FORM}" + ("_interpret" if self.INTERPRET else "")

  @pytest.fixture(autouse=True)
  def _needs_backend(self):
    if not self.INTERPRET and jax.default_backend() != self.FORM:
      pytest.skip(f"compiled {self.FORM} kernel needs a {self.FORM} backend")


def lower_for_platform(platform, fn, *args):
  """Lowers ``jit(fn)`` for ``platform`` without that platform's hardware.

  This runs the Pallas-to-Mosaic (TPU) or Pallas-to-Triton (CUDA) lowering of
  the kernels, catching unsupported ops, bad block shapes and the like on a
  CPU-only machine. (Compilation of the lowered IR needs the hardware.)
  """
  checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
  return jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)(*args)
