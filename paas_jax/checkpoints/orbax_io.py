"""paas-jax checkpoints: model parameters and config in Orbax, plus the tokenizer.

Layout of a checkpoint directory::

  CKPT/params/      Orbax arrays, one per parameter, keyed by dotted path
  CKPT/metadata/    Orbax JSON: format tag, ModelConfig, source facts
  CKPT/tokenizer.json   (optional) the tokenizers-library tokenizer
  CKPT/tiktoken.model, tokenizer_config.json, ...  (optional) copied from the
                        source (serving/tokenizer_files.py: Kimi's tiktoken BPE)

Loading restores every array directly into its target sharding, so a model
too large for one device is never materialised on one.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging as absl_logging
from flax import nnx, traverse_util
from jax.sharding import Mesh, SingleDeviceSharding

from paas_jax.checkpoints.hf_import import (TOKENIZER_FILE, abstract_params, import_hf,
                                            is_hf_model_dir, model_from_params)
from paas_jax.checkpoints.sharding import ShardingRule, param_shardings
from paas_jax.models import ModelConfig
from paas_jax.models.api import Model
from paas_jax.serving.tokenizer_files import load_tokenizer

FORMAT = "paas-jax-checkpoint/1"
PARAMS_ITEM = "params"
METADATA_ITEM = "metadata"


@contextlib.contextmanager
def _checkpointer():
  """An Orbax composite checkpointer, with its per-step INFO logging muted."""
  verbosity = absl_logging.get_verbosity()
  absl_logging.set_verbosity(absl_logging.WARNING)
  checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
  try:
    yield checkpointer
  finally:
    checkpointer.close()
    absl_logging.set_verbosity(verbosity)


def _key(path: tuple) -> str:
  return ".".join(str(p) for p in path)


def _flat_params(model: Model) -> dict[tuple, jax.Array]:
  return traverse_util.flatten_dict(nnx.to_pure_dict(model.params))


def _tokenizer_text(tokenizer_json) -> str | None:
  """Accepts a tokenizers.Tokenizer, a path to tokenizer.json, or its JSON text."""
  if tokenizer_json is None:
    return None
  if hasattr(tokenizer_json, "to_str"):
    return tokenizer_json.to_str()
  text = str(tokenizer_json)
  if not text.lstrip().startswith("{"):
    path = pathlib.Path(text)
    if not path.is_file():
      raise ValueError(f"tokenizer_json: {text!r} is neither JSON text nor a file")
    text = path.read_text()
  json.loads(text)  # fail now, not at load time
  return text


def save_checkpoint(model: Model, path: str | pathlib.Path, tokenizer_json=None, *,
                    metadata: dict | None = None, overwrite: bool = False,
                    text_files=()) -> pathlib.Path:
  """Writes ``model`` (and optionally its tokenizer) as a paas-jax checkpoint.

  Args:
    model: the model.
    path: checkpoint directory; must not exist unless ``overwrite``.
    tokenizer_json: a ``tokenizers.Tokenizer``, a tokenizer.json path, or its text.
    metadata: extra JSON-able facts stored alongside (e.g. eos token ids).
    overwrite: replace an existing directory.
    text_files: tokenizer / chat-template files to copy in (``ImportedModel.text_files``).

  Returns:
    The absolute checkpoint path.
  """
  path = pathlib.Path(path).absolute()
  if path.exists():
    if not overwrite:
      raise ValueError(f"checkpoint {path} already exists (pass overwrite=True to replace it)")
    shutil.rmtree(path)
  tokenizer_text = _tokenizer_text(tokenizer_json)
  params = {_key(p): x for p, x in _flat_params(model).items()}
  meta = {"format": FORMAT, "model_config": model.config.to_dict(), **(metadata or {})}
  with _checkpointer() as checkpointer:
    checkpointer.save(path, ocp.args.Composite(**{
        PARAMS_ITEM: ocp.args.StandardSave(params),
        METADATA_ITEM: ocp.args.JsonSave(meta)}))
  for source in text_files:
    shutil.copyfile(source, path / pathlib.Path(source).name)
  if tokenizer_text is not None:
    (path / TOKENIZER_FILE).write_text(tokenizer_text)
  return path


def checkpoint_metadata(path: str | pathlib.Path) -> dict:
  """The metadata of a checkpoint (format, ``model_config`` dict, source facts)."""
  path = pathlib.Path(path).absolute()
  if not (path / METADATA_ITEM).is_dir():
    raise ValueError(f"{path} is not a paas-jax checkpoint (no {METADATA_ITEM}/); create one "
                     "with `python -m paas_jax.tools.import_hf`")
  with _checkpointer() as checkpointer:
    meta = checkpointer.restore(path, ocp.args.Composite(**{
        METADATA_ITEM: ocp.args.JsonRestore()}))[METADATA_ITEM]
  if meta.get("format") != FORMAT:
    raise ValueError(f"{path}: unknown checkpoint format {meta.get('format')!r}, "
                     f"expected {FORMAT!r}")
  return meta


def load_checkpoint(path: str | pathlib.Path, *, mesh: Mesh | None = None,
                    sharding: ShardingRule | str | None = None, axis: str | None = None
                    ) -> tuple[Model, object | None]:
  """Restores a checkpoint, optionally sharded over a device mesh.

  ``path`` may also be a Hugging Face model directory (config.json and
  safetensors of a supported architecture), which is imported on the fly, so
  a downloaded model serves without a separate import step; importing once
  with ``paas_jax.tools.import_hf`` makes later starts faster.

  Args:
    path: checkpoint directory written by ``save_checkpoint``, or a Hugging
      Face model directory.
    mesh: device mesh; None puts every parameter on the default device.
    sharding: with a mesh, None for the tensor-parallel policy of
      ``paas_jax.checkpoints.sharding``, ``"replicated"``, or a callable
      ``(param_path, shape) -> PartitionSpec``.
    axis: mesh axis for the default policy (default ``"tp"`` or the only axis).

  Returns:
    (model, its tokenizer: ``tokenizers.Tokenizer``, Kimi's tiktoken one
    (serving/tokenizer_files.py), or None when the checkpoint has none).
  """
  path = pathlib.Path(path).absolute()
  if not (path / METADATA_ITEM).is_dir() and is_hf_model_dir(path):
    imported = import_hf(path, mesh=mesh, sharding=sharding, axis=axis)
    return imported.model, imported.tokenizer
  config = ModelConfig.from_dict(checkpoint_metadata(path)["model_config"])
  _, state = abstract_params(config)
  abstract = traverse_util.flatten_dict(nnx.to_pure_dict(state))
  if mesh is None:
    device = SingleDeviceSharding(jax.devices()[0])
    shardings = {p: device for p in abstract}
  else:
    shardings = param_shardings({p: x.shape for p, x in abstract.items()}, mesh,
                                axis=axis, rule=sharding)
  target = {_key(p): jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings[p])
            for p, x in abstract.items()}
  with _checkpointer() as checkpointer:
    restored = checkpointer.restore(path, ocp.args.Composite(**{
        PARAMS_ITEM: ocp.args.StandardRestore(target)}))[PARAMS_ITEM]
  model = model_from_params(config, {p: restored[_key(p)] for p in abstract})
  return model, load_tokenizer(path)


def checkpoint_nbytes(model: Model) -> int:
  """Bytes of all parameters (what a checkpoint stores, before compression)."""
  return int(sum(np.dtype(x.dtype).itemsize * int(np.prod(x.shape))
                 for x in _flat_params(model).values()))
