"""Per-link codec options."""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Literal

Compression = Literal["raw", "zstd", "blosc"]
Quantization = Literal["none", "int8", "fp8"]

# 1 MiB keeps one encoded chunk inside one gRPC message with room to spare
# (see shared/ENVIRONMENT.md: 1-2 MiB messages stream at ~1 GB/s on loopback,
# and the 4 MiB default receive limit fails on framing overhead).
DEFAULT_CHUNK_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class CodecOptions:
  """How a decode state is turned into zarr3 objects.

  Attributes:
    compression: "raw" (bytes codec only), "zstd" or "blosc". Chosen per link:
      raw for fat intra-region links where CPU is the bottleneck, zstd/blosc
      for thin cross-region Ethernet.
    level: zstd level or blosc clevel.
    blosc_cname: blosc inner compressor ("lz4", "lz4hc", "blosclz", "zstd",
      "zlib").
    quantization: "none", or lossy per-channel "int8" / "fp8" (float8_e4m3fn)
      of full-attention KV (AttentionCache, MLACache). Sliding-window rings and
      recurrent states are always stored exactly: an error there is carried
      into every later token instead of being diluted by softmax.
    chunk_bytes: target size of one uncompressed chunk.
    heads_per_chunk: if set, at most this many heads per chunk along the head
      axis (a divisor of the per-device shard's head count is used), so that a
      receiver with more tensor-parallel shards reads fewer bytes per device.
  """

  compression: Compression = "raw"
  level: int = 1
  blosc_cname: str = "lz4"
  quantization: Quantization = "none"
  chunk_bytes: int = DEFAULT_CHUNK_BYTES
  heads_per_chunk: int | None = None

  def __post_init__(self):
    if self.compression not in ("raw", "zstd", "blosc"):
      raise ValueError(f"CodecOptions.compression: expected raw|zstd|blosc, got "
                       f"{self.compression!r}")
    if self.quantization not in ("none", "int8", "fp8"):
      raise ValueError(f"CodecOptions.quantization: expected none|int8|fp8, got "
                       f"{self.quantization!r}")
    if self.chunk_bytes < 1024:
      raise ValueError(f"CodecOptions.chunk_bytes must be >= 1024, got {self.chunk_bytes}")
    if self.heads_per_chunk is not None and self.heads_per_chunk < 1:
      raise ValueError(f"CodecOptions.heads_per_chunk must be >= 1, got "
                       f"{self.heads_per_chunk}")

  def zarr_codecs(self, itemsize: int) -> list[dict]:
    """The zarr3 codec chain for one array with elements of ``itemsize`` bytes."""
    chain: list[dict] = [{"name": "bytes", "configuration": {"endian": "little"}}]
    if self.compression == "zstd":
      chain.append({"name": "zstd", "configuration": {"level": self.level}})
    elif self.compression == "blosc":
      chain.append({"name": "blosc", "configuration": {
          "cname": self.blosc_cname, "clevel": self.level,
          # Byte shuffle groups the exponent bytes of bf16/f32 values together,
          # which is where KV caches compress at all.
          "shuffle": "shuffle" if itemsize > 1 else "noshuffle",
          "typesize": itemsize, "blocksize": 0}})
    return chain

  def to_dict(self) -> dict:
    # Field by field: every field is a scalar, and dataclasses.asdict's deep
    # copy was a visible part of each Begin and Commit.
    return {name: getattr(self, name) for name in _FIELDS}

  def to_json(self) -> str:
    return json.dumps(self.to_dict(), sort_keys=True)

  @classmethod
  def from_dict(cls, d: dict) -> "CodecOptions":
    unknown = set(d).difference(_FIELDS)
    if unknown:
      raise ValueError(f"CodecOptions: unknown fields {sorted(unknown)}")
    return cls(**d)

  @classmethod
  def from_json(cls, s: str) -> "CodecOptions":
    return _from_json(s)


_FIELDS = tuple(f.name for f in dataclasses.fields(CodecOptions))


@functools.lru_cache(maxsize=256)
def _from_json(s: str) -> CodecOptions:
  """A link's options arrive with every Begin, mostly as the same text; the
  result is frozen, so one parse serves them all."""
  return CodecOptions.from_dict(json.loads(s))
