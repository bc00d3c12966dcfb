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
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            # ``from quiverd.wal import replay``: the submodule is what is used.
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names
                      if _source_of(f"{node.module}.{a.name}").exists()]
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
