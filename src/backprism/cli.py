"""``backprism`` command line (also ``python -m backprism``).

Sub-commands::

    backprism demo [--config economy|business|full] [--steps N] [--out DIR]
    backprism plot LOG [-o out.png] [--watch] [--interval S] [--smoothing S]
    backprism report LOG [-o report.html] [--smoothing S]
    backprism inspect LOG
    backprism cost [MODEL] [--config economy|business|full | --quantities Q[@K],...] [--json]

Bad input (a missing, empty, cut-off or foreign log, an unknown image format) and a missing
optional dependency (``report`` needs ``pip install 'backprism[report]'``) print one line
``backprism: error: ...`` to stderr and exit with status 2, like argparse's usage errors.
``demo`` shows a progress bar (tqdm) only on a terminal; piped, it prints one summary line.
``cost`` (:func:`backprism.monitor.cost.cost_estimate` from the command line) shows one only on
a terminal too, and nothing else on stderr but a line naming what it times.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["build_parser", "main"]

EXIT_USAGE = 2


class _UserError(Exception):
    """An error caused by the command's input: reported in one line, exit status 2."""


def _smoothing(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= v < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {v}")
    return v


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {v}")
    return v


def _quantity_names() -> list[str]:
    from backprism.monitor.configuration import DEFAULT_INTERVALS

    return sorted(DEFAULT_INTERVALS, key=str.lower)


def _quantity_list(text: str) -> list[tuple[str, int | None]]:
    """``"Loss,HessTrace@50"`` → ``[("Loss", None), ("HessTrace", 50)]`` (names matched without
    regard to case)."""
    names = {n.lower(): n for n in _quantity_names()}
    out: list[tuple[str, int | None]] = []
    for item in text.split(","):
        name, _, every = item.strip().partition("@")
        if name.lower() not in names:
            raise argparse.ArgumentTypeError(
                f"unknown quantity {name!r}; choose from {', '.join(names.values())}"
            )
        out.append((names[name.lower()], _positive_int(every) if every else None))
    return out


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``backprism`` command."""
    parser = argparse.ArgumentParser(
        prog="backprism",
        description="backprism: look at a training run monitored with backprism.monitor, or time "
        "the monitor on a model.",
    )
    from backprism import __version__

    parser.add_argument("--version", action="version", version=f"backprism {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("demo", help="train a small CNN on 8x8 digits with the monitor",
                       description="Train a small CNN on scikit-learn's bundled 8x8 digits "
                       "with the monitor; write the log, dashboard PNG and HTML report.")
    p.add_argument("--config", choices=("economy", "business", "full"), default="full",
                   help="monitor configuration (default: full)")
    p.add_argument("--steps", type=_positive_int, default=200, help="training steps (200)")
    p.add_argument("--out", default="backprism-demo", help="output folder (backprism-demo)")
    p.add_argument("--batch-size", type=_positive_int, default=64, help="batch size (64)")
    p.add_argument("--lr", type=_positive_float, default=0.2, help="SGD learning rate (0.2)")
    p.add_argument("--seed", type=int, default=0, help="random seed (0)")

    p = sub.add_parser("plot", help="draw the dashboard of a monitor log",
                       description="Draw the instrument panel of a monitor log (PNG, PDF, SVG).")
    p.add_argument("log", help="monitor log (.jsonl)")
    p.add_argument("-o", "--output", help="image file (default: LOG with suffix .png)")
    p.add_argument("--watch", action="store_true",
                   help="live mode: redraw whenever the log grows (Ctrl-C to stop)")
    p.add_argument("--interval", type=_positive_float, default=2.0,
                   help="seconds between checks in --watch mode (2)")
    p.add_argument("--timeout", type=_positive_float, default=None,
                   help="stop --watch after this many seconds")
    p.add_argument("--smoothing", type=_smoothing, default=0.6,
                   help="exponential moving average weight in [0, 1) (0.6)")

    p = sub.add_parser("report", help="write the interactive HTML report of a monitor log",
                       description="Write a self-contained interactive HTML report.")
    p.add_argument("log", help="monitor log (.jsonl)")
    p.add_argument("-o", "--output", help="HTML file (default: LOG with suffix .html)")
    p.add_argument("--smoothing", type=_smoothing, default=0.6,
                   help="exponential moving average weight in [0, 1) (0.6)")

    p = sub.add_parser("inspect", help="print a summary and warnings of a monitor log",
                       description="Print last values and diagnostics of a monitor log.")
    p.add_argument("log", help="monitor log (.jsonl)")

    p = sub.add_parser(
        "cost", help="time the monitor's overhead on a model (per step and amortised)",
        description="Time a plain training step and the monitor's quantities on a model and "
        "print the overhead per step (each quantity tracked at every step) and amortised over "
        "the schedules (Monitor.cost_estimate). Ratios to the plain step; they vary with the "
        "machine's load.")
    p.add_argument("model", nargs="?", default="demo",
                   help="'demo' (the demo's CNN on a random batch of 8x8 images) or "
                   "MODULE:CALLABLE / FILE.py:CALLABLE, a function of no arguments returning "
                   "(model, lossfunc, X, y) (default: demo)")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--config", choices=("economy", "business", "full"),
                      help="monitor configuration (default: full)")
    what.add_argument("--quantities", type=_quantity_list, metavar="Q[@K],...",
                      help="comma-separated quantities, e.g. Loss,GradNorm,HessTrace@50 "
                      "(@K: every K-th step; default: the quantity's default schedule)")
    p.add_argument("--every-step", action="store_true",
                   help="track every quantity at every step (Cockpit's schedules) instead of "
                   "the default schedules")
    p.add_argument("--curvature", choices=("diag_h", "diag_ggn_exact", "diag_ggn_mc",
                                           "hutchinson"),
                   help="curvature of HessTrace, TICDiag and TICTrace (hutchinson: of HessTrace "
                   "only; the others keep their default diag_h)")
    p.add_argument("--steps", type=_positive_int, default=1000,
                   help="horizon of the amortised estimate (1000)")
    p.add_argument("--repeats", type=_positive_int, default=3,
                   help="timed steps per variant, medians (3)")
    p.add_argument("--batch-size", type=_positive_int, default=None,
                   help="batch size of the demo model (64); a user model brings its own X")
    p.add_argument("--lr", type=_positive_float, default=1e-3,
                   help="learning rate of the SGD steps timed (0.001)")
    p.add_argument("--device", default="cpu", help="device of model and data (cpu)")
    p.add_argument("--clock", choices=("wall", "process"), default="wall",
                   help="wall time, or this process's CPU time (steadier on a shared CPU)")
    p.add_argument("--no-per-quantity", dest="per_quantity", action="store_false",
                   help="only the amortised estimate (skip timing every quantity alone)")
    p.add_argument("--seed", type=int, default=0, help="random seed (0)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return parser


def _read(path: str):  # -> RunLog
    """Read the log at ``path``; a cut-off last line gives one ``backprism: warning: ...`` line
    on stderr (the reader's own :class:`~backprism.monitor.log.TruncatedLogWarning` is
    silenced so that it is not reported twice), bad input a :class:`_UserError`."""
    from backprism.monitor.log import TruncatedLogWarning
    from backprism.plot.logdata import read_log

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TruncatedLogWarning)
            log = read_log(path)
    except ValueError as err:
        raise _UserError(str(err)) from None
    if log.truncated:
        print(f"backprism: warning: the last line of {path} is cut off (run still writing or "
              "crashed); it was ignored", file=sys.stderr)
    return log


def _cmd_demo(args: argparse.Namespace) -> None:
    from backprism.demo import run_demo

    print(f"training a small CNN on 8x8 digits for {args.steps} steps "
          f"(monitor configuration {args.config!r})", file=sys.stderr)
    files = run_demo(config=args.config, steps=args.steps, out=args.out,
                     batch_size=args.batch_size, lr=args.lr, seed=args.seed)
    names = {"log": "monitor log", "dashboard": "dashboard", "report": "HTML report"}
    for key, path in files.items():
        print(f"{names[key]:<12} {path}")


def _cmd_plot(args: argparse.Namespace) -> None:
    from backprism.plot import Dashboard

    out = Path(args.output) if args.output else Path(args.log).with_suffix(".png")
    if out.suffix.lower() not in (".png", ".pdf", ".svg"):
        raise _UserError(f"unsupported image format {out.suffix!r}: use .png, .pdf or .svg")
    dash = Dashboard(smoothing=args.smoothing)
    if args.watch:
        if not Path(args.log).exists():
            print(f"backprism: waiting for {args.log} to appear ...", file=sys.stderr)
        from backprism.monitor.log import TruncatedLogWarning

        with warnings.catch_warnings():  # a live run's last line is cut off now and then
            warnings.simplefilter("ignore", TruncatedLogWarning)
            n = dash.watch(args.log, interval=args.interval, out=out, timeout=args.timeout,
                           on_update=lambda log: print(
                               f"redrawn: {log.num_steps} steps -> {out}", file=sys.stderr))
        print(f"{n} redraws; dashboard {out}")
        return
    log = _read(args.log)
    dash.draw(log)
    dash.save(out)
    dash.close()
    print(f"dashboard {out}")


def _cmd_report(args: argparse.Namespace) -> None:
    from backprism.report import write_report
    from backprism.report.figures import require_plotly

    require_plotly()  # a missing extra is reported before the log is read
    out = Path(args.output) if args.output else Path(args.log).with_suffix(".html")
    log = _read(args.log)
    write_report(log, out, smoothing=args.smoothing)
    print(f"HTML report {out}")


def _cmd_inspect(args: argparse.Namespace) -> None:
    from backprism.plot import inspect_log

    print(inspect_log(_read(args.log)))


def _demo_problem(batch_size: int) -> tuple[Any, Any, Any, Any]:
    import torch
    from torch import nn

    from backprism.demo import make_model

    X, y = torch.randn(batch_size, 1, 8, 8), torch.randint(0, 10, (batch_size,))
    return make_model(), nn.CrossEntropyLoss(), X, y


#: the problems ``backprism cost`` knows by name: ``batch size -> (model, lossfunc, X, y)``
PROBLEMS: dict[str, Callable[[int], tuple[Any, Any, Any, Any]]] = {"demo": _demo_problem}


def _user_callable(spec: str) -> Callable[[], Any]:
    """The callable named by ``MODULE:CALLABLE`` or ``FILE.py:CALLABLE`` (a module is looked
    up from the current directory first, as ``python -m`` does)."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise _UserError(f"model {spec!r}: expected {' or '.join(map(repr, PROBLEMS))}, "
                         "MODULE:CALLABLE or FILE.py:CALLABLE")
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise _UserError(f"model {spec!r}: file {where} not found")
        loader = importlib.util.spec_from_file_location(f"_backprism_cost_{path.stem}", path)
        if loader is None or loader.loader is None:  # pragma: no cover - a .py file loads
            raise _UserError(f"model {spec!r}: cannot load {where}")
        module = importlib.util.module_from_spec(loader)
        sys.modules[loader.name] = module  # as an import would (dataclasses, pickle look there)
        loader.loader.exec_module(module)
    else:
        added = os.getcwd() not in sys.path
        if added:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as err:
            if err.name is not None and where.startswith(err.name):
                raise _UserError(f"model {spec!r}: no module named {err.name!r}") from None
            raise
        finally:
            if added:
                sys.path.remove(os.getcwd())
    func = getattr(module, name, None)
    if not callable(func):
        raise _UserError(f"model {spec!r}: {where} has no callable {name!r}")
    try:
        inspect.signature(func).bind()
    except TypeError:
        raise _UserError(f"model {spec!r}: {name} must be callable without arguments") from None
    except ValueError:  # no signature to inspect (some builtins): just call it
        pass
    return func


