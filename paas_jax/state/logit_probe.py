"""A compact fingerprint of one decode step's logits, checked at every handoff.

A state that passed the transport's checksums can still be the wrong state
(a bug in paging, a shifted offset, another request's state, a zeroed
recurrent state): the decode side would then stream fluent garbage. The probe
closes that hole at the cost of one decode step on each side:

1. the prefill side runs one plain decode step from the state it sends, fed the
   first token it sampled, and sends ``LogitProbe(token, top-k ids, values)``
   with the handoff;
2. the decode side runs the same step from the state it received and compares
   (``compare``) before any token of the request is streamed.

The comparison is dtype-aware: logits are compared at the probe's ids within
``tolerance(dtype)``, and no other id may rise above the probe's smallest
value by more than that tolerance (a corruption that raises some other token
is caught too). Both sides compute the step with ``probe_logits``, the same
unpaged ``api.decode_step`` on the same bytes, so an intact state gives the same
logits up to the platform's arithmetic.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from paas_jax.models import api
from paas_jax.state.cache import CAPACITY_ALIGN, DecodeState, init_state

# Top-k entries carried by a probe.
PROBE_K = 8
# (absolute, relative to the largest |logit| of the probe) tolerance per
# activation dtype. f32: both sides run the same program on the same bytes,
# 1e-3 leaves room for a different device of the same kind; bf16: a few bf16
# ulps at logit scale (bf16 has 8 mantissa bits: ulp(4) = 0.03).
_TOLERANCE = {"float32": (1e-3, 1e-3), "bfloat16": (0.05, 2e-2), "float16": (0.02, 5e-3)}
# Lossy link codecs (quantised KV) move logits by more; measured on the tiny
# configs with int8 KV (see tests/verify), still far below what a wrong state does.
_LOSSY_FACTOR = 10.0


@dataclasses.dataclass(frozen=True)
class LogitProbe:
  """The fingerprint of the logits of the first decode step.

  Attributes:
    token: the token fed to the probed step (the first sampled token).
    ids: int [k] the k largest logits' ids, largest first.
    values: f32 [k] their logits, rounded to 1e-4.
    dtype: the activation dtype of the model that made it.
  """

  token: int
  ids: tuple[int, ...]
  values: tuple[float, ...]
  dtype: str

  def __post_init__(self):
    if len(self.ids) != len(self.values) or not self.ids:
      raise ValueError(f"LogitProbe needs as many ids as values (>0), got "
                       f"{len(self.ids)} ids and {len(self.values)} values")


@dataclasses.dataclass(frozen=True)
class ProbeResult:
  """``ok``: the logits match the probe; ``max_diff``: the largest difference
  at the probe's ids; ``reason``: what differs (empty when ok)."""

  ok: bool
  max_diff: float
  tolerance: float
  reason: str = ""


def fingerprint(logits, token: int, dtype: str, k: int = PROBE_K) -> LogitProbe:
  """The probe of ``logits`` f32 [vocab] (one request's step logits)."""
  row = np.asarray(logits, np.float32).reshape(-1)
  k = min(k, row.size)
  ids = np.argsort(-row, kind="stable")[:k]
  return LogitProbe(token=int(token), ids=tuple(int(i) for i in ids),
                    values=tuple(round(float(row[i]), 4) for i in ids), dtype=str(dtype))


def tolerance(probe: LogitProbe, lossy: bool = False) -> float:
  atol, rtol = _TOLERANCE.get(probe.dtype, _TOLERANCE["bfloat16"])
  tol = atol + rtol * max(abs(v) for v in probe.values)
  return tol * (_LOSSY_FACTOR if lossy else 1.0)


