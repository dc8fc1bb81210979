"""Strict JSON for experiment reports."""

from __future__ import annotations

import math

import numpy as np


def jsonable(x):
  """Strict JSON: numpy scalars to Python, non-finite floats (unused stages) to null."""
  if isinstance(x, dict):
    return {str(k): jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [jsonable(v) for v in x]
  if isinstance(x, (np.floating, np.integer)):
    x = x.item()
  if isinstance(x, float) and not math.isfinite(x):
    return None
  return x