def _problem(args: argparse.Namespace) -> tuple[Any, Any, Any, Any]:
    """``(model, lossfunc, X, y)`` of ``args.model``, checked."""
    import torch
    from torch import nn

    torch.manual_seed(args.seed)
    if args.model in PROBLEMS:
        built = PROBLEMS[args.model](args.batch_size or 64)
    else:
        if args.batch_size is not None:
            raise _UserError("--batch-size is for the built-in models; a user model's X "
                             "sets the batch size")
        built = _user_callable(args.model)()
    if not (isinstance(built, (tuple, list)) and len(built) == 4):
        raise _UserError(f"model {args.model!r} must return (model, lossfunc, X, y), got "
                         f"{type(built).__name__}")
    model, lossfunc, X, y = built
    for what, m in (("model", model), ("lossfunc", lossfunc)):
        if not isinstance(m, nn.Module):
            raise _UserError(f"model {args.model!r} returned a {what} that is not a torch "
                             f"nn.Module ({type(m).__name__})")
    return model, lossfunc, X, y


def _monitor_quantities(args: argparse.Namespace) -> tuple[list[Any], str]:
    """The quantities to time and a phrase describing them."""
    from backprism.monitor import configuration, quantities, schedules
    from backprism.monitor.configuration import default_schedule

    every = schedules.linear(1) if args.every_step else None
    when = "every step" if args.every_step else "default schedules"
    try:
        if args.quantities is None:
            label = args.config or "full"
            curv: Any = args.curvature
            if curv == "hutchinson":  # HessTrace only; TICDiag keeps its default
                curv = {"HessTrace": "hutchinson"}
            return configuration(label, every, curvature=curv), f"configuration {label!r}, {when}"
        qs = []
        for name, k in args.quantities:
            if k is not None:
                schedule = schedules.linear(k)
            else:
                schedule = every or default_schedule(name)
            kwargs = {}
            if args.curvature is not None and (
                name == "HessTrace" or (name in ("TICDiag", "TICTrace")
                                        and args.curvature != "hutchinson")
            ):
                kwargs["curvature"] = args.curvature
            qs.append(getattr(quantities, name)(schedule, **kwargs))
    except (ValueError, KeyError, TypeError) as err:
        raise _UserError(str(err).strip("'\"")) from None
    return qs, f"{len(qs)} quantities, {when} unless @K"


