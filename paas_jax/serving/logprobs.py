"""Per-token log-probabilities on the token stream (OpenAI's ``logprobs``), JAX-free.

A request asks for them with ``logprobs`` (on/off) and ``top_logprobs`` (how
many alternatives, 0..``MAX_TOP_LOGPROBS``); ``RequestParams.logprobs`` holds
the top count, or ``LOGPROBS_OFF``. Every token of such a request then carries
one ``TokenLogprob``: the sampled token's log-probability and the
``top_logprobs`` most likely tokens with theirs, largest first.

What they are: ``log_softmax`` in f32 of the same logits the token was sampled
from, before temperature, top-k or top-p (the model's distribution, as vLLM's
default "raw" logprobs), computed on the device (``token_logprob_ops``). The
first token's come from the prefill side (region A's ``FirstToken.logprob``,
forwarded in ``HandoffRequest.first_logprob``, or PD-P's own prefill); later
tokens' from the decode pool's step. Kept apart from the JAX code so the broker
and the front door validate and relay them without loading JAX.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

# OpenAI's limit for top_logprobs (and vLLM's default max_logprobs is 20 too).
MAX_TOP_LOGPROBS = 20
# RequestParams.logprobs when the request did not ask for logprobs.
LOGPROBS_OFF = -1


class LogprobsError(ValueError):
  """A bad ``logprobs`` / ``top_logprobs`` request or a malformed ``TokenLogprob``."""


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
  """One generated token's log-probabilities.

  Attributes:
    token_id: the sampled token.
    logprob: its log-probability (f32 ``log_softmax`` of the step's logits).
    top_ids: the ``top_logprobs`` most likely token ids, largest first.
    top_logprobs: their log-probabilities (same length as ``top_ids``).
  """

  token_id: int
  logprob: float
  top_ids: tuple[int, ...] = ()
  top_logprobs: tuple[float, ...] = ()


def requested_top(logprobs: bool, top_logprobs: int) -> int:
  """``RequestParams.logprobs`` from the wire's two fields; ``LogprobsError`` if bad.

  ``top_logprobs`` without ``logprobs`` is refused (OpenAI refuses it too),
  so a client never silently gets nothing.
  """
  top = int(top_logprobs)
  if not 0 <= top <= MAX_TOP_LOGPROBS:
    raise LogprobsError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
  if not logprobs:
    if top:
      raise LogprobsError("top_logprobs needs logprobs = true")
    return LOGPROBS_OFF
  return top


def wire_fields(top: int) -> dict:
  """The request messages' ``logprobs`` / ``top_logprobs`` for ``RequestParams.logprobs``."""
  return {"logprobs": top >= 0, "top_logprobs": max(top, 0)}


def to_proto(lp: TokenLogprob, message_type):
  """``lp`` as a ``serving_pb2.TokenLogprob`` (``message_type``: that class)."""
  return message_type(token_id=int(lp.token_id), logprob=float(lp.logprob),
                      top_ids=[int(t) for t in lp.top_ids],
                      top_logprobs=[float(v) for v in lp.top_logprobs])


def from_proto(msg, vocab_size: int, top: int | None = None) -> TokenLogprob:
  """Checks a received ``TokenLogprob`` message (``LogprobsError`` with the field
  at fault): ids inside the vocabulary, ``top`` alternatives (None: any count up
  to ``MAX_TOP_LOGPROBS``), values <= 0 and not NaN."""
  ids, values = tuple(int(t) for t in msg.top_ids), tuple(float(v) for v in msg.top_logprobs)
  if len(ids) != len(values):
    raise LogprobsError(f"top_ids ({len(ids)}) and top_logprobs ({len(values)}) differ in "
                        "length")
  if top is not None and len(ids) != top:
    raise LogprobsError(f"{len(ids)} top logprobs, the request asked for {top}")
  if len(ids) > MAX_TOP_LOGPROBS:
    raise LogprobsError(f"{len(ids)} top logprobs, at most {MAX_TOP_LOGPROBS}")
  for t in (int(msg.token_id),) + ids:
    if not 0 <= t < vocab_size:
      raise LogprobsError(f"token id {t} outside the vocabulary [0, {vocab_size})")
  for v in (float(msg.logprob),) + values:
    # -inf is a legal log-probability (a token the step cannot produce).
    if math.isnan(v) or v > 1e-4:
      raise LogprobsError(f"log-probability {v} is not <= 0")
  return TokenLogprob(int(msg.token_id), float(msg.logprob), ids, values)


def handoff_logprob(request, vocab_size: int, want: int | None = None) -> TokenLogprob | None:
  """A ``HandoffRequest``'s ``first_logprob`` (None when unset), checked against
  its ``first_token`` and, when the request is registered, the top count it
  asked for (``want``: its ``RequestParams.logprobs``); ``LogprobsError`` if
  malformed or missing."""
  if not request.HasField("first_logprob"):
    if want is not None and want >= 0:
      raise LogprobsError(f"missing: the request asked for logprobs (top {want})")
    return None
  if want is not None and want < 0:
    raise LogprobsError("set, but the request did not ask for logprobs")
  lp = from_proto(request.first_logprob, vocab_size, want)
  if lp.token_id != request.first_token:
    raise LogprobsError(f"token_id {lp.token_id} is not first_token {request.first_token}")
  return lp


def with_text(messages, tokenizer) -> list:
  """``TokenLogprob`` messages with ``token`` / ``top_tokens`` filled from
  ``tokenizer.token_text`` (the served tokenizer; unchanged when None)."""
  if tokenizer is None:
    return list(messages)
  for m in messages:
    m.token = tokenizer.token_text(m.token_id)
    m.top_tokens[:] = [tokenizer.token_text(t) for t in m.top_ids]
  return list(messages)


def from_rows(tokens: Sequence[int], token_logprobs: Sequence[float], top_ids, top_values,
              tops: Sequence[int]) -> list[TokenLogprob]:
  """Host rows of ``token_logprob_ops.token_logprobs`` -> one ``TokenLogprob`` per row.

  Args:
    tokens: int [rows] sampled tokens; token_logprobs: f32 [rows].
    top_ids / top_values: int32 / f32 [rows, >= max(tops)], largest first.
    tops: alternatives kept per row.
  """
  return [TokenLogprob(int(t), float(v), tuple(int(i) for i in ids[:k]),
                       tuple(float(x) for x in vals[:k]))
          for t, v, ids, vals, k in zip(tokens, token_logprobs, top_ids, top_values, tops)]
