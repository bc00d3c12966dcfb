"""How a store's root, an object key, a URI and a location relate: no I/O, no operator.

    key        client=web/slot=0/...parquet   relative, '/'-separated, never under .tmp/
    root       lake.store.root, as OpenDAL is given it (a prefix in the bucket; for fs
               an absolute directory, <data_dir>/objects by default)
    uri        <scheme>://<bucket or container>/<root>/<key>   the catalog's uri column and
               what the CLI shows; fs: file:///abs/root/<key>, percent-encoding only what
               a URI must (so '=' stays readable: client=web, not client%3Dweb)
    location   the same object as a foreign engine (Iceberg, Spark) opens it: never
               percent-encoded (pyiceberg does not decode locations)

``StoreNames`` is the part of every store class that answers these questions; the class
methods answer from a StoreConfig alone, for code that opens no store (the Spark
reader, ``check-config``, the socket's whereabouts reply). A class overrides what its
service does differently (``LocalStore``, ``S3Store``); only the scheme table in
``quiverd.lake.store`` names schemes.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from quiverd.kernel.config import StoreConfig
from quiverd.lake.store.options import checked_options

FS_TMP_DIR = ".tmp"  # fs temp files, under the root (a rename commits); never a key prefix


class StoreNames:
    """Names of the objects of one store (mixed into ObjectStore; see the module doc)."""

    is_local: ClassVar[bool] = False  # objects are files on a local path (local_path)
    cfg: StoreConfig
    root: str
    _options: dict[str, str]  # OpenDAL's service options, root included

    # -- from a StoreConfig alone ------------------------------------------------------------
    @classmethod
    def resolve_root(cls, cfg: StoreConfig, data_dir: Path) -> str:
        """The root OpenDAL is given: lake.store.root as written (a prefix in the bucket)."""
        return cfg.root

    @classmethod
    def service_options(cls, cfg: StoreConfig, root: str) -> dict[str, str]:
        """OpenDAL's options for ``cfg`` under ``root``, checked (ConfigError otherwise)."""
        options = checked_options(cfg)
        cls.complete_options(cfg, options, root)
        if root:
            options["root"] = root
        return options

    @classmethod
    def complete_options(cls, cfg: StoreConfig, options: dict[str, str], root: str) -> None:
        """What this service requires or defaults beyond OpenDAL's own checks (in place)."""

    @classmethod
    def keys_withheld(cls, options: dict[str, str]) -> None:
        """A reader got ``options`` with the daemon's secrets left out: let it find its
        own credentials where the service's SDK looks (in place; nothing by default)."""

    @classmethod
    def file_under(cls, root: str, key: str) -> Path | None:
        """The local path of ``key`` under ``root``; None when objects are not local files."""
        return None

    # -- of this store -----------------------------------------------------------------------
    def uri(self, key: str) -> str:
        """The object's URI: <scheme>://<bucket or container>/<root>/<key> with the empty
        parts left out (s3://b/lake/<key>, memory://<key>); ``key`` "" names the store."""
        bucket = self._options.get("bucket") or self._options.get("container") or ""
        parts = (bucket, self.root.strip("/"), key)
        return f"{self.cfg.scheme}://" + "/".join(p for p in parts if p)

    def location(self, key: str) -> str:
        """Where a foreign engine finds the object, never percent-encoded:
        s3://<bucket>/<root>/<key>, the same rule for other schemes, file:///abs/<key>."""
        return self.uri(key)

    def key_of(self, uri: str) -> str | None:
        """The key that a URI or location of this store names, None when it names none.
        fs URIs written before issue 20 (percent-encoded: client%3Dweb) are read too."""
        head = self.uri("")
        head = head if head.endswith("/") else head + "/"
        key = uri[len(head):] if uri.startswith(head) else ""
        return key if key_ok(key) else None

    def local_path(self, key: str) -> Path | None:
        """The object's file when the store keeps objects as local files, else None."""
        return self.file_under(self.root, key)

    def iceberg_io_properties(self) -> dict[str, str]:
        """pyiceberg FileIO properties that reach this store's objects at ``location``:
        none here (a local file needs none; other services: pyiceberg's own defaults)."""
        return {}


def check_key(key: str) -> None:
    if not key_ok(key):
        raise ValueError(f"bad object key {key!r}: relative, '/'-separated, no empty, '.' "
                         f"or '..' parts, not under {FS_TMP_DIR}/")


def key_ok(key: str) -> bool:
    parts = key.split("/")
    return bool(key) and not any(p in ("", ".", "..") for p in parts) and parts[0] != FS_TMP_DIR
