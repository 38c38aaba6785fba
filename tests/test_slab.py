"""The slab store: invisible private files, allocation and reuse, caps, byte movers."""

from __future__ import annotations

import mmap
import os
import stat
from pathlib import Path

import pytest

from prefetch_offload import slab as slab_mod
from prefetch_offload.slab import SlabStore, open_scratch_file, prepare_save_dir

PAGE = 4096


def test_slab_files_are_never_visible(tmp_path: Path) -> None:
    store = SlabStore(str(tmp_path), slab_bytes=16 * PAGE)
    assert store.allocate(PAGE) is not None
    assert os.listdir(tmp_path) == []
    store.close()


def test_fallback_files_are_private_and_unlinked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without O_TMPFILE: a 0700 private subfolder, O_EXCL|O_NOFOLLOW 0600, both removed."""
    monkeypatch.setattr(slab_mod, "_O_TMPFILE", 0)
    seen: list[tuple[str, int, int]] = []
    real_unlink = os.unlink

    def spy_unlink(path: str) -> None:
        st = os.lstat(path)
        parent = os.stat(os.path.dirname(path))
        seen.append((path, stat.S_IMODE(st.st_mode), stat.S_IMODE(parent.st_mode)))
        real_unlink(path)

    monkeypatch.setattr(slab_mod.os, "unlink", spy_unlink)
    fd = open_scratch_file(str(tmp_path), direct=False)
    os.write(fd, b"still usable")
    os.close(fd)
    assert len(seen) == 1
    path, mode, parent_mode = seen[0]
    assert (mode, parent_mode) == (0o600, 0o700)
    assert os.path.dirname(os.path.dirname(path)) == str(tmp_path)  # save_dir/<private>/file
    assert os.listdir(tmp_path) == []


def test_fallback_refuses_to_follow_a_planted_symlink(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(slab_mod, "_O_TMPFILE", 0)
    monkeypatch.setattr(slab_mod.secrets, "token_hex", lambda n: "fixed")
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    made: list[str] = []
    real_mkdtemp = slab_mod.tempfile.mkdtemp

    def planting_mkdtemp(**kw: str) -> str:
        d = real_mkdtemp(**kw)
        os.symlink(victim, os.path.join(d, "fixed.slab"))  # an attacker races us
        made.append(d)
        return d

    monkeypatch.setattr(slab_mod.tempfile, "mkdtemp", planting_mkdtemp)
    with pytest.raises(FileExistsError):
        open_scratch_file(str(tmp_path), direct=False)
    assert victim.read_text() == "keep me"
    os.unlink(os.path.join(made[0], "fixed.slab"))
    os.rmdir(made[0])


def test_space_is_reused_first_fit_and_coalesced(tmp_path: Path) -> None:
    store = SlabStore(str(tmp_path), slab_bytes=8 * PAGE)
    a = store.allocate(2 * PAGE)
    b = store.allocate(2 * PAGE)
    c = store.allocate(4 * PAGE)
    assert a and b and c and store.reserved_bytes == 8 * PAGE
    store.free(a)
    store.free(b)  # coalesces with a: 4 free pages at offset 0
    d = store.allocate(4 * PAGE)
    assert d is not None and (d.slab, d.offset) == (a.slab, 0)
    assert store.reserved_bytes == 8 * PAGE  # no new slab
    e = store.allocate(PAGE)  # full: a second slab
    assert e is not None and e.slab != a.slab
    assert store.reserved_bytes == 16 * PAGE
    store.close()


def test_oversized_tensor_gets_its_own_slab(tmp_path: Path) -> None:
    store = SlabStore(str(tmp_path), slab_bytes=4 * PAGE)
    big = store.allocate(10 * PAGE)
    assert big is not None and store.reserved_bytes == 10 * PAGE
    store.free(big)
    again = store.allocate(10 * PAGE)
    assert again is not None and again.slab == big.slab  # kept for the next step
    store.free(again)
    store.trim()
    assert store.reserved_bytes == 0
    store.close()


def test_disk_limit_returns_none(tmp_path: Path) -> None:
    store = SlabStore(str(tmp_path), slab_bytes=4 * PAGE, disk_bytes_limit=4 * PAGE)
    assert store.allocate(4 * PAGE) is not None
    assert store.allocate(PAGE) is None
    store.close()


def test_full_disk_returns_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    def no_space(fd: int, off: int, n: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    store = SlabStore(str(tmp_path), slab_bytes=4 * PAGE)
    monkeypatch.setattr(slab_mod.os, "posix_fallocate", no_space)
    assert store.allocate(PAGE) is None
    assert store.reserved_bytes == 0
    store.close()


@pytest.mark.parametrize("io_method", ["buffered", "mmap"])
def test_byte_movers_round_trip(tmp_path: Path, io_method: str) -> None:
    store = SlabStore(str(tmp_path), slab_bytes=4 * PAGE, io_method=io_method)
    ext = store.allocate(2 * PAGE)
    assert ext is not None
    data = bytes(range(256)) * 32
    store.write(ext, 0, memoryview(data))
    out = bytearray(len(data))
    store.read(ext, 0, memoryview(out))
    assert out == data
    store.close()


def test_direct_rejected_where_unsupported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slab_mod, "direct_io_supported", lambda d: False)
    with pytest.raises(ValueError, match="io_method='auto'"):
        SlabStore(str(tmp_path), slab_bytes=PAGE, io_method="direct")
    assert SlabStore(str(tmp_path), slab_bytes=PAGE).io_method == "buffered"


def test_tmpfs_works_with_whatever_it_supports() -> None:
    """Older kernels refuse O_DIRECT on tmpfs (auto picks buffered); newer ones accept it."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    store = SlabStore("/dev/shm", slab_bytes=PAGE)
    assert store.io_method in ("direct", "buffered")
    ext = store.allocate(PAGE)
    assert ext is not None
    page = mmap.mmap(-1, PAGE)
    page.write(b"x" * PAGE)
    store.write(ext, 0, memoryview(page))
    out = mmap.mmap(-1, PAGE)
    store.read(ext, 0, memoryview(out))
    assert out[:] == b"x" * PAGE
    store.close()


def test_prepare_save_dir_errors(tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="not a folder"):
        prepare_save_dir(str(a_file))
    with pytest.raises(ValueError, match="cannot create"):
        prepare_save_dir(str(a_file / "sub"))
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "missing")
    with pytest.raises(ValueError, match="dangling symlink"):
        prepare_save_dir(str(dangling))
    created = prepare_save_dir(str(tmp_path / "new" / "dir"))
    assert created.is_dir() and stat.S_IMODE(created.stat().st_mode) == 0o700


def test_prepare_save_dir_unwritable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    def read_only(directory: str, *, direct: bool) -> int:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(slab_mod, "open_scratch_file", read_only)
    with pytest.raises(ValueError, match="read-only filesystem"):
        prepare_save_dir(str(tmp_path))
