"""Segment files (SPEC §4): the open segment, the byte format (sans-IO), the reader,
dictionaries, representative schemas, FLOOR/DELETED markers.
"""
