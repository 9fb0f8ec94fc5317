"""The examples' progress bar: a bar on a terminal, one plain line every few seconds in a log.

Set ``FLEETX_TTY=1`` to get the bar where stdout is not a terminal (under ``fleetrun``, rank
0's output reaches the terminal through a pipe).
"""
from __future__ import annotations

import os
import sys
import time


class Progress:
    """Progress through ``total`` units (samples, tokens, ...), with the latest loss and the rate.

    Args:
        total: units in the whole run.
        enabled: False draws nothing (every rank but the first).
        every: seconds between two lines when stdout is not a terminal.
        unit: the name of a unit, as printed ("samples", "tokens").
    """

    def __init__(self, total: int, enabled: bool, every: float = 5.0,
                 unit: str = "samples") -> None:
        self.total, self.enabled, self.every, self.unit = total, enabled, every, unit
        self.tty = sys.stdout.isatty() or os.environ.get("FLEETX_TTY") == "1"
        self.start = self.last = time.monotonic()

    def update(self, done: int, loss: float) -> None:
        """Show that ``done`` units are done and the last loss was ``loss``."""
        now = time.monotonic()
        if not self.enabled or (not self.tty and now - self.last < self.every):
            return
        self.last = now
        rate = done / max(now - self.start, 1e-9)
        if self.tty:
            filled = int(30 * done / self.total)
            bar = "#" * filled + "." * (30 - filled)
            print(f"\r  [{bar}] {done}/{self.total} loss {loss:.4f} {rate:,.0f} {self.unit}/s",
                  end="", flush=True)
        else:
            print(f"  {done}/{self.total} {self.unit}, loss {loss:.4f}, {rate:,.0f} "
                  f"{self.unit}/s", flush=True)

    def close(self) -> None:
        """End the bar's line (on a terminal)."""
        if self.enabled and self.tty:
            print(flush=True)
