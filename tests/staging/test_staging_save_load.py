"""Issue 19, checkpoint side: saves that stall, values that save but never load, device maps,
tied views, zstd load memory and the process umask.

Each test is bounded to a few seconds; nothing here needs a GPU (device moves use ``meta``).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import os
import stat
import time
import tracemalloc

import numpy as np
import pytest
import torch

from stripefs import staging
from stripefs.staging import MoverOptions
from stripefs.staging._format import parse_manifest
from stripefs.staging._snapshot import POOL


@pytest.fixture
def sdir(tmp_path) -> str:
    return str(tmp_path / "staging")


def _local(sdir: str, h: staging.SaveHandle) -> str:
    """The staged step directory of a save (``load`` reads it without the store)."""
    return os.path.join(sdir, "steps", h.id)


def _stage(state, sdir, cluster, **kw) -> staging.SaveHandle:
    """Save ``state`` locally only and wait until the staged copy is durable."""
    h = staging.save(state, "stripefs://t19/step-1", staging_dir=sdir, cluster=cluster.file, upload=False,
                     background_mover=False, **kw)
    assert h.wait(60, durable="local")
    h._done.wait(60)
    return h


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


# -- 1. the second save must not wait for the first upload ----------------------------------------

def test_second_save_does_not_wait_for_first_upload(cluster, testdir, sdir):
    """256 MiB at 50 MB/s in the report; here 32 MiB at 8 MB/s: the upload takes >= 4 s."""
    POOL.clear()
    opts = MoverOptions(cluster=cluster.file, bandwidth=8e6, piece=4 << 20, verify=False)
    state = {"w": torch.randn(8 << 20)}  # 32 MiB
    t = time.monotonic()
    h1 = staging.save(state, f"stripefs:/{testdir}/step-1", staging_dir=sdir, cluster=cluster.file, options=opts,
                      background_mover=False)
    first = time.monotonic() - t
    t = time.monotonic()
    h2 = staging.save(state, f"stripefs:/{testdir}/step-2", staging_dir=sdir, cluster=cluster.file, options=opts,
                      background_mover=False)
    second = time.monotonic() - t
    first_uploaded = h1.globally_durable
    # Before: the second save blocked until the first upload had finished (~4 s here).
    assert second < 2.0, f"second save blocked {second:.2f}s (first {first:.2f}s)"
    assert not first_uploaded, "the first upload should still be running (throttled)"
    assert h1.snapshot_wait_s == 0 and not h1.extra_buffer
    assert h2.snapshot_wait_s <= second and not h2.extra_buffer
    assert h1.wait(60) and h2.wait(60)
    assert torch.equal(staging.load(f"stripefs:/{testdir}/step-2", cluster=cluster.file, prefer_local=False)["w"],
                       state["w"])


def test_busy_buffer_timeout_or_extra_buffer(cluster, sdir):
    """No buffer free: wait at most ``snapshot_timeout``, or take another under ``snapshot_memory``."""
    POOL.clear()
    state = {"w": torch.randn(1 << 20)}  # 4 MiB: one 64 MiB pooled buffer
    # Both buffers of double buffering busy: stand for two previous saves still writing locally.
    held = [POOL.acquire(4 << 20) for _ in range(POOL.max_buffers)]
    try:
        t = time.monotonic()
        with pytest.raises(TimeoutError):
            staging.save(state, "stripefs://t19/step-1", staging_dir=sdir, cluster=cluster.file, upload=False,
                         background_mover=False, snapshot_timeout=0.3)
        assert 0.25 <= time.monotonic() - t < 5.0
        h = staging.save(state, "stripefs://t19/step-2", staging_dir=sdir, cluster=cluster.file, upload=False,
                         background_mover=False, snapshot_timeout=0.3, snapshot_memory=256 << 20)
        assert h.extra_buffer and h.snapshot_wait_s < 0.25
        h.wait(60, durable="local")
        h._done.wait(60)
        assert torch.equal(staging.load(_local(sdir, h))["w"], state["w"])
    finally:
        for buf in held:
            POOL.release(buf)
        POOL.clear()


# -- 2. save() accepts only what load() gives back -----------------------------------------------

Point = collections.namedtuple("Point", "x y")


class Opaque:
    def __init__(self, x: int):
        self.x = x


def test_values_round_trip_exactly(cluster, sdir):
    values = {
        "f32": np.float32(1.5), "i64": np.int64(-3), "b": np.bool_(True), "f64": np.float64(0.25), "u8": np.uint8(7),
        "dd": collections.defaultdict(list, a=[1, 2]), "ns": argparse.Namespace(lr=0.1, name="x"),
        "dt": datetime.datetime(2024, 5, 6, 7, 8, 9, 10), "dtz": datetime.datetime(2024, 5, 6, tzinfo=datetime.timezone.utc),
        "date": datetime.date(2024, 5, 6), "time": datetime.time(1, 2, 3, 4), "td": datetime.timedelta(days=2, microseconds=5),
        "slice": slice(1, None, 2), "range": range(0, 10, 3), "fs": frozenset({1, 2, "a"}), "set": {3, 4},
    }
    out = staging.load(_local(sdir, _stage(values, sdir, cluster)))
    for k, v in values.items():
        assert type(out[k]) is type(v) and out[k] == v, k
    assert out["dd"].default_factory is list and out["dd"]["new"] == []


def test_dtypes_round_trip(cluster, sdir):
    names = ["complex32", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2", "float8_e4m3fn",
             "uint4", "int4", "bits8"]
    state = {n: torch.randint(0, 256, (6, 4), dtype=torch.uint8).view(getattr(torch, n))
             for n in names if getattr(torch, n, None) is not None and getattr(torch, n).itemsize == 1}
    state["complex32"] = torch.randn(5, dtype=torch.complex64).to(torch.complex32)
    out = staging.load(_local(sdir, _stage(state, sdir, cluster)))
    for k, v in state.items():
        assert _same_bytes(out[k], v), k


@pytest.mark.parametrize("value", [Point(1, 2), Opaque(3), np.array(["a", "b"]), np.dtype("float32"),
                                   np.zeros(3, dtype=">f4"), collections.defaultdict(lambda: 0)],
                         ids=["namedtuple", "class", "str-array", "np-dtype", "big-endian", "dd-lambda"])
def test_unloadable_value_refused_at_save_naming_its_key(cluster, sdir, value):
    state = {"ok": torch.ones(2), "cfg": {"inner": [0, value]}}
    with pytest.raises(TypeError, match=r"cfg.*inner.*1"):
        staging.save(state, "stripefs://t19/step-1", staging_dir=sdir, cluster=cluster.file, upload=False,
                     background_mover=False)


# -- 3. map_location moves tensors, never numpy arrays -------------------------------------------

def test_map_location_keeps_numpy_arrays(cluster, sdir):
    state = {"np": np.arange(6, dtype=np.float32).reshape(2, 3), "t": torch.ones(3), "tied": None}
    state["tied"] = state["t"]
    out = staging.load(_local(sdir, _stage(state, sdir, cluster)), map_location=torch.device("meta"))
    assert isinstance(out["np"], np.ndarray) and (out["np"] == state["np"]).all()
    assert out["t"].device.type == "meta" and out["tied"] is out["t"]
    out = staging.load(_local(sdir, _stage(state, sdir, cluster)), map_location="meta")
    assert isinstance(out["np"], np.ndarray) and out["t"].device.type == "meta"


# -- 4. tied views, conj and neg views -----------------------------------------------------------

def test_tied_views_saved_once_and_restored_tied(cluster, sdir):
    w = torch.randn(64, 32)
    state = {"a": w.detach(), "b": w.detach(), "t": w.t(), "row": w[3], "other": torch.randn(10)}
    h = _stage(state, sdir, cluster)
    with open(os.path.join(_local(sdir, h), "manifest.json"), "rb") as f:
        man = parse_manifest(f.read(), "manifest.json")
    stored = sum(e["nbytes"] for e in man["tensors"] if "base" not in e)
    assert stored < 2 * w.nbytes, "the shared storage was written more than once"
    for loc in (None, "cpu"):
        out = staging.load(_local(sdir, h), map_location=loc)
        for k in ("a", "b", "t", "row"):
            assert torch.equal(out[k], state[k]) and out[k].stride() == state[k].stride(), k
        ptr = out["a"].untyped_storage().data_ptr()
        assert all(out[k].untyped_storage().data_ptr() == ptr for k in ("b", "t", "row"))
        out["a"][3, 0] = 123.0  # one storage: the write shows through every view
        assert out["b"][3, 0] == 123.0 and out["t"][0, 3] == 123.0 and out["row"][0] == 123.0
    meta = staging.load(_local(sdir, h), map_location="meta")
    assert meta["t"].device.type == "meta" and meta["t"].shape == w.t().shape and meta["t"].stride() == w.t().stride()


def test_conj_and_neg_views_are_saved_resolved(cluster, sdir):
    z = torch.randn(5, dtype=torch.complex64)
    state = {"z": z, "conj": z.conj(), "neg": z.conj().imag}
    assert state["conj"].is_conj() and state["neg"].is_neg()
    out = staging.load(_local(sdir, _stage(state, sdir, cluster)))
    assert torch.equal(out["conj"], z.conj().resolve_conj()) and not out["conj"].is_conj()
    assert torch.equal(out["neg"], -z.imag) and torch.equal(out["z"], z)


# -- 5. zstd loads: at most one extra copy of a shard --------------------------------------------

def test_zstd_load_holds_at_most_one_extra_copy(cluster, sdir, monkeypatch):
    pytest.importorskip("zstandard")
    state = {"r": torch.randn(6 << 20)}  # 24 MiB, incompressible: one shard
    raw = state["r"].nbytes
    h = _stage(state, sdir, cluster, compress="zstd")
    allocated = [0]
    real_empty = torch.empty

    def counting_empty(*a, **kw):  # every torch allocation the loader makes, output included
        t = real_empty(*a, **kw)
        allocated[0] += t.nbytes
        return t

    monkeypatch.setattr(torch, "empty", counting_empty)
    tracemalloc.start()
    try:
        out = staging.load(_local(sdir, h))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert torch.equal(out["r"], state["r"])
    extra = peak + allocated[0] - raw  # beyond the returned tensor's own memory
    assert extra <= raw, f"zstd load used {extra / raw:.2f} extra copies of the shard"


def test_loading_many_small_tensors_holds_a_fixed_budget_beyond_the_state(cluster, sdir, monkeypatch):
    """A run of small tensors is read into one scratch buffer: it is cut at ``RUN_BYTES``, so
    however large the state, the loader's scratch is at most ``READERS`` x ``RUN_BYTES``."""
    from stripefs.staging import _load

    budget = getattr(_load, "RUN_BYTES", 8 << 20)
    state = {f"t{i}": torch.full((4096,), float(i)) for i in range(1024)}  # 16 MiB of 16 KiB tensors, one file
    h = _stage(state, sdir, cluster)
    largest = [0]
    real_empty = torch.empty

    def watching_empty(*a, **kw):  # every torch allocation the loader makes, output included
        t = real_empty(*a, **kw)
        largest[0] = max(largest[0], t.nbytes)
        return t

    monkeypatch.setattr(torch, "empty", watching_empty)
    out = staging.load(_local(sdir, h))
    assert all(torch.equal(out[k], v) for k, v in state.items())
    assert largest[0] <= budget, f"a {largest[0] >> 20} MiB scratch buffer for 16 KiB tensors"


