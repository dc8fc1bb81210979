"""``SamplingParams``: per-request sampling settings, JAX-free.

Kept apart from ``api`` (which samples with JAX) so that request validation in the
broker and the front door can build and check them without loading JAX.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """``temperature == 0`` is greedy; ``top_k == 0`` and ``top_p == 1`` disable those filters."""

  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
    if self.top_k < 0:
      raise ValueError(f"SamplingParams.top_k must be >= 0, got {self.top_k}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
