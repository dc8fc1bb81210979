"""A local certificate authority for the demo and the tests.

Creates one CA and, per service, a key and a certificate signed by it. Each
service certificate carries:

* the role in the subject CN (``broker``, ``prefill-0``, ``decode-1``,
  ``client``) -- peer checks match on it (``paas_jax.security.peers``);
* the same name as a SPIFFE-style URI SAN (``spiffe://paas-jax/<name>``);
* DNS ``localhost`` and IP ``127.0.0.1`` / ``::1`` (plus any extra hosts), so
  a client connecting to ``127.0.0.1:port`` verifies the server's name;
* both serverAuth and clientAuth extended key usage: every server is also a
  client of another one (the broker calls prefill and decode; prefill
  streams states to decode), and one certificate per process keeps it simple.

Keys are ECDSA P-256 (fast to generate, small handshakes). Files are PEM:
``ca.pem`` (+ ``ca.key``, 0600), ``<name>.pem`` and ``<name>.key`` (0600).
This is for development and tests; a deployment brings its own PKI and only
the file paths change.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import os
import pathlib
from typing import Iterable, Sequence

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

URI_PREFIX = "spiffe://paas-jax/"
DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")
# broker, one prefill and one decode server per region, and a public client.
DEFAULT_NAMES = ("broker", "prefill", "decode", "client")


@dataclasses.dataclass(frozen=True)
class CertFiles:
  """Paths of one identity's PEM files (and of the CA that signed it)."""

  name: str
  cert: pathlib.Path
  key: pathlib.Path
  ca: pathlib.Path


def _now() -> datetime.datetime:
  return datetime.datetime.now(datetime.timezone.utc)


def _new_key() -> ec.EllipticCurvePrivateKey:
  return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key) -> bytes:
  return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                           serialization.NoEncryption())


def _write(path: pathlib.Path, data: bytes, private: bool = False) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(path.name + ".tmp")
  # Private keys are created 0600 from the start, never world-readable.
  fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
  with os.fdopen(fd, "wb") as f:
    f.write(data)
  os.replace(tmp, path)


def _san(hosts: Iterable[str], name: str) -> x509.SubjectAlternativeName:
  entries: list[x509.GeneralName] = []
  for h in hosts:
    try:
      entries.append(x509.IPAddress(ipaddress.ip_address(h)))
    except ValueError:
      entries.append(x509.DNSName(h))
  entries.append(x509.UniformResourceIdentifier(URI_PREFIX + name))
  return x509.SubjectAlternativeName(entries)


class LocalCA:
  """A self-signed CA that issues service certificates.

  Use ``LocalCA.create(dir)`` for a new one or ``LocalCA.load(dir)`` to issue
  more certificates from an existing one.
  """

  def __init__(self, directory: str | os.PathLike, key, cert: x509.Certificate):
    self.directory = pathlib.Path(directory)
    self._key = key
    self.cert = cert

  @property
  def cert_path(self) -> pathlib.Path:
    return self.directory / "ca.pem"

  @classmethod
  def create(cls, directory: str | os.PathLike, *, common_name: str = "paas-jax local CA",
             days: int = 30) -> "LocalCA":
    directory = pathlib.Path(directory)
    key = _new_key()
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "paas-jax"),
                         x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = _now()
    cert = (x509.CertificateBuilder()
            .subject_name(subject).issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                         crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .sign(key, hashes.SHA256()))
    _write(directory / "ca.key", _key_pem(key), private=True)
    _write(directory / "ca.pem", cert.public_bytes(serialization.Encoding.PEM))
    return cls(directory, key, cert)

  @classmethod
  def load(cls, directory: str | os.PathLike) -> "LocalCA":
    directory = pathlib.Path(directory)
    key = serialization.load_pem_private_key((directory / "ca.key").read_bytes(), None)
    cert = x509.load_pem_x509_certificate((directory / "ca.pem").read_bytes())
    return cls(directory, key, cert)

  def issue(self, name: str, *, hosts: Sequence[str] = DEFAULT_HOSTS, days: int = 30,
            directory: str | os.PathLike | None = None) -> CertFiles:
    """Writes ``<name>.pem``/``<name>.key`` signed by this CA; returns their paths.

    Args:
      name: the identity (subject CN and URI SAN), e.g. ``prefill-0``.
      hosts: DNS names and IP addresses the certificate is valid for as a server.
      days: validity.
      directory: where to write (default: the CA's directory).
    """
    if not name or "/" in name or name.startswith("."):
      raise ValueError(f"bad certificate name {name!r}")
    out = pathlib.Path(directory) if directory is not None else self.directory
    key = _new_key()
    now = _now()
    ca_ski = self.cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "paas-jax"),
                                     x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_agreement=True,
                                         key_cert_sign=False, crl_sign=False,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(_san(hosts, name), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(
                ca_ski), critical=False)
            .sign(self._key, hashes.SHA256()))
    files = CertFiles(name=name, cert=out / f"{name}.pem", key=out / f"{name}.key",
                      ca=self.cert_path)
    _write(files.key, _key_pem(key), private=True)
    _write(files.cert, cert.public_bytes(serialization.Encoding.PEM))
    return files


def make_certs(out: str | os.PathLike, names: Sequence[str] = DEFAULT_NAMES, *,
               hosts: Sequence[str] = DEFAULT_HOSTS, days: int = 30,
               reuse_ca: bool = True) -> dict[str, CertFiles]:
  """A CA in ``out`` (reused if present and ``reuse_ca``) and one cert per name."""
  out = pathlib.Path(out)
  if reuse_ca and (out / "ca.pem").exists() and (out / "ca.key").exists():
    ca = LocalCA.load(out)
  else:
    ca = LocalCA.create(out, days=days)
  return {n: ca.issue(n, hosts=hosts, days=days) for n in names}


def cert_files(directory: str | os.PathLike, name: str) -> CertFiles:
  """The paths ``make_certs`` uses for ``name`` in ``directory`` (not checked)."""
  d = pathlib.Path(directory)
  return CertFiles(name=name, cert=d / f"{name}.pem", key=d / f"{name}.key", ca=d / "ca.pem")
