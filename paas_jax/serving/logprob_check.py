"""Served logprobs vs single-process reference logits (the tests of issue #12).

The reference is one full single-process prefill of prompt + generated
tokens (``api.prefill``; no paging, transport, batching or prefix cache), the
same independent reference as ``paas_jax.state.sensitivity``: row
``len(prompt) - 1 + j`` of its logits is the distribution step ``j`` sampled
token ``j`` from. ``compare`` checks each served ``TokenLogprob`` against
``log_softmax`` of that row: the sampled token's value, every top alternative's
value, and that the top ids are the reference's top (up to near-ties) -- all
within ``LOGPROB_ATOL``.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from paas_jax.models import api
from paas_jax.serving.logprobs import TokenLogprob
from paas_jax.state.sensitivity import LOGIT_ATOL

# Same tolerance as the negative-control logit check (f32; prefill and paged
# decode kernels differ by ~1e-5 on the tiny configs): log_softmax shifts every
# logit of a row by one constant, so the error bound carries over.
LOGPROB_ATOL = LOGIT_ATOL


def reference_logprobs(model: api.Model, prompt: Sequence[int],
                       tokens: Sequence[int]) -> np.ndarray:
  """f32 [len(tokens), vocab]: log_softmax of the logits each token was sampled from.

  ``tokens``: the generated tokens (teacher-forced; the served ones, so a wrong
  token does not shift the rows after it).
  """
  full = np.asarray(list(prompt) + list(tokens[:-1]), np.int32)
  logits, _ = api.prefill(model, full)
  rows = np.asarray(logits[0, len(prompt) - 1:len(full)], np.float64)
  rows = rows - rows.max(axis=-1, keepdims=True)
  return (rows - np.log(np.exp(rows).sum(axis=-1, keepdims=True))).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class Comparison:
  """Worst deviation over the compared steps; ``ok`` when every check held."""

  max_error: float
  ids_ok: bool
  steps: int

  @property
  def ok(self) -> bool:
    return self.ids_ok and self.max_error <= LOGPROB_ATOL


def compare(served: Sequence[TokenLogprob], ref: np.ndarray,
            steps: Sequence[int] | None = None) -> Comparison:
  """Served logprobs of ``steps`` (default: all) vs reference rows ``ref``.

  ``ref``: f32 [>= steps, vocab] from ``reference_logprobs``.
  """
  steps = list(range(len(served))) if steps is None else list(steps)
  err, ids_ok = 0.0, True
  for j in steps:
    lp, row = served[j], ref[j]
    err = max(err, abs(lp.logprob - float(row[lp.token_id])))
    if lp.top_ids:
      values = row[list(lp.top_ids)]
      err = max(err, float(np.max(np.abs(np.asarray(lp.top_logprobs) - values))))
      k = len(lp.top_ids)
      kth = float(np.sort(row)[::-1][k - 1])
      # The served top-k must be the reference's top-k; only near-ties may swap.
      ids_ok &= bool(np.all(values >= kth - LOGPROB_ATOL))
      ids_ok &= len(set(lp.top_ids)) == k
  return Comparison(err, ids_ok, len(steps))
