"""gRPC credentials from PEM files: TLS, mutual TLS and explicit plaintext.

Servers::

  creds = server_credentials(cert="certs/decode.pem", key="certs/decode.key",
                             client_ca="certs/ca.pem")          # mTLS
  port = add_port(server, "127.0.0.1:0", creds)

Clients::

  creds = channel_credentials(ca="certs/ca.pem", cert="certs/prefill.pem",
                              key="certs/prefill.key")
  channel = grpc.secure_channel(target, creds)

Plaintext exists only when a caller asks for it (``insecure=True``); it logs a
warning every time, and leaving out the certificate without asking for
plaintext is an error, so a forgotten flag can never silently drop TLS.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib

import grpc

from paas_jax.security.ca import CertFiles, cert_files

log = logging.getLogger("paas_jax.security")

PathLike = str | os.PathLike


class SecurityConfigError(ValueError):
  """Credentials were asked for with missing, unreadable or contradictory inputs."""


def _read(path: PathLike | None, what: str) -> bytes:
  if path is None:
    raise SecurityConfigError(f"{what}: no file given")
  try:
    data = pathlib.Path(path).read_bytes()
  except OSError as e:
    raise SecurityConfigError(f"{what}: cannot read {path}: {e.strerror or e}") from None
  if b"-----BEGIN" not in data:
    raise SecurityConfigError(f"{what}: {path} is not a PEM file")
  return data


def warn_plaintext(what: str) -> None:
  log.warning("SECURITY: %s uses PLAINTEXT gRPC (insecure=True): no encryption, no "
              "authentication of the peer. Use only on a trusted loopback or test network.",
              what)


def server_credentials(cert: PathLike | None = None, key: PathLike | None = None,
                       client_ca: PathLike | None = None, *, require_client_auth: bool = True,
                       insecure: bool = False, what: str = "server"
                       ) -> grpc.ServerCredentials | None:
  """Server credentials from PEM files, or None for an explicitly requested plaintext port.

  Args:
    cert, key: the server's certificate chain and private key.
    client_ca: CA bundle that client certificates must chain to.
    require_client_auth: mutual TLS: a client without a certificate signed by
      ``client_ca`` fails the handshake. The default; the broker's public
      port, where clients authenticate with bearer tokens, passes False.
    insecure: serve plaintext (returns None, logs a warning); must not be
      combined with certificate files.
    what: name used in log and error messages.

  Raises:
    SecurityConfigError: a file is missing or unreadable, mTLS without
      ``client_ca``, no certificate without ``insecure``, or both.
  """
  if insecure:
    if cert or key:
      raise SecurityConfigError(f"{what}: insecure=True together with a certificate; "
                                "choose one")
    warn_plaintext(what)
    return None
  if not cert or not key:
    raise SecurityConfigError(f"{what}: TLS needs a certificate and a key (or pass "
                              "insecure=True to serve plaintext explicitly)")
  if require_client_auth and not client_ca:
    raise SecurityConfigError(f"{what}: mutual TLS needs client_ca (the CA client "
                              "certificates must chain to)")
  pair = [(_read(key, f"{what} key"), _read(cert, f"{what} certificate"))]
  root = _read(client_ca, f"{what} client CA") if client_ca else None
  return grpc.ssl_server_credentials(pair, root_certificates=root,
                                     require_client_auth=require_client_auth)


def channel_credentials(ca: PathLike | None = None, cert: PathLike | None = None,
                        key: PathLike | None = None, *, token: str | None = None,
                        insecure: bool = False, what: str = "channel"
                        ) -> grpc.ChannelCredentials | None:
  """Client credentials: verify the server against ``ca``; present ``cert``/``key``
  (mutual TLS) when given; attach ``authorization: Bearer <token>`` to every
  call when ``token`` is given.

  ``insecure=True`` returns None (plaintext, with a warning); a bearer token
  on plaintext would travel in the clear, so that combination is refused --
  use ``paas_jax.security.auth.token_metadata`` per call if a test needs it.
  """
  if insecure:
    if ca or cert or key:
      raise SecurityConfigError(f"{what}: insecure=True together with TLS files; choose one")
    if token:
      raise SecurityConfigError(f"{what}: refusing to send a bearer token over plaintext")
    warn_plaintext(what)
    return None
  if not ca:
    raise SecurityConfigError(f"{what}: TLS needs the CA that signed the server's "
                              "certificate (or pass insecure=True for plaintext explicitly)")
  if bool(cert) != bool(key):
    raise SecurityConfigError(f"{what}: a client certificate needs its key and vice versa")
  creds = grpc.ssl_channel_credentials(
      root_certificates=_read(ca, f"{what} CA"),
      private_key=_read(key, f"{what} key") if key else None,
      certificate_chain=_read(cert, f"{what} certificate") if cert else None)
  if token:
    creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(token))
  return creds


@dataclasses.dataclass(frozen=True)
class TLSConfig:
  """Where one process finds its identity, or an explicit plaintext choice.

  ``TLSConfig.from_dir("certs", "decode")`` uses ``make_certs`` file names.
  ``server()``/``client()`` build credentials for the process's servers and
  for the channels it opens to other services (both mutual TLS).
  """

  cert: str | None = None
  key: str | None = None
  ca: str | None = None
  insecure: bool = False
  name: str = "service"

  @classmethod
  def from_dir(cls, directory: PathLike, name: str) -> "TLSConfig":
    files = cert_files(directory, name)
    return cls.from_files(files)

  @classmethod
  def from_files(cls, files: CertFiles) -> "TLSConfig":
    return cls(cert=str(files.cert), key=str(files.key), ca=str(files.ca), name=files.name)

  @classmethod
  def plaintext(cls, name: str = "service") -> "TLSConfig":
    return cls(insecure=True, name=name)

  def server(self, *, require_client_auth: bool = True) -> grpc.ServerCredentials | None:
    return server_credentials(self.cert, self.key, self.ca,
                              require_client_auth=require_client_auth,
                              insecure=self.insecure, what=f"{self.name} server")

  def client(self, *, token: str | None = None) -> grpc.ChannelCredentials | None:
    if self.insecure:
      return channel_credentials(insecure=True, token=token, what=f"{self.name} client")
    return channel_credentials(self.ca, self.cert, self.key, token=token,
                               what=f"{self.name} client")


def add_port(server: grpc.Server, address: str,
             credentials: grpc.ServerCredentials | None) -> int:
  """Binds ``address`` with TLS, or plaintext when ``credentials`` is None (which
  ``server_credentials`` only returns after an explicit ``insecure=True``)."""
  port = (server.add_insecure_port(address) if credentials is None
          else server.add_secure_port(address, credentials))
  if port == 0:
    raise OSError(f"could not bind gRPC server to {address}")
  return port


def target_name_override(name: str) -> list[tuple[str, str]]:
  """Channel options to verify the server as ``name`` when dialling another
  address (e.g. the WAN relay's port instead of the decode server's)."""
  return [("grpc.ssl_target_name_override", name), ("grpc.default_authority", name)]
