"""What a reader trusts: latest() names only loadable steps, staging.verify / `stripefs ckpt verify`,
the manifest's own checksum, and manifest fields validated before they become local paths."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from stripefs import staging
from stripefs.staging import ChecksumError
from stripefs.staging._format import MANIFEST, manifest_bytes, parse_manifest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(70_000, generator=g), "step": step, "config": {"name": f"run-{step}", "lr": 0.5}}


def _save(cluster, testdir: str, sdir: str, step: int) -> str:
    url = f"stripefs:/{testdir}/step-{step:06d}"
    staging.save(_state(step), url, staging_dir=sdir, cluster=cluster.file, background_mover=False).wait(60)
    return url


@pytest.fixture
def sdir(tmp_path) -> str:
    return str(tmp_path / "staging")


# -- latest() and verify() -----------------------------------------------------------------------
def test_latest_skips_a_step_whose_file_is_short_or_missing(cluster, client, testdir, sdir):
    _save(cluster, testdir, sdir, 1)
    _save(cluster, testdir, sdir, 2)
    _save(cluster, testdir, sdir, 3)
    with client.open(f"{testdir}/step-000003/data-00000.bin", "wb") as f:  # committed, then cut short
        f.write(b"\0" * 4096)
    client.remove(f"{testdir}/step-000002/data-00000.bin")
    url = staging.latest(f"stripefs:/{testdir}", cluster=cluster.file)
    assert url is not None and url.endswith("step-000001")
    assert staging.load(url, cluster=cluster.file, prefer_local=False)["step"] == 1


def test_verify_checks_every_checksum(cluster, client, testdir, sdir):
    url = _save(cluster, testdir, sdir, 1)
    man = staging.verify(url, cluster=cluster.file)
    assert man["id"] and man["files"]
    with client.open(f"{testdir}/step-000001/data-00000.bin", "r+b") as f:
        f.pwrite(b"\xff" * 8, 100_000)  # same size: only a checksum can tell
    assert staging.latest(f"stripefs:/{testdir}", cluster=cluster.file) == url  # sizes only: cheap
    with pytest.raises(ChecksumError, match="data-00000.bin"):
        staging.verify(url, cluster=cluster.file)
    with pytest.raises(FileNotFoundError):
        staging.verify(f"stripefs:/{testdir}/step-000009", cluster=cluster.file)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stripefs", *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))


def test_cli_ckpt_verify(cluster, client, testdir, sdir):
    url = _save(cluster, testdir, sdir, 1)
    ok = _cli("ckpt", "verify", url, "--cluster", cluster.file)
    assert ok.returncode == 0 and "OK" in ok.stdout, ok.stdout + ok.stderr
    with client.open(f"{testdir}/step-000001/data-00000.bin", "r+b") as f:
        f.pwrite(b"\xff" * 8, 100_000)
    bad = _cli("ckpt", "verify", url, "--cluster", cluster.file)
    assert bad.returncode == 1 and "data-00000.bin" in bad.stderr and "CRC32C" in bad.stderr, bad.stdout + bad.stderr
    missing = _cli("ckpt", "verify", f"stripefs:/{testdir}/nothing", "--cluster", cluster.file)
    assert missing.returncode == 1 and "no checkpoint" in missing.stderr, missing.stderr


# -- the manifest's own checksum -------------------------------------------------------------------
def _rewrite_manifest(client, step_dir: str, edit) -> None:
    path = f"{step_dir}/{MANIFEST}"
    raw = client.read_bytes(path)
    client.write_bytes(path, edit(raw))


def test_manifest_checksum_protects_plain_values(cluster, client, testdir, sdir):
    url = _save(cluster, testdir, sdir, 1)
    step_dir = f"{testdir}/step-000001"
    _rewrite_manifest(client, step_dir, lambda raw: raw.replace(b'"run-1"', b'"run-2"'))
    for call in (lambda: staging.load(url, cluster=cluster.file, prefer_local=False),
                 lambda: staging.load(url, cluster=cluster.file, staging_dir=sdir),
                 lambda: staging.read_manifest(url, cluster=cluster.file)):
        with pytest.raises(ChecksumError, match="manifest"):
            call()
    assert staging.latest(f"stripefs:/{testdir}", cluster=cluster.file) is None


def test_manifest_checksum_unit():
    man = {"format": "stripefs-checkpoint", "version": 2, "id": "0" * 32, "kind": "state_dict", "step": 3,
           "files": [], "tensors": [], "tree": {"d": [["lr", 0.25], ["seed", 7]]}}
    raw = manifest_bytes(man)
    assert parse_manifest(raw, "x")["tree"] == man["tree"]
    for a, b in ((b"0.25", b"0.26"), (b'"seed",7', b'"seed",8'), (b'"step":3', b'"step":4')):
        assert a in raw
        with pytest.raises(ChecksumError, match="checksum"):
            parse_manifest(raw.replace(a, b), "x")
    # A version 1 manifest (written before the checksum existed) is still read.
    old = json.dumps({**man, "version": 1}).encode()
    assert parse_manifest(old, "x")["step"] == 3
    # A version 2 manifest whose checksum was cut off is not.
    with pytest.raises(ChecksumError):
        parse_manifest(json.dumps(man).encode(), "x")


# -- manifest fields are data, never paths -----------------------------------------------------------
def _encodings(man: dict) -> list[bytes]:
    """``man`` as written today (version 2, checksummed) and as a version 1 manifest (no checksum):
    a checksum proves only that the bytes are the ones written, not that the writer was honest."""
    return [manifest_bytes({**man, "version": 2}), json.dumps({**man, "version": 1}).encode()]


def _file(name: str) -> dict:
    return {"name": name, "size": 0, "crc32c": 0, "chunk": 4 << 20, "chunk_crc32c": [], "encoding": "raw"}


@pytest.mark.parametrize("field,value", [
    ("id", "/home/x"), ("id", "../../x"), ("id", "abc"), ("id", 5),
    ("name", "/etc/evil"), ("name", "../evil"), ("name", "a/b"), ("name", ""), ("name", ".."), ("name", "."),
    ("name", MANIFEST), ("name", "a\0b"), ("name", 7),
])
def test_hostile_manifest_fields_are_rejected(field, value):
    man = {"format": "stripefs-checkpoint", "version": 2, "id": "0" * 32, "kind": "dcp", "files": [_file("ok.bin")]}
    if field == "id":
        man["id"] = value
    else:
        man["files"].append(_file(value))
    for raw in _encodings(man):
        with pytest.raises(ChecksumError, match="manifest"):
            parse_manifest(raw, "x")


def test_hostile_tensor_index_is_rejected():
    man = {"format": "stripefs-checkpoint", "version": 2, "id": "0" * 32, "kind": "state_dict",
           "files": [_file("data-00000.bin")], "tree": {"t": 0},
           "tensors": [{"file": 3, "offset": 0, "nbytes": 4, "dtype": "float32", "shape": [1], "crc32c": 0}]}
    for raw in _encodings(man):
        with pytest.raises(ChecksumError, match="manifest"):
            parse_manifest(raw, "x")
    man["tensors"][0]["file"] = 0  # inside the file list, but past the end of the 0-byte file
    for raw in _encodings(man):
        with pytest.raises(ChecksumError, match="manifest"):
            parse_manifest(raw, "x")


def _plant_dcp_manifest(client, step_dir: str, man: dict) -> None:
    """A hostile manifest in the version 1 form (no checksum needed: any reader accepts the bytes)."""
    client.makedirs(step_dir)
    client.write_bytes(f"{step_dir}/{MANIFEST}", _encodings(man)[1])


def _open_reader(cluster, step_dir: str, tmp_path) -> bool:
    """True when the DCP reader refuses the manifest with ChecksumError."""
    try:
        staging.StagedStorageReader(f"stripefs:/{step_dir}", staging_dir=str(tmp_path / "s"), cluster=cluster.file)
    except ChecksumError:
        return True
    return False


def test_dcp_reader_never_deletes_a_directory_named_by_the_manifest(cluster, client, testdir, tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("keep me")
    client.write_bytes(f"{testdir}/payload.bin", b"abc")
    import crc32c

    rec = {**_file("payload.bin"), "size": 3, "crc32c": crc32c.crc32c(b"abc"), "chunk_crc32c": [crc32c.crc32c(b"abc")]}
    step_dir = f"{testdir}/step-1"
    _plant_dcp_manifest(client, step_dir, {"format": "stripefs-checkpoint", "version": 2, "id": str(victim),
                                           "kind": "dcp", "files": [rec]})
    client.write_bytes(f"{step_dir}/payload.bin", b"abc")
    refused = _open_reader(cluster, step_dir, tmp_path)
    assert (victim / "precious").exists(), "the DCP reader deleted a directory named by the manifest"
    assert refused


def test_dcp_reader_never_writes_outside_its_cache(cluster, client, testdir, tmp_path):
    evil = str(tmp_path / "evil.bin")
    client.makedirs(str(tmp_path))
    client.write_bytes(evil, b"abc")  # the same absolute path exists in the store
    import crc32c

    rec = {**_file(evil), "size": 3, "crc32c": crc32c.crc32c(b"abc"), "chunk_crc32c": [crc32c.crc32c(b"abc")]}
    step_dir = f"{testdir}/step-1"
    _plant_dcp_manifest(client, step_dir, {"format": "stripefs-checkpoint", "version": 2, "id": "a" * 32,
                                           "kind": "dcp", "files": [rec]})
    refused = _open_reader(cluster, step_dir, tmp_path)
    assert not os.path.exists(evil), "the DCP reader wrote to an absolute path named by the manifest"
    assert refused


@pytest.mark.parametrize("index", [-1, 1, "0", True, 0.0])
def test_tree_tensor_reference_must_name_a_listed_tensor(index):
    from stripefs.staging._format import decode_tree

    only = torch.zeros(1)
    assert decode_tree({"t": 0}, [only]) is only
    with pytest.raises(ValueError, match="tensor"):
        decode_tree({"l": [{"t": index}]}, [only])  # -1 would silently alias the last tensor


def test_load_names_a_short_file_before_allocating(cluster, client, testdir, sdir):
    url = _save(cluster, testdir, sdir, 1)
    with client.open(f"{testdir}/step-000001/data-00000.bin", "wb") as f:
        f.write(b"\0" * 4096)
    with pytest.raises(ChecksumError, match=r"data-00000.bin: committed size is 4096 bytes"):
        staging.load(url, cluster=cluster.file, prefer_local=False)
