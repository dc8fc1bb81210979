"""Tiny Hugging Face models, built, saved and imported once per test session."""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np
import pytest
import torch

from paas_jax.checkpoints import ImportedModel, import_hf
from tests.checkpoints import hf_tiny


@dataclasses.dataclass
class TinyModel:
  family: str
  hf_dir: pathlib.Path
  hf: torch.nn.Module
  imported: ImportedModel

  @property
  def prompts(self) -> list[list[int]]:
    tok = self.imported.tokenizer
    return [tok.encode(p).ids for p in hf_tiny.PROMPTS]

  @torch.no_grad()
  def hf_logits(self, ids) -> np.ndarray:
    return self.hf(torch.tensor([list(ids)])).logits[0].numpy()

  @torch.no_grad()
  def hf_greedy(self, ids, n: int) -> list[int]:
    out = self.hf.generate(torch.tensor([list(ids)]), max_new_tokens=n, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


class TinyModels:
  """Builds each family on first use; torch and jax compile caches stay warm."""

  def __init__(self, root: pathlib.Path):
    self.root = root
    self._models: dict[str, TinyModel] = {}

  def __getitem__(self, family: str) -> TinyModel:
    if family not in self._models:
      hf_dir = self.root / family
      hf_dir.mkdir()
      hf = hf_tiny.save_family(family, hf_dir)
      self._models[family] = TinyModel(family, hf_dir, hf, import_hf(hf_dir))
    return self._models[family]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> TinyModels:
  return TinyModels(tmp_path_factory.mktemp("hf_tiny"))
