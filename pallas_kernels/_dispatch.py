"""Choosing between the XLA and Pallas implementations of an op.

``impl`` values:
  * ``"auto"``: Pallas on TPU/GPU, XLA on CPU. Decided from the default backend
    only; a kernel that cannot handle a shape raises instead of silently
    falling back, so a test can always assert which path ran.
  * ``"xla"``: the chunked / blocked pure-jnp path.
  * ``"pallas"``: the compiled Pallas kernel for the current backend.
  * ``"pallas_interpret"``: the Pallas kernel run by the Pallas interpreter
    (works on CPU; used by the tests). Interprets the GPU form on a GPU
    backend and the TPU form otherwise.
  * ``"pallas_tpu_interpret"`` / ``"pallas_gpu_interpret"``: a specific
    kernel form under the interpreter, so CPU tests cover both forms.
  * ``"reference"``: the naive reference (token-by-token or dense), for tests.

Resolved paths: ``"xla"``, ``"reference"``, ``"pallas_tpu"``, ``"pallas_gpu"``,
``"pallas_tpu_interpret"``, ``"pallas_gpu_interpret"``.
"""

from __future__ import annotations

import jax

IMPLS = ("auto", "xla", "pallas", "pallas_interpret", "pallas_tpu_interpret",
         "pallas_gpu_interpret", "reference")

_LAST_IMPL: dict[str, str] = {}


def platform() -> str:
  """The platform ops resolve against ("cpu", "gpu" or "tpu")."""
  return jax.default_backend()


def resolve_impl(impl: str, *, backend: str | None = None) -> str:
  """Maps ``impl`` to the concrete path that will run on ``backend``.

  Args:
    impl: one of ``IMPLS``.
    backend: platform name; defaults to ``jax.default_backend()``.

  Returns:
    The resolved path (see the module docstring).
  """
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
  backend = backend or platform()
  if impl == "auto":
    impl = "xla" if backend == "cpu" else "pallas"
  is_gpu = backend in ("gpu", "cuda", "rocm")
  if impl == "pallas_interpret":
    return "pallas_gpu_interpret" if is_gpu else "pallas_tpu_interpret"
  if impl == "pallas":
    if backend == "tpu":
      return "pallas_tpu"
    if is_gpu:
      return "pallas_gpu"
    raise ValueError(
        f"impl='pallas' needs a TPU or GPU backend, got {backend!r}; "
        "use impl='pallas_interpret' to run the kernel on CPU")
  return impl


def kernel_form(path: str) -> tuple[str, bool]:
  """(form, interpret) for a resolved Pallas path, e.g. ("tpu", True)."""
  forms = {"pallas_tpu": ("tpu", False), "pallas_gpu": ("gpu", False),
           "pallas_tpu_interpret": ("tpu", True), "pallas_gpu_interpret": ("gpu", True)}
  if path not in forms:
    raise ValueError(f"{path!r} is not a Pallas path")
  return forms[path]


def record(op: str, path: str) -> str:
  """Notes which path ``op`` took (at trace time, so also under jit)."""
  _LAST_IMPL[op] = path
  return path


def last_impl(op: str) -> str | None:
  """The path the most recent trace of ``op`` resolved to, or None."""
  return _LAST_IMPL.get(op)


def clear_impl_records() -> None:
  """Forgets every op's recorded path (so ``last_impl`` answers for what runs next)."""
  _LAST_IMPL.clear()
