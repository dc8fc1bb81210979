"""TCP data plane for state transfers; see docs/transport.md."""
