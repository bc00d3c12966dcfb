"""One way to name the daemon, for every direction of the quiver data source: its ingest
socket (option ``socket``; the writer's ``path``/``paths`` too) or its config file
(option ``config``).

    located = resolve(options)       # reader: socket, and the lake from the daemon
    located.socket, located.cfg      # cfg: data_dir, catalog, lake.store, time_column
    sockets, why = writer_sockets(options)   # writer: no lake needed, no I/O

Neither given, the first of these that applies names the daemon (``defaults``):

    $QUIVERD_SOCKET                     a socket
    /var/lib/quiverd/ingest.sock        a socket, if it exists
    /etc/quiverd/config.toml            a config, if it exists

and when none does, the error names each one tried. Both given is refused: one daemon,
named once.

Given a config, the lake is read from it as the daemon reads it. Given a socket, the
reader asks the daemon over the ingest protocol (JOB ``{"op": "lake"}``,
docs/protocol.md "Where the lake is"), which answers with its data_dir, catalog, store
and time column, **secrets withheld** (a DSN's password, S3 keys): the ingest socket
lets a peer produce, not administer the lake. The reader then uses its own
credentials from its environment: PGPASSWORD or ~/.pgpass for the catalog, and for an
S3 store the AWS_* variables or ~/.aws (``disable_config_load`` is turned off for this
when the daemon withheld the store's keys). A reader that holds the config file reads
it, secrets included, as before.

No pyspark here: the reader, the writer, the stream reader and ``paths`` share it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from quiverd.kernel.config import Config, load
from quiverd.kernel.errors import ConfigError, DaemonUnreachable, ProtocolError
from quiverd.lake.store import store_class
from quiverd.protocol.frames import ErrorCode

SOCKET_ENV = "QUIVERD_SOCKET"
DEFAULT_SOCKET = "/var/lib/quiverd/ingest.sock"
DEFAULT_CONFIG = "/etc/quiverd/config.toml"
ASK_TIMEOUT_S = 30.0  # one connect + HELLO + JOB lake; the daemon answers from memory


@dataclass(frozen=True)
class Locator:
    """What the options say about the daemon, unchecked: a socket, a config, or neither
    (then ``defaults`` decide when it is resolved). Pure, picklable."""

    socket: str = ""
    config: str = ""

    @classmethod
    def parse(cls, opts: Mapping[str, str]) -> Locator:
        """From lowercased options: ``socket`` and ``config`` (not both)."""
        socket, config = opts.get("socket", "").strip(), opts.get("config", "").strip()
        if socket and config:
            raise ValueError(f'options "socket" ({socket}) and "config" ({config}) both name '
                             "the daemon: give one of them")
        return cls(socket=socket, config=config)

    def __str__(self) -> str:
        if self.socket:
            return f"the daemon at {self.socket}"
        if self.config:
            return self.config
        return "the default daemon"


@dataclass(frozen=True)
class Located:
    """A daemon found: its ingest socket and its lake (``cfg``: data_dir, catalog,
    lake.store, lake.time_column, lake.node_id; from the config file, or from the
    daemon's answer with the other keys at their defaults). ``str()`` says where it was
    found, for messages."""

    socket: str
    cfg: Config
    where: str
    config_path: str = ""  # "" when the daemon described its lake
    withheld: tuple[str, ...] = ()  # secrets the daemon did not hand out

    def __str__(self) -> str:
        return self.where


def resolve(where: Locator | Mapping[str, str]) -> Located:
    """The daemon and its lake: from the config file, or asked over its socket."""
    loc = where if isinstance(where, Locator) else Locator.parse(
        {str(k).lower(): str(v) for k, v in where.items()})
    socket, config, why = defaults(loc)
    if config:
        cfg = load(config)
        return Located(socket=str(cfg.ingest_socket), cfg=cfg, where=f"{config}{why}",
                       config_path=config)
    return ask(socket, why)


def defaults(loc: Locator) -> tuple[str, str, str]:
    """(socket, config, why): exactly one of socket and config set; ``why`` is "" when
    the options named it, else which default chose it. Only stats files."""
    if loc.socket or loc.config:
        return loc.socket, loc.config, ""
    env = os.environ.get(SOCKET_ENV, "").strip()
    if env:
        return env, "", f" (from ${SOCKET_ENV})"
    if Path(DEFAULT_SOCKET).exists():
        return DEFAULT_SOCKET, "", " (the default socket)"
    if Path(DEFAULT_CONFIG).exists():
        return "", DEFAULT_CONFIG, " (the default config)"
    raise ConfigError("", "no quiverd named, and none found where one is looked for: "
                      f'option "socket" and option "config" not given, ${SOCKET_ENV} not '
                      f"set, no socket at {DEFAULT_SOCKET}, no config at {DEFAULT_CONFIG}",
                      hint='name the daemon: .option("socket", "<data_dir>/ingest.sock") '
                      'or .option("config", "<its config.toml>")')


def ask(socket: str, why: str = "") -> Located:
    """The lake of the daemon listening on ``socket``, as it describes it."""
    from quiverd.client import Client  # the reader's driver only; keeps imports light

    try:
        with Client.connect(socket, timeout=ASK_TIMEOUT_S) as c:
            info = c.lake_info()
    except DaemonUnreachable as exc:
        raise DaemonUnreachable(f"{exc}{why}: the reader asks the daemon there where its "
                                "lake is", hint=exc.hint) from None
    except ProtocolError as exc:
        if exc.code != ErrorCode.MALFORMED:
            raise
        raise ConfigError("", f"the daemon at {socket}{why} does not say where its lake is "
                          f"({exc}): it is older than this reader",
                          hint='name its config instead: .option("config", "<its config.toml>'
                          '")') from None
    return Located(socket=socket, cfg=config_of(info), where=f"the daemon at {socket}{why}",
                   withheld=tuple(str(w) for w in info.get("withheld", ())))


def config_of(info: Mapping[str, Any]) -> Config:
    """The daemon's answer as a Config: the lake's keys set, every other one default."""
    catalog, lake = dict(info["catalog"]), dict(info["lake"])
    store = dict(lake.get("store", {}))
    options = dict(store.get("options", {}))
    withheld = [str(w) for w in info.get("withheld", ())]
    if any(w.startswith("lake.store.options.") for w in withheld):
        # The daemon kept its keys: the reader's own come from where its service looks.
        store_class(str(store.get("scheme", ""))).keys_withheld(options)
    tree = {
        "data_dir": info["data_dir"],
        "catalog": {k: catalog[k] for k in ("dsn", "connect_timeout_ms", "pool_size")
                    if k in catalog},
        "lake": {"node_id": info.get("node_id", ""), "time_column": lake.get("time_column", ""),
                 "store": {**{k: store[k] for k in ("scheme", "root", "timeout_ms",
                                                    "max_attempts") if k in store},
                           "options": options}},
    }
    try:
        return msgspec.convert(tree, Config)
    except msgspec.ValidationError as exc:
        raise ConfigError("", f"the daemon's answer to JOB lake does not fit a config: {exc}"
                          ) from None


def writer_sockets(opts: Mapping[str, str]) -> tuple[tuple[str, ...], str]:
    """The writer's sockets, and how they were chosen (for its errors): ``paths``
    (comma-separated; it wins over ``path``, as before), else ``path`` or ``socket``,
    else a config's ingest socket, else the defaults; when nothing exists, the default
    socket (it may exist on the executors' hosts, which the driver cannot see)."""
    given = {n: opts.get(n, "").strip() for n in ("paths", "path", "socket", "config")}
    sockets = [n for n in ("paths", "path", "socket") if given[n]]
    if given["config"] and sockets:
        raise ValueError(f'options "config" and "{sockets[0]}" both name the daemon: give '
                         "one of them")
    if given["path"] and given["socket"] and given["path"] != given["socket"]:
        raise ValueError(f'options "path" ({given["path"]}) and "socket" ({given["socket"]}) '
                         "name two sockets: give one of them")
    listed = tuple(p.strip() for p in given["paths"].split(",") if p.strip())
    if listed:
        return listed, ""
    loc = Locator(socket=given["path"] or given["socket"], config=given["config"])
    try:
        socket, config, why = defaults(loc)
    except ConfigError:
        return (DEFAULT_SOCKET,), (f" (the default socket; ${SOCKET_ENV} not set, no "
                                   f"config at {DEFAULT_CONFIG})")
    if config:
        return (str(load(config).ingest_socket),), f" (from {config})"
    return (socket,), why
