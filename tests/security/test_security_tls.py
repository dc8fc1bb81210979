"""TLS and mutual TLS between real gRPC servers and clients on 127.0.0.1."""

from __future__ import annotations

import logging
import os
import pathlib
import stat
import subprocess
import sys

import grpc
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from paas_jax.security import SecurityConfigError, ca as ca_lib, tls
from tests.security.conftest import health_check

REPO = pathlib.Path(__file__).resolve().parents[2]


def mtls_server(pki, serve, name="decode-0", **kw):
  return serve(credentials=pki.tls(name).server(**kw))


def test_mtls_accepts_a_client_certificate_from_the_ca(pki, serve):
  s = mtls_server(pki, serve)
  with grpc.secure_channel(s.target, pki.tls("prefill-0").client()) as ch:
    assert health_check(ch).status == 1  # SERVING
  # The certificate names localhost as well as 127.0.0.1.
  with grpc.secure_channel(f"localhost:{s.port}", pki.tls("broker").client()) as ch:
    assert health_check(ch).status == 1


@pytest.mark.parametrize("who", ["no_cert", "rogue_cert", "plaintext", "untrusted_server"])
def test_mtls_refuses_clients_that_do_not_belong(pki, serve, who):
  s = mtls_server(pki, serve)
  good, rogue = pki.files["client"], pki.rogue["client"]
  if who == "no_cert":
    creds = tls.channel_credentials(good.ca)
  elif who == "rogue_cert":  # a certificate, but from another CA
    creds = tls.channel_credentials(good.ca, rogue.cert, rogue.key)
  elif who == "untrusted_server":  # the client trusts only the rogue CA
    creds = tls.channel_credentials(rogue.ca, good.cert, good.key)
  channel = (grpc.insecure_channel(s.target) if who == "plaintext"
             else grpc.secure_channel(s.target, creds))
  with channel, pytest.raises(grpc.RpcError) as e:
    health_check(channel, timeout=3)
  # The handshake fails before any RPC exists, so gRPC reports the connection
  # as unusable rather than a per-call auth status.
  assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_server_only_tls_serves_clients_without_certificates(pki, serve):
  s = mtls_server(pki, serve, name="broker", require_client_auth=False)
  with grpc.secure_channel(s.target, tls.channel_credentials(pki.files["broker"].ca)) as ch:
    assert health_check(ch).status == 1
  with grpc.insecure_channel(s.target) as ch, pytest.raises(grpc.RpcError) as e:
    health_check(ch, timeout=3)
  assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_wrong_server_name_is_refused(pki, serve):
  s = mtls_server(pki, serve)
  options = tls.target_name_override("decode.example.com")
  with grpc.secure_channel(s.target, pki.tls("broker").client(), options=options) as ch:
    with pytest.raises(grpc.RpcError) as e:
      health_check(ch, timeout=3)
  assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_plaintext_only_when_asked_for_and_with_a_warning(pki, caplog):
  f = pki.files["decode-0"]
  with pytest.raises(SecurityConfigError, match="insecure=True"):
    tls.server_credentials()
  with pytest.raises(SecurityConfigError, match="insecure=True"):
    tls.channel_credentials()
  with pytest.raises(SecurityConfigError, match="choose one"):
    tls.server_credentials(f.cert, f.key, insecure=True)
  with pytest.raises(SecurityConfigError, match="plaintext"):
    tls.channel_credentials(insecure=True, token="x" * 20)
  with caplog.at_level(logging.WARNING, logger="paas_jax.security"):
    assert tls.server_credentials(insecure=True, what="test server") is None
    assert tls.channel_credentials(insecure=True, what="test client") is None
    assert tls.TLSConfig.plaintext("decode").server() is None
  warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert len(warnings) == 3 and all("PLAINTEXT" in w for w in warnings)
  assert "test server" in warnings[0]


def test_bad_credential_files_are_reported(pki, tmp_path):
  f = pki.files["decode-0"]
  with pytest.raises(SecurityConfigError, match="client_ca"):
    tls.server_credentials(f.cert, f.key)  # mTLS is the default: needs the CA
  with pytest.raises(SecurityConfigError, match="cannot read"):
    tls.server_credentials(tmp_path / "missing.pem", f.key, f.ca)
  junk = tmp_path / "junk.pem"
  junk.write_text("not a certificate")
  with pytest.raises(SecurityConfigError, match="not a PEM"):
    tls.channel_credentials(junk)
  with pytest.raises(SecurityConfigError, match="its key"):
    tls.channel_credentials(f.ca, cert=f.cert)


def test_issued_certificates(pki):
  f = pki.files["prefill-0"]
  cert = x509.load_pem_x509_certificate(f.cert.read_bytes())
  ca = x509.load_pem_x509_certificate(f.ca.read_bytes())
  assert cert.issuer == ca.subject
  assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "prefill-0"
  san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
  assert "localhost" in san.get_values_for_type(x509.DNSName)
  assert {str(ip) for ip in san.get_values_for_type(x509.IPAddress)} >= {"127.0.0.1"}
  assert san.get_values_for_type(x509.UniformResourceIdentifier) == [
      "spiffe://paas-jax/prefill-0"]
  eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
  assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
  assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
  for key in (f.key, pathlib.Path(pki.dir) / "ca.key"):
    assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
  with pytest.raises(ValueError):
    ca_lib.LocalCA.load(pki.dir).issue("../escape")


def test_make_certs_cli_reuses_its_ca(tmp_path):
  cmd = [sys.executable, "-m", "paas_jax.security.make_certs", f"--out={tmp_path}",
         "--names=broker,decode-1"]
  subprocess.run(cmd, check=True, cwd=REPO, capture_output=True, timeout=60)
  ca_before = (tmp_path / "ca.pem").read_bytes()
  subprocess.run(cmd[:-1] + ["--names=prefill-1", "--notoken"], check=True, cwd=REPO,
                 capture_output=True, timeout=60)
  assert (tmp_path / "ca.pem").read_bytes() == ca_before
  for name in ("broker", "decode-1", "prefill-1"):
    assert (tmp_path / f"{name}.pem").exists() and (tmp_path / f"{name}.key").exists()
  token = (tmp_path / "client.token").read_text().strip()
  assert (tmp_path / "api_tokens.txt").read_text().strip() == f"client:{token}"
  # The later certificate chains to the same CA: it works against the first one.
  ca = ca_lib.LocalCA.load(tmp_path)
  late = x509.load_pem_x509_certificate((tmp_path / "prefill-1.pem").read_bytes())
  assert late.issuer == ca.cert.subject