# -- 6. the process umask ----------------------------------------------------------------------

def test_files_and_directories_respect_umask(cluster, client, testdir, sdir):
    old = os.umask(0o007)
    try:
        url = f"stripefs:/{testdir}/run/step-1"
        h = staging.save({"w": torch.ones(10)}, url, staging_dir=sdir, cluster=cluster.file, background_mover=False)
        assert h.wait(60)
    finally:
        os.umask(old)
    for path in (f"{testdir}/run", f"{testdir}/run/step-1"):
        assert stat.S_IMODE(client.stat(path).mode) == 0o770, path
    for name in client.listdir(f"{testdir}/run/step-1"):
        assert stat.S_IMODE(client.stat(f"{testdir}/run/step-1/{name}").mode) == 0o660, name
    local = _local(sdir, h)
    assert stat.S_IMODE(os.stat(local).st_mode) == 0o770
    for name in os.listdir(local):
        assert stat.S_IMODE(os.stat(os.path.join(local, name)).st_mode) == 0o660, name


def test_manifest_version_and_hostile_views(cluster, sdir):
    """Plain checkpoints stay version 2 (older readers read them); views need 3 and are checked."""
    import json

    from stripefs.staging import ChecksumError
    from stripefs.staging._format import manifest_bytes

    def manifest(h):
        with open(os.path.join(_local(sdir, h), "manifest.json"), "rb") as f:
            return parse_manifest(f.read(), "manifest.json")

    assert manifest(_stage({"w": torch.ones(4), "cfg": {"lr": 0.1}}, sdir, cluster))["version"] == 2
    w = torch.arange(12.0).reshape(3, 4)
    man = manifest(_stage({"a": w, "t": w.t()}, sdir, cluster))
    assert man["version"] == 3 and man["tensors"][1]["base"] == 2
    for change in ({"byte_offset": 4}, {"stride": [1, 5]}, {"base": 0}, {"base": 7}, {"byte_offset": 2}):
        bad = json.loads(json.dumps(man))
        bad["tensors"][1].update(change)
        with pytest.raises(ChecksumError, match="malformed manifest"):
            parse_manifest(manifest_bytes(bad), "hostile")


