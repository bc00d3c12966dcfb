"""The write-ahead log (SPEC §3): byte format (sans-IO), files (append, sync, rotate, release),
replay, dump.
"""
