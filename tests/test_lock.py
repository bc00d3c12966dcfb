"""constraints.txt is the lock: the suite runs on exactly its versions, and it names every
distribution the project's dependencies bring. A fresh machine installs the lock
(scripts/setup, scripts/install), so what passed here is what it gets; scripts/lock moves
it forward and runs the suite on the new versions."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "constraints.txt"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)$")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def locked() -> dict[str, str]:
    pins: dict[str, str] = {}
    for n, line in enumerate(LOCK.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = PIN.match(line)
        assert m, f"constraints.txt:{n}: not an exact pin: {line!r}"
        assert canonical(m[1]) not in pins, f"constraints.txt:{n}: {m[1]} pinned twice"
        pins[canonical(m[1])] = m[2]
    return pins


def test_lock_pins_exactly_what_the_suite_runs_on() -> None:
    pins = locked()
    installed = {canonical(d.metadata["Name"]): d.version for d in metadata.distributions()}
    # setuptools and pip of the venv itself are not what builds or installs the project
    # (the lock's pip is installed first; its setuptools is the build backend's).
    drift = {name: (version, pins.get(name)) for name, version in installed.items()
             if name not in ("quiverd", "setuptools") and pins.get(name) != version}
    assert not drift, ("installed versions differ from constraints.txt (name: installed, "
                       f"locked): {drift}; run scripts/setup, or scripts/lock to move the lock")


def test_lock_names_every_declared_dependency() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        declared += extra
    names = {canonical(re.split(r"[\[<>=!~; ]", d, maxsplit=1)[0]) for d in declared}
    build = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    names |= {canonical(re.split(r"[\[<>=!~; ]", d, maxsplit=1)[0]) for d in build}
    names.add("pip")
    assert names - set(locked()) == set()


def test_lock_is_what_setup_and_install_use() -> None:
    for script in ("setup", "install"):
        text = (ROOT / "scripts" / script).read_text()
        assert text.count("-c constraints.txt") == 2, script  # pip itself, then quiverd
        assert "--build-constraint constraints.txt" in text, script
