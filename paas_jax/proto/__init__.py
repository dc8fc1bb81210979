"""Protocol buffers of paas-jax, compiled at import time.

Every ``*.proto`` in this folder is compiled with ``grpc_tools.protoc`` into
``<name>_pb2.py`` and ``<name>_pb2_grpc.py`` next to it when those are missing or
older than the ``.proto``. The generated files are gitignored and never edited by
hand, so a checkout only needs ``grpcio-tools`` installed, not a build step.

The include root is the repository root (the folder above ``paas_jax``), so a
proto imports another as ``import "paas_jax/proto/other.proto";`` and the
generated code imports ``from paas_jax.proto import other_pb2``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_INCLUDE_ROOT = _HERE.parent.parent


def _outputs(proto: Path) -> tuple[Path, Path]:
  return (proto.with_name(proto.stem + "_pb2.py"),
          proto.with_name(proto.stem + "_pb2_grpc.py"))


def _is_stale(proto: Path) -> bool:
  # make-style: any change to the .proto (edit, checkout, pull) bumps its mtime.
  src_mtime = proto.stat().st_mtime_ns
  for out in _outputs(proto):
    if not out.exists() or out.stat().st_mtime_ns < src_mtime:
      return True
  return False


@contextlib.contextmanager
def _generation_lock():
  # Parallel pytest workers and spawned sender/receiver processes import this
  # package at the same moment; one of them compiles, the others wait. The lock
  # lives in the temp dir so the source tree gets no untracked file.
  tag = hashlib.sha256(str(_HERE).encode()).hexdigest()[:16]
  path = Path(tempfile.gettempdir()) / f"paas_jax_protoc_{tag}.lock"
  with open(path, "w") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def generate(force: bool = False) -> list[Path]:
  """Compiles the stale ``.proto`` files of this folder; returns those compiled."""
  protos = sorted(_HERE.glob("*.proto"))
  if not force and not any(_is_stale(p) for p in protos):
    return []
  with _generation_lock():
    todo = [p for p in protos if force or _is_stale(p)]
    if not todo:
      return []
    # Deferred: grpcio-tools is optional at run time (a checkout whose generated
    # files are fresh does not need it).
    import grpc_tools
    from grpc_tools import protoc

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory(dir=_HERE, prefix=".protoc-") as tmp:
      args = [
          "grpc_tools.protoc",
          f"-I{_INCLUDE_ROOT}",
          f"-I{well_known}",
          f"--python_out={tmp}",
          f"--grpc_python_out={tmp}",
          *[str(p.relative_to(_INCLUDE_ROOT)) for p in todo],
      ]
      rc = protoc.main(args)
      if rc != 0:
        raise RuntimeError(f"protoc failed (exit {rc}) on {[p.name for p in todo]}; "
                           "run it by hand to see the error: " + " ".join(args))
      gen_dir = Path(tmp) / _HERE.relative_to(_INCLUDE_ROOT)
      for proto in todo:
        for out in _outputs(proto):
          produced = gen_dir / out.name
          # Write-then-rename: a concurrent importer sees the old file or the
          # new one, never a half-written module.
          staged = out.with_name(f".{out.name}.{os.getpid()}.tmp")
          shutil.copyfile(produced, staged)
          os.replace(staged, out)
    return todo


generate()
