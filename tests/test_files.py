"""hpcdl.fs.files.read_regular: a whole-file read that a symlink to /dev/zero, a FIFO or a huge file
cannot turn into a hang or an exhausted memory."""

from __future__ import annotations

import errno
import os

import pytest

from hpcdl.fs.files import read_regular


def test_a_regular_file_is_read_whole(tmp_path):
    path = tmp_path / "a.json"
    path.write_bytes(b"x" * 1000)
    assert read_regular(path, 1000) == b"x" * 1000


@pytest.mark.parametrize("make", ["dev_zero", "fifo", "directory"])
def test_what_is_not_a_regular_file_is_refused(tmp_path, make):
    path = tmp_path / "f"
    if make == "dev_zero":
        path.symlink_to("/dev/zero")
    elif make == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()
    with pytest.raises(OSError) as info:
        read_regular(path)
    assert info.value.errno in (errno.EINVAL, errno.EISDIR) and info.value.filename == str(path)


def test_a_larger_file_is_refused_or_read_by_its_tail(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b"a" * 10 + b"b" * 10)
    with pytest.raises(OSError) as info:
        read_regular(path, 15)
    assert info.value.errno == errno.EFBIG and "larger than 15 bytes" in info.value.strerror
    assert read_regular(path, 15, tail=True) == b"a" * 5 + b"b" * 10


def test_a_missing_file_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_regular(tmp_path / "none")


def test_several_files_are_published_together_or_not_at_all(tmp_path):
    from hpcdl.fs.files import atomic_paths

    names = [tmp_path / f"{split}.h5" for split in ("train", "val", "test")]
    for name in names:
        name.write_text("old")
    with pytest.raises(OSError):
        with atomic_paths(names) as temporaries:
            temporaries[0].write_text("new")
            raise OSError(28, "No space left on device")
    assert [n.read_text() for n in names] == ["old"] * 3 and sorted(p.name for p in tmp_path.iterdir()) == sorted(
        n.name for n in names)
    with atomic_paths(names) as temporaries:
        for tmp in temporaries:
            assert not (tmp_path / "train.h5").read_text() == "new"
            tmp.write_text("new")
    assert [n.read_text() for n in names] == ["new"] * 3 and len(list(tmp_path.iterdir())) == 3
