"""``infinity plot RUN_DIR``: one PNG of a training run's metrics.csv.

Four panels over optimizer steps: loss (training, and validation where it was
measured), learning rate, tokens/s, and each tier's bandwidth (bytes read plus
written per second of step). Written to ``RUN_DIR/metrics.png`` unless
``--output`` names another file. Example::

    infinity train --preset tiny --steps 100 --eval-every 20 --run-dir runs/tiny
    infinity plot runs/tiny
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from infinity.train.metrics_log import METRICS_FILE, read_metrics
from infinity.config.tier_names import TIERS

logger = logging.getLogger(__name__)

PLOT_FILE = "metrics.png"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help=f"a run folder holding {METRICS_FILE} (or the CSV file itself)")
    p.add_argument("-o", "--output", metavar="PNG",
                   help=f"the picture to write, in the format its suffix names (.png, .pdf, .svg) (default "
                        f"RUN_DIR/{PLOT_FILE})")
    p.add_argument("--dpi", type=int, default=100, help="resolution of the picture (default 100)")


def run(args: argparse.Namespace) -> int:
    source = Path(args.run_dir)
    csv_path = source if source.is_file() else source / METRICS_FILE
    if not source.exists():
        raise FileNotFoundError(f"run folder {str(source)!r} does not exist")
    rows = read_metrics(csv_path)
    if not rows:
        raise ValueError(f"{str(csv_path)!r} holds no steps yet")
    if args.dpi <= 0:
        raise ValueError(f"--dpi must be positive, got {args.dpi}")
    output = Path(args.output) if args.output else csv_path.parent / PLOT_FILE
    _check_output(output, "--output " if args.output else "the picture ")
    plot_metrics(rows, output, title=csv_path.parent.name, dpi=args.dpi, file_format=picture_format(output, "--output"))
    print(f"wrote {output} ({len(rows)} steps)")
    return 0


def _check_output(output: Path, said: str) -> None:
    """Before drawing: ``output`` can be a new or replaced file, named as the user gave it (``said``)."""
    where = f"{said}{str(output)!r}"
    if output.is_dir():
        raise IsADirectoryError(f"{where} is a folder: name the picture file in it (e.g. {output / PLOT_FILE})")
    folder = output.parent
    if not folder.is_dir():
        raise FileNotFoundError(f"{where}: folder {str(folder)!r} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PermissionError(f"{where}: folder {str(folder)!r} is not writable")


def picture_format(output, flag: str) -> str:
    """The format of the picture ``output`` (given as ``flag``), from its name's suffix (PNG where it has none); one
    matplotlib cannot write is named before drawing, rather than PNG bytes written under its name."""
    suffix = Path(output).suffix.lower().lstrip(".")
    if not suffix:
        return "png"
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
    except ImportError:
        raise ImportError(f"{flag} needs matplotlib (pip install matplotlib)") from None
    if suffix not in FigureCanvasAgg.get_supported_filetypes():
        raise ValueError(f"{flag} {str(output)!r}: matplotlib cannot write .{suffix} files; name a .png (or .pdf, "
                         f".svg)")
    return suffix


def plot_metrics(rows: list[dict], output: str | Path, *, title: str = "", dpi: int = 100,
                 file_format: str = "png") -> None:
    """Draw ``rows`` (as :func:`read_metrics` returns them) into the picture ``output`` (written atomically), in
    ``file_format`` (png, pdf, svg, ...)."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]

    def series(key):
        return [(r["step"], r[key]) for r in rows if r.get(key) is not None]

    fig, axes = plt.subplots(2, 2, figsize=(10, 6.5), sharex=True)
    (loss_ax, lr_ax), (tok_ax, bw_ax) = axes
    loss_ax.plot(steps, [r.get("loss") for r in rows], label="train", linewidth=1)
    val = series("val_loss")
    if val:
        loss_ax.plot(*zip(*val), "o-", label="validation", markersize=4)
    loss_ax.set_ylabel("loss")
    loss_ax.legend()
    lr_ax.plot(*_unzip(series("lr")), color="tab:purple")
    lr_ax.set_ylabel("learning rate")
    lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    tok_ax.plot(*_unzip(series("tokens_per_s")), color="tab:green")
    tok_ax.set_ylabel("tokens/s")
    for tier in TIERS:
        points = [(r["step"], ((r.get(f"{tier}_bytes_read") or 0) + (r.get(f"{tier}_bytes_written") or 0))
                   / r["step_s"] / 1e9) for r in rows if r.get("step_s")]
        if any(v > 0 for _, v in points):
            bw_ax.plot(*zip(*points), label=tier)
    bw_ax.set_ylabel("tier bandwidth, GB/s (read + written)")
    if bw_ax.get_legend_handles_labels()[0]:
        bw_ax.legend()
    for ax in (tok_ax, bw_ax):
        ax.set_xlabel("step")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    output = Path(output)
    tmp = output.with_name(f".{output.name}.tmp-{os.getpid()}.{file_format}")
    try:
        fig.savefig(tmp, dpi=dpi, format=file_format)
        os.replace(tmp, output)
    except OSError as err:  # named as the user gave it, not by the temporary file beside it
        raise type(err)(f"cannot write the picture {str(output)!r}: {err.strerror or err}") from None
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)


def _unzip(points):
    return zip(*points) if points else ([], [])