# -- 7. parameters and memory formats ------------------------------------------------------------

def _layout_state() -> dict:
    p = torch.nn.Parameter(torch.randn(8, 4))
    return {
        "p": p, "p_again": p,  # one object: one parameter back
        "frozen": torch.nn.Parameter(torch.randn(3), requires_grad=False),
        "grad": torch.randn(5).requires_grad_(),  # a plain leaf that requires grad
        "cl": torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last),
        "cl3d": torch.randn(2, 3, 2, 4, 5).contiguous(memory_format=torch.channels_last_3d),
        "t": torch.randn(6, 7).t(),
        "expanded": torch.arange(4.0).expand(1000, 4),  # stride 0: 16 bytes of storage
        "gapped": torch.randn(10, 10)[:, ::3],  # a slice with gaps: loads contiguous
        "plain": torch.randn(3),
        "np": np.arange(4.0),
    }


def test_parameters_and_memory_formats_come_back(cluster, sdir):
    state = _layout_state()
    h = _stage(state, sdir, cluster)
    with open(os.path.join(_local(sdir, h), "manifest.json"), "rb") as f:
        man = parse_manifest(f.read(), "manifest.json")
    assert man["version"] == 4
    stored = sum(e["nbytes"] for e in man["tensors"] if "base" not in e)
    assert stored < state["expanded"].numel() * 4, "the expanded tensor was stored expanded"
    for loc in (None, "cpu", "meta"):
        out = staging.load(_local(sdir, h), map_location=loc)
        assert type(out["p"]) is torch.nn.Parameter and out["p"].requires_grad and out["p_again"] is out["p"]
        assert type(out["frozen"]) is torch.nn.Parameter and not out["frozen"].requires_grad
        assert type(out["grad"]) is torch.Tensor and out["grad"].requires_grad and out["grad"].is_leaf
        assert type(out["plain"]) is torch.Tensor and not out["plain"].requires_grad
        assert out["cl"].is_contiguous(memory_format=torch.channels_last)
        assert out["cl3d"].is_contiguous(memory_format=torch.channels_last_3d)
        for k in ("cl", "cl3d", "t", "expanded"):
            assert out[k].stride() == state[k].stride(), k
        assert out["gapped"].is_contiguous() and out["gapped"].shape == state["gapped"].shape
        if loc != "meta":
            for k, v in state.items():
                assert (out[k] == v).all() if k == "np" else torch.equal(out[k].detach(), v.detach()), k
            assert out["expanded"].untyped_storage().nbytes() == 16
            assert isinstance(out["np"], np.ndarray)


