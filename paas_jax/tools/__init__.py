"""Command-line tools (``python -m paas_jax.tools.<name>``)."""
