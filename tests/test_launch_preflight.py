"""The launcher's NCCL preflight (issue 29, S3-5): /dev/shm of 64 MB, with faked statvfs."""

import os
from types import SimpleNamespace

from handbook_lib.launch.preflight import SHM_MIN_BYTES, shm_warning


def _fs(size):
    return lambda path: SimpleNamespace(f_frsize=4096, f_blocks=size // 4096)


def test_a_64_mb_shm_is_named_in_one_line():
    line = shm_warning(2, cuda=True, statvfs=_fs(64 * 2**20))
    assert line.startswith("/dev/shm is 64 MiB: NCCL may fail") and "--shm-size" in line
    assert "\n" not in line and len(line) <= 100


def test_nothing_to_say():
    assert shm_warning(8, True, statvfs=_fs(SHM_MIN_BYTES)) is None   # large enough
    assert shm_warning(1, True, statvfs=_fs(2**20)) is None          # one rank: no NCCL peers
    assert shm_warning(4, False, statvfs=_fs(2**20)) is None         # gloo ranks on the CPU

    def missing(path):
        raise FileNotFoundError(path)
    assert shm_warning(4, True, statvfs=missing) is None


def test_reads_the_real_filesystem(tmp_path):
    real = os.statvfs(tmp_path)
    expected = real.f_frsize * real.f_blocks < SHM_MIN_BYTES
    assert (shm_warning(2, True, str(tmp_path)) is not None) == expected
