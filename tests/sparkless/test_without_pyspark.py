"""The Spark integration's pure modules, and tests/sparkless/ itself, run where pyspark is
not installed: a child pytest runs every other test of this directory with pyspark made
unimportable, and reports each attempt to import it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().relative_to(ROOT)
PURE = ("quiverd.spark.options", "quiverd.spark.locator", "quiverd.spark.chunks",
        "quiverd.spark.pruning", "quiverd.spark.types")

# The child: a finder first on sys.meta_path refuses pyspark (as if not installed, an
# ImportError) and remembers the name asked for, so a guarded ``try: import pyspark``
# that would pass quietly is seen too; then pytest, with a plugin counting outcomes.
CHILD = r"""
import json, sys

class NoPyspark:
    asked = []

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.split(".")[0] == "pyspark":
            cls.asked.append(name)
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

class Outcomes:
    counts = {}
    files = set()

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            self.counts[report.outcome] = self.counts.get(report.outcome, 0) + 1
            self.files.add(report.nodeid.split("::")[0])

    def pytest_collectreport(self, report):
        if report.outcome != "passed":  # a module skipped or broken at import
            self.counts["collect " + report.outcome] = 1

for name in [m for m in sys.modules if m.split(".")[0] == "pyspark"]:
    del sys.modules[name]
sys.meta_path.insert(0, NoPyspark)
import pytest

outcomes = Outcomes()
code = pytest.main(sys.argv[2:], plugins=[outcomes])
with open(sys.argv[1], "w") as out:
    json.dump({"code": int(code), "asked": NoPyspark.asked, "counts": outcomes.counts,
               "files": sorted(outcomes.files),
               "modules": sorted(m for m in sys.modules if m.split(".")[0] in
                                 ("pyspark", "quiverd"))}, out)
sys.exit(code)
"""


def test_sparkless_tests_pass_with_pyspark_absent_and_never_import_it(tmp_path: Path) -> None:
    result = tmp_path / "result.json"
    # --ignore: the child must not run this test again (it would recurse); -p no:xdist:
    # one process, so the finder is in the interpreter that runs every test.
    args = [str(HERE.parent), f"--ignore={HERE}", "-q", "-p", "no:cacheprovider",
            "-p", "no:xdist"]
    # Without PYTEST_ADDOPTS: options meant for the outer run (-n) must not reach it.
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(result), *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(result.read_text())
    assert report["asked"] == [], f"pyspark was imported: {report['asked']}"
    assert not [m for m in report["modules"] if m.startswith("pyspark")]
    assert set(PURE) <= set(report["modules"]), report["modules"]
    # Every test ran and passed, in every file here: none skipped for want of pyspark.
    assert set(report["counts"]) == {"passed"}, report["counts"]
    files = {str(p.relative_to(ROOT)) for p in (ROOT / HERE.parent).glob("test_*.py")}
    files.discard(str(HERE))
    assert set(report["files"]) == files and len(files) >= 5, report["files"]
