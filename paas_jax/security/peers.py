"""Which authenticated peer may call which service.

Mutual TLS proves that a peer holds a certificate from our CA; it does not say
that the peer is the right kind of process. Every service certificate names
its role (``paas_jax.security.ca``: subject CN and ``spiffe://paas-jax/<name>``
URI SAN), and ``PeerIdentityInterceptor`` checks that name against per-service
patterns, e.g. on a decode server::

  PeerIdentityInterceptor({
      "/paas_jax.transport.v1.StateTransfer/": ["prefill*", "decode*"],  # states
      "/paas_jax.serving.v1.Decode/": ["broker*"],                       # control
  })

A call from a peer without a verified certificate (plaintext port) is refused
with UNAUTHENTICATED, from a peer whose name matches no pattern with
PERMISSION_DENIED. On an mTLS port a client without a certificate from the
CA never gets this far: the TLS handshake fails and no RPC exists (the client
sees UNAVAILABLE).
"""

from __future__ import annotations

import fnmatch
import logging
from typing import Mapping, Sequence

import grpc

from paas_jax.security import interceptors
from paas_jax.security.ca import URI_PREFIX

log = logging.getLogger("paas_jax.security")

STATE_TRANSFER_PREFIX = "/paas_jax.transport.v1.StateTransfer/"
DECODE_PREFIX = "/paas_jax.serving.v1.Decode/"
PREFILL_PREFIX = "/paas_jax.serving.v1.Prefill/"
BROKER_PREFIX = "/paas_jax.serving.v1.Broker/"
# The broker's operator method: only an identified operator (or a broker) may
# move PD nodes between roles; a bearer token alone is a client, not an operator.
BROKER_ADMIN_METHOD = BROKER_PREFIX + "SetRoles"
BROKER_ADMIN_PEERS = ("admin*", "broker*")


def peer_names(context: grpc.ServicerContext) -> list[str] | None:
  """The verified names of the caller (CN and ``spiffe://paas-jax/`` URIs),
  or None when the connection carries no verified client certificate."""
  auth = context.auth_context() or {}
  if auth.get("transport_security_type") != [b"ssl"] or not auth.get("x509_pem_cert"):
    return None
  names = [v.decode("utf-8", "replace") for v in auth.get("x509_common_name", [])]
  for uri in auth.get("peer_uri", []) or auth.get("x509_subject_alternative_name", []):
    text = uri.decode("utf-8", "replace")
    if text.startswith(URI_PREFIX):
      names.append(text[len(URI_PREFIX):])
  return names


def service_rules(role: str) -> dict[str, list[str]]:
  """The default rules of one server role in the paas-jax topology.

  broker: the public API takes any authenticated client (bearer tokens do
  the authorisation there). prefill: only brokers may ask for prefills (and
  prefix exports); only decode servers may push states to its transfer port
  (cross-cluster prefix transfers, which its receiver accepts alone).
  decode: only brokers may register requests or ask a PD node to prefill as
  PD-P for another PD node (Prefill); only prefill servers may push states
  (and decode servers, which hand work to one another: PD-P -> PD-D).
  ``Broker/SetRoles`` (moving PD nodes between roles) needs a certificate
  named ``admin*`` or ``broker*``; see ``admin_interceptor``.
  """
  if role == "broker":
    return {BROKER_PREFIX: ["*"], BROKER_ADMIN_METHOD: list(BROKER_ADMIN_PEERS)}
  if role == "prefill":
    return {PREFILL_PREFIX: ["broker*"], STATE_TRANSFER_PREFIX: ["decode*"]}
  if role == "decode":
    return {DECODE_PREFIX: ["broker*"], PREFILL_PREFIX: ["broker*"],
            STATE_TRANSFER_PREFIX: ["prefill*", "decode*"]}
  raise ValueError(f"unknown role {role!r} (broker, prefill or decode)")


class PeerIdentityInterceptor(grpc.ServerInterceptor):
  """Allows a call only from peers whose certificate name matches the rule of
  its method (longest matching method prefix wins).

  Args:
    rules: method-name prefix -> fnmatch patterns of allowed peer names.
    default: patterns for methods no rule covers; None lets any verified peer
      through (the CA already vouched for it), [] refuses them.
    exempt: prefixes served to anyone, even without a certificate (health).
    on_result: optional ``f(method, allowed: bool, names)`` for metrics.
  """

  def __init__(self, rules: Mapping[str, Sequence[str]], *,
               default: Sequence[str] | None = None,
               exempt: Sequence[str] = (interceptors.HEALTH_PREFIX,), on_result=None,
               only_ruled: bool = False):
    self.rules = sorted(((p, tuple(v)) for p, v in rules.items()), key=lambda r: -len(r[0]))
    # only_ruled: methods no rule covers pass unchecked (admin_interceptor).
    self.only_ruled = only_ruled
    self.default = None if default is None else tuple(default)
    self.exempt = tuple(exempt)
    self._on_result = on_result

  def patterns_for(self, method: str) -> tuple[str, ...] | None:
    for prefix, patterns in self.rules:
      if method.startswith(prefix):
        return patterns
    return self.default

  def _report(self, method, allowed, names):
    if self._on_result is not None:
      try:
        self._on_result(method, allowed, names)
      except Exception:  # pylint: disable=broad-except
        log.exception("peer on_result hook raised")

  def intercept_service(self, continuation, handler_call_details):
    method = handler_call_details.method
    if interceptors.matches(method, self.exempt):
      return continuation(handler_call_details)
    patterns = self.patterns_for(method)
    if patterns is None and self.only_ruled:
      return continuation(handler_call_details)

    def check(context: grpc.ServicerContext) -> None:
      names = peer_names(context)
      if names is None:
        self._report(method, False, [])
        log.warning("refused %s from %s: no verified client certificate", method,
                    context.peer())
        context.abort(grpc.StatusCode.UNAUTHENTICATED,
                      "this service requires a client certificate (mutual TLS)")
      if patterns is not None and not any(fnmatch.fnmatchcase(n, p)
                                          for n in names for p in patterns):
        self._report(method, False, names)
        log.warning("refused %s from %s (%s): not in %s", method, context.peer(), names,
                    list(patterns))
        context.abort(grpc.StatusCode.PERMISSION_DENIED,
                      f"peer {names[0] if names else '?'!r} may not call {method}")
      self._report(method, True, names)

    return interceptors.guarded(continuation(handler_call_details), check)


def admin_interceptor(on_result=None) -> PeerIdentityInterceptor:
  """For a broker whose public port takes bearer tokens without client
  certificates: checks only ``Broker/SetRoles`` (a peer certificate named
  ``admin*``/``broker*``) and lets every other method through to the token
  check. Such a port requests no certificates, so SetRoles is refused there
  (UNAUTHENTICATED) unless the broker runs with ``public_client_auth``."""
  return PeerIdentityInterceptor({BROKER_ADMIN_METHOD: list(BROKER_ADMIN_PEERS)},
                                 on_result=on_result, only_ruled=True)
