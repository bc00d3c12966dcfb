"""The uploader actor, the built-in subscriber ``uploader``: finalized bundles in, Parquet
files in the lake out (SPEC §6). One room, three modules:

    actor.py      Uploader: intake, open files, rotation, acks (the actor itself)
    files.py      what the actor and its publisher share: OpenFile, Part, Sealed, Steps
    publisher.py  Publisher: a sealed file uploaded, verified and registered

Other code imports the names below from the package, not its modules. The modules
import each other and the shared actor modules (messages, sessions), never another
actor (tests/test_layers.py).
"""

from quiverd_actors.uploader.actor import (
    EXTRA_FIELDS,
    INGESTED_AT,
    MAX_OPEN_FILES,
    SUBSCRIBER,
    FeedbackSink,
    Uploader,
)

__all__ = ["EXTRA_FIELDS", "INGESTED_AT", "MAX_OPEN_FILES", "SUBSCRIBER", "FeedbackSink",
           "Uploader"]
