"""TLS for the data plane from the same PEM files as the gRPC ports.

The gRPC credentials objects are opaque, so the data plane builds its own
``ssl.SSLContext`` from a ``paas_jax.security.TLSConfig`` (CA, certificate,
key): mutual TLS, TLS 1.2+, and after the handshake the receiver checks the
sender's certificate names (subject CN and ``spiffe://paas-jax/<name>`` URI
SAN) against the same peer patterns as its StateTransfer gRPC service
(``paas_jax.security.peers.service_rules``). Servers are verified against
the CA (not the host name: the address dialled may be a WAN relay), as the
gRPC side does with ``target_name_override``.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import ssl
from typing import Sequence

from paas_jax.security.ca import URI_PREFIX
from paas_jax.security.peers import STATE_TRANSFER_PREFIX, service_rules
from paas_jax.security.tls import SecurityConfigError, TLSConfig


def server_context(tls: TLSConfig) -> ssl.SSLContext:
  """Receiver side: present ``tls.cert``, require a client certificate from ``tls.ca``."""
  if tls.insecure or not (tls.cert and tls.key and tls.ca):
    raise SecurityConfigError(f"{tls.name} data plane: mutual TLS needs cert, key and ca")
  ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
  ctx.minimum_version = ssl.TLSVersion.TLSv1_2
  ctx.load_cert_chain(tls.cert, tls.key)
  ctx.load_verify_locations(tls.ca)
  ctx.verify_mode = ssl.CERT_REQUIRED
  return ctx


def client_context(tls: TLSConfig) -> ssl.SSLContext:
  """Sender side: verify the receiver against ``tls.ca``, present ``tls.cert``."""
  if tls.insecure or not (tls.cert and tls.key and tls.ca):
    raise SecurityConfigError(f"{tls.name} data plane: mutual TLS needs cert, key and ca")
  ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
  ctx.minimum_version = ssl.TLSVersion.TLSv1_2
  ctx.load_cert_chain(tls.cert, tls.key)
  ctx.load_verify_locations(tls.ca)
  ctx.check_hostname = False
  ctx.verify_mode = ssl.CERT_REQUIRED
  return ctx


def peer_names(sock: ssl.SSLSocket) -> list[str]:
  """Verified names of the peer's certificate: subject CN and our URI SANs."""
  cert = sock.getpeercert() or {}
  names = [value for rdn in cert.get("subject", ()) for key, value in rdn
           if key == "commonName"]
  for kind, value in cert.get("subjectAltName", ()):
    if kind == "URI" and value.startswith(URI_PREFIX):
      names.append(value[len(URI_PREFIX):])
  return names


def allowed(names: Sequence[str], patterns: Sequence[str] | None) -> bool:
  """Whether any name matches any pattern (None: any verified peer)."""
  if patterns is None:
    return True
  return any(fnmatch.fnmatchcase(n, p) for n in names for p in patterns)


def receiver_kwargs(security, role: str, credentials=None, host: str | None = None) -> dict:
  """``serve_receiver`` keyword arguments that open the data plane of a serving
  process's StateTransfer port: TLS and the role's StateTransfer peer patterns
  from ``security`` (a ``ServiceSecurity``), plaintext when it is None or
  --insecure. {} (no data plane) when the port has gRPC ``credentials`` but no
  ``security`` to build the data plane's TLS from. Begin and Commit may ride
  the data plane (``data_control``) unless the service checks bearer tokens,
  which only its gRPC port does."""
  tokens = security is not None and security.tokens is not None
  if security is None or security.insecure:
    if credentials is not None:
      return {}
    return {"data_plane": True, "data_host": host, "data_control": not tokens}
  patterns = service_rules(role)[STATE_TRANSFER_PREFIX]
  return {"data_plane": True, "data_ssl": server_context(security.tls),
          "data_peers": patterns, "data_host": host, "data_control": not tokens}


def sender_fields(security, lanes: int) -> dict:
  """``SenderOptions`` fields for ``plane="tcp"`` with ``security``'s identity."""
  if security is None or security.insecure:
    return {"plane": "tcp", "lanes": lanes}
  return {"plane": "tcp", "lanes": lanes, "data_ssl": client_context(security.tls)}


def secured_sender(opts, security):
  """``opts`` (``SenderOptions``) carrying ``security``'s identity: its gRPC
  channel credentials and, on the tcp plane without a data-plane context of
  its own, the data plane's (one replace: TLS credentials without
  ``data_ssl`` are refused on their own)."""
  fields = {"credentials": security.channel_credentials()}
  if opts.plane == "tcp" and opts.data_ssl is None:
    fields.update(sender_fields(security, opts.lanes))
  return dataclasses.replace(opts, **fields)
