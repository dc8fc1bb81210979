"""Fixtures for the serving tests: one real two-region cluster per session.

The cluster runs the prefill server (region A), the decode server (region B),
a WAN relay between them and the broker as separate processes on 127.0.0.1.
Compiled engines go to the persistent XLA cache ($PAAS_JAX_COMPILATION_CACHE
or runs/.jax_cache), so only the first run pays for compilation.
"""

from __future__ import annotations

import functools
import socket
import threading
import time

import pytest

from paas_jax.netem import LinkSpec
from paas_jax.serving import common, logprob_check
from paas_jax.serving.launch import ClusterSpec, LocalCluster

CONFIG = "tiny_gdn_gqa"
SEED = 0
# Prompts up to 100 tokens are prefilled locally (PD-P), longer ones remotely.
THRESHOLD = 100
N_SLOTS = 8
MAX_QUEUE = 8
MAX_CTX = 512
SHORT, LONG = 40, 200  # LONG spans two 128-token prefill chunks
# Both regions prefill through a HybridPrefixCache with 64-token blocks, so every
# token-exactness test below also covers api.cached_prefill.
PREFIX_BLOCK = 64


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
  spec = ClusterSpec(config=CONFIG, seed=SEED, n_slots=N_SLOTS, max_queue=MAX_QUEUE,
                     max_ctx=MAX_CTX, prefill_buckets=(128,), prefill_max_batch=4,
                     threshold=THRESHOLD, prefix_block=PREFIX_BLOCK,
                     link=LinkSpec(bandwidth_bps=200e6, rtt_s=0.01,
                                                        jitter_s=0.001))
  c = LocalCluster(spec, tmp_path_factory.mktemp("cluster"))
  c.start()
  yield c
  c.stop()


@pytest.fixture(scope="session")
def ref_model():
  common.enable_compilation_cache(common.default_compilation_cache())
  model, _ = common.load_model(CONFIG, SEED)
  return model


@pytest.fixture(scope="session")
def reference(ref_model):
  """tokens = reference(prompt, max_new_tokens, temperature, top_k, top_p, seed, stops)."""
  from paas_jax.models import api

  @functools.lru_cache(maxsize=None)
  def ref(prompt: tuple, max_new: int, temperature=0.0, top_k=0, top_p=1.0, seed=0,
          stops: tuple = ()):
    return api.generate(ref_model, list(prompt), max_new,
                        sampling=api.SamplingParams(temperature, top_k, top_p), seed=seed,
                        stop_tokens=stops).tokens
  return ref


@pytest.fixture(scope="session")
def assert_logprobs(ref_model):
  """assert_logprobs(prompt, out): ``out`` (asked with ``logprobs=True``) carries one
  logprob per token and each matches the single-process reference logits within
  ``logprob_check.LOGPROB_ATOL`` (#12: logits, not only tokens)."""
  def check(prompt, out):
    assert len(out.logprobs) == len(out.tokens), (len(out.logprobs), len(out.tokens))
    cmp = logprob_check.compare(out.logprobs, logprob_check.reference_logprobs(
        ref_model, list(prompt), out.tokens))
    assert cmp.ok and cmp.steps == len(out.tokens), cmp
  return check


def relay_stats_reaching(read_stats, minimum: int, timeout_s: float = 30.0) -> dict:
  """The relay's statistics once its ``a_to_b`` bytes reach ``minimum``.

  The relay rewrites its statistics file every 0.5 s, so a read right after a
  reply can miss that request's bytes; ``read_stats()`` may return None while
  the file is not there yet. Fails (with the last reading) after ``timeout_s``.
  """
  deadline = time.monotonic() + timeout_s
  while (stats := read_stats()) is None or stats["a_to_b"]["bytes"] < minimum:
    assert time.monotonic() < deadline, (stats, minimum)
    time.sleep(0.2)
  return stats


def thread_server(handler) -> tuple[socket.socket, int]:
  """A TCP server on 127.0.0.1 that runs ``handler(connection)`` in a thread
  per accepted connection; returns (listening socket, port). Close the socket
  to stop accepting."""
  srv = socket.create_server(("127.0.0.1", 0))

  def serve():
    while True:
      try:
        conn, _ = srv.accept()
      except OSError:
        return
      threading.Thread(target=handler, args=(conn,), daemon=True).start()
  threading.Thread(target=serve, daemon=True).start()
  return srv, srv.getsockname()[1]
