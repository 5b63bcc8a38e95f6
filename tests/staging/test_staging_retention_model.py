"""Retention against a model: random sequences of saves, slow and failing uploads, rollbacks and
mover passes, checked after every operation against a model of what must survive.

The model (one ``keep_remote``/``keep_local`` for the whole run, as a training job has):

* ``store``: step -> the save (tag) whose checkpoint must be at the step's URL. A commit adds
  its step and trims to the newest ``max(1, keep_remote)`` steps by step number; nothing else
  ever removes a step but a rollback (steps above a cut deleted by hand). So a failed save,
  or one still uploading, deletes nothing, and the newest durable step always survives.
* ``pending``: step -> the save left ``staged`` (its upload failed its retries, or it was
  saved with ``upload=False``); the next mover pass commits it; a later save of the same step
  supersedes it (abandoned: its local copy and its partial upload go).
* local copies: the pending saves', and after each commit those of the newest ``keep_local``
  steps in ``store`` that still have one (a copy that fell out of the window never comes back;
  ``keep_local=None``: at least every step in ``store``).

Checked after every operation: the store's step directories and the checkpoint id in each,
no hidden partial directory but those of pending saves, ``latest()`` names the newest step of
the model and it loads with that save's state, the journal's unfinished rows are exactly the
pending saves, and the local copies.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from stripefs import staging
from stripefs.staging._mover import committed_id, remove_tree

STEPS = 10  # steps 1..STEPS: few enough that steps are saved again, in and out of order
FAIL_POINTS = ("upload_piece", "before_rename")  # an upload that fails before / after its files are up


def _state(tag: int) -> dict:
    return {"w": torch.full((256,), float(tag)), "tag": tag}


class Run:
    """One random sequence: the system under test and its model side by side."""

    def __init__(self, seed: int, keep_remote: int | None, keep_local: int | None, cluster, client, testdir: str,
                 sdir: str, monkeypatch):
        self.rng = random.Random(seed)
        self.cluster, self.client, self.dir, self.sdir, self.mp = cluster, client, testdir, sdir, monkeypatch
        self.keep_remote, self.keep_local = keep_remote, keep_local
        self.store: dict[int, int] = {}
        self.pending: dict[int, int] = {}
        self.ids: dict[int, str] = {}  # tag -> checkpoint id
        self.local: set[str] = set()  # ids with a local copy after the last commit
        self.tag = 0
        self.log: list[str] = [f"keep_remote={self.keep_remote} keep_local={self.keep_local}"]

    def url(self, step: int) -> str:
        return f"stripefs:/{self.dir}/step-{step:06d}"

    # -- the system ---------------------------------------------------------------------------
    def _start(self, step: int, *, upload: bool = True, options: staging.MoverOptions | None = None
               ) -> staging.SaveHandle:
        self.tag += 1
        self.pending.pop(step, None)  # a later save of the step supersedes the staged leftover
        h = staging.save(_state(self.tag), self.url(step), staging_dir=self.sdir, cluster=self.cluster.file,
                         keep_local=self.keep_local, keep_remote=self.keep_remote, upload=upload,
                         background_mover=False, options=options or staging.MoverOptions(cluster=self.cluster.file))
        self.ids[self.tag] = h.id
        return h

    @staticmethod
    def _settled(h: staging.SaveHandle) -> None:
        """The save's thread is done: after ``upload=False`` or an error, wait() may return while
        it still removes what the leftover it superseded had uploaded."""
        assert h._done.wait(60)

    def save(self, step: int) -> None:
        h = self._start(step)
        assert h.wait(60)
        self._settled(h)
        self._committed({step: self.tag})

    def save_staged(self, step: int) -> None:
        if self.keep_local == 0:  # nothing local to stage: refused, as documented
            with pytest.raises(ValueError):
                self._start(step, upload=False)
            self.tag -= 1
            return
        h = self._start(step, upload=False)
        assert h.wait(60, durable="local")
        self._settled(h)
        self.pending[step] = self.tag

    def save_failing(self, step: int) -> None:
        point = self.rng.choice(FAIL_POINTS)
        self.log[-1] += f" at {point}"
        self.mp.setenv("STRIPEFS_STAGING_FAIL_AT", point)
        try:
            h = self._start(step, options=staging.MoverOptions(cluster=self.cluster.file, retries=0))
            with pytest.raises(ConnectionError):
                h.wait(60)
            self._settled(h)
        finally:
            self.mp.delenv("STRIPEFS_STAGING_FAIL_AT")
        if self.keep_local != 0:  # with a local copy the step waits for the mover; without, it is lost
            assert h.locally_durable
            self.pending[step] = self.tag
        # Nothing was committed, so nothing may have been deleted: checked by the caller.

    def slow_then_fast(self, slow: int, fast: int) -> None:
        """The older save's upload is slow; a newer one, started after it, commits first."""
        h_slow = self._start(slow, options=staging.MoverOptions(cluster=self.cluster.file, bandwidth=4096 / 0.2))
        slow_tag = self.tag
        h_fast = self._start(fast)
        assert h_fast.wait(60) and h_slow.wait(60)
        self._settled(h_fast)
        self._settled(h_slow)
        self._committed({slow: slow_tag, fast: self.tag})

    def mover_pass(self) -> None:
        done = staging.Mover(self.sdir, staging.MoverOptions(cluster=self.cluster.file)).run_once()
        expected = {self.ids[t]: "committed" for t in self.pending.values()}
        assert {k: v for k, v in done.items() if v != "cleaned"} == expected
        committed, self.pending = self.pending, {}
        if committed:
            self._committed(committed)

    def rollback(self, cut: int) -> None:
        """The job resumes from step ``cut``: the newer steps are deleted by hand."""
        for step in [s for s in self.store if s > cut]:
            remove_tree(self.client, f"{self.dir}/step-{step:06d}")
            del self.store[step]

    # -- the model ----------------------------------------------------------------------------
    def _committed(self, saves: dict[int, int]) -> None:
        self.store.update(saves)
        if self.keep_remote is not None:
            for old in sorted(self.store, reverse=True)[max(1, self.keep_remote):]:
                del self.store[old]
        kept = sorted(self.store, reverse=True)
        if self.keep_local is not None:
            kept = kept[: self.keep_local]
        # A local copy that fell out of the window is gone for good: after a rollback the step
        # that is newest again may have none left.
        self.local = (self.local | {self.ids[t] for t in saves.values()}) & {self.ids[self.store[s]] for s in kept}

    def check(self) -> None:
        names = self.client.listdir(self.dir)
        present = {int(n.split("-")[1]): n for n in names if n.startswith("step-")}
        assert sorted(present) == sorted(self.store), ("store", sorted(present), self.store)
        for step, t in self.store.items():
            assert committed_id(self.client, f"{self.dir}/step-{step:06d}") == self.ids[t], ("id at", step)
        hidden = sorted(n for n in names if n.startswith("."))
        partial_ok = {f".step-{s:06d}.partial-{self.ids[t]}" for s, t in self.pending.items()}
        assert set(hidden) <= partial_ok, ("partial directories left", hidden)
        newest = staging.latest(f"stripefs:/{self.dir}", cluster=self.cluster.file)
        assert newest == (self.url(max(self.store)) if self.store else None)
        if newest is not None:
            out = staging.load(newest, cluster=self.cluster.file, staging_dir=self.sdir)
            assert out["tag"] == self.store[max(self.store)]
        rows = staging.Mover(self.sdir).journal.checkpoints()
        unfinished = {r.id for r in rows if r.state in ("writing", "streaming", "staged")}
        assert unfinished == {self.ids[t] for t in self.pending.values()}, "unfinished journal rows"
        local = {n for n in os.listdir(os.path.join(self.sdir, "steps")) if not n.startswith(".")}
        want = self.local | {self.ids[t] for t in self.pending.values()}
        if self.keep_local is None:
            assert want <= local, ("local copies missing", want - local)
        else:
            assert local == want, ("local copies", sorted(local - want), sorted(want - local))

    # -- the driver ---------------------------------------------------------------------------
    def pick_step(self) -> int:
        top = max([*self.store, *self.pending, 0])
        if self.rng.random() < 0.6:
            return min(top + 1, STEPS)  # in order
        return self.rng.randint(1, STEPS)  # out of order: older, or a step saved before

    def step(self) -> None:
        op = self.rng.random()
        if op < 0.35:
            step = self.pick_step()
            self.log.append(f"save {step}")
            self.save(step)
        elif op < 0.5:
            step = self.pick_step()
            self.log.append(f"save {step} failing")
            self.save_failing(step)
        elif op < 0.6:
            step = self.pick_step()
            self.log.append(f"save {step} staged")
            self.save_staged(step)
        elif op < 0.7:
            fast = self.pick_step()
            slow = self.rng.choice([s for s in range(1, STEPS + 1) if s != fast])
            self.log.append(f"slow {slow}, fast {fast}")
            self.slow_then_fast(slow, fast)
        elif op < 0.85:
            self.log.append("mover pass")
            self.mover_pass()
        else:
            cut = self.rng.choice([0, *sorted(self.store)])
            self.log.append(f"rollback to {cut}")
            self.rollback(cut)
        self.check()


