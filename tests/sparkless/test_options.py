"""quiverd.spark.options without Spark: each direction's option names, the refusal of an
unknown one with a did-you-mean, which set a schema() call's options are for, and the
OPTIONS of a CREATE TABLE as Spark hands them over."""

from __future__ import annotations

import pytest

from quiverd.spark.options import (
    READ,
    STREAM_ONLY,
    STREAM_READ,
    WRITE,
    lowered,
    read_or_stream,
    refuse_unknown,
    table_options,
)
from quiverd.spark.write_options import WriteOptions


def test_options_refuse_unknown_names_the_closest_and_ignores_case() -> None:
    refuse_unknown({"Client": "w", "SINCE": "1", "checkpointLocation": "/c"},
                   READ | {"checkpointlocation"}, "r")
    with pytest.raises(ValueError, match='unknown option "batch_row" for df.write.format'
                       '\\("quiver"\\); did you mean "batch_rows"\\? \\(known: '):
        WriteOptions.parse({"batch_row": "5"})
    with pytest.raises(ValueError, match='unknown option "zzz" for w \\(known: '):
        refuse_unknown({"zzz": 1}, WRITE, "w")
    assert not any(n.startswith("_") for n in STREAM_READ)
    with pytest.raises(ValueError, match='"if_committed" must be one of skip, verify, error'):
        WriteOptions.parse({"if_committed": "ignore"})


def test_options_refusal_lists_the_public_names_sorted_and_the_first_unknown() -> None:
    with pytest.raises(ValueError) as info:
        refuse_unknown({"Sinse": "1", "colums": "a"}, READ, 'spark.read.format("quiver")')
    text = str(info.value)
    # Sorted: "colums" before "sinse"; lowercased as Spark compares them.
    assert text.startswith('unknown option "colums" for spark.read.format("quiver"); did you '
                           'mean "columns"? (known: ')
    known = text.split("(known: ")[1].rstrip(")").split(", ")
    assert known == sorted(READ - {"_trace_dir"})  # test hooks are accepted, never shown
    refuse_unknown({"_TRACE_DIR": "/t"}, READ, "r")
    with pytest.raises(ValueError, match='unknown option "_nope" for r'):
        refuse_unknown({"_nope": "1"}, READ, "r")  # a hook only where it is listed


def test_options_each_direction_accepts_its_names_and_spark_s_own() -> None:
    refuse_unknown({n.upper(): "x" for n in READ}, READ, "r")
    refuse_unknown({n: "x" for n in WRITE}, WRITE, "w")
    refuse_unknown({"maxBundlesPerTrigger": "1", "failOnDataLoss": "false", "from": "0"},
                   STREAM_READ, "s")
    assert {"path", "checkpointlocation"} <= WRITE  # added by Spark itself
    with pytest.raises(ValueError, match='unknown option "subscriber" for r'):
        refuse_unknown({"subscriber": "s"}, READ, "r")  # a stream option on a batch read
    with pytest.raises(ValueError, match='unknown option "since" for s'):
        refuse_unknown({"since": "1"}, STREAM_READ, "s")
    assert STREAM_ONLY == {"subscriber", "maxbundlespertrigger", "from", "failondataloss"}


def test_read_or_stream_chooses_the_set_a_name_or_its_typo_belongs_to() -> None:
    assert read_or_stream({}) is READ
    assert read_or_stream({"client": "web", "since": "1"}) is READ
    assert read_or_stream({"Subscriber": "s"}) is STREAM_READ
    assert read_or_stream({"client": "web", "maxBundlesPerTrigger": "5"}) is STREAM_READ
    # A typo of a stream-only name: the stream's set, so its did-you-mean names it.
    assert read_or_stream({"subscribr": "s"}) is STREAM_READ
    assert read_or_stream({"failondatalos": "x"}) is STREAM_READ
    # A typo of a batch name, or of no name: the batch read's set.
    assert read_or_stream({"sinse": "1"}) is READ
    assert read_or_stream({"zzzz": "1"}) is READ
    assert read_or_stream({"slotfrom": "1"}) is READ  # near "slot" and "from" alike
    with pytest.raises(ValueError, match='"subscribr" for s; did you mean "subscriber"'):
        refuse_unknown({"subscribr": "x"}, read_or_stream({"subscribr": "x"}), "s")


def test_lowered_names_and_string_values() -> None:
    assert lowered({"Slot": 3, "CLIENT": "Web", "x": None}) == {"slot": "3", "client": "Web",
                                                                 "x": "None"}


def test_table_options_of_a_create_table_and_none_otherwise() -> None:
    assert table_options({"client": "web", "config": "/c"}) is None  # a plain read
    assert table_options({}) is None
    # CREATE TABLE t USING quiver OPTIONS (client 'web', Socket '/s'): each twice, plus
    # Spark's own keys.
    created = {"client": "web", "option.client": "web", "Socket": "/s", "option.socket": "/s",
               "owner": "root", "provider": "quiver"}
    assert table_options(created) == {"client": "web", "socket": "/s"}
    # With LOCATION, Spark adds "location" and its copy as "path": not a client.
    located = {**created, "location": "file:/w", "path": "file:/w"}
    assert table_options(located) == {"client": "web", "socket": "/s"}
    # A path of its own (load("<client>")'s) is kept.
    assert table_options({**created, "location": "file:/w", "path": "web"}) == \
        {"client": "web", "socket": "/s", "path": "web"}
