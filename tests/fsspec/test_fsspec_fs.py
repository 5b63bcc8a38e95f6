"""``stripefs://`` beyond fsspec's suite: registration, listings, ranges, transactions, cache, errors."""

from __future__ import annotations

import errno
import io
import os
import random
from typing import Any

import fsspec
import pytest
from fsspec.callbacks import Callback

from stripefs.fsclient.fsspec import StripeFileSystem, StripeFsFile
from tests.conftest import TEST_CHUNK, metadata_requests
from tests.core.test_attr_leases import _watching


def test_registered_through_entry_point(cluster: Any, cluster_env: str) -> None:
    assert fsspec.get_filesystem_class("stripefs") is StripeFileSystem
    fs, path = fsspec.url_to_fs("stripefs://a/b.bin", cluster=cluster.file)
    assert isinstance(fs, StripeFileSystem) and path == "/a/b.bin"
    assert fs.unstrip_protocol(path) == "stripefs://a/b.bin"
    # No storage options: STRIPEFS_CLUSTER names the cluster.
    with fsspec.open("stripefs://fsspec-tests/env.txt", "w", skip_instance_cache=True) as f:
        f.write("via env")
    assert fs.cat_file("stripefs://fsspec-tests/env.txt") == b"via env"


def test_ls_and_info_contents(sfs: StripeFileSystem, root: str) -> None:
    sfs.pipe(f"{root}/a.bin", b"x" * 1000)
    sfs.makedirs(f"{root}/sub")
    sfs.client.symlink(f"{root}/a.bin", f"{root}/link")
    listing = {e["name"]: e for e in sfs.ls(root)}
    assert set(listing) == {f"{root}/a.bin", f"{root}/sub", f"{root}/link"}
    f, d, link = listing[f"{root}/a.bin"], listing[f"{root}/sub"], listing[f"{root}/link"]
    assert (f["type"], f["size"], f["mode"] & 0o170000) == ("file", 1000, 0o100000)
    assert (d["type"], d["size"]) == ("directory", 0)
    assert link["type"] == "file" and link["islink"] and link["destination"] == f"{root}/a.bin"
    assert abs(f["mtime"] - sfs.modified(f"{root}/a.bin").timestamp()) < 1e-3
    assert sorted(sfs.ls(root, detail=False)) == sorted(listing)
    sfs.invalidate_cache()
    assert sfs.info(f"stripefs:/{root}/a.bin") == f
    assert not sfs.dircache  # info answered without listing the parent
    assert sfs.ls(f"{root}/a.bin") == [f]  # ls of a file: its own entry, as fsspec defines
    assert sfs.info("/")["type"] == "directory"


def test_cat_file_ranges_and_open_modes(sfs: StripeFileSystem, root: str) -> None:
    data = os.urandom(TEST_CHUNK * 5 + 321)
    path = f"{root}/data"
    sfs.pipe(path, data)
    assert sfs.cat_file(path) == data
    for start, end in [(3, 4), (0, 10), (TEST_CHUNK - 5, TEST_CHUNK + 5), (-100, None), (None, -100), (10, 5), (len(data) + 9, None)]:
        assert sfs.cat_file(path, start, end) == data[start:end]
    with sfs.open(path, "ab") as f:
        f.write(b"tail")
    with sfs.open(path, "rb") as f:
        assert isinstance(f, StripeFsFile) and f.size == len(data) + 4 and f.readable() and not f.writable()
        f.seek(-4, io.SEEK_END)
        assert f.read() == b"tail" and f.loc == len(data) + 4
        assert f.pread(3, 1) == data[1:4]
    with pytest.raises(FileExistsError):
        sfs.open(path, "xb")
    with pytest.raises(ValueError):
        sfs.open(path, "r+b")
    with sfs.open(f"{root}/t.txt", "w", encoding="utf-8") as tf:
        tf.write("héllo\n")
    assert sfs.read_text(f"{root}/t.txt", encoding="utf-8") == "héllo\n"


def test_cat_ranges_matches_local_reference(sfs: StripeFileSystem, root: str) -> None:
    rng = random.Random(7)
    files = {f"{root}/f{i}": rng.randbytes(rng.randrange(1, TEST_CHUNK * 6)) for i in range(5)}
    for p, d in files.items():
        sfs.pipe(p, d)
    paths, starts, ends = [], [], []
    for _ in range(300):
        p = rng.choice(list(files))
        size = len(files[p])
        s = rng.randrange(-size, size + 10) if rng.random() < 0.1 else rng.randrange(0, size)
        e = rng.choice([None, s + rng.randrange(0, 200_000), -rng.randrange(1, size + 1)]) if rng.random() < 0.2 else s + rng.randrange(1, 70_000)
        paths.append(p)
        starts.append(s)
        ends.append(e)
    expected = [files[p][s:e] for p, s, e in zip(paths, starts, ends)]
    for gap in (0, 64 << 10, 4 << 20):  # no merging, the default, and merging nearly everything
        assert sfs.cat_ranges(paths, starts, ends, max_gap=gap) == expected
    assert sfs.cat_ranges([f"{root}/f0"] * 2, 0, 5) == [files[f"{root}/f0"][:5]] * 2


