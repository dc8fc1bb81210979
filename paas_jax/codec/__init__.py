"""Decode-state codec: TensorStore zarr3 arrays plus a verifiable manifest.

Typical use::

  manifest = encode_state(state, "file:///tmp/req42/", model_id=cfg.name,
                          config_fingerprint=cfg.fingerprint(),
                          options=CodecOptions(compression="zstd"))
  state = decode_state("file:///tmp/req42/", like=abstract_state(cfg, 1, 4096),
                       expected_fingerprint=cfg.fingerprint())
"""

from paas_jax.codec.decode import (check_blob, check_identity, check_template, decode_state,
                                   fetch_group, read_manifest, restore_array,
                                   restore_from_store, restore_group, restore_indexed_group,
                                   assemble, verify_state, RestoreTemplate)
from paas_jax.codec.encode import (EncodedGroup, build_manifest, encode_arrays, encode_groups,
                                   encode_layer, encode_state, encode_state_arrays,
                                   source_sharding, spans_devices, token_count_of,
                                   wire_arrays)
from paas_jax.codec.errors import (ChunkIntegrityError, CodecError, FingerprintMismatchError,
                                   IncompleteStateError, LayoutMismatchError)
from paas_jax.codec.layout import ArrayRole, split_state
from paas_jax.codec.manifest import (MANIFEST_KEY, ArrayEntry, ChunkEntry, LayerEntry,
                                     StateManifest, merge_manifests)
from paas_jax.codec.options import CodecOptions
from paas_jax.codec.store import MemoryStore, crc32c, open_kvstore

__all__ = [
    "ArrayEntry", "ArrayRole", "ChunkEntry", "ChunkIntegrityError", "CodecError",
    "CodecOptions", "EncodedGroup", "FingerprintMismatchError", "IncompleteStateError",
    "LayerEntry", "LayoutMismatchError", "MANIFEST_KEY", "MemoryStore", "RestoreTemplate",
    "StateManifest", "assemble", "build_manifest", "check_blob", "check_identity",
    "check_template", "crc32c",
    "decode_state", "encode_arrays", "encode_groups", "encode_layer", "encode_state",
    "encode_state_arrays", "fetch_group", "merge_manifests", "open_kvstore", "read_manifest",
    "restore_array", "restore_from_store", "restore_group", "restore_indexed_group",
    "source_sharding", "spans_devices", "split_state", "token_count_of", "verify_state", "wire_arrays",
]
