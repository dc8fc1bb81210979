"""Read-only view of the safetensors shards of a Hugging Face model directory."""

from __future__ import annotations

import json
import pathlib

import numpy as np
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"


class SafetensorsDir:
  """Maps tensor names to their shard and loads them one at a time as numpy.

  The shard list comes from ``model.safetensors.index.json`` when present,
  else from every ``*.safetensors`` file of the directory. Loaded names are
  remembered so that the importer can report tensors it did not use.
  """

  def __init__(self, directory: str | pathlib.Path):
    self.directory = pathlib.Path(directory)
    index = self.directory / INDEX_FILE
    if index.is_file():
      weight_map = json.loads(index.read_text())["weight_map"]
      self._shard_of = {name: self.directory / shard for name, shard in weight_map.items()}
    else:
      self._shard_of = {}
      for shard in sorted(self.directory.glob("*.safetensors")):
        with safe_open(shard, framework="numpy") as f:
          for name in f.keys():
            self._shard_of[name] = shard
    if not self._shard_of:
      raise ValueError(f"{self.directory}: no safetensors weights found (expected "
                       f"{INDEX_FILE} or *.safetensors files)")
    self.used: set[str] = set()
    self._handles: dict[pathlib.Path, object] = {}

  def __contains__(self, name: str) -> bool:
    return name in self._shard_of

  @property
  def names(self) -> list[str]:
    return sorted(self._shard_of)

  def get(self, name: str) -> np.ndarray:
    """The tensor ``name`` in its stored dtype (bf16 comes back as ml_dtypes.bfloat16)."""
    shard = self._shard_of.get(name)
    if shard is None:
      raise KeyError(name)
    handle = self._handles.get(shard)
    if handle is None:  # opened once per shard: the header parse is not free
      handle = self._handles[shard] = safe_open(shard, framework="numpy")
    array = handle.get_tensor(name)
    self.used.add(name)
    return array

  def unused(self) -> list[str]:
    return sorted(set(self._shard_of) - self.used)
