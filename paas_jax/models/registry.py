"""Finds model configs: ``configs/models/NAME.py`` files defining ``get_config()``."""

from __future__ import annotations

import importlib.util
import pathlib

from paas_jax.models.config import ModelConfig

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[2] / "configs" / "models"


def list_configs() -> list[str]:
  return sorted(p.stem for p in CONFIG_DIR.glob("*.py") if not p.stem.startswith("_"))


def load_config(name_or_path: str) -> ModelConfig:
  """Loads a config by registry name (``tiny_gdn_gqa``) or by ``.py`` file path."""
  path = pathlib.Path(name_or_path)
  if path.suffix != ".py":
    path = CONFIG_DIR / f"{name_or_path}.py"
  if not path.is_file():
    raise ValueError(f"unknown model config {name_or_path!r}; available: "
                     f"{', '.join(list_configs())}")
  spec = importlib.util.spec_from_file_location(f"paas_jax_config_{path.stem}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  if not isinstance(config, ModelConfig):
    raise ValueError(f"{path}: get_config() must return a ModelConfig, got {type(config)}")
  return config
