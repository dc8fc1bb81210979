"""paas_jax/proto compiles every .proto of its folder at import time."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

REPO = pathlib.Path(__file__).resolve().parents[2]


def run(code: str, root: pathlib.Path) -> str:
  env = dict(os.environ, PYTHONPATH=str(root))
  out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=root, env=env,
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  return out.stdout


def test_new_and_stale_protos_are_generated(tmp_path):
  # A copy of the package with the real transport.proto plus one added later
  # that imports it, as a future service would.
  pkg = tmp_path / "paas_jax" / "proto"
  pkg.mkdir(parents=True)
  (tmp_path / "paas_jax" / "__init__.py").write_text("")
  shutil.copy(REPO / "paas_jax/proto/__init__.py", pkg)
  shutil.copy(REPO / "paas_jax/proto/transport.proto", pkg)
  (pkg / "extra.proto").write_text(textwrap.dedent("""\
      syntax = "proto3";
      package paas_jax.extra.v1;
      import "paas_jax/proto/transport.proto";
      message Wrapped { paas_jax.transport.v1.Chunk chunk = 1; }
      service Echo { rpc Say(Wrapped) returns (Wrapped); }
      """))
  out = run("""
      from paas_jax.proto import extra_pb2, extra_pb2_grpc, transport_pb2
      m = extra_pb2.Wrapped(chunk=transport_pb2.Chunk(key="k", nbytes=3))
      print(extra_pb2.Wrapped.FromString(m.SerializeToString()).chunk.key,
            hasattr(extra_pb2_grpc, "EchoStub"))
      """, tmp_path)
  assert out.split() == ["k", "True"]
  for name in ("extra_pb2.py", "extra_pb2_grpc.py", "transport_pb2.py", "transport_pb2_grpc.py"):
    assert (pkg / name).is_file()
  assert not list(pkg.glob(".protoc-*")) and not list(pkg.glob(".*.tmp"))

  # Fresh outputs are left alone; an edited .proto is recompiled on the next import.
  assert run("import paas_jax.proto as p; print(p.generate())", tmp_path).strip() == "[]"
  proto = pkg / "extra.proto"
  proto.write_text(proto.read_text().replace("chunk = 1; }", "chunk = 1; string note = 2; }"))
  os.utime(proto, ns=(proto.stat().st_mtime_ns + 10**9,) * 2)
  out = run("""
      from paas_jax.proto import extra_pb2
      print(extra_pb2.Wrapped(note="hi").note)
      """, tmp_path)
  assert out.strip() == "hi"
