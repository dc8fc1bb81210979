"""Checks that can fail: a serving-independent reference, state corruptions and
negative controls (issue #12).

The reference, corruptions and checks live in ``paas_jax.state.sensitivity``
(flag-free, shared with ``experiments/state_sensitivity.py``); this package
builds each tiny model and its handed-off state once per test session.
"""

from __future__ import annotations

import functools

from paas_jax.models import api, load_config
from paas_jax.state import sensitivity

SEED = 0
# Two requests of equal length (so a swap is not visible in ``lengths``); 24
# tokens make the last 16-token KV block partial and overflow the 8-token window.
PROMPT_LEN = 24
NEW_TOKENS = 8
# Every layer kind in the fast suite: G+A, G+M, m+A, S+A. tiny_dense_gqa (A only)
# and the tied-head "before" variants run in the slow sweep.
FAST_CONFIGS = ("tiny_gdn_gqa", "tiny_kda_mla", "tiny_mamba2_gqa", "tiny_swa_gqa")
SLOW_CONFIGS = ("tiny_dense_gqa",)


@functools.cache
def model(name: str, tie_embeddings: bool | None = None) -> api.Model:
  config = load_config(name)
  if tie_embeddings is not None:
    config = config.with_updates(tie_embeddings=tie_embeddings)
  return api.Model.create(config, seed=SEED)


def prompts(name: str, n: int = 2, seed: int = 1) -> list[list[int]]:
  return sensitivity.random_prompts(load_config(name).vocab_size, n, PROMPT_LEN, seed=seed)


@functools.cache
def handoff(name: str, tie_embeddings: bool | None = None) -> sensitivity.Handoff:
  return sensitivity.handoff(model(name, tie_embeddings), prompts(name), NEW_TOKENS)


@functools.cache
def controls(name: str, tie_embeddings: bool | None = None) -> dict:
  return sensitivity.negative_controls(model(name, tie_embeddings),
                                       handoff(name, tie_embeddings))