def test_cat_ranges_errors(sfs: StripeFileSystem, root: str) -> None:
    sfs.pipe(f"{root}/ok", b"0123456789")
    out = sfs.cat_ranges([f"{root}/ok", f"{root}/missing", root], [1, 0, 0], [4, 5, 5])
    assert out[0] == b"123"
    assert isinstance(out[1], FileNotFoundError) and isinstance(out[2], IsADirectoryError)
    out = sfs.cat_ranges([f"{root}/ok", f"{root}/bad\x00name"], [0, 0], [2, 2])  # a path no request can carry
    assert out[0] == b"01" and isinstance(out[1], OSError) and out[1].errno == errno.EINVAL
    with pytest.raises(FileNotFoundError):
        sfs.cat_ranges([f"{root}/missing"], [0], [1], on_error="raise")
    with pytest.raises(ValueError):
        sfs.cat_ranges([f"{root}/ok"], [0, 1], [1])


def test_cat_of_many_files_resolves_them_together(metered_cluster: Any) -> None:
    """``cat``/``cat_ranges`` of a batch of one directory's files resolve them in one
    ``stat_many`` (its listing, once several are missed), not a ``Resolve`` each."""
    fs = StripeFileSystem(cluster=metered_cluster.file, skip_instance_cache=True)
    try:
        paths = [f"/batch/f{i}" for i in range(24)]
        for i, p in enumerate(paths):
            fs.pipe_file(p, b"%03d" % i * 100)
        _watching(fs.client)
        resolves = metadata_requests(metered_cluster.file, "Resolve")
        stats = metadata_requests(metered_cluster.file, "StatMany")
        assert fs.cat_ranges(paths, 0, 3) == [b"%03d" % i for i in range(24)]
        assert fs.cat(paths[12:]) == {p: b"%03d" % (12 + i) * 100 for i, p in enumerate(paths[12:])}
        # The directory's own Resolve (without stat_many: 17 Resolves); a StatMany at most if
        # the listing's 5 s lease ran out on a slow machine.
        assert metadata_requests(metered_cluster.file, "Resolve") - resolves <= 2
        assert metadata_requests(metered_cluster.file, "StatMany") - stats <= 1
    finally:
        fs.client.close()


def test_transaction_commits_atomically_and_discards(sfs: StripeFileSystem, root: str) -> None:
    sfs.pipe(f"{root}/keep", b"old")
    with sfs.transaction:
        sfs.pipe(f"{root}/keep", b"new")
        with sfs.open(f"{root}/deep/new.bin", "wb") as f:
            f.write(b"x" * (TEST_CHUNK + 1))
        # Inside: nothing visible under the final names, old content intact.
        assert sfs.cat_file(f"{root}/keep") == b"old" and not sfs.exists(f"{root}/deep/new.bin")
    assert sfs.cat_file(f"{root}/keep") == b"new" and sfs.size(f"{root}/deep/new.bin") == TEST_CHUNK + 1
    with pytest.raises(RuntimeError):
        with sfs.transaction:
            sfs.pipe(f"{root}/keep", b"discarded")
            sfs.pipe(f"{root}/never", b"discarded")
            raise RuntimeError("abort")
    assert sfs.cat_file(f"{root}/keep") == b"new" and not sfs.exists(f"{root}/never")
    assert not [n for n in sfs.find(root, withdirs=True) if "stripefs-tx" in n]  # no temporary left
    with pytest.raises(FileExistsError):
        with sfs.transaction:
            sfs.pipe(f"{root}/keep", b"x", mode="create")
    assert not sfs._intrans


