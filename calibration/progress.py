"""The progress bar of a calibration fit."""

from __future__ import annotations


class FitProgress:
    """A small rich progress bar (steps and loss); silent when not on a terminal."""

    def __init__(self, total):
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self._p = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TextColumn("{task.fields[loss]}"),
            TimeElapsedColumn(),
            transient=True,
        )
        # the first step compiles the whole fit (tens of seconds) before any loss exists
        self._task = self._p.add_task("compiling the fit step", total=total, loss="")
        self._p.start()

    def update(self, done, loss):
        self._p.update(
            self._task, completed=done, loss=f"loss {loss:.4g}", description="calibrating"
        )

    def close(self):
        self._p.stop()
