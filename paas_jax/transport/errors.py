"""Transfer errors carrying a gRPC status code."""

from __future__ import annotations

import grpc


class TransferError(Exception):
  """A transfer failed; ``code`` is the gRPC status that describes why.

  INVALID_ARGUMENT: malformed frames or manifest. DATA_LOSS: a chunk kept
  failing its integrity check (the message names the layer and chunk).
  FAILED_PRECONDITION: model / config-fingerprint mismatch. DEADLINE_EXCEEDED:
  an RPC or the whole transfer ran out of time. RESOURCE_EXHAUSTED: the
  receiver's byte budget is full. CANCELLED: aborted by one side.
  """

  def __init__(self, code: grpc.StatusCode, message: str, transfer_id: str | None = None):
    self.code = code
    self.message = message
    self.transfer_id = transfer_id
    prefix = f"transfer {transfer_id}: " if transfer_id else ""
    super().__init__(f"{prefix}{code.name}: {message}")

  @classmethod
  def from_rpc_error(cls, e: grpc.RpcError, transfer_id: str | None = None,
                     what: str = "") -> "TransferError":
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = e.details() if hasattr(e, "details") else str(e)
    message = f"{what}: {details}" if what else str(details)
    return cls(code or grpc.StatusCode.UNKNOWN, message, transfer_id)
