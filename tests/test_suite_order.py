"""The suite's file order (tests/conftest.py, scripts/test_file_seconds.py): files heaviest first,
each file's tests kept together and in their own order, a file the table does not list first."""
from __future__ import annotations

import json
from types import SimpleNamespace

from scripts.test_file_seconds import file_seconds
from tests import conftest

REPORT = """\
============================ slowest durations =============================
201.96s setup    tests/test_b.py::test_one
 ignored line
3.50s call     tests/test_a.py::test_x[param-1]
0.25s teardown tests/test_b.py::test_one
1.25s call     tests/test_a.py::TestKind::test_y
0.01s setup    tests/test_c.py::test_z
(12 durations < 0.005s hidden.)
"""


def test_file_seconds_sums_each_files_phases():
    got = file_seconds(REPORT.splitlines())
    assert got == {"tests/test_b.py": 201.96 + 0.25, "tests/test_a.py": 3.5 + 1.25, "tests/test_c.py": 0.01}


def test_files_ordered_heaviest_first_unknown_first_tests_in_their_order(tmp_path, monkeypatch):
    table = tmp_path / "file_seconds.json"
    table.write_text(json.dumps({"measured": "a hand-written table",
                                 "seconds": {"tests/test_a.py": 5.0, "tests/test_b.py": 200.0, "tests/test_c.py": 0.5}}))
    monkeypatch.setattr(conftest, "FILE_SECONDS", str(table))
    ids = ["tests/test_a.py::test_1", "tests/test_a.py::test_2", "tests/test_b.py::test_1", "tests/test_c.py::test_1",
           "tests/test_new.py::test_2", "tests/test_new.py::test_1", "tests/test_b.py::test_0"]
    items = [SimpleNamespace(nodeid=i) for i in ids]
    conftest.pytest_collection_modifyitems(None, items)
    assert [i.nodeid for i in items] == [
        "tests/test_new.py::test_2", "tests/test_new.py::test_1",      # not in the table: first
        "tests/test_b.py::test_1", "tests/test_b.py::test_0",          # 200 s
        "tests/test_a.py::test_1", "tests/test_a.py::test_2",          # 5 s
        "tests/test_c.py::test_1"]                                     # 0.5 s


def test_a_missing_table_keeps_the_collection_order(tmp_path, monkeypatch):
    monkeypatch.setattr(conftest, "FILE_SECONDS", str(tmp_path / "absent.json"))
    items = [SimpleNamespace(nodeid=i) for i in ("tests/test_z.py::t", "tests/test_a.py::t")]
    conftest.pytest_collection_modifyitems(None, items)
    assert [i.nodeid for i in items] == ["tests/test_z.py::t", "tests/test_a.py::t"]
