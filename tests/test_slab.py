"""The slab store: invisible private files, allocation and reuse, caps, a disk smaller
than a slab, byte movers."""

from __future__ import annotations

import errno
import mmap
import os
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest
from engine_helpers import mounted_tmpfs

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
    def no_space(fd: int, off: int, n: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    store = SlabStore(str(tmp_path), slab_bytes=4 * PAGE)
    monkeypatch.setattr(slab_mod.os, "posix_fallocate", no_space)
    assert store.allocate(PAGE) is None
    assert store.reserved_bytes == 0
    store.close()


# -- a disk smaller than a slab (NOTE [slab sizes on a full disk]) ----------------------

MiB = 1 << 20


class _SmallDisk:
    """A pretend filesystem of ``free`` bytes over the real one: ``posix_fallocate``
    past what is left raises ENOSPC (after taking what was left, as a real one may),
    and ``statvfs`` reports what is left (and a fixed inode count). Records the size of
    every reservation tried."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, free: int) -> None:
        self.free = free
        self.tried: list[int] = []
        self._held: dict[int, tuple[int, int]] = {}  # fd: (inode, bytes)
        real_fallocate = os.posix_fallocate

        def fallocate(fd: int, offset: int, length: int) -> None:
            self.tried.append(length)
            self._held.pop(fd, None)  # a slab file is reserved once: an old entry was closed
            left = self.left()
            if length > left:
                if left:
                    real_fallocate(fd, 0, left)  # half-reserved: closing must return it
                    self._held[fd] = (os.fstat(fd).st_ino, left)
                raise OSError(errno.ENOSPC, "No space left on device")
            real_fallocate(fd, offset, length)
            self._held[fd] = (os.fstat(fd).st_ino, length)

        def statvfs(path: str) -> object:  # inodes held still: other tests' files don't count
            return SimpleNamespace(f_bavail=self.left() // PAGE, f_frsize=PAGE, f_favail=1000)

        monkeypatch.setattr(slab_mod.os, "posix_fallocate", fallocate)
        monkeypatch.setattr(slab_mod.os, "statvfs", statvfs)

    def left(self) -> int:
        """Free bytes: ``free`` less what files still open hold."""
        held = 0
        for fd, (ino, n) in list(self._held.items()):
            try:
                alive = os.fstat(fd).st_ino == ino
            except OSError:
                alive = False
            if alive:
                held += n
            else:
                del self._held[fd]
        return self.free - held


def _fill(store: SlabStore, length: int, limit: int = 10_000) -> list[slab_mod.Extent]:
    """Allocate ``length`` bytes at a time until the store says no."""
    taken = []
    while (ext := store.allocate(length)) is not None:
        taken.append(ext)
        assert len(taken) < limit
    return taken


@pytest.mark.parametrize(
    ("free", "length", "sizes", "taken"),
    [
        (16 * MiB, MiB, [16 * MiB], 16 * MiB),
        (16 * MiB + (192 << 10), 64 << 10, [16 * MiB, 128 << 10, 64 << 10], 16 * MiB + (192 << 10)),
        (5 * MiB, 3 * MiB, [4 * MiB], 3 * MiB),  # 2 MiB left: less than one request
    ],
)
def test_a_disk_smaller_than_a_slab_takes_what_it_has(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    free: int,
    length: int,
    sizes: list[int],
    taken: int,
) -> None:
    """Slabs halve from slab_bytes down to the request until one fits."""
    store = SlabStore(str(tmp_path), slab_bytes=256 * MiB, io_method="buffered")
    disk = _SmallDisk(monkeypatch, free)
    extents = _fill(store, length)
    assert [s.size for s in store._slabs.values()] == sizes
    assert len(extents) * length == store.used_bytes == taken
    assert store.reserved_bytes == store.peak_reserved_bytes == sum(sizes) <= free
    assert disk.left() == free - sum(sizes)  # every failed try gave its space back
    store.close()


def test_a_full_disk_is_not_asked_again_and_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a failure, a request at least the size that failed costs no reservation,
    and the failed tries from one reset to the next stay within one halving ladder."""
    store = SlabStore(str(tmp_path), slab_bytes=256 * MiB, io_method="buffered")
    disk = _SmallDisk(monkeypatch, 16 * MiB)
    _fill(store, MiB)
    ladder = len(disk.tried)
    assert ladder <= 2 * 9  # 256 MiB .. 1 MiB: at most nine sizes, twice
    for _ in range(100):
        assert store.allocate(MiB) is None
        assert store.allocate(2 * MiB) is None
    assert len(disk.tried) == ladder  # refused without a reservation
    for n in (512 << 10, 256 << 10, 64 << 10, 4 << 10):  # smaller ones: each a few tries
        assert store.allocate(n) is None
    assert len(disk.tried) - ladder <= 9  # 512 KiB .. 4 KiB: one ladder in all
    assert max(disk.tried[ladder:]) <= 512 << 10
    store.close()


def test_slabs_grow_again_after_trim(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = SlabStore(str(tmp_path), slab_bytes=64 * MiB, io_method="buffered")
    disk = _SmallDisk(monkeypatch, 16 * MiB)
    for ext in _fill(store, MiB):
        store.free(ext)
    store.trim()
    assert store.reserved_bytes == 0
    disk.free = 128 * MiB
    disk.tried.clear()
    assert store.allocate(MiB) is not None
    assert disk.tried == [64 * MiB]  # the full slab_bytes, at once
    store.close()


def test_space_freed_by_others_is_taken_at_the_next_slab(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """statvfs reporting more free space ends the back-off; the next slab starts there."""
    store = SlabStore(str(tmp_path), slab_bytes=256 * MiB, io_method="buffered")
    disk = _SmallDisk(monkeypatch, 16 * MiB)
    _fill(store, MiB)
    disk.free += 6 * MiB  # someone deleted a file
    disk.tried.clear()
    assert len(_fill(store, MiB)) == 6
    assert disk.tried[0] == 6 * MiB  # one reservation of what statvfs reported
    assert [s.size for s in store._slabs.values()] == [16 * MiB, 6 * MiB]
    store.close()


def test_failed_slabs_leave_nothing_behind_and_lose_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Half-reserved files are closed at once (no descriptor, no name, no private
    folder kept), and the bytes in the slabs that did fit stay as written."""
    monkeypatch.setattr(slab_mod, "_O_TMPFILE", 0)  # the named fallback path too
    base = len(os.listdir("/proc/self/fd"))
    store = SlabStore(str(tmp_path), slab_bytes=256 * MiB, io_method="buffered")
    disk = _SmallDisk(monkeypatch, 3 * MiB + 8 * PAGE)
    taken = _fill(store, 4 * PAGE)
    assert len(taken) * 4 * PAGE == 3 * MiB + 8 * PAGE
    for i, ext in enumerate(taken):
        store.write(ext, 0, memoryview(bytes([i % 251]) * ext.length))
    for _ in range(20):
        assert store.allocate(PAGE) is None
    assert len(os.listdir("/proc/self/fd")) == base + len(store._slabs)
    assert os.listdir(tmp_path) == []
    assert disk.left() == 0
    for i, ext in enumerate(taken):
        out = bytearray(ext.length)
        store.read(ext, 0, memoryview(out))
        assert out == bytes([i % 251]) * ext.length
    store.close()
    assert len(os.listdir("/proc/self/fd")) == base


@pytest.mark.parametrize(
    ("limit", "expected"),
    [(10 * MiB, [10 * MiB]), (40 * MiB, [10 * MiB, 5 * MiB, MiB])],  # halving from the cap
)
def test_the_disk_cap_and_a_small_disk_together(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limit: int, expected: list[int]
) -> None:
    store = SlabStore(
        str(tmp_path), slab_bytes=256 * MiB, io_method="buffered", disk_bytes_limit=limit
    )
    _SmallDisk(monkeypatch, 16 * MiB)
    _fill(store, MiB)
    assert [s.size for s in store._slabs.values()] == expected
    assert store.peak_reserved_bytes == sum(expected) <= limit
    store.close()


def test_other_reservation_errors_still_raise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(fd: int, off: int, n: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    base = len(os.listdir("/proc/self/fd"))
    store = SlabStore(str(tmp_path), slab_bytes=16 * PAGE, io_method="buffered")
    monkeypatch.setattr(slab_mod.os, "posix_fallocate", broken)
    with pytest.raises(OSError, match="Input/output"):
        store.allocate(PAGE)
    assert len(os.listdir("/proc/self/fd")) == base
    store.close()


def test_no_inode_left_is_a_full_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC from creating the file: None, and no file is tried again until space returns."""
    store = SlabStore(str(tmp_path), slab_bytes=16 * PAGE, io_method="buffered")
    opened: list[str] = []

    def no_inode(directory: str, *, direct: bool) -> int:
        opened.append(directory)
        raise OSError(errno.ENOSPC, "No space left on device")

    real_open = slab_mod.open_scratch_file
    monkeypatch.setattr(slab_mod, "open_scratch_file", no_inode)
    inodes = [100]
    monkeypatch.setattr(
        slab_mod.os,
        "statvfs",
        lambda d: SimpleNamespace(f_bavail=1 << 20, f_frsize=PAGE, f_favail=inodes[0]),
    )
    assert store.allocate(PAGE) is None
    assert store.allocate(PAGE) is None
    assert len(opened) == 1
    inodes[0] += 1  # a file was deleted
    monkeypatch.setattr(slab_mod, "open_scratch_file", real_open)
    assert store.allocate(PAGE) is not None
    store.close()


def _used(path: Path) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


@pytest.mark.parametrize("length", [MiB, 64 << 10])
def test_a_16_mib_tmpfs_takes_16_mib_of_256_mib_slabs(tmp_path: Path, length: int) -> None:
    with mounted_tmpfs(tmp_path / "small", "16m") as small:
        store = SlabStore(str(small), slab_bytes=256 * MiB)
        taken = _fill(store, length)
        assert len(taken) * length >= 15 * MiB
        assert store.reserved_bytes == _used(small) <= 16 * MiB
        for i, ext in enumerate(taken):
            page = mmap.mmap(-1, length)
            page.write(bytes([i % 251 + 1]) * length)
            store.write(ext, 0, memoryview(page))
        for i, ext in enumerate(taken):
            out = mmap.mmap(-1, length)
            store.read(ext, 0, memoryview(out))
            assert out[:] == bytes([i % 251 + 1]) * length
        assert list(small.iterdir()) == []
        store.close()
        assert _used(small) == 0


def test_a_tmpfs_gives_back_what_others_free(tmp_path: Path) -> None:
    """Real statvfs: a file deleted by someone else is taken at the next slab."""
    with mounted_tmpfs(tmp_path / "small", "16m") as small:
        other = small / "other"
        other.write_bytes(b"\0" * (8 * MiB))
        store = SlabStore(str(small), slab_bytes=256 * MiB)
        first = len(_fill(store, MiB))
        assert first >= 7
        other.unlink()
        assert len(_fill(store, MiB)) >= 7
        assert store.reserved_bytes >= 15 * MiB
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
    with pytest.raises(ValueError, match="cannot be used"):  # ENAMETOOLONG from stat
        prepare_save_dir(str(tmp_path / ("x" * 300) / "acts"))
    with pytest.raises(ValueError, match="pass a folder"):  # os's bare "embedded null byte"
        prepare_save_dir(str(tmp_path / "nul\0byte"))


def test_prepare_save_dir_under_an_unreadable_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folder above it this user may not enter: stat raises EACCES (root passes any
    mode bits, so the refusal is simulated)."""
    real = Path.is_symlink

    def refused(self: Path) -> bool:
        if "locked" in self.parts:
            raise PermissionError(errno.EACCES, "Permission denied")
        return real(self)

    monkeypatch.setattr(Path, "is_symlink", refused)
    with pytest.raises(ValueError, match="Permission denied"):
        prepare_save_dir(str(tmp_path / "locked" / "inner" / "acts"))


def test_prepare_save_dir_unwritable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def read_only(directory: str, *, direct: bool) -> int:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(slab_mod, "open_scratch_file", read_only)
    with pytest.raises(ValueError, match="read-only filesystem"):
        prepare_save_dir(str(tmp_path))
