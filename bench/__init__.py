"""stripefs benchmarks: ``stripefs bench`` (``bench.cli``) and this machine's floors (``bench.floors``).

The benchmark runs AI-cluster-shaped workloads with N client processes over every route into
stripefs (native, fsspec, FUSE, zero-copy batch reads), the local disk and peer file systems,
and reports each figure next to floors measured in the same run.
"""

from ._orchestrate import BenchConfig, aggregate, run_bench

__all__ = ["BenchConfig", "run_bench", "aggregate"]
