"""gRPC channel and server construction with explicit message-size limits."""

from __future__ import annotations

from concurrent import futures
from typing import Sequence

import grpc

# Encoded chunks are ~1 MiB; 8 MiB leaves room for protobuf framing and for
# a compressed chunk that grew on incompressible data (shared/ENVIRONMENT.md:
# the 4 MiB default fails on a 4 MiB payload).
DEFAULT_MAX_MESSAGE_BYTES = 8 << 20
# Frame fields around the payload (ids, key, crc) stay far below this.
FRAME_OVERHEAD_BYTES = 64 << 10


def message_options(max_message_bytes: int) -> list[tuple[str, int]]:
  return [("grpc.max_send_message_length", max_message_bytes),
          ("grpc.max_receive_message_length", max_message_bytes)]


def make_channels(target: str, count: int, *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                  credentials: grpc.ChannelCredentials | None = None,
                  extra_options: Sequence[tuple[str, object]] = ()) -> list[grpc.Channel]:
  """``count`` channels to ``target``, each on its own TCP connection.

  Channels with identical arguments share one subchannel (one connection) by
  default; a local subchannel pool per channel gives N real connections,
  which is what spreads a transfer over N TCP congestion windows.
  """
  options = message_options(max_message_bytes) + [("grpc.use_local_subchannel_pool", 1)]
  options += list(extra_options)
  if credentials is None:
    return [grpc.insecure_channel(target, options=options) for _ in range(count)]
  return [grpc.secure_channel(target, credentials, options=options) for _ in range(count)]


def make_server(*, max_workers: int, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                maximum_concurrent_rpcs: int | None = None,
                extra_options: Sequence[tuple[str, object]] = (),
                interceptors: Sequence[grpc.ServerInterceptor] = ()) -> grpc.Server:
  """A sync gRPC server. Each Push stream holds one worker thread for its
  lifetime, so ``max_workers`` bounds concurrent transfers x streams; RPCs
  beyond ``maximum_concurrent_rpcs`` get RESOURCE_EXHAUSTED instead of queueing."""
  return grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers,
                                                thread_name_prefix="state-rx"),
                     options=message_options(max_message_bytes) + list(extra_options),
                     maximum_concurrent_rpcs=maximum_concurrent_rpcs,
                     interceptors=list(interceptors))


def add_port(server: grpc.Server, address: str,
             credentials: grpc.ServerCredentials | None = None) -> int:
  """Binds ``address`` (``host:0`` picks a free port); returns the port."""
  if credentials is None:
    port = server.add_insecure_port(address)
  else:
    port = server.add_secure_port(address, credentials)
  if port == 0:
    raise OSError(f"could not bind gRPC server to {address}")
  return port
