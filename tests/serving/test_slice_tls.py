"""A decode slice with mutual TLS (#16): certificates per slice process, the peer
rules of a decode server, and the TCP data plane under TLS.

A real cluster as ``LocalCluster`` starts it with ``tls=True``: region A a
prefill pod of two processes, region B a decode slice of two processes, no
emulated link (so the pod streams each slice process its parts on the TLS data
plane; ``test_slice_serving.py`` covers the relay, where the parts ride gRPC).
The launcher issues each slice process its own certificate
(``decode-slice<q>``); each process checks its callers as a decode server does.
Negative controls: a prefill certificate calling Decode, broker and client
certificates pushing state to a slice process (gRPC and data plane), a peer
without a certificate, with a certificate from another CA, and in plaintext:
all refused, and nothing of theirs is kept.
"""

from __future__ import annotations

import dataclasses
import pathlib
import socket

import grpc
import numpy as np
import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID

from paas_jax.client import BrokerClient
from paas_jax.proto import serving_pb2, serving_pb2_grpc
from paas_jax.security import (ServiceSecurity, TLSConfig, channel_credentials, make_certs,
                               peers)
from paas_jax.serving import launch_args, pod_supervisor
from paas_jax.serving.launch import ClusterSpec, LocalCluster
from paas_jax.transport import SenderOptions, StateSender, TransferError
from paas_jax.transport.dataplane import tls as dp_tls
from tests.serving.test_pod_serving import _stats, _wait_remote
from tests.serving.test_slice_serving import _idle_stats

Code = grpc.StatusCode
# The cluster's tests are slow: a pod and a slice of two processes each compile and
# start (~80 s on 2 shared cores); test_slice_serving.py runs a TLS slice behind a
# relay in the default suite.


def _prompt(n: int, salt: int) -> list[int]:
  return [int(t) for t in np.random.default_rng(2600 + salt).integers(1, 256, n)]


def test_the_launcher_issues_each_slice_process_its_own_certificate(tmp_path):
  spec = ClusterSpec(prefill_pod=2, decode_slice=3, tls=True)
  assert launch_args.slice_tls_names(spec) == [f"decode-slice{q}" for q in range(3)]
  args = launch_args.decode_args(spec, "127.0.0.1", None)
  assert "--slice_tls_names=decode-slice0,decode-slice1,decode-slice2" in args
  # The supervisor hands the list on to every process (each picks its own entry).
  region = pod_supervisor.RegionProcesses(module="paas_jax.serving.slice_decode_server",
                                          kind="slice", processes=3, own_transfer_ports=True)
  assert "--slice_tls_names=decode-slice0,decode-slice1,decode-slice2" in (
      pod_supervisor.passed_on(args, region))
  cluster = LocalCluster(spec, tmp_path)
  cluster._make_certs("127.0.0.1", "127.0.0.1")  # pylint: disable=protected-access
  for q in range(3):
    tls = cluster.tls_config(f"decode-slice{q}")
    cert = x509.load_pem_x509_certificate(pathlib.Path(tls.cert).read_bytes())
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == tls.name
    # Its name is a decode peer's (decode*), its peer rules a decode server's.
    assert ServiceSecurity(tls, "decode").interceptors()[0].patterns_for(
        peers.STATE_TRANSFER_PREFIX + "Begin") == ("prefill*", "decode*")
  # Without TLS or without a slice: no per-process names, the flag is not passed.
  for other in (ClusterSpec(prefill_pod=2, decode_slice=2),
                ClusterSpec(tls=True)):
    assert launch_args.slice_tls_names(other) == []
    assert not any(a.startswith("--slice_tls_names") for a in launch_args.decode_args(
        other, "127.0.0.1", None))


@pytest.fixture(scope="module")
def tls_slice(tmp_path_factory):
  spec = ClusterSpec(n_slots=4, max_queue=8, max_ctx=256, prefill_buckets=(64,),
                     prefill_max_batch=1, threshold=16, prefill_pod=2, decode_slice=2,
                     tls=True)
  c = LocalCluster(spec, tmp_path_factory.mktemp("slice_tls")).start()
  yield c
  c.stop()


def _server_names(address: str, tls: TLSConfig) -> list[str]:
  """The names (CN and our URI SAN) of the certificate the server at ``address``
  presents to a client holding ``tls`` (mutual TLS, HTTP/2 as gRPC speaks it)."""
  ctx = dp_tls.client_context(tls)
  ctx.set_alpn_protocols(["h2"])
  host, port = address.rsplit(":", 1)
  with socket.create_connection((host, int(port)), timeout=10) as raw:
    with ctx.wrap_socket(raw) as sock:
      return dp_tls.peer_names(sock)


