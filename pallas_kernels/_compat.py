"""Every version-specific Pallas call the kernels make, in one place.

Written against jax 0.10.2. Pallas moved a lot between 0.8 and 0.11
(``pl.load``/``pl.store`` removed in favour of ref indexing with ``pl.ds``;
``backend=`` replaced by typed ``compiler_params``; the GPU default lowering
switched from Triton to Mosaic GPU). When jax is upgraded, this is the file to
touch.

GPU kernels are lowered through Triton, selected explicitly by passing Triton
``CompilerParams``: with no compiler params jax 0.10 routes ``pallas_call`` on
GPU to Mosaic GPU, whose ``pallas_call`` entry point is deprecated in favour of
warpgroup-level ``plgpu.kernel`` programs, a different programming model.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

# Kernel "forms": how a kernel is written, independent of where it runs.
TPU = "tpu"  # BlockSpec grid with a sequential ("arbitrary") reduction axis + VMEM scratch
GPU = "gpu"  # fully parallel grid, reductions as in-kernel loops (Triton)

BlockSpec = pl.BlockSpec
ds = pl.ds
cdiv = pl.cdiv
program_id = pl.program_id
num_programs = pl.num_programs
when = pl.when


def vmem(shape: Sequence[int], dtype) -> Any:
  """A TPU VMEM scratch buffer (kept across grid steps)."""
  return pltpu.VMEM(tuple(shape), dtype)


def tpu_call(kernel: Callable[..., None], *, out_shape, grid, in_specs, out_specs,
             scratch_shapes=(), dimension_semantics: Sequence[str], num_scalar_prefetch=0,
             interpret: bool = False, name: str | None = None, cost_estimate=None):
  """``pallas_call`` for a TPU-form kernel.

  With ``num_scalar_prefetch`` > 0 the first that many operands are int32
  arrays placed in SMEM before the grid runs; index maps and the kernel get
  them as leading arguments (used for page tables and block bounds).
  """
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=num_scalar_prefetch, grid=tuple(grid), in_specs=in_specs,
      out_specs=out_specs, scratch_shapes=tuple(scratch_shapes))
  return pl.pallas_call(
      kernel, out_shape=out_shape, grid_spec=grid_spec,
      compiler_params=pltpu.CompilerParams(dimension_semantics=tuple(dimension_semantics)),
      interpret=interpret, name=name, cost_estimate=cost_estimate)


def gpu_call(kernel: Callable[..., None], *, out_shape, grid, in_specs, out_specs,
             num_warps: int = 4, num_stages: int = 2, interpret: bool = False,
             name: str | None = None, cost_estimate=None):
  """``pallas_call`` for a GPU-form kernel, lowered through Triton."""
  return pl.pallas_call(
      kernel, out_shape=out_shape, grid=tuple(grid), in_specs=in_specs, out_specs=out_specs,
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret, name=name, cost_estimate=cost_estimate)


def cost(flops: float, transcendentals: float, bytes_accessed: float) -> pl.CostEstimate:
  """Hint for XLA's scheduler around the custom call."""
  return pl.CostEstimate(flops=int(flops), transcendentals=int(transcendentals),
                         bytes_accessed=int(bytes_accessed))


def _precision(a, b):
  # f32 operands ask for full f32 (IEEE on Triton, multi-pass on the MXU):
  # the recurrent kernels feed each product back into a state, where TF32 /
  # single-pass bf16 error would compound over chunks. bf16 operands use the
  # native single pass.
  if a.dtype == jax.numpy.float32 or b.dtype == jax.numpy.float32:
    return jax.lax.Precision.HIGHEST
  return None


def dot(a: jax.Array, b: jax.Array, *, trans_b: bool = False) -> jax.Array:
  """a @ b (or a @ b^T) with f32 accumulation, for TPU and Triton kernels."""
  dims = (((1,), (1,) if trans_b else (0,)), ((), ()))
  return jax.lax.dot_general(a, b, dims, precision=_precision(a, b),
                             preferred_element_type=jax.numpy.float32)


def dot_tn(a: jax.Array, b: jax.Array) -> jax.Array:
  """a^T @ b with f32 accumulation (contracts the leading axes)."""
  return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=_precision(a, b),
                             preferred_element_type=jax.numpy.float32)
