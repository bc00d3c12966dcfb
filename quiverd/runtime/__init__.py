"""The running daemon: root task group, shards (recovery and actor wiring), systemd notify, the
data directory LOCK.
"""
