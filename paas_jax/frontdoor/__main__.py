"""``python -m paas_jax.frontdoor``: see paas_jax/frontdoor/server.py."""

from absl import app

from paas_jax.frontdoor import server

if __name__ == "__main__":
  server.define_flags()
  app.run(server.main)
