"""Streaming decode states from prefill to decode processes over gRPC.

Prefill side::

  sender = StateSender("decode-host:50051", options=SenderOptions(num_streams=4))
  with sender.begin(model_id=cfg.name, config_fingerprint=cfg.fingerprint(),
                    num_layers=cfg.n_layers, lengths=prompt_lengths,
                    codec=CodecOptions(compression="zstd")) as tx:
    tx.send_layers(LayerwisePrefill(model, tokens))   # overlaps prefill and transfer
    result = tx.finish()                              # committed; result.timeline

Decode side::

  receiver = StateReceiver(models={cfg.name: cfg.fingerprint()},
                           template=lambda info: (abstract_state(cfg, 1, cap(info)), None))
  server = serve_receiver(receiver, "0.0.0.0:50051")
  received = receiver.ready.get()                     # ReceivedState, .state restored
"""

from paas_jax.transport.counters import LinkCounters, LinkTransfer
from paas_jax.transport.errors import TransferError
from paas_jax.transport.flow import ByteBoundedQueue
from paas_jax.transport.receiver import ReceivedState, ReceiverOptions, StateReceiver, TransferInfo
from paas_jax.transport.receiver_server import ReceiverServer, serve_receiver
from paas_jax.transport.sender import (SenderOptions, StateSender, Transfer, TransferResult)
from paas_jax.transport.timeline import (LayerTiming, ReceiveTimeline, TransferTimeline)

__all__ = [
    "ByteBoundedQueue", "LayerTiming", "LinkCounters", "LinkTransfer", "ReceiveTimeline",
    "ReceivedState", "ReceiverOptions",
    "ReceiverServer", "SenderOptions", "StateReceiver", "StateSender", "Transfer",
    "TransferError", "TransferInfo", "TransferResult", "TransferTimeline", "serve_receiver",
]
