"""The walkthrough's trainer: a small classifier over a dataset of small files in stripefs,
checkpointed every N steps with staging.save, resumed from staging.latest() when restarted.

usage: python train.py --data /data/ds --ckpt stripefs://ckpt/run1 [--steps 200] [--every 50]
                       [--batch 32] [--workers 2] [--seed 0] [--cluster C] [--staging DIR]

Run the same command again after a crash (kill -9 included): it goes on from the newest
committed checkpoint and ends in exactly the state an uninterrupted run ends in.
docs/training.md quotes the parts between the ``# [doc:...]`` markers;
tests/staging/test_training_walkthrough.py checks that the quotes match and runs this file.
"""

from __future__ import annotations

import argparse
from typing import Sequence

import torch
from torch import nn
from torch.utils.data import DataLoader

import stripefs
from stripefs import staging
from stripefs.fsclient.batchread.dataset import IndexDataset, collate_batch

from common import CLASSES, StepBatches, remote_index


# [doc:dataset]
class Samples(IndexDataset):
    """One sample per file; a batch is ``(pixels, labels)``, read through one ring into one tensor."""

    def __init__(self, index: Sequence[tuple[str, int, int]], cluster: str | None):
        super().__init__([(path, 0, size) for path, size, _label in index], cluster=cluster)
        self.size = index[0][1]  # every sample has the same size here
        self.labels = torch.tensor([label for _path, _size, label in index])

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        batch = super().__getitems__(indices)
        return batch.data.view(len(indices), self.size), self.labels[indices]
# [/doc]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True, help="the dataset's folder in stripefs")
    p.add_argument("--ckpt", required=True, help="the run's checkpoint prefix, stripefs://ckpt/run1")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=50, help="checkpoint every N steps (and at the last)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cluster", help="cluster.json (default: STRIPEFS_CLUSTER, then the last `stripefs up`)")
    p.add_argument("--staging", help="local staging directory (default: $STRIPEFS_STAGING or /tmp/stripefs-staging-UID)")
    a = p.parse_args()

    with stripefs.Client(a.cluster) as client:
        index = remote_index(client, a.data)  # one listing per class folder
    ds = Samples(index, a.cluster)
    torch.manual_seed(a.seed)
    model = nn.Sequential(nn.Linear(ds.size, 64), nn.ReLU(), nn.Linear(64, CLASSES))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    # [doc:resume]
    start = 0
    last = staging.latest(a.ckpt, cluster=a.cluster)  # newest step that loads, or None
    if last is not None:
        state = staging.load(last, cluster=a.cluster)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start = state["step"]
        print(f"resumed from {last} at step {start}", flush=True)
    # [/doc]

    # [doc:loop]
    batches = DataLoader(ds, batch_sampler=StepBatches(len(ds), a.batch, a.seed, start, a.steps),
                         collate_fn=collate_batch, num_workers=a.workers)
    saving = None
    for step, (pixels, labels) in enumerate(batches, start + 1):
        loss = nn.functional.cross_entropy(model(pixels.float() / 255), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item()!r}", flush=True)
        if step % a.every == 0 or step == a.steps:
            state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}
            # Blocks only while the tensors are copied; the local write and the upload
            # run in the background. An error of an earlier save is raised here.
            saving = staging.save(state, f"{a.ckpt}/step-{step:06d}", cluster=a.cluster,
                                  staging_dir=a.staging, keep_remote=3)
            print(f"saving step {step} (blocked {saving.timings['snapshot']:.3f} s)", flush=True)
    if saving is not None:
        saving.wait()  # the last step is committed in the store before the job ends
    print(f"done at step {a.steps}", flush=True)
    # [/doc]


if __name__ == "__main__":
    main()
