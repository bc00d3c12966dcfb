"""What a shard's WAL directory holds, read-only: generations and the usable sidecar.

    wal_dir/quiver.wal          active file, generation = max(rotated) + 1 (or the sidecar's)
    wal_dir/quiver.wal.<gen>    rotated files
    wal_dir/truncate.offset     sidecar: usable only when it decodes and points into a file

Replay, ``wal dump`` and fsck apply the same rules through these functions.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from quiverd.kernel import layout
from quiverd.kernel.errors import CorruptRecord
from quiverd.wal import format as wf


class WalInventory(msgspec.Struct, frozen=True, kw_only=True):
    """The files of one WAL directory and the sidecar, as replay will see them."""

    files: dict[int, Path]  # generation -> path; the active file only if it exists
    active_generation: int
    sidecar: wf.Sidecar | None  # None when missing, corrupt or pointing nowhere
    sidecar_state: str  # ok | missing | corrupt | out_of_range
    sidecar_problem: str = ""  # why a present sidecar is unusable

    def generation_of(self, path: Path) -> int | None:
        if layout.is_active_wal(path.name):
            return self.active_generation
        return layout.rotated_generation(path.name)


def wal_inventory(wal_dir: Path) -> WalInventory:
    """Read-only: generations and the usable sidecar (same rules as ``replay_wal``)."""
    rotated = {
        gen: p for p in wal_dir.iterdir() if (gen := layout.rotated_generation(p.name)) is not None
    } if wal_dir.is_dir() else {}
    sidecar: wf.Sidecar | None = None
    state, problem = "missing", ""
    sidecar_path = layout.sidecar(wal_dir)
    if sidecar_path.exists():
        try:
            sidecar = wf.decode_sidecar(sidecar_path.read_bytes(), path=str(sidecar_path))
            state = "ok"
        except CorruptRecord as exc:
            state, problem = "corrupt", str(exc)
    active_gen = max(max(rotated) + 1 if rotated else 0,
                     sidecar.rotation_generation if sidecar else 0)
    files = dict(sorted(rotated.items()))
    if layout.active_wal(wal_dir).exists():
        files[active_gen] = layout.active_wal(wal_dir)
    if sidecar is not None:
        target = files.get(sidecar.rotation_generation)
        if target is None or not wf.HEADER_LEN <= sidecar.truncate_offset <= target.stat().st_size:
            problem = (f"sidecar points at generation {sidecar.rotation_generation} offset "
                       f"{sidecar.truncate_offset}, which no WAL file holds: replay ignores it")
            state, sidecar = "out_of_range", None
    return WalInventory(files=files, active_generation=active_gen, sidecar=sidecar,
                     sidecar_state=state, sidecar_problem=problem)


def live_start(path: Path, size: int) -> int:
    """First byte of ``path`` a valid sidecar beside it still needs (``size``: none)."""
    inv = wal_inventory(path.parent)
    gen = inv.generation_of(path)
    sidecar = inv.sidecar
    if sidecar is None or gen is None or gen > sidecar.rotation_generation:
        return wf.HEADER_LEN
    if gen < sidecar.rotation_generation:
        return size
    return min(sidecar.truncate_offset, size)
