"""Logprobs on the session cluster (separate server processes, WAN relay, both
regions prefilling through the hybrid prefix cache): a prompt that reuses a
cached prefix gets the same logprobs as a cold prefill, on both routes, each
within ``LOGPROB_ATOL`` of the single-process reference logits
(``logprob_check``), with reference tokens."""

from __future__ import annotations

import numpy as np
import pytest

from paas_jax.client import BrokerClient
from paas_jax.serving import logprob_check

from tests.serving.conftest import LONG, PREFIX_BLOCK, THRESHOLD

# Region A caches the chunk ends (128 tokens) of chunk-streamed remote prompts,
# PD-P every 64-token block.
CHUNK = 128

MAX_NEW = 5


@pytest.fixture(scope="module")
def client(cluster):
  with BrokerClient(cluster.broker_address, timeout_s=120) as c:
    yield c


@pytest.mark.parametrize("length,route,reused", [(THRESHOLD - 10, "pdp", PREFIX_BLOCK),
                                                (LONG, "prfaas", CHUNK)])
def test_prefix_cache_hit_keeps_reference_logprobs(client, ref_model, reference, length,
                                                    route, reused):
  rng = np.random.default_rng(4400 + length)
  shared = [int(t) for t in rng.integers(0, 256, reused)]
  prompts = [shared + [int(t) for t in rng.integers(0, 256, length - reused)]
             for _ in range(2)]
  outs = [client.generate(prompt_ids=p, max_new_tokens=MAX_NEW, logprobs=True,
                          top_logprobs=4) for p in prompts]
  # The second prompt reused the first one's cached prefix block.
  assert [o.summary["cached_tokens"] for o in outs] == [0, reused]
  for out, prompt in zip(outs, prompts):
    assert out.route == route
    assert out.tokens == list(reference(tuple(prompt), MAX_NEW))
    cmp = logprob_check.compare(out.logprobs, logprob_check.reference_logprobs(
        ref_model, prompt, out.tokens))
    assert cmp.ok and cmp.steps == MAX_NEW, cmp
