"""Subscriber outcomes (SPEC §5): ack.log byte format (sans-IO), the file, the in-memory
AckState, the subscriber registry, recovery.
"""
