"""What tale-convert prints around tale_convert.convert: progress (a live bar in a terminal, one whole line per layer
elsewhere), warnings, then the report (with as_json, the one JSON object on stdout). No torch here."""

from __future__ import annotations

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from tale_runtime import console


class Display:
    """The callbacks of tale_convert.convert (on_layer, log, warn) printing as tale-convert does; `report(...)`
    prints the report once it returns. stdout: progress and report (with as_json: the JSON object only, progress on
    stderr); stderr: warnings. Entered around the call: the live bar lasts while it runs."""

    def __init__(self, as_json: bool = False, quiet: bool = False, verbose: bool = False):
        self.as_json, self.verbose = as_json, verbose
        self.report_to = console.rich_console(quiet=quiet or as_json)
        self.progress_to = console.rich_console(stderr=True, quiet=quiet) if as_json else self.report_to
        self.err_to = console.rich_console(stderr=True, quiet=quiet)
        self.warned: list[str] = []
        self.bar: Progress | None = None

    def __enter__(self) -> Display:
        quiet_libraries()
        if self.progress_to.is_terminal:  # a live bar, rewritten in place
            self.bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=self.progress_to,
                transient=True,
            )
            self.bar.__enter__()
            self.task = self.bar.add_task("calibrating + factorizing layers", total=None)
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)
            self.bar = None

    def on_layer(self, lr, total: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, total=total, advance=1)
            return
        reused = " (reused)" if lr.reused else ""  # a pipe or a log file: one whole line per event, as it happens
        self.progress_to.print(
            f"layer {lr.index + 1}/{total}: energy kept at r0 {lr.energy[0]:.4f}, {lr.seconds:.1f} s{reused}",
            markup=False,
        )

    def log(self, s: str) -> None:
        if self.bar is not None:
            self.bar.console.print(s)
        else:
            self.progress_to.print(s, markup=False)

    def warn(self, msg: str) -> None:
        self.warned.append(msg)
        self.err_to.print(f"warning: {msg}", markup=False)

    def report(self, report) -> None:
        few = any("calibration tokens" in w for w in self.warned)
        summary(self.report_to, report, few_tokens=few, verbose=self.verbose)
        if self.as_json:
            console.print_json(report_dict(report, self.warned))


def quiet_libraries() -> None:
    """Their tqdm bars and info logs would interleave with ours on stderr."""
    import transformers

    try:  # optional: only --calib .parquet uses it
        import datasets

        datasets.disable_progress_bars()
        if not console.debug():  # datasets logs a failed read at ERROR level before raising it
            datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    except ImportError:
        pass
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def report_dict(report, warnings: list[str]) -> dict:
    return {
        "out": str(report.out),
        "nominal_ratio": report.nominal_ratio,
        "seconds": round(report.seconds, 3),
        "peak_rss_bytes": report.peak_rss,
        "peak_device_bytes": report.peak_device,
        "layers": [
            {
                "index": lr.index,
                "energy_kept": lr.energy,
                "eps": lr.eps,
                "seconds": round(lr.seconds, 3),
                "reused": lr.reused,
            }
            for lr in report.layers
        ],
        "key_ranks": report.key_ranks,
        "warnings": warnings,
    }


def summary(to, report, few_tokens: bool = False, verbose: bool = False) -> None:
    """The report: one line on the energy kept (the per-layer table with --verbose), where it went, what it cost."""
    caveat = " (not meaningful: too few calibration tokens)" if few_tokens else ""
    if verbose:
        t = Table(title="per layer")
        for col in ("layer", "energy kept at r0" + caveat, "whitening eps", "time (s)"):
            t.add_column(col, justify="right")
        for lr in report.layers:
            seconds = f"{lr.seconds:.1f}" + (" (reused)" if lr.reused else "")
            t.add_row(str(lr.index), f"{lr.energy[0]:.4f}", f"{lr.eps:g}", seconds)
        to.print(t)
    elif report.layers:
        e = [lr.energy[0] for lr in report.layers]
        low = min(range(len(e)), key=e.__getitem__)
        to.print(
            f"energy kept at r0{caveat}: mean {sum(e) / len(e):.4f}, lowest {e[low]:.4f} (layer "
            f"{report.layers[low].index}) over {len(e)} layers; --verbose shows each layer",
            markup=False,
        )
    for j in range(len(report.key_ranks[0]) if report.key_ranks else 0):  # --key-rank-policy energy
        ranks = [row[j] for row in report.key_ranks]
        if any(ranks):
            to.print(f"key ranks at level {j}, per layer: {', '.join(map(str, ranks))}", markup=False)
    dev = f", device peak {report.peak_device / 2**30:.2f} GiB" if report.peak_device is not None else ""
    to.print(
        f"wrote {report.out}\nnominal ratio {report.nominal_ratio:.2f}x, total {report.seconds:.1f} s, "
        f"peak RSS {report.peak_rss / 2**30:.2f} GiB{dev}",
        markup=False,
    )