def compare(probe: LogitProbe, logits, lossy: bool = False) -> ProbeResult:
  """Checks step logits f32 [vocab] against ``probe``.

  ``lossy``: the state crossed a lossy codec (quantised KV), which widens the
  tolerance by ``_LOSSY_FACTOR``.
  """
  row = np.asarray(logits, np.float32).reshape(-1)
  tol = tolerance(probe, lossy)
  ids = np.asarray(probe.ids, np.int64)
  if ids.max() >= row.size:
    return ProbeResult(False, float("inf"), tol, f"probe id {int(ids.max())} outside the "
                                                 f"vocabulary of {row.size}")
  expected = np.asarray(probe.values, np.float32)
  diffs = np.abs(row[ids] - expected)
  max_diff = float(diffs.max())
  if not np.all(np.isfinite(row[ids])) or max_diff > tol:
    worst = int(np.argmax(diffs))
    return ProbeResult(False, max_diff, tol,
                       f"logit of token {int(ids[worst])} is {float(row[ids[worst]]):.4f}, "
                       f"the prefill side had {float(expected[worst]):.4f} (tolerance "
                       f"{tol:.2g})")
  others = np.delete(row, ids)
  if others.size and float(others.max()) > float(expected.min()) + tol:
    intruder = int(np.setdiff1d(np.arange(row.size), ids)[int(np.argmax(others))])
    return ProbeResult(False, max_diff, tol,
                       f"token {intruder} rose to {float(others.max()):.4f}, above the "
                       f"prefill side's top-{len(ids)} (>= {float(expected.min()):.4f})")
  return ProbeResult(True, max_diff, tol)


def probe_capacity(length: int) -> int:
  """Attention capacity the probe step runs at: a power of two >= length + 1
  (and >= CAPACITY_ALIGN), so a server compiles one step per octave of
  context, not one per 64 tokens."""
  need = max(length + 1, CAPACITY_ALIGN)
  return 1 << (need - 1).bit_length()


def probe_logits(model: api.Model, state: DecodeState, token: int) -> np.ndarray:
  """Logits f32 [vocab] of one plain decode step of batch-1 ``state`` fed ``token``.

  The state may hold host (numpy) or device arrays; it is not modified.
  """
  if state.batch_size != 1:
    raise ValueError(f"probe_logits takes a batch-1 state, got batch {state.batch_size}")
  length = int(np.asarray(state.lengths)[0])
  state = state.grow(probe_capacity(length))
  logits, _ = api.decode_step(model, state, jnp.asarray([int(token)], jnp.int32))
  return np.asarray(logits[0], np.float32)


def warm(model: api.Model, max_ctx: int) -> int:
  """Compiles the probe step at every capacity ``probe_logits`` can reach for
  contexts below ``max_ctx`` (one per octave), so that a server's first probe
  at each length costs one decode step, not a compile. Returns the count."""
  config = model.config
  max_ctx = min(max_ctx, config.max_seq_len)
  capacities = []
  cap = probe_capacity(1)
  while cap <= probe_capacity(max(max_ctx - 1, 1)):
    capacities.append(cap)
    cap *= 2
  for cap in capacities:
    state = init_state(config, 1, cap)
    length = 1 if cap == probe_capacity(1) else cap // 2
    state = state.replace(lengths=jnp.full((1,), length, jnp.int32))
    probe_logits(model, state, 0)
  return len(capacities)


def make_probe(model: api.Model, state: DecodeState, token: int,
               k: int = PROBE_K) -> LogitProbe:
  """The prefill side's probe of batch-1 ``state`` followed by ``token``."""
  return fingerprint(probe_logits(model, state, token), token, model.config.dtype, k)


def check_state(model: api.Model, state: DecodeState, probe: LogitProbe,
                lossy: bool = False) -> ProbeResult:
  """The decode side's check of a received batch-1 ``state`` against ``probe``."""
  if not 0 <= probe.token < model.config.vocab_size:
    return ProbeResult(False, float("inf"), 0.0,
                       f"probe token {probe.token} outside the vocabulary")
  return compare(probe, probe_logits(model, state, probe.token), lossy)
