"""Tensor-parallel serving on one host (``--tp=N`` of the prefill and decode servers).

The model's parameters are placed on a one-axis mesh (``"tp"``) over the first
``N`` local devices by the checkpoints' tensor-parallel policy
(``checkpoints/sharding.py``: attention heads and MLP / expert width by column
or row, experts by expert, embedding and head by vocabulary). A checkpoint is
restored straight into those shardings (``load_checkpoint(mesh=...)``), so no
device ever holds the whole model; a random-init config is created on the host
and then placed.

Everything else follows the parameters: the engines' jitted prefill, insert
and decode steps take sharded parameters and uncommitted inputs, and XLA's
sharding propagation lays out activations, the paged KV pool and the
recurrent slots to match (heads split where the projections are), inserting
the all-reduces that the row-parallel projections need. Outputs agree with
TP=1 up to float summation order (``tests/serving/test_tensor_parallel.py``
holds the tokens equal). The state is not gathered to send it: the prefill
server hands the codec its head-split caches as device arrays
(``codec.wire_arrays``), the encoder writes every shard from its own device in
chunks that lie inside one shard and records the sender's sharding in the
manifest (``ArrayEntry.source_sharding``); the receiver restores the global
coordinates into its own layout (the decode pool's at its own ``--tp``).

On CPU, N devices exist only with ``XLA_FLAGS=--xla_force_host_platform_device_count=N``
set before JAX starts.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx, traverse_util
from jax.sharding import Mesh

from paas_jax.checkpoints.hf_import import model_from_params
from paas_jax.checkpoints.sharding import param_shardings
from paas_jax.models.api import Model

TP_AXIS = "tp"


def local_mesh(tp: int) -> Mesh:
  """A one-axis ``"tp"`` mesh over the first ``tp`` local devices.

  Raises:
    ValueError: ``tp`` < 1, or more than this host's devices (naming the
      XLA flag that makes CPU devices).
  """
  if tp < 1:
    raise ValueError(f"--tp must be >= 1, got {tp}")
  devices = jax.local_devices()
  if tp > len(devices):
    hint = (f"; on CPU start the process with XLA_FLAGS="
            f"--xla_force_host_platform_device_count={tp}"
            if devices[0].platform == "cpu" else "")
    raise ValueError(f"--tp={tp} needs {tp} local devices, this host has {len(devices)} "
                     f"{devices[0].platform} device(s){hint}")
  return Mesh(np.array(devices[:tp]), (TP_AXIS,))


def shard_model(model: Model, mesh: Mesh) -> Model:
  """The same parameters, placed on ``mesh`` by the tensor-parallel policy."""
  flat = traverse_util.flatten_dict(nnx.to_pure_dict(model.params))
  shardings = param_shardings({p: x.shape for p, x in flat.items()}, mesh, axis=TP_AXIS)
  return model_from_params(model.config, flat, shardings)


def tp_degree(model: Model) -> int:
  """Devices the model's parameters are spread over (1: one device)."""
  return max(len(x.sharding.device_set) for x in jax.tree_util.tree_leaves(model.params))
