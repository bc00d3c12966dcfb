"""The lake: finalized bundles as Parquet in an object store, registered in a catalog.

    model      the catalog's rows, states and coverage (what every part agrees on)
    drift      one representative schema per file out of drifting bundle schemas
    parquet    Active Parquet files: append row groups, close, name, zone maps
    objects    the object store through OpenDAL: upload, verify, list, delete
    catalog/   the catalog: base (interface), sql + jobs, sqlite (embedded), pg (asyncpg)

The uploader actor (``quiverd_actors.uploader``) drives these; SPEC §6.
"""
