"""The demo's console display: a live progress bar (rich), or plain lines for logs and pipes."""

from __future__ import annotations

from typing import Any

from rich.console import Console


class Progress:
    """A live display or plain lines; either way every phase is reported."""

    def __init__(self, console: Console, steps: int, plain: bool) -> None:
        self.console, self.plain = console, plain
        self._progress: Any = None
        if not plain:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as Live

            self._progress = Live(
                TextColumn("[bold]step"),
                MofNCompleteColumn(),
                BarColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.description}"),
                console=console,
                transient=False,
            )
            self._task = self._progress.add_task("starting", total=steps)

    def __enter__(self) -> Progress:
        if self._progress is not None:
            self._progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)

    def phase(self, step: int, text: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, description=text)
        else:
            self.console.print(f"step {step}: {text}")

    def done(self, step: int) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=step)

    def note(self, text: str) -> None:
        self.console.print(text)
