"""Certificates and small real gRPC servers for the security tests."""

from __future__ import annotations

import dataclasses
from concurrent import futures
from typing import Callable, Sequence

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from paas_jax.security import ca as ca_lib
from paas_jax.security import tls


@dataclasses.dataclass
class Pki:
  """Our CA with one cert per role, plus a rogue CA that issued its own 'prefill'."""

  dir: str
  files: dict
  rogue: dict

  def tls(self, name: str) -> tls.TLSConfig:
    return tls.TLSConfig.from_files(self.files[name])


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> Pki:
  good = tmp_path_factory.mktemp("pki")
  rogue = tmp_path_factory.mktemp("rogue")
  files = ca_lib.make_certs(good, ("broker", "prefill-0", "decode-0", "client"))
  rogue_files = ca_lib.make_certs(rogue, ("prefill-0", "client"))
  return Pki(dir=str(good), files=files, rogue=rogue_files)


@dataclasses.dataclass
class Served:
  server: grpc.Server
  port: int
  health: health.HealthServicer

  @property
  def target(self) -> str:
    return f"127.0.0.1:{self.port}"


@pytest.fixture
def serve():
  """serve(register, credentials, interceptors) -> a started server on 127.0.0.1."""
  started: list[grpc.Server] = []

  def start(register: Callable[[grpc.Server], None] | None = None,
            credentials: grpc.ServerCredentials | None = None,
            interceptors: Sequence[grpc.ServerInterceptor] = ()) -> Served:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8),
                         interceptors=list(interceptors))
    h = health.HealthServicer()
    h.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(h, server)
    if register is not None:
      register(server)
    port = tls.add_port(server, "127.0.0.1:0", credentials)
    server.start()
    started.append(server)
    return Served(server, port, h)

  yield start
  for s in started:
    s.stop(0)


def health_check(channel: grpc.Channel, timeout: float = 5.0):
  return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                   timeout=timeout)