def _run(seed: int, keep_remote: int | None, keep_local: int | None, ops: int, cluster, client, testdir, tmp_path,
         monkeypatch) -> None:
    run = Run(seed, keep_remote, keep_local, cluster, client, testdir, str(tmp_path / "s"), monkeypatch)
    for _ in range(ops):
        try:
            run.step()
        except BaseException:
            print("\n".join(run.log[-30:]))
            raise


# (seed, keep_remote, keep_local): every kind of window, keep_local=0 (no local copy) included.
CASES = [(1, 2, 2), (2, None, 1), (3, 1, 0), (4, 0, None), (5, 3, 1), (6, None, 2)]


# Operations per run: short in `make test`; STRIPEFS_RETENTION_OPS=1000 soaks (each case).
OPS = int(os.environ.get("STRIPEFS_RETENTION_OPS", "50"))


@pytest.mark.parametrize("seed,keep_remote,keep_local", CASES)
def test_retention_model(cluster, client, testdir, tmp_path, monkeypatch, seed, keep_remote, keep_local):
    _run(seed, keep_remote, keep_local, OPS, cluster, client, testdir, tmp_path, monkeypatch)


# -- what the model found (each failed before its fix) -------------------------------------------

def test_a_superseded_leftover_loses_its_partial_upload(cluster, client, testdir, tmp_path, monkeypatch):
    """A save whose upload failed after its files were up leaves a partial directory; the resumed
    run's save of the same step supersedes the leftover, and no mover pass ever looks at an
    abandoned row again: the save removes the partial."""
    run = Run(0, 2, 1, cluster, client, testdir, str(tmp_path / "s"), monkeypatch)
    monkeypatch.setattr(run.rng, "choice", lambda seq: "before_rename")  # the files are up, the commit fails
    run.save_failing(3)
    assert [n for n in client.listdir(testdir) if n.startswith(".")]
    run.check()
    run.save(3)
    run.check()
    assert client.listdir(testdir) == ["step-000003"]


def test_rolled_back_steps_take_no_local_slot_without_keep_remote(cluster, client, testdir, tmp_path, monkeypatch):
    """keep_remote=None, keep_local=1: after a rollback the deleted step's row is stale; it must not
    keep the local copy of the step that is now the newest."""
    run = Run(0, None, 1, cluster, client, testdir, str(tmp_path / "s"), monkeypatch)
    for step in (1, 2):
        run.save(step)
        run.check()
    run.rollback(0)
    run.save(1)  # the resumed run saves step 1 again; step 2's row is stale
    run.check()
