"""A prefill-side process for the killed-sender test (run as a script).

Begins a transfer, streams the first layers, then blocks with its streams
open, as a prefill that hangs or is about to be killed would.

usage: python sender_proc.py TARGET TRANSFER_ID
"""

import sys
import time

from paas_jax.codec import CodecOptions
from paas_jax.codec.testing import random_state
from paas_jax.models import load_config
from paas_jax.transport import SenderOptions, StateSender


def main(target: str, transfer_id: str) -> None:
  config = load_config("tiny_gdn_gqa")
  state = random_state(config, [50], capacity=64, seed=3)
  sender = StateSender(target, options=SenderOptions(num_streams=2))
  tx = sender.begin(model_id=config.name, config_fingerprint=config.fingerprint(),
                    num_layers=config.n_layers, lengths=[50], transfer_id=transfer_id,
                    codec=CodecOptions(chunk_bytes=1024))
  tx.send_layer(0, state.layers[0])
  tx.send_layer(1, state.layers[1])
  print("layers queued", flush=True)
  time.sleep(600)


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2])
