"""CUDA tensors through staging: pinned snapshot buffers, reused; bit-exact round trips to CUDA and CPU.

Runs only where ``torch.cuda.is_available()`` (skipped otherwise, with that reason). The
fixtures are the CPU tests' own: the session's 4-server loopback cluster and a private
staging directory.
"""

from __future__ import annotations

import pytest
import torch

from stripefs import staging
from stripefs.staging._snapshot import POOL

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available())")


@pytest.fixture
def sdir(tmp_path) -> str:
    return str(tmp_path / "staging")


def _state(mb: int = 0) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    base = torch.randn(4096, device="cuda", generator=g)
    state = {
        "f32": torch.randn(1000, 33, device="cuda", generator=g),
        "f16": torch.randn(777, device="cuda", generator=g).half(),
        "bf16": torch.randn(64, 129, device="cuda", generator=g).to(torch.bfloat16),
        "f64": torch.randn(100, device="cuda", generator=g).double(),
        "i64": torch.randint(-2**40, 2**40, (300,), device="cuda", generator=g),
        "u8": torch.randint(0, 256, (1001,), device="cuda", generator=g, dtype=torch.uint8),
        "bool": torch.randn(99, device="cuda", generator=g) > 0,
        "noncontig": torch.randn(48, 80, device="cuda", generator=g).t()[::2],  # transposed and strided
        "base": base,
        "view": base[100:612].view(16, 32),  # a view of another saved tensor: stays tied
        "cpu": torch.arange(10),  # a host tensor beside device ones
        "step": 3,
    }
    if mb:
        state["big"] = torch.randn(mb << 18, device="cuda", generator=g)  # mb MiB of float32
    return state


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)


def _assert_exact(got: dict, want: dict, device: str) -> None:
    assert list(got) == list(want)
    for k, w in want.items():
        g = got[k]
        if not isinstance(w, torch.Tensor):
            assert g == w, k
            continue
        assert g.dtype == w.dtype and g.shape == w.shape, k
        assert g.device.type == device, (k, g.device)
        assert torch.equal(_bytes(g), _bytes(w)), f"{k} differs bit-wise"


@pytest.mark.parametrize("keep_local", [1, 0])
def test_cuda_state_round_trips_bit_exactly(cluster, testdir, sdir, keep_local):
    state = _state()
    url = f"stripefs:/{testdir}/step-000003"
    h = staging.save(state, url, staging_dir=sdir, cluster=cluster.file, keep_local=keep_local,
                     background_mover=False)
    assert h.wait(120)
    on_gpu = staging.load(url, cluster=cluster.file, prefer_local=False, map_location="cuda")
    _assert_exact(on_gpu, state, "cuda")
    # The view is still a view of the loaded base, on the device.
    assert on_gpu["view"].untyped_storage().data_ptr() == on_gpu["base"].untyped_storage().data_ptr()
    on_cpu = staging.load(url, cluster=cluster.file, prefer_local=False)
    _assert_exact(on_cpu, state, "cpu")


def test_save_blocks_briefly_and_reuses_pinned_buffers(cluster, testdir, sdir):
    POOL.clear()
    state = _state(mb=128)
    handles = []
    for step in (1, 2):
        h = staging.save(state, f"stripefs:/{testdir}/step-{step:06d}", staging_dir=sdir, cluster=cluster.file,
                         keep_local=1, background_mover=False)
        assert h.wait(120)
        handles.append(h)
        if step == 1:
            first = list(POOL._free)
            assert len(first) == 1 and first[0].tensor.is_pinned(), "the snapshot buffer should be pinned"
            ptr = first[0].tensor.data_ptr()
    # The second save copied into the same pinned buffer: none waited, none was added.
    assert list(POOL._free) == first and POOL._free[0].tensor.data_ptr() == ptr
    assert not handles[1].extra_buffer and handles[1].snapshot_wait_s == 0
    # Blocking (device -> pinned host copy) is small next to the upload of the same bytes.
    h = handles[1]
    assert h.timings["snapshot"] < 0.5 * h.timings["upload"], h.timings
    _assert_exact(staging.load(h.url, cluster=cluster.file, prefer_local=False, map_location="cuda"), state, "cuda")
    POOL.clear()
