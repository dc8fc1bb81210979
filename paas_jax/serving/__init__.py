"""Two-region serving: PrfaaS prefill (region A), PD decode (region B), a broker.

Processes and their gRPC services (contract: ``paas_jax/proto/serving.proto``;
every server also serves ``grpc.health.v1`` and ``GetStats``):

* ``prefill_server`` (region A): ``Prefill`` -- batched, chunked prefill
  (``prefill_engine.PrefillEngine`` behind ``prefill_batcher.PrefillBatcher``;
  one RPC's life in ``prefill_rpc``); each computed chunk (or each layer of
  the last chunk) goes to the transfer as soon as it is computed, so the
  transfer overlaps the prefill.
* ``decode_server`` (region B): ``Decode`` + ``Handoff`` on the control port,
  ``paas_jax.transport`` ``StateTransfer`` on the transfer port. A
  continuous-batching ``decode_scheduler.DecodeScheduler`` over
  ``decode_engine.DecodeEngine`` (``slot_pool``: paged KV pool for A/M layers,
  slot-indexed recurrent and ring-buffer state), plus local PD-P prefill for
  short prompts. Launchers (flags) are ``*_main.py``, never imported by the
  servers.
* ``broker``: ``Broker.Generate`` (server streaming), routing by
  ``routing.RoutingPolicy`` (static selective offloading: l > t goes to PrfaaS).
* ``paas_jax.netem`` joins A and B (userspace relay; optionally a network
  namespace with tbf); ``launch.LocalCluster`` starts everything.

Engine boundary (JetStream): ``PrefillEngine.prefill`` -> ``DecodeEngine.insert(
state, slot)`` -> ``DecodeEngine.generate()`` -> ``DecodeEngine.free(slot)``.
Tokens equal single-process ``api.generate`` because sampling is keyed by
(seed, absolute position) with the same ``sample_tokens``.
"""
