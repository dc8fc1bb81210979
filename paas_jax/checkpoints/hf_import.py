"""Imports a Hugging Face model directory into a paas-jax ``Model``.

The directory holds ``config.json``, safetensors weights (one file or shards
with ``model.safetensors.index.json``) and, optionally, ``tokenizer.json``.
Parameters are built on the host, one checkpoint tensor at a time, into the
shapes of an abstract (never initialised) ``HybridLM``, so importing a large
model costs its weights in host memory and nothing more.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util
from jax.sharding import Mesh, Sharding
from tokenizers import Tokenizer

from paas_jax.checkpoints.hf_families import family_for
from paas_jax.checkpoints.hf_layout import HFImportError, model_dtype
from paas_jax.checkpoints.safetensors_dir import SafetensorsDir
from paas_jax.checkpoints.sharding import ShardingRule, param_shardings
from paas_jax.models import ModelConfig
from paas_jax.models.api import Model
from paas_jax.models.hybrid import HybridLM
from paas_jax.serving.tokenizer_files import load_tokenizer, text_side_files

TOKENIZER_FILE = "tokenizer.json"
_MAX_LISTED = 12


@dataclasses.dataclass(frozen=True)
class ImportedModel:
  """The result of ``import_hf``.

  Attributes:
    model: the paas-jax model, parameters on the default device (or the mesh
      given to ``import_hf``).
    tokenizer_json: text of ``tokenizer.json``, or None if the directory has none.
    metadata: facts about the source (architecture, special token ids, tensors
      of the checkpoint that the model does not use), saved with the checkpoint.
    text_files: the source's tokenizer and chat-template files (``tokenizer.json``,
      Kimi's ``tiktoken.model``, ``tokenizer_config.json``, ...), which
      ``save_checkpoint`` copies next to the parameters.
  """

  model: Model
  tokenizer_json: str | None
  metadata: dict
  text_files: tuple[pathlib.Path, ...] = ()

  @property
  def tokenizer(self):
    """The source's tokenizer (``tokenizers.Tokenizer`` or Kimi's tiktoken one), or None."""
    if self.text_files:
      return load_tokenizer(self.text_files[0].parent)
    if self.tokenizer_json is None:
      return None
    return Tokenizer.from_str(self.tokenizer_json)


def read_hf_config(hf_dir: str | pathlib.Path) -> dict:
  path = pathlib.Path(hf_dir) / "config.json"
  if not path.is_file():
    raise HFImportError(f"{hf_dir}: no config.json (is this a Hugging Face model directory?)")
  return json.loads(path.read_text())


def hf_model_config(hf: dict, *, name: str = "hf_model", dtype: str | None = None,
                    max_seq_len: int | None = None) -> ModelConfig:
  """Translates a ``config.json`` dict into a ``ModelConfig`` (no weights read)."""
  family = family_for(hf)
  return family.model_config(hf, name=name, dtype=model_dtype(hf, dtype),
                             max_seq_len=max_seq_len)


def abstract_params(config: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
  """Graph definition and parameter state of ``config`` with ShapeDtypeStruct leaves."""
  module = nnx.eval_shape(lambda: HybridLM(config, rngs=nnx.Rngs(params=0)))
  return nnx.split(module)


def _format_names(names, limit: int = _MAX_LISTED) -> str:
  names = sorted(names)
  more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
  return ", ".join(names[:limit]) + more


def _path_str(path: tuple) -> str:
  return ".".join(str(p) for p in path)


def load_hf_params(hf: dict, config: ModelConfig, src: SafetensorsDir
                   ) -> dict[tuple, np.ndarray]:
  """Builds every parameter of ``config`` from the checkpoint, keyed by path.

  Raises:
    HFImportError: naming the missing checkpoint tensors, or the parameters
      whose shape does not match the config.
  """
  family = family_for(hf)
  specs = family.tensor_specs(hf, config, src)
  missing = {name for spec in specs for name in spec.sources if name not in src}
  if missing:
    raise HFImportError(f"{src.directory}: checkpoint lacks {len(missing)} tensor(s) that "
                        f"{family.architecture} needs: {_format_names(missing)}")
  _, state = abstract_params(config)
  expected = traverse_util.flatten_dict(nnx.to_pure_dict(state))
  params: dict[tuple, np.ndarray] = {}
  mismatched = []
  for spec in specs:
    arrays = spec.build(*(src.get(name) for name in spec.sources))
    for target, array in zip(spec.targets, arrays):
      want = expected.get(target)
      if want is None:
        raise HFImportError(f"internal: {family.model_type} maps {spec.sources[0]} to "
                            f"{_path_str(target)}, which the model does not have")
      if tuple(array.shape) != tuple(want.shape):
        mismatched.append(f"{_path_str(target)} from {spec.sources[0]}: checkpoint gives "
                          f"{tuple(array.shape)}, config needs {tuple(want.shape)}")
        continue
      params[target] = np.asarray(array).astype(want.dtype)
  if mismatched:
    raise HFImportError(f"{src.directory}: tensor shapes disagree with config.json: "
                        + "; ".join(mismatched[:_MAX_LISTED]))
  unfilled = set(expected) - set(params)
  if unfilled:
    raise HFImportError(f"internal: {family.model_type} leaves parameters unset: "
                        f"{_format_names(_path_str(p) for p in unfilled)}")
  return params


def model_from_params(config: ModelConfig, params: dict[tuple, np.ndarray | jax.Array],
                      shardings: dict[tuple, Sharding] | None = None) -> Model:
  """A ``Model`` whose parameters are ``params`` (flat path -> array).

  Host arrays go to the default device, or straight to their ``shardings``.
  """
  graphdef, state = abstract_params(config)
  if shardings is None:
    arrays = {k: jnp.asarray(v) for k, v in params.items()}
  else:
    arrays = {k: jax.device_put(v, shardings[k]) for k, v in params.items()}
  pure = traverse_util.unflatten_dict(arrays)
  nnx.replace_by_pure_dict(state, pure)
  return Model.from_module(nnx.merge(graphdef, state))


def is_hf_model_dir(path: str | pathlib.Path) -> bool:
  """Whether ``path`` looks like a Hugging Face model directory."""
  path = pathlib.Path(path)
  return (path / "config.json").is_file() and (
      (path / "model.safetensors.index.json").is_file() or any(path.glob("*.safetensors")))


def import_hf(hf_dir: str | pathlib.Path, *, name: str | None = None,
              dtype: str | None = None, max_seq_len: int | None = None,
              mesh: Mesh | None = None, sharding: ShardingRule | str | None = None,
              axis: str | None = None) -> ImportedModel:
  """Imports a Hugging Face model directory (see module docstring).

  Args:
    hf_dir: the directory.
    name: model name for the config (default: the directory name).
    dtype: parameter and activation dtype (default: the checkpoint's).
    max_seq_len: context limit (default: the model's ``max_position_embeddings``).
    mesh, sharding, axis: place the parameters on a device mesh, as
      ``load_checkpoint`` does; None keeps them on the default device.

  Raises:
    HFImportError (a ValueError) for unsupported architectures or options,
    missing tensors and shape mismatches, naming them.
  """
  hf_dir = pathlib.Path(hf_dir)
  hf = read_hf_config(hf_dir)
  family = family_for(hf)
  config = hf_model_config(hf, name=name or hf_dir.resolve().name, dtype=dtype,
                           max_seq_len=max_seq_len)
  src = SafetensorsDir(hf_dir)
  params = load_hf_params(hf, config, src)
  shardings = None
  if mesh is not None:
    shardings = param_shardings({k: v.shape for k, v in params.items()}, mesh, axis=axis,
                                rule=sharding)
  model = model_from_params(config, params, shardings)
  unused = [n for n in src.unused() if not n.startswith(family.ignored_prefixes)]
  tokenizer_path = hf_dir / TOKENIZER_FILE
  metadata = {
      "source": {"architecture": family.architecture, "model_type": family.model_type,
                 "hf_dir": str(hf_dir.resolve())},
      "bos_token_id": hf.get("bos_token_id"),
      "eos_token_ids": _as_list(hf.get("eos_token_id")),
      "unused_tensors": unused,
  }
  return ImportedModel(model=model,
                       tokenizer_json=(tokenizer_path.read_text()
                                       if tokenizer_path.is_file() else None),
                       metadata=metadata, text_files=tuple(text_side_files(hf_dir)))


def _as_list(x) -> list[int]:
  if x is None:
    return []
  return [int(v) for v in (x if isinstance(x, (list, tuple)) else [x])]
