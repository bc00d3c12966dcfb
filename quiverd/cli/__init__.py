"""The ``quiverd`` command line: serve, send, subscribe, status, wal/segment dumps, fsck."""