def test_layouts_alone_stay_readable_by_version_3_readers_and_version_4_is_refused_by_them(cluster, sdir,
                                                                                          monkeypatch):
    from stripefs.staging import ChecksumError, _format

    def manifest(h) -> bytes:
        with open(os.path.join(_local(sdir, h), "manifest.json"), "rb") as f:
            return f.read()

    layouts = manifest(_stage({"cl": torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)},
                              sdir, cluster))
    params = manifest(_stage({"p": torch.nn.Parameter(torch.randn(3))}, sdir, cluster))
    monkeypatch.setattr(_format, "VERSION", 3)  # a reader from before parameters were recorded
    assert parse_manifest(layouts, "m")["version"] == 3
    with pytest.raises(ChecksumError, match="newer than this reader"):
        parse_manifest(params, "m")


def test_hostile_parameter_flags_are_refused(cluster, sdir):
    import json

    from stripefs.staging import ChecksumError
    from stripefs.staging._format import manifest_bytes

    h = _stage({"p": torch.nn.Parameter(torch.randn(3)), "i": torch.arange(3)}, sdir, cluster)
    with open(os.path.join(_local(sdir, h), "manifest.json"), "rb") as f:
        man = parse_manifest(f.read(), "manifest.json")
    for i, change in ((0, {"param": 1}), (0, {"requires_grad": "yes"}), (1, {"requires_grad": True})):
        bad = json.loads(json.dumps(man))
        bad["tensors"][i].update(change)
        with pytest.raises(ChecksumError, match="malformed manifest"):
            parse_manifest(manifest_bytes(bad), "hostile")
