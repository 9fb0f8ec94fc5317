"""What ``fleet.shrink``, ``fleet.print_table_stat`` and ``fleet.save_inference_model`` do,
with servers or alone (:class:`TableCalls`, mixed into the runtime).

* :func:`shrink` ends a pass: every worker calls it; they meet at a barrier (each having sent
  its queued updates), worker 0 asks every server to shrink its tables, and they meet again,
  so that no worker reads a row of the next pass before the shrink is done. In a one-process
  job the local tables shrink at once.
* :func:`table_stats` gathers the memory report of every server (STATS): per sparse table and
  server, rows, bytes by part (values, index, statistics, pending ids, change marks), passes,
  rows created and removed, updates dropped for ids not admitted, ids pending admission;
  :func:`format_table_stats` prints it. It never waits for other workers.
"""
from __future__ import annotations

import os
import resource
from typing import Any, Optional

from fleetx.ps.api import StateError
from fleetx.ps.shard import table_report

__all__ = ["TableCalls", "shrink", "table_stats", "format_table_stats"]

_SUMMED = ("rows", "created", "removed", "dropped_updates", "pending")


def shrink(session: Any, rank: int, threshold: Optional[int]) -> Optional[dict]:
    """End a pass; returns ``{table: {"removed", "forgotten", "rows"}}`` on worker 0 (None on
    the others, which only meet it at the barriers)."""
    if hasattr(session, "backend") and hasattr(session.backend, "tables"):  # no servers
        return {n: {**t.shrink(threshold), "rows": len(t)}
                for n, t in session.backend.tables.items()}
    comm = session.comm
    comm.barrier("fleetx.ps.shrink")
    out = comm.client.shrink(threshold).wait() if rank == 0 else None
    comm.barrier("fleetx.ps.shrunk")
    return out


