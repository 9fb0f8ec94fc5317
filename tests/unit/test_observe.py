"""fleetx.observe: the Observer's rows, bar and files; the summary table's pieces; fleetx.plot."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from fleetx.launch import summary
from fleetx.observe import COLUMNS, MissingExtraError, Observer, read_scalars, require
from fleetx.observe.api import read_throughput, throughput_path

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_rows_every_n_steps_with_mean_loss_and_samples_per_second(tmp_path):
    clock = Clock()
    obs = Observer(rank=1, batch_size=4, every=2, scalars_dir=str(tmp_path), tensorboard=False,
                   extras=lambda: {"loss_scale": 8.0, "dgc_sparsity": None}, clock=clock,
                   throughput_file=throughput_path(str(tmp_path), 1))
    for loss in (1.0, 3.0, 5.0):
        clock.t += 0.5
        obs.step(torch.tensor(loss))
    obs.close()  # logs step 3, the remainder
    rows = read_scalars(str(tmp_path / "scalars.1.csv"))
    assert [r["step"] for r in rows] == [2, 3]
    assert rows[0]["loss"] == 2.0 and rows[0]["samples_per_s"] == 8 / 1.0
    assert rows[1]["loss"] == 5.0 and rows[1]["samples_per_s"] == 4 / 0.5
    assert rows[0]["loss_scale"] == 8.0 and rows[0]["dgc_sparsity"] is None
    assert read_throughput(str(tmp_path), 1) == 12 / 1.5
    assert (tmp_path / "scalars.1.csv").read_text().splitlines()[0] == ",".join(COLUMNS)


def test_the_kept_losses_are_read_at_once_and_their_mean_is_that_of_the_per_step_means(
        monkeypatch):
    from fleetx.observe.observer import _mean
    scalars = [torch.tensor(v, requires_grad=True) * 1.5 for v in (0.1, 0.2, 0.7)]
    reads = []
    item = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda t: reads.append(1) or item(t))
    assert _mean(scalars) == pytest.approx((0.15 + 0.3 + 1.05) / 3, rel=1e-7)
    assert len(reads) == 1  # one read (one device synchronisation), not one per step
    monkeypatch.undo()
    mixed = [torch.tensor([1.0, 3.0]), 4.0, torch.tensor(6.0, dtype=torch.float64)]
    assert _mean(mixed) == pytest.approx((2.0 + 4.0 + 6.0) / 3)  # per-loss means, then mean
    assert _mean([]) is None and _mean([torch.tensor(2.5)]) == 2.5


def test_a_restarted_process_goes_on_with_its_ranks_rows_and_a_new_run_starts_afresh(
        tmp_path, monkeypatch):
    def run(losses):
        with Observer(rank=0, every=1, scalars_dir=str(tmp_path), tensorboard=False,
                      progress=False) as obs:
            for loss in losses:
                obs.step(loss, samples=1)
        return [r["loss"] for r in read_scalars(str(tmp_path / "scalars.0.csv"))]
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert run([1.0, 2.0]) == [1.0, 2.0]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # fleetrun restarted this rank
    assert run([3.0]) == [1.0, 2.0, 3.0]
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")  # a new run in the same folder
    assert run([4.0]) == [4.0]


def test_tensorboard_run_per_rank(tmp_path):
    with Observer(rank=3, every=1, scalars_dir=str(tmp_path)) as obs:
        obs.step(0.5, samples=2)
    events = os.listdir(tmp_path / "tb" / "rank3")
    assert any(name.startswith("events.out.tfevents") for name in events)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tmp_path / "tb" / "rank3"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("loss")] == [0.5]


def test_bar_only_on_rank_0_hidden_without_a_terminal_unless_forced():
    assert Observer(rank=1, force_progress=True).bar is None
    hidden = Observer(rank=0)  # pytest captures stderr: not a terminal, as tqdm's disable=None
    assert hidden.bar.disable
    forced = Observer(rank=0, total=3, batch_size=2, force_progress=True)
    forced.step(1.0)
    assert not forced.bar.disable and forced.bar.n == 2 and forced.bar.total == 6
    forced.close()
    assert Observer(rank=0, progress=False).bar is None


def test_bad_arguments_and_unknown_scalars_are_named(tmp_path):
    with pytest.raises(ValueError, match="every must be an int >= 1, got 0"):
        Observer(every=0)
    obs = Observer(rank=0, progress=False, every=1, scalars_dir=str(tmp_path), tensorboard=False,
                   extras=lambda: {"lr": 0.1})
    with pytest.raises(KeyError, match=r"unknown scalar\(s\) \['lr'\]; known: \['step'"):
        obs.step(1.0)


def test_a_missing_library_names_the_extra():
    with pytest.raises(MissingExtraError, match=r'the bar needs no_such_lib_x, which is not '
                                                r'installed: pip install "fleetx\[observe\]"'):
        require("no_such_lib_x.sub", "the bar")


def test_fleetx_imports_without_the_observe_libraries():
    code = ("import sys\nfor m in ('tqdm', 'tensorboard', 'matplotlib'): sys.modules[m] = None\n"
            "import fleetx, fleetx.fleet, fleetx.observe, fleetx.plot, fleetx.launch.summary\n"
            "from fleetx.observe import Observer\nObserver(progress=False).step(1.0)\n"
            "try:\n    Observer(rank=0)\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert 'the progress bar needs tqdm, which is not installed: pip install "fleetx[observe]"' \
        in out.stdout


def test_summary_words_and_table():
    assert [summary.exit_words(c) for c in (0, 3, -9, None)] == [
        "ok", "failed (exit 3)", "killed (SIGKILL)", "stopped"]
    rows = [summary.SummaryRow("worker", 0, 0, 2.0, 2048, 12.5, (0.0123, 0.0456, 1.5)),
            summary.SummaryRow("server", 1, -15, 3.25, None, None)]
    lines = summary.format_table(rows).splitlines()
    assert lines[0] == "fleetrun: job summary"
    assert lines[1].split() == ["role", "rank", "exit", "status", "wall", "time", "peak", "RSS",
                                "samples/s", "step", "p50", "step", "p99", "busy", "p50"]
    assert lines[2].split() == ["worker", "0", "ok", "2.0", "s", "2.0", "MiB", "12.5", "12.3",
                                "ms", "45.6", "ms", "1.5", "s"]
    assert lines[3].split() == ["server", "1", "killed", "(SIGTERM)", "3.2", "s", "-", "-", "-",
                                "-", "-"]


def test_step_time_percentiles_come_back_from_the_histogram(tmp_path):
    from fleetx.observe.steptimes import StepTimes, read_step_times
    assert read_step_times(str(tmp_path), 3) is None
    record = StepTimes(str(tmp_path), 3)
    for i in range(1000):
        record.add(0.010 if i < 985 else 2.0, 0.004)
    p50, p99, busy = read_step_times(str(tmp_path), 3)
    # each bucket is 2 ** (1/16) wide: a value comes back within about 2.2 %
    assert abs(p50 / 0.010 - 1) < 0.025 and abs(p99 / 2.0 - 1) < 0.025
    assert abs(busy / 0.004 - 1) < 0.025


def test_watch_reads_the_peak_rss_of_a_live_process(tmp_path):
    clock = Clock()
    watch = summary.ProcessWatch(clock)
    child = subprocess.Popen([sys.executable, "-c", "b = bytearray(64 << 20); input()"],
                             stdin=subprocess.PIPE)
    try:
        watch.started(("worker", 0), child.pid)
        import time
        deadline = time.monotonic() + 20
        while (summary.peak_rss_kb(child.pid) or 0) < 64 << 10 and time.monotonic() < deadline:
            time.sleep(0.05)
        clock.t = 1.5
        watch.poll(("worker", 0), child.pid, None)
    finally:
        child.communicate(b"\n", timeout=20)
    clock.t = 2.0
    watch.poll(("worker", 0), child.pid, child.returncode)
    (row,) = watch.rows(str(tmp_path))
    assert row.exit_code == 0 and row.wall_s == 2.0 and row.samples_per_s is None
    assert row.peak_rss_kb >= 64 << 10  # the 64 MiB the child held


def test_plot_draws_one_line_per_rank_into_a_png(tmp_path):
    from fleetx import plot
    for rank in range(3):
        with Observer(rank=rank, progress=False, every=1, scalars_dir=str(tmp_path),
                      tensorboard=False) as obs:
            for i in range(4):
                obs.step(float(i + rank), samples=8)
    fig = plot.figure(str(tmp_path))
    assert [len(ax.get_lines()) for ax in fig.axes] == [3, 3]
    out = plot.plot(str(tmp_path), str(tmp_path / "o.png"))
    data = open(out, "rb").read()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000
    assert plot.main([str(tmp_path / "empty")]) == 1
