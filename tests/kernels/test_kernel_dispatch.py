"""impl resolution: which path each impl string selects on each backend."""

from __future__ import annotations

import pytest

from pallas_kernels import IMPLS, resolve_impl
from pallas_kernels._dispatch import kernel_form


@pytest.mark.parametrize("impl,backend,path", [
    ("auto", "cpu", "xla"),
    ("auto", "tpu", "pallas_tpu"),
    ("auto", "gpu", "pallas_gpu"),
    ("auto", "cuda", "pallas_gpu"),
    ("xla", "tpu", "xla"),
    ("reference", "gpu", "reference"),
    ("pallas", "tpu", "pallas_tpu"),
    ("pallas", "gpu", "pallas_gpu"),
    ("pallas_interpret", "cpu", "pallas_tpu_interpret"),
    ("pallas_interpret", "gpu", "pallas_gpu_interpret"),
    ("pallas_gpu_interpret", "cpu", "pallas_gpu_interpret"),
    ("pallas_tpu_interpret", "gpu", "pallas_tpu_interpret"),
])
def test_resolution_table(impl, backend, path):
  assert resolve_impl(impl, backend=backend) == path


def test_compiled_pallas_on_cpu_is_an_error_not_a_fallback():
  with pytest.raises(ValueError, match="pallas_interpret"):
    resolve_impl("pallas", backend="cpu")


def test_unknown_impl_rejected():
  with pytest.raises(ValueError, match="impl must be one of"):
    resolve_impl("triton", backend="gpu")
  assert "triton" not in IMPLS


def test_kernel_form():
  assert kernel_form("pallas_tpu") == ("tpu", False)
  assert kernel_form("pallas_gpu_interpret") == ("gpu", True)
  with pytest.raises(ValueError):
    kernel_form("xla")
