"""Transport security of paas-jax: TLS/mTLS credentials, bearer tokens, peer roles.

* ``ca``: a local CA and per-service certificates (``python -m
  paas_jax.security.make_certs --out=DIR``).
* ``tls``: ``server_credentials`` / ``channel_credentials`` from PEM files;
  plaintext only with an explicit ``insecure=True`` (and a warning).
* ``auth``: ``BearerTokenInterceptor`` for the broker's public API.
* ``peers``: ``PeerIdentityInterceptor``: which certificate role may call what.
* ``ServiceSecurity``: the bundle one server process needs.
"""

from __future__ import annotations

import dataclasses

import grpc

from paas_jax.security.auth import (BearerTokenInterceptor, TokenSet, generate_token,
                                    read_token, token_metadata)
from paas_jax.security.ca import CertFiles, LocalCA, cert_files, make_certs
from paas_jax.security.peers import (PeerIdentityInterceptor, admin_interceptor, peer_names,
                                     service_rules)
from paas_jax.security.tls import (SecurityConfigError, TLSConfig, add_port,
                                   channel_credentials, server_credentials,
                                   target_name_override)


@dataclasses.dataclass(frozen=True)
class ServiceSecurity:
  """Everything one serving process needs: its TLS identity, its role's peer
  rules and, for the broker, the accepted API tokens.

  Attributes:
    tls: certificate files (or an explicit plaintext choice).
    role: ``broker``, ``prefill`` or ``decode``; selects ``service_rules``.
    tokens: bearer tokens checked on the broker's public API (None: none).
    public_client_auth: for the broker: also require client certificates on
      the public port (default: TLS + bearer token, no client certificate).
  """

  tls: TLSConfig
  role: str
  tokens: TokenSet | None = None
  public_client_auth: bool = False

  @property
  def insecure(self) -> bool:
    return self.tls.insecure

  def server_credentials(self) -> grpc.ServerCredentials | None:
    require = self.role != "broker" or self.public_client_auth
    return self.tls.server(require_client_auth=require)

  def channel_credentials(self) -> grpc.ChannelCredentials | None:
    """For this process's channels to the other services (mutual TLS)."""
    return self.tls.client()

  def interceptors(self, *, on_auth=None, on_peer=None) -> list[grpc.ServerInterceptor]:
    out: list[grpc.ServerInterceptor] = []
    if self.tokens is not None:
      out.append(BearerTokenInterceptor(self.tokens, on_result=on_auth))
    require_certs = self.role != "broker" or self.public_client_auth
    if not self.insecure and require_certs:
      out.append(PeerIdentityInterceptor(service_rules(self.role), on_result=on_peer))
    elif not self.insecure and self.role == "broker":
      # Token-only public port: still guard the operator method (SetRoles).
      out.append(admin_interceptor(on_result=on_peer))
    return out


__all__ = [
    "BearerTokenInterceptor", "CertFiles", "LocalCA", "PeerIdentityInterceptor",
    "SecurityConfigError", "ServiceSecurity", "TLSConfig", "TokenSet", "add_port", "cert_files",
    "channel_credentials", "generate_token", "make_certs", "peer_names", "read_token",
    "server_credentials", "service_rules", "target_name_override", "token_metadata",
]
