"""Creates a local CA, service certificates and an API token for the demo/tests.

  python -m paas_jax.security.make_certs --out=runs/certs
  python -m paas_jax.security.make_certs --out=runs/certs --names=broker,prefill-0,decode-0

Writes into --out: ca.pem, ca.key, <name>.pem / <name>.key per name, and
(unless --notoken) api_tokens.txt (the broker's accepted tokens, ``name:token``)
plus client.token (the client's token). Keys and token files are 0600. An
existing CA in --out is reused, so certificates issued later still chain to it.
"""

from __future__ import annotations

import json
import pathlib

from absl import app, flags

from paas_jax.security import ca as ca_lib
from paas_jax.security.auth import write_token_files

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "Output directory.", required=True)
flags.DEFINE_list("names", list(ca_lib.DEFAULT_NAMES),
                  "Identities to issue (the role is the name's prefix: broker, prefill*, "
                  "decode*, client).")
flags.DEFINE_list("hosts", list(ca_lib.DEFAULT_HOSTS),
                  "DNS names / IP addresses the certificates are valid for.")
flags.DEFINE_integer("days", 30, "Validity in days.")
flags.DEFINE_bool("new_ca", False, "Create a new CA even if --out already holds one.")
flags.DEFINE_bool("token", True, "Also write api_tokens.txt and client.token.")


def main(argv):
  del argv
  files = ca_lib.make_certs(FLAGS.out, FLAGS.names, hosts=FLAGS.hosts, days=FLAGS.days,
                            reuse_ca=not FLAGS.new_ca)
  report = {n: {"cert": str(f.cert), "key": str(f.key)} for n, f in files.items()}
  report["ca"] = str(pathlib.Path(FLAGS.out) / "ca.pem")
  if FLAGS.token:
    write_token_files(FLAGS.out)
    report["api_tokens"] = str(pathlib.Path(FLAGS.out) / "api_tokens.txt")
    report["client_token"] = str(pathlib.Path(FLAGS.out) / "client.token")
  print(json.dumps(report, indent=1))


if __name__ == "__main__":
  app.run(main)