def test_listing_cache_never_stale_after_own_writes(sfs: StripeFileSystem, root: str, cluster: Any, tmp_path: Any) -> None:
    def sizes() -> dict[str, int]:
        return {os.path.basename(e["name"]): e["size"] for e in sfs.ls(root)}

    sfs.pipe(f"{root}/a", b"1")
    assert sizes() == {"a": 1} and root in sfs.dircache
    with sfs.open(f"{root}/a", "ab") as f:
        f.write(b"23")
    assert sizes() == {"a": 3}
    sfs.pipe(f"{root}/a", b"123456")
    sfs.cp_file(f"{root}/a", f"{root}/b")
    assert sizes() == {"a": 6, "b": 6}
    sfs.mv(f"{root}/b", f"{root}/c")
    (tmp_path / "local").write_bytes(b"x" * 10)
    sfs.put_file(str(tmp_path / "local"), f"{root}/d")
    assert sizes() == {"a": 6, "c": 6, "d": 10}
    sfs.rm(f"{root}/a")
    with sfs.transaction:
        sfs.pipe(f"{root}/c", b"")
    assert sizes() == {"c": 0, "d": 10}
    # Another client's write: close-to-open, seen after refresh (or the expiry time).
    with cluster.client() as other:
        other.write_bytes(f"{root}/e", b"abc")
    assert "e" not in sizes()
    assert {os.path.basename(e["name"]) for e in sfs.ls(root, refresh=True)} == {"c", "d", "e"}
    assert sfs.size(f"{root}/e") == 3  # info never uses the listing cache


def test_put_get_copy_move_with_callbacks(sfs: StripeFileSystem, root: str, tmp_path: Any) -> None:
    data = os.urandom(3 * TEST_CHUNK + 17)
    src = tmp_path / "src.bin"
    src.write_bytes(data)

    class Count(Callback):
        def __init__(self) -> None:
            super().__init__()
            self.total = 0

        def relative_update(self, inc: int = 1) -> None:
            self.total += inc

    up, down = Count(), Count()
    sfs.put_file(str(src), f"{root}/up.bin", callback=up)
    assert up.size == up.total == len(data)
    sfs.get_file(f"{root}/up.bin", str(tmp_path / "down.bin"), callback=down)
    assert down.total == len(data) and (tmp_path / "down.bin").read_bytes() == data
    sfs.cp_file(f"{root}/up.bin", f"{root}/copy/c.bin")
    assert sfs.cat_file(f"{root}/copy/c.bin") == data
    ino = sfs.info(f"{root}/copy")["ino"]
    key = sfs.ukey(f"{root}/copy/c.bin")
    sfs.mv(f"{root}/copy", f"{root}/moved")  # one rename: the directory keeps its inode
    assert sfs.info(f"{root}/moved")["ino"] == ino and not sfs.exists(f"{root}/copy")
    assert sfs.ukey(f"{root}/moved/c.bin") == key
    sfs.pipe(f"{root}/moved/c.bin", b"changed")
    assert sfs.ukey(f"{root}/moved/c.bin") != key and isinstance(sfs.checksum(f"{root}/moved/c.bin"), int)
    assert sfs.created(f"{root}/moved/c.bin").tzinfo is not None


def test_errors_map_to_builtin_exceptions(sfs: StripeFileSystem, root: str) -> None:
    sfs.pipe(f"{root}/f", b"x")
    sfs.makedirs(f"{root}/d/e")
    cases = [
        (FileNotFoundError, errno.ENOENT, lambda: sfs.cat_file(f"{root}/missing")),
        (FileNotFoundError, errno.ENOENT, lambda: sfs.mv(f"{root}/missing", f"{root}/x")),
        (FileExistsError, errno.EEXIST, lambda: sfs.pipe(f"{root}/f", b"y", mode="create")),
        (FileExistsError, errno.EEXIST, lambda: sfs.mkdir(f"{root}/d")),
        (FileExistsError, errno.EEXIST, lambda: sfs.makedirs(f"{root}/d")),
        (IsADirectoryError, errno.EISDIR, lambda: sfs.open(f"{root}/d", "rb")),
        (IsADirectoryError, errno.EISDIR, lambda: sfs.cat_file(f"{root}/d")),
        (IsADirectoryError, errno.EISDIR, lambda: sfs.rm(f"{root}/d")),
        (NotADirectoryError, errno.ENOTDIR, lambda: sfs.info(f"{root}/f/x")),
        (NotADirectoryError, errno.ENOTDIR, lambda: sfs.pipe(f"{root}/f/x", b"")),
        (OSError, errno.ENOTEMPTY, lambda: sfs.rmdir(f"{root}/d")),
        (OSError, errno.ENAMETOOLONG, lambda: sfs.pipe(f"{root}/{'n' * 300}", b"")),
    ]
    for exc_type, code, op in cases:
        with pytest.raises(exc_type) as info:
            op()
        assert info.value.errno == code, (op, info.value)
    host, port = sfs.client.config.metadata
    bad = StripeFileSystem(f"{host}:{port}", secret="not-the-secret", skip_instance_cache=True)
    with pytest.raises(PermissionError) as info:
        bad.ls("/")
    assert info.value.errno == errno.EACCES


