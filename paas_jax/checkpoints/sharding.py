"""Parameter shardings for serving a checkpoint on a device mesh.

The default policy is Megatron-style tensor parallelism over one mesh axis:
projections into a wider space (q/k/v, MLP up/gate, Mamba in_proj...) are
split by output column, projections back to the residual width (o_proj,
down, out_proj) by input row, experts by expert, the embedding and the output
head by vocabulary; small tensors (norm scales, biases, gates' decay rates)
are replicated. An axis is only split when the mesh size divides it;
otherwise the other axis is tried, then replication. XLA inserts the
collectives the split matmuls need, so any choice is correct; this one keeps
them to one all-reduce per block on the residual stream.
"""

from __future__ import annotations

from typing import Callable

from jax.sharding import Mesh, NamedSharding, PartitionSpec

# Kernels [in, out] whose input is the wide side: split by rows.
_ROW_PARALLEL = ("o_proj", "down", "out_proj")
_EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")

ShardingRule = Callable[[tuple, tuple], PartitionSpec]


def tensor_parallel_spec(path: tuple, shape: tuple, axis: str, size: int) -> PartitionSpec:
  """The ``PartitionSpec`` of the parameter at ``path`` under the default policy."""
  names = [str(p) for p in path]
  rank = len(shape)

  def split(dim: int) -> PartitionSpec | None:
    if shape[dim] % size or shape[dim] < size:
      return None
    spec = [None] * rank
    spec[dim] = axis
    return PartitionSpec(*spec)

  if rank < 2 or size == 1:
    return PartitionSpec()
  leaf = names[-1]
  if leaf in _EXPERT_WEIGHTS:
    order = (0, rank - 1 if leaf != "w_down" else rank - 2)  # experts, then hidden width
  elif leaf == "embedding":
    order = (0,)                                            # [vocab, d]: by vocabulary
  elif leaf == "kernel" and any(n in _ROW_PARALLEL for n in names[-2:-1]):
    order = (0, 1)
  elif leaf == "kernel":
    order = (rank - 1, 0)
  else:  # e.g. conv weights [kernel, channels]: by channel
    order = (rank - 1,)
  for dim in order:
    spec = split(dim)
    if spec is not None:
      return spec
  return PartitionSpec()


def mesh_axis(mesh: Mesh, axis: str | None) -> str:
  """The mesh axis to shard over: ``axis``, else ``"tp"``, else the only axis."""
  if axis is not None:
    if axis not in mesh.axis_names:
      raise ValueError(f"mesh has no axis {axis!r}; its axes are {mesh.axis_names}")
    return axis
  if "tp" in mesh.axis_names:
    return "tp"
  if len(mesh.axis_names) == 1:
    return mesh.axis_names[0]
  raise ValueError(f"give the mesh axis to shard over; the mesh has axes {mesh.axis_names}")


def param_shardings(flat_shapes: dict[tuple, tuple], mesh: Mesh, *, axis: str | None = None,
                    rule: ShardingRule | str | None = None) -> dict[tuple, NamedSharding]:
  """``NamedSharding`` for every parameter.

  Args:
    flat_shapes: parameter path -> shape.
    mesh: the device mesh.
    axis: mesh axis for the default policy (default ``"tp"`` or the only axis).
    rule: None for the default policy, ``"replicated"``, or a callable
      ``(path, shape) -> PartitionSpec``.
  """
  if rule == "replicated":
    return {p: NamedSharding(mesh, PartitionSpec()) for p in flat_shapes}
  if callable(rule):
    return {p: NamedSharding(mesh, rule(p, s)) for p, s in flat_shapes.items()}
  if rule is not None:
    raise ValueError(f"sharding must be None, 'replicated' or a callable, got {rule!r}")
  name = mesh_axis(mesh, axis)
  size = int(mesh.shape[name])
  return {p: NamedSharding(mesh, tensor_parallel_spec(p, s, name, size))
          for p, s in flat_shapes.items()}
