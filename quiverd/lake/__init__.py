"""The lake: finalized bundles as Parquet in an object store, registered in a catalog.

    model      the catalog's rows, states and coverage (what every part agrees on)
    drift      one representative schema per file out of drifting bundle schemas
    parquet    Active Parquet files: append row groups, close, name, zone maps
    store/     the object store through OpenDAL: upload, verify, list, delete; one class
               per kind of service (fs: local, s3), chosen by scheme
    catalog/   the catalog: base (interface), sql + jobs, sqlite (embedded), pg (asyncpg)

The uploader actor (``quiverd_actors.uploader``) drives these; SPEC §6.
"""