def test_recursive_operations_never_descend_through_symlinks(sfs: StripeFileSystem, root: str, tmp_path: Any) -> None:
    # The usual "latest checkpoint" link: removing, listing or copying run1 must not reach run0.
    sfs.makedirs(f"{root}/run0/sub")
    sfs.makedirs(f"{root}/run1")
    sfs.pipe({f"{root}/run0/a.bin": b"a" * 10, f"{root}/run0/sub/b.bin": b"b" * 20, f"{root}/run1/c.bin": b"c" * 30})
    sfs.client.symlink(f"{root}/run0", f"{root}/run1/latest")
    sfs.client.symlink(f"{root}/run0/a.bin", f"{root}/run1/a-link")
    run1 = [f"{root}/run1/{n}" for n in ("a-link", "c.bin", "latest")]
    assert sfs.find(f"{root}/run1") == run1
    assert [w[0] for w in sfs.walk(f"{root}/run1")] == [f"{root}/run1"]
    assert sorted(sfs.walk(f"{root}/run1", topdown=False, detail=False))[0][2] == ["a-link", "c.bin", "latest"]
    assert sfs.info(f"{root}/run1/latest")["type"] == "directory"  # info and ls follow the link itself
    sfs.get(f"{root}/run1", str(tmp_path / "got"), recursive=True)
    assert not (tmp_path / "got" / "latest" / "sub").exists()
    sfs.copy(f"{root}/run1", f"{root}/run2", recursive=True)
    assert not sfs.exists(f"{root}/run2/latest/sub/b.bin") or sfs.client.lstat(f"{root}/run2/latest").is_symlink
    sfs.rm(f"{root}/run1", recursive=True)
    assert not sfs.exists(f"{root}/run1")
    assert sfs.cat({f"{root}/run0/a.bin", f"{root}/run0/sub/b.bin"}) == {
        f"{root}/run0/a.bin": b"a" * 10, f"{root}/run0/sub/b.bin": b"b" * 20}


def test_creation_applies_the_umask_and_a_transaction_keeps_mode_and_owner(sfs: StripeFileSystem, root: str) -> None:
    import stat

    old = os.umask(0o027)
    try:
        sfs.pipe(f"{root}/new", b"x")
        with sfs.open(f"{root}/deep/er/file", "wb") as f:  # auto_mkdir creates the parents
            f.write(b"y")
        sfs.mkdir(f"{root}/made")
        sfs.makedirs(f"{root}/p/q")
        sfs.touch(f"{root}/touched")
        with sfs.transaction:
            sfs.pipe(f"{root}/tx-new", b"z")
        perms = {n: stat.S_IMODE(sfs.info(f"{root}/{n}")["mode"])
                 for n in ("new", "deep", "deep/er", "deep/er/file", "made", "p", "p/q", "touched", "tx-new")}
        assert perms == {"new": 0o640, "deep": 0o750, "deep/er": 0o750, "deep/er/file": 0o640, "made": 0o750,
                         "p": 0o750, "p/q": 0o750, "touched": 0o640, "tx-new": 0o640}
        # A transaction replaces a file by renaming its new version over it: the new
        # version takes the original's mode and owner, as an in-place rewrite would keep them.
        for name, mode in (("keep-w", "wb"), ("keep-a", "ab")):
            sfs.pipe(f"{root}/{name}", b"old")
            sfs.client.chmod(f"{root}/{name}", 0o604)
            sfs.client.chown(f"{root}/{name}", 1234, 4321)
            with sfs.transaction:
                with sfs.open(f"{root}/{name}", mode) as f:
                    f.write(b"new")
            info = sfs.info(f"{root}/{name}")
            assert (stat.S_IMODE(info["mode"]), info["uid"], info["gid"]) == (0o604, 1234, 4321), name
        assert sfs.cat_file(f"{root}/keep-w") == b"new" and sfs.cat_file(f"{root}/keep-a") == b"oldnew"
    finally:
        os.umask(old)


