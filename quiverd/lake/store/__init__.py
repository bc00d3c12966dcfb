"""The lake's object store (quiverd/lake/store/): one class per kind of service, chosen by
scheme from one table (litestream's replica_url.go is the model).

    scheme   class          module     what differs
    fs       LocalStore     local      fsync of parent dirs, temp dir sweep, xattrs check,
                                       absolute root (<data_dir>/objects), file:// names
    s3       S3Store        here       bucket/region required, no surprise credentials,
                                       pyiceberg FileIO properties
    other    ObjectStore    objects    any OpenDAL service, as OpenDAL configures it

    names     how root, key, URI and location relate (StoreNames, mixed into ObjectStore)
    options   OpenDAL's options checked, errors classified (no scheme named there)
    transfer  bytes between a local file and an object, in bounded chunks

Guarantees: ``SCHEMES`` below is the only place that names a scheme; everything else
asks a store (``is_local``, ``uri``, ``location``, ``local_path``, ``key_of``,
``iceberg_io_properties``) or, holding only a StoreConfig, the class ``store_class``
returns (``store_root``, ``opendal_options``, ``file_under``, ``keys_withheld``).
Opening a store (``open_store``: the class the table names for the scheme) builds
the operator and, for fs, creates the temp directory; the class methods do no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from quiverd.kernel.config import StoreConfig
from quiverd.kernel.errors import ConfigError
from quiverd.kernel.logs import Logger
from quiverd.lake.store.local import LocalStore
from quiverd.lake.store.names import StoreNames
from quiverd.lake.store.objects import ObjectStore

__all__ = [
    "SCHEMES",
    "LocalStore",
    "ObjectStore",
    "S3Store",
    "StoreNames",
    "open_store",
    "opendal_options",
    "service_options",
    "store_class",
    "store_root",
]


def open_store(cfg: StoreConfig, *, data_dir: Path, log: Logger) -> ObjectStore:
    """The store ``cfg`` configures, of the class its scheme names (ConfigError when the
    options are wrong; no request is sent)."""
    return store_class(cfg.scheme)(cfg, data_dir=data_dir, log=log)


def store_class(scheme: str) -> type[ObjectStore]:
    """The class of a scheme: the table's entry, or the generic ObjectStore."""
    return SCHEMES.get(scheme, ObjectStore)


def store_root(cfg: StoreConfig, *, data_dir: Path) -> str:
    """The root OpenDAL is given for ``cfg`` (fs: absolute, <data_dir>/objects by default)."""
    return store_class(cfg.scheme).resolve_root(cfg, data_dir)


def opendal_options(cfg: StoreConfig, *, data_dir: Path) -> dict[str, str]:
    """OpenDAL's service options for ``cfg``, root included, checked (ConfigError)."""
    cls = store_class(cfg.scheme)
    return cls.service_options(cfg, cls.resolve_root(cfg, data_dir))


def service_options(cfg: StoreConfig, root: str) -> dict[str, str]:
    """OpenDAL's service options for ``cfg`` under ``root``, checked (ConfigError)."""
    return store_class(cfg.scheme).service_options(cfg, root)


# OpenDAL's s3 option -> pyiceberg's FileIO property (pyiceberg.io's S3_* names).
ICEBERG_S3 = {
    "endpoint": "s3.endpoint",
    "region": "s3.region",
    "access_key_id": "s3.access-key-id",
    "secret_access_key": "s3.secret-access-key",
    "session_token": "s3.session-token",
}


class S3Store(ObjectStore):
    """Objects in one S3 bucket (or an S3-compatible service: MinIO, moto, R2), under
    lake.store.root as a key prefix; ``uri`` and ``location`` are both
    s3://<bucket>/<root>/<key>, unencoded. OpenDAL reads ~/.aws and AWS_* only when
    ``disable_config_load = "false"`` is set."""

    @classmethod
    def complete_options(cls, cfg: StoreConfig, options: dict[str, str], root: str) -> None:
        where = "lake.store.options"
        if "bucket" not in options:  # also when opendal.config is not there to tell us
            raise ConfigError(where, "bucket is missing: the s3 service needs it",
                              hint='add bucket = "my-bucket" under [lake.store.options]')
        if "region" not in options:
            raise ConfigError(where, "region is missing: S3 signs requests for a region",
                              hint='add region = "us-east-1" (MinIO and moto accept it)')
        if ("access_key_id" in options) != ("secret_access_key" in options):
            raise ConfigError(where, "access_key_id and secret_access_key go together")
        # No surprise credentials: ~/.aws and AWS_* are read only when asked for.
        options.setdefault("disable_config_load", "true")

    @classmethod
    def keys_withheld(cls, options: dict[str, str]) -> None:
        options["disable_config_load"] = "false"  # AWS_* and ~/.aws, as AWS SDKs do

    def iceberg_io_properties(self) -> dict[str, str]:
        """s3.endpoint, s3.region, the keys and s3.session-token as configured, and the
        addressing style OpenDAL uses: path-style unless enable_virtual_host_style is
        "true" (pyiceberg: s3.force-virtual-addressing; Java's S3FileIO, for Spark and
        Trino: s3.path-style-access). Without keys (disable_config_load = "false"), the
        engine finds credentials where AWS SDKs look, as OpenDAL does."""
        props = {prop: self._options[name] for name, prop in ICEBERG_S3.items()
                 if self._options.get(name)}
        virtual = self._options.get("enable_virtual_host_style", "").lower() == "true"
        props["s3.force-virtual-addressing"] = str(virtual).lower()
        props["s3.path-style-access"] = str(not virtual).lower()
        return props


# The one place that names schemes.
SCHEMES: Mapping[str, type[ObjectStore]] = {
    "fs": LocalStore,
    "s3": S3Store,
}
