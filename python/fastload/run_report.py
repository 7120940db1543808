"""``python -m fastload run --report``: a table per loader when the script ends.

Each loader's :class:`fastload.stats.meter.EpochMeter` announces itself on
the ``fastload.stats`` logger when an epoch begins; :class:`ReportHandler`
keeps the meters it hears of (small objects holding figures, not loaders)
and :func:`format_report` prints their epochs, including one the script
left unfinished.
"""

from __future__ import annotations

import logging
from typing import Dict, List

from .stats.meter import EpochMeter, stats_log
from .stats.loader_stats import LoaderStats, WAIT_SHARE_TO_REPORT, advice

__all__ = ["ReportHandler", "format_report"]


class ReportHandler(logging.Handler):
    """Collects the meters of every loader that runs while it is attached."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.meters: Dict[int, EpochMeter] = {}  # id -> meter, in the order first heard of

    def emit(self, record: logging.LogRecord) -> None:
        meter = getattr(record, "fastload_meter", None)
        if isinstance(meter, EpochMeter):
            self.meters.setdefault(id(meter), meter)

    def attach(self) -> None:
        """Listen on the ``fastload.stats`` logger (records stay there)."""
        stats_log.addHandler(self)
        stats_log.setLevel(logging.DEBUG)
        stats_log.propagate = False

    def detach(self) -> None:
        stats_log.removeHandler(self)
        stats_log.propagate = True
        stats_log.setLevel(logging.NOTSET)


_COLUMNS = ("epoch", "batches", "samples/s", "wait", "wait p50/p99 ms", "make p50/p99 ms",
            "workers busy", "workers", "copied", "restarts")


def _row(s: LoaderStats) -> List[str]:
    busy = (f"{sum(s.worker_busy_share) / len(s.worker_busy_share):.0%}"
            if s.worker_busy_share else "-")
    return [f"{s.epoch}{'' if s.finished else ' (unfinished)'}", str(s.batches),
            f"{s.samples_per_s:,.0f}", f"{s.wait_share:.0%}",
            f"{s.wait_ms.p50:.2f} / {s.wait_ms.p99:.2f}", f"{s.make_ms.p50:.2f} / {s.make_ms.p99:.2f}",
            busy, str(s.workers), str(s.copied_batches), str(s.restarts)]


def format_report(meters: List[EpochMeter], max_rows: int = 20) -> str:
    """A table per loader: one row per epoch (the last ``max_rows``), then
    what bounded its last epoch when the loop waited for batches."""
    if not meters:
        return "fastload report: no loader ran on fastload.\n"
    out: List[str] = []
    for n, meter in enumerate(meters, 1):
        epochs = list(meter.history)
        if not meter.finished and meter.epoch >= 0:
            epochs.append(meter.stats(at_last_batch=True))
        out.append(f"fastload report, loader {n}: {meter.label}")
        rows = [list(_COLUMNS)] + [_row(s) for s in epochs[-max_rows:]]
        if len(epochs) > max_rows:
            out.append(f"  (the last {max_rows} of {len(epochs)} epochs)")
        widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
        for r in rows:
            out.append("  " + "  ".join(c.rjust(w) for c, w in zip(r, widths)))
        if epochs and epochs[-1].wait_share > WAIT_SHARE_TO_REPORT:
            out.append("  " + advice(epochs[-1], meter.auto, meter.started_with))
        out.append("")
    return "\n".join(out)
