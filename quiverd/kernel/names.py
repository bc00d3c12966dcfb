"""The names users choose, one rule each: subscriber names, client names, and the
column prefix quiverd keeps for itself.

Config, the admin commands, the subscriber registry, the socket protocol, the producer
client and the Spark writer all check names here, so the rule and its message are
written once.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from quiverd.kernel.errors import QuiverError

SUBSCRIBER_NAME_RULE = "[a-z0-9_-]{1,64}"
CLIENT_NAME_RULE = "[A-Za-z0-9._-]{1,255}"
SUBSCRIBER_NAME = re.compile(SUBSCRIBER_NAME_RULE)
CLIENT_NAME = re.compile(CLIENT_NAME_RULE)
# The protocol checks raw bytes before decoding them.
SUBSCRIBER_NAME_BYTES = re.compile(SUBSCRIBER_NAME_RULE.encode())
CLIENT_NAME_BYTES = re.compile(CLIENT_NAME_RULE.encode())


class InvalidSubscriberName(QuiverError, ValueError):
    """A subscriber name outside ``[a-z0-9_-]{1,64}``."""

    hint = "subscriber names are 1-64 chars of lowercase letters, digits, '_' and '-'"


def subscriber_name_problem(name: object) -> str | None:
    """Why ``name`` is not a valid subscriber name, or None when it is."""
    if isinstance(name, str) and SUBSCRIBER_NAME.fullmatch(name) is not None:
        return None
    return f"invalid subscriber name {name!r}: must match {SUBSCRIBER_NAME_RULE}"


def validate_subscriber_name(name: str) -> str:
    """Return ``name`` if it is a valid subscriber name, else raise InvalidSubscriberName."""
    problem = subscriber_name_problem(name)
    if problem is not None:
        raise InvalidSubscriberName(problem)
    return name


def client_name_problem(name: str) -> str | None:
    """Why ``name`` is not a valid client name, or None when it is."""
    if CLIENT_NAME_BYTES.fullmatch(name.encode("ascii", "replace")) is not None:
        return None
    return f"client name {name!r} must match {CLIENT_NAME_RULE}"


# The lake adds _quiver_ingested_at, _quiver_shard, _quiver_segment and _quiver_bundle to
# every row (quiverd/lake/model.py): a producer column of such a name would replace the
# bundle id or break the file (SPEC §1), so every top-level column name with this prefix
# is refused at ingest.
RESERVED_COLUMN_PREFIX = "_quiver_"


def reserved_column_problem(names: Iterable[str]) -> str | None:
    """Why a schema with these top-level column ``names`` may not be ingested, or None."""
    for name in names:
        if name.startswith(RESERVED_COLUMN_PREFIX):
            return (f"column {name!r}: the prefix {RESERVED_COLUMN_PREFIX!r} is reserved for "
                    "the columns quiverd adds to every row (_quiver_ingested_at, "
                    "_quiver_shard, _quiver_segment, _quiver_bundle); rename the column")
    return None


NODE_ID_RULE = "[A-Za-z0-9._-]{1,64}, not '.' or '..'"
NODE_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")


def node_id_problem(node_id: str) -> str | None:
    """Why ``node_id`` cannot name a node in object keys, or None when it can."""
    if NODE_ID.fullmatch(node_id) and node_id not in (".", ".."):
        return None
    return f"node id {node_id!r} must match {NODE_ID_RULE} (it is part of every object key)"