@pytest.mark.slow
def test_a_tls_slice_serves_through_the_broker_token_exact(tls_slice, reference,
                                                           assert_logprobs):
  cluster = tls_slice
  info = cluster.procs["decode"].info
  assert "--slice_tls_names=decode-slice0,decode-slice1" in cluster.procs["decode"].args
  assert not any(a == "--insecure" for p in cluster.procs.values() for a in p.args)
  # Each slice process presents its own certificate on its StateTransfer port.
  prefill = cluster.tls_config("prefill")
  for q, address in enumerate(info["slice_transfer"]):
    assert f"decode-slice{q}" in _server_names(address, prefill), q
  with BrokerClient(cluster.broker_address, timeout_s=120,
                    credentials=cluster.client_credentials()) as client:
    _wait_remote(client)
    before = _idle_stats(cluster, "decode", serving_pb2_grpc.DecodeStub)
    prompt = _prompt(60, 1)
    out = client.generate(prompt_ids=prompt, max_new_tokens=6, route="remote",
                          request_id="tls-slice-remote", logprobs=True)
    assert out.route == "prfaas", out.summary
    assert out.tokens == reference(tuple(prompt), 6)
    assert_logprobs(prompt, out)
    prompt = _prompt(14, 2)
    out = client.generate(prompt_ids=prompt, max_new_tokens=5, route="local",
                          request_id="tls-slice-local", temperature=0.8, seed=5)
    assert out.route != "prfaas", out.summary
    assert out.tokens == reference(tuple(prompt), 5, 0.8, 0, 1.0, 5)
  after = _idle_stats(cluster, "decode", serving_pb2_grpc.DecodeStub)
  assert after["jobs_done"] - before.get("jobs_done", 0) == 2
  assert after.get("jobs_failed", 0) == 0 and after["slice_parts_pending"] == 0
  # Both slice processes took their part of the remote request through their TLS ports.
  got = [after[f"slice_bytes_in:{q}"] - before.get(f"slice_bytes_in:{q}", 0) for q in (0, 1)]
  assert all(b > 0 for b in got), got


def _push(address: str, cfg, *, credentials, data_ssl=None) -> TransferError:
  """A whole state pushed to ``address``; returns the TransferError it must end in."""
  from paas_jax.codec.testing import random_state
  state = random_state(cfg, [10], capacity=64)
  plane = {"plane": "tcp", "lanes": 1, "data_ssl": data_ssl} if data_ssl else {}
  with StateSender(address, options=SenderOptions(credentials=credentials, rpc_timeout_s=10,
                                                  **plane)) as sender:
    with pytest.raises(TransferError) as e:
      sender.send_state(state, model_id=cfg.name, config_fingerprint=cfg.fingerprint())
  return e.value


@pytest.mark.slow
def test_a_tls_slice_refuses_peers_of_the_wrong_role_or_without_a_certificate(
    tls_slice, ref_model, tmp_path):
  cluster = tls_slice
  info = cluster.procs["decode"].info
  control = cluster.pd_address("decode")
  follower = info["slice_transfer"][1]  # process 1's StateTransfer port
  cfg = ref_model.config
  ca = cluster.certs / "ca.pem"
  before = _idle_stats(cluster, "decode", serving_pb2_grpc.DecodeStub)

  def decode(credentials) -> grpc.RpcError:
    channel = (grpc.insecure_channel(control) if credentials is None
               else grpc.secure_channel(control, credentials))
    with channel:
      call = serving_pb2_grpc.DecodeStub(channel).Decode(serving_pb2.DecodeRequest(
          request_id="intruder", prompt_ids=[1, 2, 3], max_new_tokens=2), timeout=10)
      with pytest.raises(grpc.RpcError) as e:
        list(call)
    return e.value

  # Only brokers register requests at process 0: region A's certificate may not ...
  e = decode(cluster.tls_config("prefill").client())
  assert e.code() == Code.PERMISSION_DENIED and "prefill" in e.details()
  # ... nor may a slice process's own (a decode peer pushes state, it does not call Decode).
  e = decode(cluster.tls_config("decode-slice1").client())
  assert e.code() == Code.PERMISSION_DENIED
  # Without a client certificate, or in plaintext, the handshake fails: no RPC exists.
  assert decode(channel_credentials(ca)).code() == Code.UNAVAILABLE
  assert decode(None).code() == Code.UNAVAILABLE
  # A certificate named like the broker but from another CA (the caller trusts ours):
  # the slice refuses it at the handshake.
  rogue = {name: dataclasses.replace(TLSConfig.from_files(files), ca=str(ca))
           for name, files in make_certs(tmp_path / "rogue", ("broker", "prefill")).items()}
  assert decode(rogue["broker"].client()).code() == Code.UNAVAILABLE

  # Only prefill (and decode) peers push state, to every slice process's port.
  for who in ("broker", "client"):
    e = _push(follower, cfg, credentials=cluster.tls_config(who).client())
    assert e.code == Code.PERMISSION_DENIED and who in e.message, (who, e)
  # The data plane checks its peers as the gRPC port does: region A's gRPC
  # certificate opens the transfer, a broker certificate on the data plane is refused.
  e = _push(follower, cfg, credentials=cluster.tls_config("prefill").client(),
            data_ssl=dp_tls.client_context(cluster.tls_config("broker")))
  assert e.code == Code.PERMISSION_DENIED and "broker" in e.message, e
  assert _push(follower, cfg, credentials=channel_credentials(ca)).code == Code.UNAVAILABLE
  assert _push(follower, cfg, credentials=rogue["prefill"].client()).code == Code.UNAVAILABLE

  # Nothing of theirs was kept or decoded, and the slice still serves.
  after = _idle_stats(cluster, "decode", serving_pb2_grpc.DecodeStub)
  assert after["slice_parts_pending"] == 0 and after["slice_parts_in"] == before.get(
      "slice_parts_in", 0)
  assert after.get("requests", 0) == before.get("requests", 0)
  assert _stats(cluster, "prefill", serving_pb2_grpc.PrefillStub)
