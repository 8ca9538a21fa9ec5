"""DDP benchmark: what global statistics cost on top of a plain DDP step (gloo, CPU by default).

``R`` processes (default 2) each train on ``N/R`` samples of a benchmark problem under
``DistributedDataParallel``. Per extension it prints

* ``1 proc``: the step time with the extension over a plain step in *one* process on the same
  per-process batch ``N/R``;
* ``DDP``: the step time with the extension over a plain DDP step;
* ``DDP/1 proc``: the ratio of the two (goal for first-order statistics: ≤ 1.15);
* ``reduce``: the wall time of backprism's reduction after the local pass (size exchange,
  buckets, results; ``collect.communication.seconds``), median over the steps, and ``+ratio``,
  what it adds to the ``DDP`` ratio (``reduce`` over the plain DDP step): the part of the cost
  that is communication rather than the extension's own arithmetic;
* the payload bytes backprism all-reduces per step for the extension (``collect.communication``)
  next to DDP's own gradient all-reduce, and its collective calls next to DDP's buckets.

On a machine with as many cores as processes the processes compete for cores and memory
bandwidth, so an extension's arithmetic costs more under DDP than in the ``1 proc`` run alone;
expect noisy ratios and read ``+ratio`` for what the communication adds.

Steps alternate between the configurations; times are medians over ``--repeats`` rounds after
a warm-up, taken on rank 0 after a barrier. With ``R`` processes on ``R`` cores each process runs
one thread. Run: ``python benchmarks/bench_ddp.py [--problem mnist_mlp] [--extensions ...]``;
``--markdown`` prints a GitHub markdown table. No peak memory is measured here: the MiB column is
the payload backprism all-reduces per step (``collect.communication``), not memory.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
import types
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from measure import print_markdown
from problems import PROBLEMS, build

from backprism import collect, extend
from backprism import extensions as E

FIRST = ["BatchL2Grad", "SumGradSquared", "Variance", "BatchGrad"]
SECOND = ["DiagGGNMC", "KFAC", "DiagGGNExact", "KFLR"]


def _step(model, lossfunc, X, y, ext):
    model.zero_grad(set_to_none=True)
    loss = lossfunc(model(X), y)
    if ext is None:
        loss.backward()
        return None
    with collect(getattr(E, ext)()) as ctx:
        loss.backward()
    return ctx


def _time(configs, repeats, barrier=None):
    times = {k: [] for k in configs}
    for rnd in range(repeats + 1):
        for key, run in configs.items():
            gc.collect()
            if barrier is not None:
                barrier()
            t0 = time.perf_counter()
            run()
            if rnd > 0:
                times[key].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def _single(problem, n, exts, repeats, threads):
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model, lossfunc, X, y = build(problem, n)
    model, lossfunc = extend(model), extend(lossfunc)
    configs = {None: lambda: _step(model, lossfunc, X, y, None)}
    for e in exts:
        configs[e] = lambda e=e: _step(model, lossfunc, X, y, e)
    return _time(configs, repeats)


def _worker(rank, world, path, problem, n, exts, repeats, threads, out):
    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{path}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=300),
    )
    try:
        torch.manual_seed(0)
        model, lossfunc, X, y = build(problem, n * world)
        X, y = X[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]
        model, lossfunc = extend(model), extend(lossfunc)
        ddp = DDP(model)
        comm, seconds = {}, {}

        def run(e):
            ctx = _step(ddp, lossfunc, X, y, e)
            if ctx is not None:
                comm[e] = ctx.communication
                seconds.setdefault(e, []).append(ctx.communication.seconds)

        configs = {None: lambda: run(None)}
        for e in exts:
            configs[e] = lambda e=e: run(e)
        med = _time(configs, repeats, barrier=dist.barrier)
        for e, c in comm.items():
            c.seconds = statistics.median(seconds[e][1:] or seconds[e])
        if rank == 0:
            data = ddp._get_ddp_logging_data() or {}  # DDP rebuilds its buckets after step 1
            sizes = data.get("rebuilt_bucket_sizes", data.get("bucket_sizes"))
            buckets = len(str(sizes).split(",")) if sizes else None
            # only the figures main() reads: a Communication may hold unpicklable references
            # (e.g. its process group)
            figures = {
                e: types.SimpleNamespace(
                    total=c.total,
                    gradient_bytes=c.gradient_bytes,
                    collectives=c.collectives,
                    seconds=c.seconds,
                )
                for e, c in comm.items()
            }
            torch.save({"times": med, "comm": figures, "ddp_buckets": buckets}, out)
    finally:
        dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problem", default="mnist_mlp", choices=list(PROBLEMS))
    ap.add_argument("--n", type=int, default=128, help="global batch size")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1, help="threads per process")
    ap.add_argument("--extensions", nargs="+", default=FIRST + SECOND)
    ap.add_argument("--markdown", action="store_true", help="print a GitHub markdown table")
    args = ap.parse_args(argv)
    n = args.n // args.world
    settings = (
        f"{args.problem}, N={args.n} ({args.world} gloo processes x {n}), "
        f"{args.threads} thread(s) per process, repeats={args.repeats}"
    )
    if not args.markdown:
        print(f"{settings}, torch {torch.__version__}")
    single = _single(args.problem, n, args.extensions, args.repeats, args.threads)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch._dynamo", "backprism.extensions"])
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "result.pt")
        tmp.start_processes(
            _worker,
            args=(
                args.world,
                os.path.join(d, "rendezvous"),
                args.problem,
                n,
                args.extensions,
                args.repeats,
                args.threads,
                out,
            ),
            nprocs=args.world,
            start_method="forkserver",
        )
        res = torch.load(out, weights_only=False)
    times, comm = res["times"], res["comm"]
    grad_bytes = next(iter(comm.values())).gradient_bytes if comm else 0
    summary = (
        f"plain step: 1 proc {single[None] * 1e3:.1f} ms, DDP {times[None] * 1e3:.1f} ms; "
        f"DDP all-reduces {grad_bytes / 2**20:.2f} MiB of gradients per step"
        + (f" in {res['ddp_buckets']} buckets" if res["ddp_buckets"] else "")
    )
    rows = []
    for e in args.extensions:
        r1 = single[e] / single[None]
        rd = times[e] / times[None]
        c = comm.get(e)
        rows.append(
            {
                "extension": e,
                "single": r1,
                "ddp": rd,
                "ms": c.seconds * 1e3 if c else 0.0,
                "add": c.seconds / times[None] if c else 0.0,
                "bytes": c.total if c else 0,
                "mib": c.total / 2**20 if c else 0.0,
                "rel": c.total / grad_bytes if c and grad_bytes else 0.0,
                "calls": c.collectives if c else 0,
            }
        )
    if args.markdown:
        headers = ["extension", "1 proc", "DDP", "DDP / 1 proc", "reduce", "+ratio",
                   "all-reduced", "× DDP's gradients", "collectives"]
        table = [
            [r["extension"], f"{r['single']:.2f}x", f"{r['ddp']:.2f}x",
             f"{r['ddp'] / r['single']:.2f}x", f"{r['ms']:.1f} ms", f"{r['add']:.2f}",
             _size(r["bytes"]), f"{r['rel']:.2f}x", r["calls"]]
            for r in rows
        ]
        notes = [
            summary,
            "1 proc: ratio to a plain step in one process on the same per-process batch; DDP: "
            "ratio to a plain DDP step; reduce: backprism's reduction after the local pass "
            "(median), +ratio: reduce over the plain DDP step",
            "all-reduced: payload backprism all-reduces per step (not memory); × DDP's "
            "gradients: that payload over DDP's own gradient all-reduce",
        ]
        print_markdown(headers, table, settings, "cpu", threads=args.threads, notes=notes)
        return
    print(summary)
    head = (
        f"{'extension':<16} {'1 proc':>7} {'DDP':>7} {'DDP/1 proc':>10} {'reduce':>9} "
        f"{'+ratio':>6} {'comm MiB':>9} {'x grads':>7} {'collectives':>11}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['extension']:<16} {r['single']:>6.2f}x {r['ddp']:>6.2f}x "
            f"{r['ddp'] / r['single']:>9.2f}x {r['ms']:>6.1f} ms {r['add']:>6.2f} "
            f"{r['mib']:>9.2f} {r['rel']:>6.2f}x {r['calls']:>11}"
        )

def _size(nbytes: int) -> str:
    """``48 B`` below 1 KiB, else MiB."""
    return f"{nbytes} B" if nbytes < 1024 else f"{nbytes / 2**20:.2f} MiB"


if __name__ == "__main__":
    main()
