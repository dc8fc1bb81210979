"""Strict JSON for experiment reports."""

from __future__ import annotations

import json
import math
import pathlib

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


def write_json(path, obj) -> None:
  """Writes ``obj`` as strict, indented JSON, creating parent folders, and says where."""
  out = pathlib.Path(path)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(jsonable(obj), indent=1, allow_nan=False))
  print(f"wrote {out}")
