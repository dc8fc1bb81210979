"""One real deployment for the front-door tests: prefill region, decode region,
WAN relay, broker and the OpenAI gateway as separate processes, with TLS and
bearer tokens as in production (the gateway shares the broker's certificate
and token file)."""

from __future__ import annotations

import ssl

import openai
import pytest

from paas_jax.netem import LinkSpec
from paas_jax.serving.launch import ClusterSpec, LocalCluster
# Single-process generation of the same weights (same config and seed).
from tests.serving.conftest import ref_model, reference  # noqa: F401  (fixtures)
from tests.serving.conftest import CONFIG, MAX_CTX, SEED

THRESHOLD = 100
SHORT, LONG = 40, 200
N_SLOTS = 4


@pytest.fixture(scope="session")
def gateway_cluster(tmp_path_factory):
  spec = ClusterSpec(config=CONFIG, seed=SEED, n_slots=N_SLOTS, max_queue=8, max_ctx=MAX_CTX,
                     prefill_buckets=(128,), prefill_max_batch=4, threshold=THRESHOLD,
                     tls=True, http=True,
                     link=LinkSpec(bandwidth_bps=200e6, rtt_s=0.01, jitter_s=0.001))
  c = LocalCluster(spec, tmp_path_factory.mktemp("frontdoor"))
  c.start()
  yield c
  c.stop()


@pytest.fixture(scope="session")
def http(gateway_cluster):
  """An HTTP client (openai's httpx) that trusts the deployment's CA (no token attached)."""
  with openai.DefaultHttpxClient(base_url=gateway_cluster.http_url.removesuffix("/v1"),
                    verify=ssl.create_default_context(cafile=gateway_cluster.certs / "ca.pem"), timeout=120) as c:
    yield c


@pytest.fixture(scope="session")
def oai(gateway_cluster):
  """The official openai client with the deployment's bearer token."""
  with openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=gateway_cluster.certs / "ca.pem"), timeout=120) as h:
    yield openai.OpenAI(base_url=gateway_cluster.http_url, api_key=gateway_cluster.token,
                        http_client=h, max_retries=0)
