"""handbook_lib.core.files: atomic writes, and directories checked before a run starts."""

import os
from pathlib import Path

import pytest

from handbook_lib.core.files import check_writable_dir, write_json_atomic


def test_a_missing_folder_under_a_writable_one_passes_and_nothing_is_left(tmp_path):
    before = sorted(tmp_path.iterdir())
    assert check_writable_dir("ckpt_dir", tmp_path / "a" / "b") == tmp_path / "a" / "b"
    assert check_writable_dir("ckpt_dir", tmp_path) == tmp_path
    assert sorted(tmp_path.iterdir()) == before  # the probe folder is gone, nothing created


def test_a_file_or_a_path_under_a_file_is_refused_in_one_line(tmp_path):
    file = tmp_path / "f"
    file.write_text("mine")
    with pytest.raises(ValueError, match=r"config key 'ckpt_dir'='.*/f' is a file, not a folder") as err:
        check_writable_dir("ckpt_dir", file)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"'trainer_dir'='.*/f/x' cannot be created: .*/f is a file"):
        check_writable_dir("trainer_dir", file / "x")
    assert file.read_text() == "mine"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_a_folder_that_takes_no_entry_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(ValueError, match="cannot be created: .* takes no new folder"):
            check_writable_dir("ckpt_dir", locked / "ck")
    finally:
        locked.chmod(0o700)


def test_proc_takes_no_new_folder_even_for_root():
    if not Path("/proc").is_dir():
        pytest.skip("no /proc on this system")
    with pytest.raises(ValueError, match=r"'ckpt_dir'='/proc/x' cannot be created: /proc takes no new folder"):
        check_writable_dir("ckpt_dir", "/proc/x")


def test_write_json_atomic_leaves_no_temporary_file(tmp_path):
    write_json_atomic(tmp_path / "r.json", {"a": 1})
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]
    assert (tmp_path / "r.json").read_text() == '{\n  "a": 1\n}\n'
