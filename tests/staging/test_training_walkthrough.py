"""docs/training.md, run as written: the scripts it quotes are the ones run here.

The walkthrough on a small scale (300 files, 40 steps, a checkpoint every 10): make the
dataset, ``stripefs put -r`` it, read it back with the recommended loader (and through a
FUSE mount, where the machine has FUSE), train, ``kill -9`` the trainer mid-run, run the
same command again, and look at the result with the CLI. The resumed run must end
bit-exact with an uninterrupted run of the same seed: the same weights, the same
optimizer state and, step for step, the same losses.

The docs quote docs/examples/training/train.py by its ``# [doc:...]`` regions; the first
test checks that every quote is the file's current text, so neither can drift alone.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from stripefs import staging

from tests.fuse.fuse_helpers import fuse_unusable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "docs", "examples", "training")
DOC = os.path.join(ROOT, "docs", "training.md")
FILES, STEPS, EVERY, KILL_AFTER = 300, 40, 10, 20  # kill past step 20, once a step is committed


def _env(cluster) -> dict[str, str]:
    env = dict(os.environ, STRIPEFS_CLUSTER=cluster.file)
    env.pop("STRIPEFS_STAGING_KILL_AT", None)
    return env


def _run(cluster, *args: str, cwd: str = EXAMPLES, timeout: float = 120) -> str:
    p = subprocess.run([sys.executable, *args], cwd=cwd, env=_env(cluster), capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, f"{args} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
    return p.stdout


def _cli(cluster, *args: str) -> str:
    return _run(cluster, "-m", "stripefs", *args, cwd=ROOT, timeout=60)


def _sha(out: str) -> str:
    return re.search(r"sha256 ([0-9a-f]{64})", out).group(1)


def _losses(out: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^step (\d+) loss (\S+)$", out, re.M)}


def _train_args(testdir: str, run: str, staging_dir: str) -> list[str]:
    return ["train.py", "--data", f"{testdir}/data/ds", "--ckpt", f"stripefs:/{testdir}/ckpt/{run}",
            "--steps", str(STEPS), "--every", str(EVERY), "--staging", staging_dir]


def _doc_regions(path: str) -> dict[str, str]:
    text = open(path).read()
    return {m.group(1): m.group(2) for m in re.finditer(r"^ *# \[doc:(\w+)\]\n(.*?)^ *# \[/doc\]\n", text, re.M | re.S)}


def test_docs_quote_the_example_scripts() -> None:
    doc = open(DOC).read()
    regions = _doc_regions(os.path.join(EXAMPLES, "train.py"))
    assert set(regions) == {"dataset", "resume", "loop"}
    for name, code in regions.items():
        # Quoted dedented, as a reader would paste it.
        lines = code.splitlines()
        indent = min(len(l) - len(l.lstrip()) for l in lines if l.strip())
        quoted = "\n".join(l[indent:] for l in lines) + "\n"
        assert quoted in doc, f"docs/training.md does not quote train.py's [doc:{name}] region as it is now"
    for script in re.findall(r"python (docs/examples/\S+\.py)", doc):
        assert os.path.isfile(os.path.join(ROOT, script)), f"docs/training.md runs {script}, which is missing"


@pytest.mark.slow
def test_training_walkthrough(cluster, client, testdir, tmp_path) -> None:
    # 1. A dataset of small files, uploaded the fast way.
    made = _run(cluster, "make_dataset.py", str(tmp_path / "ds"), "--files", str(FILES))
    _cli(cluster, "mkdir", "-p", f"{testdir}/data")
    _cli(cluster, "put", "-r", str(tmp_path / "ds"), f"{testdir}/data/")
    assert len(_cli(cluster, "ls", f"{testdir}/data/ds").split()) == 10  # a folder per class

    # 2. Read back whole with the recommended loader (IndexDataset, 2 workers): intact.
    read = _run(cluster, "read_dataset.py", "--data", f"{testdir}/data/ds")
    assert f"read {FILES} files" in read and _sha(read) == _sha(made)

    # 3. The reference: an uninterrupted run.
    ref = _run(cluster, *_train_args(testdir, "ref", str(tmp_path / "staging-ref")))
    assert f"done at step {STEPS}" in ref and "resumed" not in ref

    # 4. The same run, killed (-9) mid-run, then the same command again.
    sdir = str(tmp_path / "staging-run")
    proc = subprocess.Popen([sys.executable, *_train_args(testdir, "run", sdir)], cwd=EXAMPLES, env=_env(cluster),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    seen = []
    try:
        deadline = time.monotonic() + 60
        for line in proc.stdout:
            seen.append(line)
            # Past step KILL_AFTER, and once some step is committed (its upload runs in the
            # background: on a fast machine step 10 may still be on its way at step 20).
            done = re.match(r"step (\d+) loss", line)
            if (done and int(done.group(1)) >= KILL_AFTER
                    and staging.latest(f"stripefs:/{testdir}/ckpt/run", cluster=cluster.file) is not None):
                proc.send_signal(signal.SIGKILL)
                break
            assert time.monotonic() < deadline, "the trainer did not reach the kill point"
    finally:
        proc.kill()
        rest = proc.communicate(timeout=30)[0]
    killed = "".join(seen) + rest
    assert proc.returncode == -signal.SIGKILL and "done at step" not in killed, "not killed mid-run"
    resumed = _run(cluster, *_train_args(testdir, "run", sdir))
    start = int(re.search(r"resumed from \S+ at step (\d+)", resumed).group(1))
    assert start % EVERY == 0 and EVERY <= start < STEPS, resumed  # the newest step committed before the kill
    assert f"done at step {STEPS}" in resumed

    # Bit-exact: every step after the resume has the reference's loss, and the last checkpoint
    # holds the reference's weights and optimizer state, read back from the store.
    ref_losses, run_losses = _losses(ref), _losses(resumed)
    assert sorted(run_losses) == list(range(start + 1, STEPS + 1))
    differ = [s for s in sorted(run_losses) if run_losses[s] != ref_losses[s]]
    assert not differ, f"losses differ from the uninterrupted run's at steps {differ[:5]}"
    a = staging.load(f"stripefs:/{testdir}/ckpt/ref/step-{STEPS:06d}", cluster=cluster.file, prefer_local=False)
    b = staging.load(f"stripefs:/{testdir}/ckpt/run/step-{STEPS:06d}", cluster=cluster.file, prefer_local=False)
    assert a["step"] == b["step"] == STEPS
    _assert_identical(a["model"], b["model"])
    _assert_identical(a["optim"], b["optim"])

    # 5. Look around with the CLI.
    listing = _cli(cluster, "ckpt", "list", f"stripefs:/{testdir}/ckpt/run")
    assert f"step-{STEPS:06d}" in listing and "latest" in listing
    assert _cli(cluster, "ckpt", "latest", f"stripefs:/{testdir}/ckpt/run").strip().endswith(f"step-{STEPS:06d}")
    names = _cli(cluster, "ls", f"{testdir}/ckpt/run").split()
    assert names[-1].rstrip("/") == f"step-{STEPS:06d}" and len(names) <= 3  # keep_remote=3
    assert "serving" in _cli(cluster, "status")


def _assert_identical(a, b, where: str = "state") -> None:
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_identical(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.fuse
@pytest.mark.skipif(fuse_unusable() is not None, reason=str(fuse_unusable()))
def test_walkthrough_reads_the_dataset_through_a_mount(cluster, client, testdir, tmp_path) -> None:
    """The walkthrough's other way in: the same dataset read through ``stripefs mount`` is intact."""
    made = _run(cluster, "make_dataset.py", str(tmp_path / "ds"), "--files", "100")
    _cli(cluster, "put", "-r", str(tmp_path / "ds"), testdir)
    mp = str(tmp_path / "mnt")
    os.makedirs(mp)
    _cli(cluster, "mount", mp)
    try:
        read = _run(cluster, "read_dataset.py", "--mount", f"{mp}{testdir}/ds")
    finally:
        _cli(cluster, "umount", mp)
    assert "read 100 files" in read and _sha(read) == _sha(made)
