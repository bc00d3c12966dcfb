"""The answer to JOB ``{"op": "lake"}``: where this daemon's catalog and store are, so a
reader holding only the ingest socket can read the lake (docs/protocol.md, "Where the
lake is"). Sans-IO: a Config in, a JSON-ready dict out, built once at start.

    {"node_id", "data_dir",
     "catalog": {"dsn", "file", "connect_timeout_ms", "pool_size"},
     "lake": {"enabled", "time_column",
              "store": {"scheme", "root", "options", "timeout_ms", "max_attempts"}},
     "withheld": ["catalog.dsn password", "lake.store.options.secret_access_key", ...]}

Secrets are never in it. Whoever may connect to the ingest socket (mode
ingest.socket_mode, peers in ingest.allowed_uids/gids) is allowed to *produce*; the
daemon's store credentials can also overwrite and delete objects, and its catalog DSN
can rewrite the catalog. Handing them to every producer would make each one an
administrator of the lake. So a DSN's password (in the URI or as a ``password``-like
query parameter) and every store option whose name looks like a credential
(``SECRET_WORDS``) are left out, and named in ``withheld``: the reader brings its own,
read-only credentials from its environment.
"""

from __future__ import annotations

import re
import socket
import urllib.parse
from pathlib import Path
from typing import Any

from quiverd.kernel.config import Config
from quiverd.kernel.layout import DataDir
from quiverd.lake.model import INGESTED_AT

# A store option or DSN query parameter whose name contains one of these is a secret
# (OpenDAL: secret_access_key, access_key_id, session_token, account_key, sas_token,
# credential, credential_path, ...; libpq: password, sslpassword). The match is wide on
# purpose: withholding a harmless key costs the reader one setting, leaking one costs more.
SECRET_WORDS = ("secret", "key", "token", "password", "credential", "sas", "signature")
_SECRET = re.compile("|".join(SECRET_WORDS), re.IGNORECASE)


def is_secret(name: str) -> bool:
    return bool(_SECRET.search(name))


def lake_reply(cfg: Config) -> dict[str, Any]:
    """What a reader needs to open ``cfg``'s catalog and store, secrets withheld."""
    withheld: list[str] = []
    dsn = _public_dsn(cfg.catalog.dsn, withheld)
    store = cfg.lake.store
    options = {}
    for name, value in sorted(store.options.items()):
        if is_secret(name):
            withheld.append(f"lake.store.options.{name}")
        else:
            options[name] = value
    from quiverd.lake.store import store_root  # OpenDAL: only once a reader asks

    root = store_root(store, data_dir=Path(cfg.data_dir))
    return {
        "node_id": cfg.lake.node_id or socket.gethostname(),
        "data_dir": cfg.data_dir,
        "catalog": {"dsn": dsn,
                    "file": "" if dsn else str(DataDir(Path(cfg.data_dir)).catalog_db),
                    "connect_timeout_ms": cfg.catalog.connect_timeout_ms,
                    "pool_size": cfg.catalog.pool_size},
        "lake": {"enabled": cfg.lake.enabled,
                 "time_column": cfg.lake.time_column or INGESTED_AT,
                 "store": {"scheme": store.scheme, "root": root, "options": options,
                           "timeout_ms": store.timeout_ms,
                           "max_attempts": store.max_attempts}},
        "withheld": withheld,
    }


def _public_dsn(dsn: str, withheld: list[str]) -> str:
    """``dsn`` without its password (user info or query); the rest as written."""
    if not dsn:
        return ""
    parts = urllib.parse.urlsplit(dsn)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hostport = netloc.rpartition("@")
        user, colon, _password = userinfo.partition(":")
        if colon:
            withheld.append("catalog.dsn password")
        netloc = f"{user}@{hostport}"
    query = []
    for name, value in urllib.parse.parse_qsl(parts.query, keep_blank_values=True):
        if is_secret(name):
            withheld.append(f"catalog.dsn {name}")
        else:
            query.append((name, value))
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc,
                                                  query=urllib.parse.urlencode(query)))
