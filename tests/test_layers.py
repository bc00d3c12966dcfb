"""The house rules, checked by reading the source: layers, package count, path names.

Layers, lowest first; a module may import its own layer and the ones below,
never one above, lazy imports (inside functions) included:

    kernel                         shared by everything, imports nothing else
    wal, segments, acks, protocol  formats and their files
    lake                           Parquet, object store, catalog (the storage tier)
    client                         talks to a running daemon over the socket
    spark                          spark.read.format("quiver"), over the lake (same rank)
    quiverd_actors (actors/)       the daemon's actors and their messages
    net                            servers that feed the actors
    runtime                        wires shards and servers into the daemon
    cli                            the command line

Inside quiverd_actors, actors do not import each other: an actor's module may import
the modules of its own room (the ``uploader/`` package's modules among themselves; a
helper module that is part of one actor, below) and the shared modules, never another
actor's, lazy and TYPE_CHECKING imports included. Actors talk through streams and the
shared types; where one calls another, it names a small Protocol (``FeedbackSink``).

    shared (no actor's code)       messages (what crosses a boundary), sessions (Session,
                                   OutgoingDelivery), feedback (a dispatcher's inbox),
                                   inbox (a shard's append inbox), segment_checks (CRC
                                   bookkeeping shared by dispatcher and scrubber), retry
                                   (pacing), retention_gate (gc_sweeper -> wal_writer)
    helpers in an actor's room     ranges -> dispatcher (reads its state for STREAM
                                   connections), wal_threads -> wal_writer (its threads)
    actors (one room each)         ack_logger, dispatcher, finalizer, gc_sweeper, indexer,
                                   janitor, scrubber, segment_builder, uploader (package),
                                   wal_writer
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RANKS = {
    "quiverd.kernel": 0,
    "quiverd.wal": 1, "quiverd.segments": 1, "quiverd.acks": 1, "quiverd.protocol": 1,
    "quiverd.lake": 1,
    "quiverd.client": 2,
    "quiverd.spark": 2,  # spark.read.format("quiver"): reads the lake (1) with kernel (0)
    "quiverd_actors": 3,
    "quiverd.net": 4,
    "quiverd.runtime": 5,
    "quiverd.cli": 6,
    "quiverd.__main__": 7,
    "quiverd": 0,  # the package's own __init__ (version only)
}
# Format packages may use each other only where one format embeds another's type.
FORMAT_PEERS: dict[str, set[str]] = {
    "quiverd.wal": set(), "quiverd.segments": set(), "quiverd.acks": set(),
    "quiverd.protocol": set(), "quiverd.lake": set(),
}


def _module_name(path: Path) -> str:
    base = ROOT / "actors" if path.is_relative_to(ROOT / "actors") else ROOT
    rel = path.relative_to(base).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> list[Path]:
    return sorted([*ROOT.joinpath("quiverd").rglob("*.py"),
                   *ROOT.joinpath("actors", "quiverd_actors").rglob("*.py")])


def _source_of(module: str) -> Path:
    """Where a module's file would be (quiverd_actors lives in the actors/ folder)."""
    base = ROOT / "actors" if module.startswith("quiverd_actors") else ROOT
    return base.joinpath(*module.split(".")).with_suffix(".py")


def _is_module(module: str) -> bool:
    source = _source_of(module)
    return source.exists() or source.with_suffix("").joinpath("__init__.py").exists()


def _absolute(path: Path, module: str | None, level: int) -> str:
    """The absolute name of ``from <dots><module> import ...`` written in ``path``."""
    if level == 0:
        return module or ""
    if not (path.is_relative_to(ROOT / "quiverd") or path.is_relative_to(ROOT / "actors")):
        return ""  # a file outside the packages (a test's planted source): none of ours
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package.pop()
    package = package[:len(package) - (level - 1)]
    return ".".join([*package, module] if module else package)


def _group(module: str) -> str:
    best = ""
    for prefix in RANKS:
        if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best):
            best = prefix
    assert best, f"{module} belongs to no layer: add it to RANKS"
    return best


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every module ``path`` imports, at any depth of the file (lazy ones too)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(path, node.module, node.level)
            if not base:
                continue
            found.append((node.lineno, base))
            # ``from quiverd.wal import replay``: the submodule is what is used.
            found += [(node.lineno, f"{base}.{a.name}") for a in node.names
                      if _is_module(f"{base}.{a.name}")]
    return [(n, m) for n, m in found if m.split(".")[0] in ("quiverd", "quiverd_actors")]