def table_stats(session: Any) -> dict:
    """The memory report of every server (one entry, this process, without servers)."""
    if hasattr(session, "backend") and hasattr(session.backend, "tables"):
        per_server = [{"server": 0, "tables": {n: table_report(t) for n, t in
                                                session.backend.tables.items()},
                       "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                       * 1024}]
    else:
        per_server = session.comm.client.stats().wait()
    return merge_reports(per_server)


def merge_reports(per_server: list) -> dict:
    """``{"tables": {name: totals + "servers": [...]}, "servers": [...]}`` from each server's
    STATS reply."""
    tables: dict = {}
    for s in per_server:
        for name, rep in s.get("tables", {}).items():
            t = tables.setdefault(name, {k: 0 for k in _SUMMED} | {
                "bytes": 0, "passes": rep["passes"], "entry": rep["entry"],
                "row_bytes": rep["row_bytes"], "servers": []})
            for k in _SUMMED:
                t[k] += rep[k]
            t["bytes"] += sum(rep["bytes"].values())
            t["servers"].append({"server": s["server"], **rep})
    for t in tables.values():
        t["bytes_per_row"] = t["bytes"] / t["rows"] if t["rows"] else 0.0
    return {"tables": tables, "servers": [{"server": s["server"],
                                           "max_rss_bytes": s.get("max_rss_bytes", 0)}
                                          for s in per_server]}


def format_table_stats(report: dict) -> str:
    """The report as lines: one per table, then one per table and server."""
    lines = [f"{'table':<20} {'rows':>12} {'MiB':>9} {'B/row':>7} {'raw B/row':>9} "
             f"{'pending':>9} {'created':>10} {'removed':>9} {'dropped':>9} {'passes':>6}"]
    for name, t in report["tables"].items():
        lines.append(f"{name:<20} {t['rows']:>12} {t['bytes'] / 2 ** 20:>9.2f} "
                     f"{t['bytes_per_row']:>7.1f} {t['row_bytes']:>9} {t['pending']:>9} "
                     f"{t['created']:>10} {t['removed']:>9} {t['dropped_updates']:>9} "
                     f"{t['passes']:>6}")
        for s in t["servers"]:
            parts = ", ".join(f"{k} {v / 2 ** 20:.2f}" for k, v in s["bytes"].items() if v)
            lines.append(f"  server {s['server']}: {s['rows']} rows; MiB: {parts or '0'}")
    for s in report["servers"]:
        lines.append(f"server {s['server']}: max RSS {s['max_rss_bytes'] / 2 ** 20:.0f} MiB")
    return "\n".join(lines)


class TableCalls:
    """The runtime's table-maintenance calls (mixed into :class:`~fleetx.ps_torch.runtime.
    PSRuntime`, which supplies ``is_server``, ``index``, ``model``, ``layout`` and
    ``_started``)."""

    is_server: bool
    index: int

    def _worker_only(self, what: str, why: str) -> Any:
        if self.is_server:
            raise StateError(f"{what}() runs on workers; this process is a server ({why})")
        return self._started(what)

    def shrink(self, threshold: Optional[int] = None) -> Optional[dict]:
        """End a pass (``fleet.shrink``): every worker calls it; once all got there, every
        server decays show/click, deletes the rows its tables' accessors mark (``threshold``
        replaces ``delete_after_unseen_days``) and forgets pending ids not seen in the pass.

        Returns:
            On worker 0 (and alone): ``{table: {"removed", "forgotten", "rows"}}``; else None.

        Raises:
            StateError: on a server, before ``init_worker``, or in inference.
            ValueError: ``threshold`` is not None or an int in ``[0, 2**24)``.
        """
        if threshold is not None and (not isinstance(threshold, int) or isinstance(
                threshold, bool) or not 0 <= threshold < 1 << 24):
            raise ValueError(f"shrink(threshold={threshold!r}): expected None or an int in "
                             "[0, 2**24) (passes a row may go unseen)")
        session = self._worker_only("shrink", "every worker calls it after a pass")
        if getattr(self, "_inference", False):
            raise StateError("shrink() after DistributedInfer.init_distributed_infer_env(): "
                             "this worker only reads, and a shrink removes rows; shrink before "
                             "turning to inference")
        return shrink(session, self.index, threshold)

    def table_stats(self) -> dict:
        """The memory report (``fleet.print_table_stat`` prints it): per sparse table, rows and
        bytes in all and per server.

        Raises:
            StateError: on a server, or before ``init_worker``.
        """
        return table_stats(self._worker_only("table_stats", "a server logs its rows and "
                                             "memory every FLEETX_LOG_INTERVAL seconds"))

    def print_table_stat(self) -> dict:
        """Print :meth:`table_stats` (one line per table, then per table and server) on this
        worker's console, and return it."""
        report = self.table_stats()
        print(format_table_stats(report), flush=True)
        return report

    def save_inference_model(self, dirname: str, feeded_var_names: Any = None,
                             target_vars: Any = None, main_program: Any = None,
                             export_for_deployment: bool = True, mode: int = 0) -> None:
        """Export the model for serving (``fleet.save_inference_model``): on the first worker,
        the dense ``state_dict`` as ``model.pt`` (with the whole weight of every table that
        came from an ``nn.Embedding``) and every sparse table's ids and weights as ``.npy``
        parts, readable without fleetx (:mod:`fleetx.ps_torch.export`); other workers do
        nothing. ``feeded_var_names``, ``target_vars``, ``main_program`` and
        ``export_for_deployment`` have no effect: a torch model has no feed or fetch
        variables, and the export holds the whole model.

        Raises:
            ValueError: ``mode`` other than 0.
            StateError: on a server, or before ``init_worker``.
            fleetx.checkpoint.CheckpointError: a file or the commit cannot be written.
        """
        if mode != 0:
            raise ValueError(f"save_inference_model(mode={mode!r}): only 0 (weights) is "
                             "exported; use save_persistables(dirname, mode) for checkpoints")
        session = self._worker_only("save_inference_model", "the first worker exports")
        if self.index != 0:
            return
        from fleetx.ps_torch.export import describe, export  # torch-facing: loaded on use
        doc = export(session, self.layout, self.model, dirname)
        print(f"fleetx ps worker 0: exported to {os.path.abspath(dirname)} ({describe(doc)})",
              flush=True)
