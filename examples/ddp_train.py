"""Training under DDP with statistics of the global batch.

    torchrun --nproc-per-node 2 examples/ddp_train.py

Runs unchanged on CPUs (gloo) and on GPUs (nccl, one GPU per process). The training loop is an
ordinary DDP loop; the only backprism lines are ``extend`` and ``with collect(...)`` around
``loss.backward()``. Because the model is wrapped by ``DistributedDataParallel``, ``collect``
reduces over the ranks by itself: ``variance`` and ``diag_ggn_mc`` are those of the global batch
(the same on every rank), per-sample tensors (``batch_l2``) are this rank's rows of the global
batch's. With ``--accumulate K`` the first ``K - 1`` micro-batches run inside ``ddp.no_sync()``
(no communication, local statistics if collected there) and the last one synchronises.

With ``--monitor-log run/monitor.jsonl`` the backward pass runs inside backprism's training
monitor (``configuration("economy")``) instead of a bare ``collect``: every logged value is
that of the global batch, the same on every rank, and only rank 0 writes the log (``backprism
plot run/monitor.jsonl`` then draws the global run). Each rank passes its own local ``info``.

Data: scikit-learn's bundled 8x8 digits if scikit-learn is installed, else a synthetic
10-class problem.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import backprism
from backprism.engine.distributed import describe
from backprism.extensions import BatchL2Grad, DiagGGNMC, Variance
from backprism.monitor import Monitor, configuration


def load_data() -> TensorDataset:
    try:
        from sklearn.datasets import load_digits

        digits = load_digits()
        X = torch.tensor(digits.data, dtype=torch.float32) / 16.0
        y = torch.tensor(digits.target, dtype=torch.long)
    except ImportError:
        g = torch.Generator().manual_seed(0)
        X = torch.randn(1797, 64, generator=g)
        y = (X @ torch.randn(64, 10, generator=g)).argmax(1)
    return TensorDataset(X, y)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64, help="global batch size")
    ap.add_argument("--accumulate", type=int, default=1, help="micro-batches per step")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument(
        "--monitor-log",
        metavar="LOG",
        help="monitor the global batch into this log (written by rank 0; α assumes one "
        "micro-batch per step)",
    )
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))

    data = load_data()
    sampler = DistributedSampler(data, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(data, batch_size=max(1, args.batch_size // world), sampler=sampler)

    torch.manual_seed(0)
    model = backprism.extend(
        nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).to(device)
    )
    ddp = DDP(model, device_ids=[device.index] if cuda else None)
    lossfunc = backprism.extend(nn.CrossEntropyLoss())
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    params = [p for p in model.parameters() if p.requires_grad]
    # every rank builds the monitor (after init_process_group); only rank 0 writes the log
    monitor = None
    if args.monitor_log:
        monitor = Monitor(params, configuration("economy"), log_path=args.monitor_log)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        opt.zero_grad(set_to_none=True)
        for i, (X, y) in enumerate(loader):
            X, y = X.to(device), y.to(device)
            if (i + 1) % args.accumulate:  # accumulate locally, DDP does not communicate
                with ddp.no_sync():
                    (lossfunc(ddp(X), y) / args.accumulate).backward()
                continue
            out = ddp(X)
            loss = lossfunc(out, y) / args.accumulate
            exts = (BatchL2Grad(), Variance(), DiagGGNMC())
            if monitor is None:
                with backprism.collect(*exts) as ctx:
                    loss.backward()
            else:  # this rank's local info; the monitor logs the global batch's values
                losses = nn.functional.cross_entropy(out, y, reduction="none") / args.accumulate
                info = {"loss": loss, "batch_size": len(X), "individual_losses": losses,
                        "optimizer": opt}
                with monitor(step, *exts, info=info):
                    loss.backward(create_graph=monitor.create_graph(step))
            if step % 10 == 0:
                # global statistics: the same numbers on every rank
                variance = sum(p.variance.sum() for p in params)
                ggn_trace = sum(p.diag_ggn_mc.sum() for p in params)
                grad_norm2 = sum(p.grad.square().sum() for p in params)
                # per-sample rows are this rank's: combine them across ranks yourself
                l2 = sum(p.batch_l2 for p in params)
                l2_max = l2.max()
                dist.all_reduce(l2_max, op=dist.ReduceOp.MAX)
                mean_loss = loss.detach() * args.accumulate
                dist.all_reduce(mean_loss)
                if rank == 0:
                    print(
                        f"epoch {epoch} step {step:3d}  loss {mean_loss.item() / world:.3f}  "
                        f"|grad|^2 {grad_norm2.item():.2e}  tr Var {variance.item():.2e}  "
                        f"tr GGN {ggn_trace.item():.2e}  max |g_n|^2 {l2_max.item():.2e}"
                    )
                if step == 0 and rank == 0 and monitor is None:
                    print("communicated per step:\n" + describe(ctx.communication))
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
    if monitor is not None:
        monitor.close()
        if monitor.writes_log:
            log = args.monitor_log
            print(f"monitor log: {log} (draw it: backprism plot {log} -o dashboard.png)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