def test_layers_no_import_points_upward() -> None:
    violations = []
    for path in _modules():
        me = _group(_module_name(path))
        for line, target in _imports(path):
            them = _group(target)
            if RANKS[them] > RANKS[me]:
                violations.append(f"{path.relative_to(ROOT)}:{line}: {me} imports {target} "
                                  f"(layer {RANKS[them]} above {RANKS[me]})")
            elif them != me and me in FORMAT_PEERS and them in FORMAT_PEERS \
                    and them not in FORMAT_PEERS[me]:
                violations.append(f"{path.relative_to(ROOT)}:{line}: format package {me} "
                                  f"imports its peer {target}")
    assert not violations, "\n".join(violations)


SHARED_ACTOR_MODULES = {"messages", "sessions", "feedback", "inbox", "segment_checks", "retry",
                        "retention_gate"}
ACTOR_HELPERS = {"ranges": "dispatcher", "wal_threads": "wal_writer"}  # module -> its room


def _room(module: str) -> str | None:
    """The actor room a quiverd_actors module belongs to; None for a shared module (or
    the package itself, or anything outside quiverd_actors)."""
    parts = module.split(".")
    if parts[0] != "quiverd_actors" or len(parts) == 1 or parts[1] in SHARED_ACTOR_MODULES:
        return None
    return ACTOR_HELPERS.get(parts[1], parts[1])


def _actor_violations(paths: list[Path]) -> list[str]:
    violations = []
    for path in paths:
        me = _module_name(path)
        for line, target in _imports(path):
            theirs = _room(target)
            if theirs is not None and theirs != _room(me):
                violations.append(f"{path.relative_to(ROOT)}:{line}: {me} imports {target} "
                                  f"(the {theirs} actor's room)")
    return violations


def test_layers_actors_do_not_import_each_other() -> None:
    actors = [p for p in _modules() if p.is_relative_to(ROOT / "actors")]
    known = SHARED_ACTOR_MODULES | set(ACTOR_HELPERS)
    for path in actors:  # every top-level module is shared, a helper, or an actor's room
        name = _module_name(path).split(".")
        assert len(name) == 1 or name[1] in known or _room(".".join(name)) == name[1]
    assert not _actor_violations(actors), "\n".join(_actor_violations(actors))


@pytest.mark.parametrize("planted", [
    "from quiverd_actors.dispatcher import Session\n",
    "def f():\n    from quiverd_actors.finalizer import run\n    return run\n",
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
    "    from quiverd_actors import janitor\n",
    "from .. import dispatcher\n",
    "from ..scrubber import run\n",
])
def test_layers_actor_rule_catches_a_planted_import(planted: str) -> None:
    """The rule can fail: an uploader module importing another actor, however spelled, is
    reported; one importing its own room or a shared module is not. The planted module
    is written into the real package tree (then removed) so relative imports resolve."""
    planted_at = ROOT / "actors" / "quiverd_actors" / "uploader" / "_planted_for_test.py"
    try:
        planted_at.write_text(planted)
        assert _actor_violations([planted_at]), planted
        planted_at.write_text("from quiverd_actors.uploader.files import OpenFile\n"
                              "from . import publisher\nfrom ..messages import LocalDelivery\n"
                              "from quiverd_actors.sessions import Session\n")
        assert not _actor_violations([planted_at])
    finally:
        planted_at.unlink()


def test_layers_check_sees_lazy_imports(tmp_path: Path) -> None:
    """The walker must find an import hidden inside a function (the check can fail)."""
    source = tmp_path / "lazy.py"
    source.write_text("def f():\n    from quiverd_actors.dispatcher import Session\n"
                      "    return Session\n")
    assert (2, "quiverd_actors.dispatcher") in _imports(source)


def test_layers_quiverd_top_level_stays_small() -> None:
    entries = [p.name for p in ROOT.joinpath("quiverd").iterdir()
               if p.name != "__pycache__" and not p.name.endswith(".egg-info")]
    # 13: quiverd/spark/ is the card's Spark integration (spark.read.format("quiver")).
    assert len(entries) <= 13, sorted(entries)


@pytest.mark.parametrize("literal", ['"wal"', '"segments"', '"quarantine"', '"ack.log"',
                                     '"quiver.wal"', '"truncate.offset"', '"LOCK"',
                                     '"FLOOR"', '"DELETED"', '".qseg"'])
def test_layers_only_layout_names_shard_paths(literal: str) -> None:
    """One owner per fact: ``quiverd/kernel/layout.py`` spells the data directory's names."""
    owners = [str(p.relative_to(ROOT)) for p in _modules() if literal in p.read_text()]
    path_like = [o for o in owners if o != "quiverd/kernel/layout.py"
                 and _used_as_path(ROOT / o, literal)]
    assert not path_like, f"{literal} spelled outside kernel/layout.py: {path_like}"


def _used_as_path(path: Path, literal: str) -> bool:
    """A literal after ``/`` or inside a path join, not a dict key or a CLI word."""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if literal in line and not stripped.startswith("#") and (
                f"/ {literal}" in line or f"{literal} /" in line or "Path(" in line
                or "os.path.join" in line or ".glob(" in line):
            return True
    return False
