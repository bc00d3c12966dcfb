"""The parallel run's groups (tests/xdist_groups.py): a group stays on one worker.

A real ``pytest -n 3`` in a scratch tree laid out like ours (tests/spark/, a sessionless
file there, tests/daemon/ files); each test appends its worker's name to a file.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.xdist_groups import SESSIONLESS, group_of

ROOT = Path(__file__).resolve().parents[1]

TEST = """
import os, time

def _record(name):
    with open(os.environ["GROUPS_OUT"], "a") as f:
        f.write(f"{name} {os.environ['PYTEST_XDIST_WORKER']}\\n")

def test_{n}_1():
    _record(__name__ + "_1"); time.sleep(0.2)

def test_{n}_2():
    _record(__name__ + "_2"); time.sleep(0.2)
"""

PLUGIN = ROOT / "tests" / "xdist_groups.py"
CONFTEST = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("xdist_groups", {str(PLUGIN)!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
pytest_xdist_make_scheduler = module.pytest_xdist_make_scheduler
pytest_collection_modifyitems = module.pytest_collection_modifyitems
"""


def test_group_of_maps_paths_to_groups() -> None:
    assert group_of("tests/spark/test_reader.py::test_x") == "spark"
    assert group_of("tests/spark/cluster/test_cluster_writer.py::test_y") == "cluster"
    assert group_of("tests/daemon/test_power_cut.py::test_z[plain]") == "loop"
    assert group_of("tests/daemon/test_ingest.py::test_a") == "tests/daemon/test_ingest.py"
    for prefix in SESSIONLESS:
        assert group_of(prefix + "::t" if "::" not in prefix else prefix) == prefix
        assert prefix.startswith("tests/spark/")  # SESSIONLESS only carves out of spark


def test_a_parallel_run_keeps_each_group_on_one_worker(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "tests" / "spark").mkdir(parents=True)
    (tree / "tests" / "daemon").mkdir()
    (tree / "conftest.py").write_text(CONFTEST)
    names = {"spark": ["test_s1", "test_s2", "test_s3"], "daemon": ["test_d1", "test_d2",
                                                                     "test_d3", "test_d4"]}
    for folder, files in names.items():
        for name in files:
            (tree / "tests" / folder / f"{name}.py").write_text(TEST.replace("{n}", name))
    out = tmp_path / "workers.txt"
    env = {**os.environ, "GROUPS_OUT": str(out)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "3",
         "-o", "addopts=", "-o", "timeout=60", "--rootdir", str(tree), str(tree)],
        cwd=tree, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ran = [line.split() for line in out.read_text().splitlines()]
    assert len(ran) == 14
    spark_workers = {worker for name, worker in ran if name.startswith("test_s")}
    assert len(spark_workers) == 1, f"the Spark group was split: {ran}"
    # Handed out first: the Spark group's worker starts with its tests.
    worker = spark_workers.pop()
    mine = [name for name, w in ran if w == worker]
    assert all(name.startswith("test_s") for name in mine[:6]), mine
    # The other files are spread over the other workers, a file whole.
    others = {w for name, w in ran if name.startswith("test_d")}
    assert worker not in others and len(others) == 2, ran


def test_a_session_user_outside_the_spark_group_fails_collection(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "tests" / "daemon").mkdir(parents=True)
    (tree / "conftest.py").write_text(CONFTEST + "\nimport pytest\n\n@pytest.fixture\n"
                                      "def spark():\n    return None\n")
    (tree / "tests" / "daemon" / "test_stray.py").write_text("def test_x(spark):\n    pass\n")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
         "--collect-only", "--rootdir", str(tree), str(tree)],
        cwd=tree, capture_output=True, text=True, timeout=60)
    assert done.returncode == 4, done.stdout[-2000:] + done.stderr[-2000:]  # a usage error
    assert "ask for the Spark session outside the Spark group" in done.stdout + done.stderr
    assert "tests/daemon/test_stray.py::test_x" in done.stdout + done.stderr
