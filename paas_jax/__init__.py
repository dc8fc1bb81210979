"""paas-jax: Prefill-as-a-Service for hybrid-attention language models in JAX.

Data flows one way: request -> broker -> prefill (region A) -> state codec ->
transport -> decode (region B) -> tokens back to the client.
"""

__version__ = "0.1.0"