class _CostProgress:
    """``cost_estimate``'s ``progress`` as a tqdm bar on ``stream`` if it is a terminal (and
    tqdm is installed); otherwise nothing."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.bar: Any = None
        self.tqdm: Any = None
        if hasattr(stream, "isatty") and stream.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self.tqdm = tqdm

    def __call__(self, done: int, total: int, label: str) -> None:
        if self.tqdm is None:
            return
        if self.bar is None:
            self.bar = self.tqdm(total=total, file=self.stream, unit="variant", desc="timing",
                                 dynamic_ncols=True, leave=False)
        self.bar.n = done
        self.bar.set_postfix_str(label, refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _cmd_cost(args: argparse.Namespace) -> None:
    import torch

    import backprism
    from backprism.monitor import Monitor
    from backprism.monitor.cost import cost_estimate

    try:
        device = torch.device(args.device)
    except RuntimeError as err:
        raise _UserError(f"--device: {err}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise _UserError("--device cuda: no CUDA device is available")
    qs, described = _monitor_quantities(args)
    model, lossfunc, X, y = _problem(args)
    model, lossfunc = backprism.extend(model.to(device)), backprism.extend(lossfunc.to(device))
    X = X.to(device) if isinstance(X, torch.Tensor) else X
    y = y.to(device) if isinstance(y, torch.Tensor) else y
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise _UserError(f"model {args.model!r} has no trainable parameters")
    batch = int(X.shape[0]) if isinstance(X, torch.Tensor) else len(X)
    n_params = sum(p.numel() for p in params)
    print(f"timing the monitor on {args.model} ({n_params:,} parameters, batch {batch}, "
          f"{device}): {described}", file=sys.stderr)
    monitor = Monitor(params, qs)
    progress = _CostProgress(sys.stderr)
    try:
        report = cost_estimate(
            monitor, model, X, y, lossfunc=lossfunc, lr=args.lr, steps=args.steps,
            repeats=args.repeats, verbose=False, per_quantity=args.per_quantity,
            clock=time.process_time if args.clock == "process" else time.perf_counter,
            progress=progress,
        )
    except (RuntimeError, ValueError) as err:  # the monitor's own diagnostics: one line
        if not str(err).startswith("backprism"):
            raise
        raise _UserError(str(err)) from None
    finally:
        progress.close()
        monitor.close()
    if args.json:
        setup = {
            "model": args.model, "parameters": n_params, "batch_size": batch,
            "device": str(device), "configuration": None if args.quantities else
            (args.config or "full"), "every_step": args.every_step,
            "curvature": args.curvature, "steps": args.steps, "repeats": args.repeats,
            "clock": args.clock,
        }
        data = {"setup": setup, **report.to_dict()}
        print(json.dumps(data, indent=2, allow_nan=False))
        return
    print(f"{args.model}: {n_params:,} parameters, batch {batch}, {device}; {described}")
    print(report)


_COMMANDS = {"demo": _cmd_demo, "plot": _cmd_plot, "report": _cmd_report,
             "inspect": _cmd_inspect, "cost": _cmd_cost}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``backprism`` command; returns the exit status (0 ok, 2 bad input)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _COMMANDS[args.command](args)
    except _UserError as err:
        print(f"backprism: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except ImportError as err:
        print(f"backprism: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
