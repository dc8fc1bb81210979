"""Errors raised by the state codec.

Every error that concerns stored bytes names the layer and the chunk, because
the operator's first question on a failed transfer is "which object, from
which layer" (to tell a flaky link from a bad encoder or a bad disk).
"""

from __future__ import annotations


class CodecError(Exception):
  """Base class of every codec error."""


class IncompleteStateError(CodecError):
  """The store holds no (complete) manifest: the state was never committed."""


class FingerprintMismatchError(CodecError):
  """The state was produced by a different model or config than the reader's."""

  def __init__(self, *, expected_model_id: str | None, expected_fingerprint: str | None,
               got_model_id: str, got_fingerprint: str):
    self.expected_model_id = expected_model_id
    self.expected_fingerprint = expected_fingerprint
    self.got_model_id = got_model_id
    self.got_fingerprint = got_fingerprint
    super().__init__(
        f"state was encoded for model {got_model_id!r} (config fingerprint "
        f"{got_fingerprint}), but the reader expects model {expected_model_id!r} "
        f"(fingerprint {expected_fingerprint}); refusing to restore it")


def describe_location(layer_index: int, layer_kind: str, array: str, key: str) -> str:
  where = "state-level arrays" if layer_index < 0 else f"layer {layer_index} ({layer_kind})"
  return f"{where}, array {array!r}, chunk {key!r}"


class ChunkIntegrityError(CodecError):
  """A stored chunk is missing, truncated or fails its crc32c."""

  def __init__(self, *, layer_index: int, layer_kind: str, array: str, key: str,
               reason: str):
    self.layer_index = layer_index
    self.layer_kind = layer_kind
    self.array = array
    self.key = key
    self.reason = reason
    super().__init__(f"{describe_location(layer_index, layer_kind, array, key)}: {reason}")


class LayoutMismatchError(CodecError):
  """The stored state does not fit the template it is restored into."""
