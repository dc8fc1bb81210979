"""Model checkpoints: Hugging Face import and Orbax save / sharded restore.

  from paas_jax.checkpoints import import_hf, save_checkpoint, load_checkpoint
  imported = import_hf("/models/Kimi-Linear-48B-A3B-Instruct")
  save_checkpoint(imported.model, "/ckpt/kimi", imported.tokenizer_json,
                  metadata=imported.metadata)
  model, tokenizer = load_checkpoint("/ckpt/kimi", mesh=mesh)  # mesh axis "tp"
"""

from paas_jax.checkpoints.hf_families import FAMILIES, HFImportError
from paas_jax.checkpoints.hf_import import ImportedModel, hf_model_config, import_hf
from paas_jax.checkpoints.orbax_io import (checkpoint_metadata, load_checkpoint,
                                           save_checkpoint)
from paas_jax.checkpoints.sharding import param_shardings, tensor_parallel_spec
