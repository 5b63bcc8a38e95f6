"""``staging.load(url, into=state)`` (issue 31): a restore into the memory a restarted job
already holds. Each stored tensor whose place in ``into`` holds one of the same dtype and shape
comes back *as that object*, with the stored values, and host contiguous ones are read straight
into their memory: no fresh memory is made for them (checked by counting ``_fill.fresh``).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from stripefs import staging
from stripefs.staging import ChecksumError, _fill
from stripefs.staging._format import MANIFEST, parse_manifest


@pytest.fixture
def sdir(tmp_path) -> str:
    return str(tmp_path / "staging")


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(300, 64)
        self.body = torch.nn.Linear(64, 1 << 12)  # a 1 MiB weight: read in pieces, not in a run
        self.norm = torch.nn.BatchNorm1d(64)  # buffers, an int64 counter among them
        self.head = torch.nn.Linear(64, 300, bias=False)
        self.head.weight = self.embed.weight  # tied: one tensor under two keys


def _state(seed: int) -> dict:
    torch.manual_seed(seed)
    net = _Net()
    g = torch.Generator().manual_seed(seed)
    return {
        "model": net.state_dict(),
        "optim": {"state": {0: {"exp_avg": torch.randn(300, 64, generator=g), "step": torch.tensor(float(seed))}}},
        "biases": [torch.randn(n, generator=g) for n in (1, 17, 4097)],
        "table": np.arange(1000, dtype=np.int64) * seed,
        "step": seed,
    }, net


def _save(state, url, sdir, cluster, **kw) -> str:
    h = staging.save(state, url, staging_dir=sdir, cluster=cluster.file, keep_local=1, keep_remote=1,
                     background_mover=False, **kw)
    assert h.wait(60)
    return os.path.join(sdir, "steps", h.id)


def _leaves(tree, path=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, f"{path}/{k}")
    elif isinstance(tree, (list, tuple)):
        for n, v in enumerate(tree):
            yield from _leaves(v, f"{path}/{n}")
    else:
        yield path, tree


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    return a == b


@pytest.fixture
def count_fresh(monkeypatch):
    made: list[int] = []
    real = _fill.fresh

    def counted(e):
        made.append(e["nbytes"])
        return real(e)

    monkeypatch.setattr(_fill, "fresh", counted)
    return made


@pytest.mark.parametrize("compress", [None, "zstd"])
@pytest.mark.parametrize("where", ["store", "local copy"])
def test_every_target_is_filled_in_place_and_returned(cluster, testdir, sdir, count_fresh, compress, where):
    saved, _ = _state(1)
    url = f"stripefs:/{testdir}/step-1"
    _save(saved, url, sdir, cluster, compress=compress)
    target, net = _state(2)  # the restarted job's own state: other values, same shapes
    before = {p: (id(v), v.data_ptr() if isinstance(v, torch.Tensor) else None) for p, v in _leaves(target)}
    kw = dict(prefer_local=False) if where == "store" else dict(staging_dir=sdir)
    out = staging.load(url, cluster=cluster.file, into=target, **kw)
    for (path, want), (_, got) in zip(_leaves(saved), _leaves(out)):
        assert _equal(want, got), path
        if isinstance(got, (torch.Tensor, np.ndarray)):
            assert id(got) == before[path][0], f"{path}: not the target's object"
    assert all(_equal(a, b) for (_, a), (_, b) in zip(_leaves(saved), _leaves(target))
               if isinstance(a, (torch.Tensor, np.ndarray)))
    # The model itself holds the checkpoint now: its parameters were the targets.
    assert torch.equal(net.body.weight, saved["model"]["body.weight"]) and net.body.weight.requires_grad
    assert isinstance(net.body.weight, torch.nn.Parameter)
    assert net.head.weight is net.embed.weight and torch.equal(net.head.weight, saved["model"]["embed.weight"])
    assert [p.data_ptr() for _, p in net.state_dict().items()] == \
        [before[f"/model/{k}"][1] for k in net.state_dict()]
    assert count_fresh == [], "a target was loaded into fresh memory"


def test_a_plain_load_still_makes_fresh_memory(cluster, testdir, sdir, count_fresh):
    """The counter the test above relies on does see fresh tensors."""
    saved, _ = _state(1)
    local = _save(saved, f"stripefs:/{testdir}/step-1", sdir, cluster)
    staging.load(local)
    assert len(count_fresh) >= 10


def test_places_the_target_lacks_load_fresh_and_its_extra_keys_stay(cluster, testdir, sdir, count_fresh):
    saved = {"a": torch.randn(1000), "b": torch.randn(3 << 18), "step": 3}
    local = _save(saved, f"stripefs:/{testdir}/step-1", sdir, cluster)
    mine = {"a": torch.zeros(1000), "extra": torch.ones(5)}
    out = staging.load(local, into=mine)
    assert out.keys() == saved.keys()
    assert out["a"] is mine["a"] and torch.equal(mine["a"], saved["a"])
    assert torch.equal(out["b"], saved["b"]) and count_fresh == [saved["b"].nbytes]
    assert torch.equal(mine["extra"], torch.ones(5))


def test_a_target_of_another_dtype_or_shape_is_refused_before_any_read(cluster, testdir, sdir):
    saved = {"w": torch.randn(64, 64), "v": torch.randn(3 << 18)}
    local = _save(saved, f"stripefs:/{testdir}/step-1", sdir, cluster)
    for bad, why in ((torch.zeros(64, 64, dtype=torch.float16), "torch.float16"), (torch.zeros(64, 65), "65")):
        mine = {"v": torch.zeros(3 << 18), "w": bad}
        with pytest.raises(ValueError, match=f"\\['w'\\].*{why}"):
            staging.load(local, into=mine)
        assert not mine["v"].any() and not mine["w"].any()  # nothing written
    with pytest.raises(TypeError, match="dict, list or tuple"):
        staging.load(local, into=torch.zeros(3))


def test_strided_and_shared_targets_are_copied_into(cluster, testdir, sdir):
    saved = {"t": torch.randn(128, 256), "u": torch.randn(3 << 18), "u2": torch.randn(3 << 18)}
    local = _save(saved, f"stripefs:/{testdir}/step-1", sdir, cluster)
    shared = torch.zeros(3 << 18)
    mine = {"t": torch.zeros(256, 128).t(), "u": shared, "u2": shared[:]}  # a transpose; one memory twice
    out = staging.load(local, into=mine)
    assert out["t"] is mine["t"] and torch.equal(mine["t"], saved["t"])
    # Both keys fill the same memory: it ends as one of them, whole, never a mix of the two.
    assert torch.equal(shared, saved["u"]) or torch.equal(shared, saved["u2"])


def test_a_bad_byte_is_still_an_error(cluster, testdir, sdir):
    saved = {"big": torch.randn(3 << 18), "small": torch.randn(300)}
    local = _save(saved, f"stripefs:/{testdir}/step-1", sdir, cluster)
    with open(os.path.join(local, MANIFEST), "rb") as f:
        man = parse_manifest(f.read(), local)
    e = man["tensors"][0]
    path = os.path.join(local, man["files"][e["file"]]["name"])
    with open(path, "r+b") as f:
        f.seek(e["offset"] + e["nbytes"] // 2)
        b = f.read(1)
        f.seek(e["offset"] + e["nbytes"] // 2)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(ChecksumError):
        staging.load(local, into={"big": torch.zeros(3 << 18), "small": torch.zeros(300)})


def test_one_rank_of_a_step_loads_into_its_own_state(cluster, testdir, sdir, count_fresh):
    url = f"stripefs:/{testdir}/step-1"
    parts = [{"r0.w": torch.randn(1000)}, {"r1.w": torch.randn(3 << 18), "r1.b": torch.randn(7)}]
    handles = [staging.save(p, url, staging_dir=sdir, cluster=cluster.file, rank=r, world_size=2, save_id="s1",
                            background_mover=False, snapshot_memory=1 << 30, rank_timeout=30.0)
               for r, p in enumerate(parts)]
    assert all(h.wait(60) for h in handles)
    mine = {"r1.w": torch.zeros(3 << 18), "r1.b": torch.zeros(7)}
    out = staging.load(url, cluster=cluster.file, rank=1, prefer_local=False, into=mine)
    assert out.keys() == parts[1].keys() and out["r1.w"] is mine["r1.w"]
    assert all(torch.equal(mine[k], parts[1][k]) for k in mine) and count_fresh == []
