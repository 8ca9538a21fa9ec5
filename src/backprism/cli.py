"""``backprism`` command line (also ``python -m backprism``).

Sub-commands::

    backprism demo [--config economy|business|full] [--steps N] [--out DIR]
    backprism plot LOG [-o out.png] [--watch] [--interval S] [--smoothing S]
    backprism report LOG [-o report.html] [--smoothing S]
    backprism inspect LOG

Bad input (a missing, empty, cut-off or foreign log, an unknown image format) and a missing
optional dependency (``report`` needs ``pip install 'backprism[report]'``) print one line
``backprism: error: ...`` to stderr and exit with status 2, like argparse's usage errors.
``demo`` shows a progress bar (tqdm) only on a terminal; piped, it prints one summary line.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

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


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``backprism`` command."""
    parser = argparse.ArgumentParser(
        prog="backprism",
        description="backprism: look at a training run monitored with backprism.monitor.",
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


_COMMANDS = {"demo": _cmd_demo, "plot": _cmd_plot, "report": _cmd_report,
             "inspect": _cmd_inspect}


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
