"""megatron_gigpo.files.write_text_atomic: the one atomic rewrite every writer of run files uses."""

import os
import stat

import pytest

from megatron_gigpo.files import write_text_atomic

pytestmark = pytest.mark.unit


def test_replaces_the_whole_file_with_readable_permissions_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("old\n")
    assert write_text_atomic(path, "new\n", fsync=True) == path
    assert path.read_text() == "new\n"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]


def test_a_failed_write_keeps_the_old_file_and_removes_its_temporary(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("old\n")
    with pytest.raises(UnicodeEncodeError):
        write_text_atomic(path, "\udcff")  # a lone surrogate cannot be encoded: the write fails half-way
    assert path.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["config.yaml"]


def test_a_missing_folder_is_an_os_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        write_text_atomic(tmp_path / "no" / "file.json", "{}")