def test_discarded_transaction_leaves_no_temporary_when_close_fails(sfs: StripeFileSystem, root: str) -> None:
    def failing_close(f: StripeFsFile) -> None:
        real = f.raw.close

        def close() -> None:
            real()
            raise OSError(errno.EIO, "injected close failure")

        f.raw.close = close  # type: ignore[method-assign]

    with pytest.raises(RuntimeError, match="abort"):
        with sfs.transaction:
            f1 = sfs.open(f"{root}/one", "wb")
            f1.write(b"1")
            failing_close(f1)
            f2 = sfs.open(f"{root}/two", "wb")
            f2.write(b"2")
            raise RuntimeError("abort")
    assert sfs.ls(root, refresh=True, detail=False) == []  # neither file nor any .stripefs-tx temporary
    # A commit whose close fails reports the failure and leaves nothing behind either.
    with pytest.raises(OSError, match="injected"):
        with sfs.transaction:
            f3 = sfs.open(f"{root}/three", "wb")
            f3.write(b"3")
            failing_close(f3)
    assert sfs.ls(root, refresh=True, detail=False) == []
    assert not sfs._intrans


def requests_sent(sfs: StripeFileSystem, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the metadata requests the filesystem's client sends from now on (still sent)."""
    sent: list[str] = []
    call = sfs.client._core.call

    def recording(msg: Any, *args: Any, **kwargs: Any) -> Any:
        sent.append(type(msg).__name__)
        return call(msg, *args, **kwargs)

    monkeypatch.setattr(sfs.client._core, "call", recording)
    return sent


def test_put_recursive_creates_its_files_in_one_batch(sfs: StripeFileSystem, root: str, tmp_path: Any,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "tree"
    want = {f"f{k:02d}.bin": os.urandom(k * 100) for k in range(30)}  # f00 is empty
    want.update({"sub/a.bin": os.urandom(TEST_CHUNK + 9), "sub/deeper/b.bin": b"b"})
    for rel, data in want.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    (src / "emptydir").mkdir()
    sent = requests_sent(sfs, monkeypatch)

    class Count(Callback):
        def __init__(self) -> None:
            super().__init__()
            self.done = 0

        def relative_update(self, inc: int = 1) -> None:
            self.done += inc

    progress = Count()
    sfs.put(str(src), f"{root}/up", recursive=True, callback=progress)
    assert sent.count("CreateMany") == 1 and "CreatePath" not in sent  # every file in one request
    assert progress.size == progress.done == len(want) + 4  # files and directories, as fsspec counts them
    for rel, data in want.items():
        assert sfs.cat_file(f"{root}/up/{rel}") == data
    assert sfs.isdir(f"{root}/up/emptydir")
    assert sorted(sfs.ls(f"{root}/up/sub", detail=False)) == [f"{root}/up/sub/a.bin", f"{root}/up/sub/deeper"]

    (src / "f29.bin").write_bytes(b"shorter")  # a second put overwrites: existing files are truncated
    sfs.put(str(src) + "/", f"{root}/up", recursive=True)
    assert sfs.cat_file(f"{root}/up/f29.bin") == b"shorter" and sfs.cat_file(f"{root}/up/f03.bin") == want["f03.bin"]
    with pytest.raises(FileExistsError):
        sfs.put(str(src) + "/", f"{root}/up", recursive=True, mode="create")


def test_put_recursive_makes_missing_parents_unless_told_not_to(sfs: StripeFileSystem, root: str,
                                                                tmp_path: Any, cluster: Any) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.bin").write_bytes(b"x")
    files = [str(tmp_path / "a" / "x.bin")]
    sfs.put(files, [f"{root}/new/deep/x.bin"], recursive=True)  # lists: no directory entries given
    assert sfs.cat_file(f"{root}/new/deep/x.bin") == b"x"
    strict = StripeFileSystem(cluster.file, auto_mkdir=False, skip_instance_cache=True)
    try:
        with pytest.raises(FileNotFoundError):
            strict.put(files, [f"{root}/other/x.bin"], recursive=True)
    finally:
        strict.client.close()


def test_rm_recursive_unlinks_its_files_in_batches(sfs: StripeFileSystem, root: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    files = [f"{root}/t/f{k:03d}" for k in range(250)] + [f"{root}/t/a/b/deep", f"{root}/t/a/x"]
    sfs.makedirs(f"{root}/t/a/b")
    sfs.makedirs(f"{root}/t/empty")
    sfs.client.create_many(files)
    sfs.pipe(f"{root}/keep/data", b"kept")
    sfs.client.symlink(f"{root}/keep", f"{root}/t/a/link")  # removed, never followed
    sent = requests_sent(sfs, monkeypatch)
    sfs.rm(f"{root}/t", recursive=True)
    assert sent.count("UnlinkMany") == 2 and "UnlinkPath" not in sent  # 253 names, 200 per request
    assert not sfs.exists(f"{root}/t") and sfs.cat_file(f"{root}/keep/data") == b"kept"
    assert sfs.ls(root, detail=False) == [f"{root}/keep"]
