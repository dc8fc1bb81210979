"""Request validation for every server, JAX-free.

The broker (and through it the front door) validates requests before routing
them; it must not load JAX to do so, so the checks, the request parameters and
the error types live here rather than in ``engine`` (which re-exports them).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from paas_jax.models.config import ModelConfig
from paas_jax.models.sampling_params import SamplingParams
from paas_jax.serving.logprobs import (LOGPROBS_OFF, MAX_TOP_LOGPROBS, LogprobsError,
                                       requested_top)


class EngineError(Exception):
  """Base class of engine errors."""


class InvalidRequestError(EngineError, ValueError):
  """The request can never be served (bad tokens, too long, bad sampling...)."""


MAX_REQUEST_ID_CHARS = 256


def check_request_identity(request, config: ModelConfig, server: str, *,
                           require_id: bool = True) -> None:
  """Refuses a request for another model, or (``require_id``) one without a
  usable ``request_id``; ``server`` names this server in the message."""
  if request.model and request.model != config.name:
    raise InvalidRequestError(f"unknown model {request.model!r}; this {server} serves "
                              f"{config.name!r}")
  if require_id and (not request.request_id
                     or len(request.request_id) > MAX_REQUEST_ID_CHARS):
    raise InvalidRequestError(
        f"request_id is required (at most {MAX_REQUEST_ID_CHARS} characters)")


@dataclasses.dataclass(frozen=True)
class RequestParams:
  """Per-request generation settings (what the decode engine needs to continue).

  ``logprobs``: ``LOGPROBS_OFF`` (-1), or return each token's log-probability
  with this many top alternatives (0..``MAX_TOP_LOGPROBS``; ``logprobs.py``).
  """

  sampling: SamplingParams = SamplingParams()
  seed: int = 0
  max_new_tokens: int = 16
  stop_tokens: tuple[int, ...] = ()
  logprobs: int = LOGPROBS_OFF


MAX_SEED = 2**31 - 1


def validate_request(config: ModelConfig, prompt: Sequence[int], params: RequestParams,
                     max_ctx: int | None = None) -> None:
  """Raises ``InvalidRequestError`` with a user-facing message if the request is bad."""
  limit = config.max_seq_len if max_ctx is None else min(max_ctx, config.max_seq_len)
  if len(prompt) == 0:
    raise InvalidRequestError("the prompt is empty")
  arr = np.asarray(prompt)
  if not np.issubdtype(arr.dtype, np.integer):
    raise InvalidRequestError("prompt token ids must be integers")
  lo, hi = int(arr.min()), int(arr.max())
  if lo < 0 or hi >= config.vocab_size:
    bad = lo if lo < 0 else hi
    raise InvalidRequestError(f"token id {bad} is outside the vocabulary [0, "
                              f"{config.vocab_size}) of model {config.name!r}")
  if params.max_new_tokens <= 0:
    raise InvalidRequestError(f"max_new_tokens must be > 0, got {params.max_new_tokens}")
  if len(prompt) >= limit:
    raise InvalidRequestError(f"the prompt has {len(prompt)} tokens; the context of model "
                              f"{config.name!r} holds {limit} (prompt + new tokens)")
  if len(prompt) + params.max_new_tokens > limit:
    raise InvalidRequestError(
        f"prompt ({len(prompt)} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds "
        f"the context of {limit} tokens of model {config.name!r}")
  s = params.sampling
  if not (s.temperature >= 0 and np.isfinite(s.temperature)):
    raise InvalidRequestError(f"temperature must be a finite number >= 0, got {s.temperature}")
  if s.top_k < 0:
    raise InvalidRequestError(f"top_k must be >= 0, got {s.top_k}")
  if not 0.0 < s.top_p <= 1.0:
    raise InvalidRequestError(f"top_p must be in (0, 1], got {s.top_p}")
  if not 0 <= params.seed <= MAX_SEED:
    raise InvalidRequestError(f"seed must be in [0, {MAX_SEED}], got {params.seed}")
  if not LOGPROBS_OFF <= params.logprobs <= MAX_TOP_LOGPROBS:
    raise InvalidRequestError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got "
                              f"{params.logprobs}")
  for t in params.stop_tokens:
    if not 0 <= t < config.vocab_size:
      raise InvalidRequestError(f"stop token {t} is outside the vocabulary [0, "
                                f"{config.vocab_size})")


def requested_logprobs(logprobs: bool, top_logprobs: int) -> int:
  """``RequestParams.logprobs`` from a request's ``logprobs`` / ``top_logprobs``
  (``logprobs.requested_top``), with ``InvalidRequestError`` on bad input."""
  try:
    return requested_top(logprobs, top_logprobs)
  except LogprobsError as e:
    raise InvalidRequestError(str(e)) from None


def make_sampling(temperature: float, top_k: int, top_p: float) -> SamplingParams:
  """``SamplingParams`` from wire values, with ``InvalidRequestError`` on bad input.

  The proto3 default ``top_p = 0`` means "unset" and maps to 1 (no filter).
  """
  if top_p == 0:
    top_p = 1.0
  try:
    return SamplingParams(float(temperature), int(top_k), float(top_p))
  except ValueError as e:
    raise InvalidRequestError(str(e)) from e
