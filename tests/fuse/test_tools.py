"""Ordinary tools on the mount: git, tar, dd/cp, fio with checksum verification."""

from __future__ import annotations

import filecmp
import hashlib
import os
import shutil

import pytest

from .fuse_helpers import sh

pytestmark = pytest.mark.fuse


def test_git_init_add_commit(mdir: str) -> None:
    repo = f"{mdir}/repo"
    os.mkdir(repo)
    for i in range(8):
        os.makedirs(f"{repo}/pkg{i % 4}", exist_ok=True)
        with open(f"{repo}/pkg{i % 4}/mod{i}.py", "w") as f:
            f.write(f"VALUE = {i}\n" * (i + 1))
    env = "GIT_AUTHOR_NAME=t GIT_AUTHOR_EMAIL=t@x GIT_COMMITTER_NAME=t GIT_COMMITTER_EMAIL=t@x"
    sh(f"git init -q . && git add -A && {env} git commit -q -m first", repo)
    with open(f"{repo}/pkg0/mod0.py", "a") as f:
        f.write("CHANGED = True\n")
    sh(f"git add -A && {env} git commit -q -m second", repo)
    sh("git fsck --full --no-progress", repo)
    log = sh("git log --oneline", repo).splitlines()
    assert len(log) == 2
    assert sh("git status --porcelain", repo).strip() == ""
    assert "CHANGED" in sh("git show HEAD:pkg0/mod0.py", repo)


def test_tar_in_and_out(mdir: str, tmp_path) -> None:
    src = tmp_path / "src"
    for d in ("a/b/c", "a/d", "e"):
        (src / d).mkdir(parents=True)
    for i, d in enumerate(("a", "a/b", "a/b/c", "a/d", "e")):
        (src / d / f"f{i}.bin").write_bytes(os.urandom(1000 * (i + 1) ** 3))
    (src / "e" / "empty").write_bytes(b"")
    os.symlink("../a/f0.bin", src / "e" / "link")
    os.chmod(src / "a" / "f0.bin", 0o600)
    sh(f"tar -C {src} -cf - . | tar -C {mdir} -xpf -", str(tmp_path))
    out = tmp_path / "out"
    out.mkdir()
    sh(f"tar -C {mdir} -cf - . | tar -C {out} -xpf -", str(tmp_path))
    cmp = filecmp.dircmp(src, out)
    _assert_same(cmp)
    assert os.readlink(out / "e" / "link") == "../a/f0.bin"
    assert os.stat(out / "a" / "f0.bin").st_mode & 0o777 == 0o600
    # tar's default format keeps whole seconds
    assert os.stat(f"{mdir}/a/b/c/f2.bin").st_mtime == int(os.stat(src / "a/b/c/f2.bin").st_mtime)


def _assert_same(cmp: filecmp.dircmp) -> None:
    assert not cmp.left_only and not cmp.right_only and not cmp.funny_files
    _, mismatch, errors = filecmp.cmpfiles(cmp.left, cmp.right, cmp.common_files, shallow=False)
    assert not mismatch and not errors
    for sub in cmp.subdirs.values():
        _assert_same(sub)


def test_dd_and_cp_large_file(mdir: str, tmp_path) -> None:
    # 96 MiB keeps the group fast on a shared 2-core machine; bench/fuse_bench.py does GiBs.
    local = tmp_path / "big"
    sh(f"head -c {96 << 20} /dev/urandom > {local}", str(tmp_path))
    want = hashlib.sha256(local.read_bytes()).hexdigest()
    sh(f"dd if={local} of={mdir}/big bs=1M conv=fsync status=none", mdir)
    shutil.copyfile(f"{mdir}/big", f"{mdir}/copy")
    sh(f"cp {mdir}/copy {tmp_path}/back", mdir)
    for p in (f"{mdir}/big", f"{mdir}/copy", f"{tmp_path}/back"):
        assert sh(f"sha256sum {p}", mdir).split()[0] == want


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed (apt-get install fio; `make sysdeps` does)")
@pytest.mark.parametrize("rw", ["write", "randwrite"])
def test_fio_verify_crc32c(mdir: str, rw: str) -> None:
    out = sh(
        f"fio --name=v --directory={mdir} --rw={rw} --bsrange=4k-256k --size=24m --numjobs=3 "
        "--verify=crc32c --do_verify=1 --verify_fatal=1 --ioengine=psync --group_reporting "
        "--randrepeat=0 --end_fsync=1 --output-format=terse",
        mdir,
        timeout=180,
    )
    fields = out.strip().splitlines()[-1].split(";")
    assert fields[4] == "0", f"fio reported error {fields[4]}"
