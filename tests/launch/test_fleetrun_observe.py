"""fleetrun and fleet.observe end to end: the example under fleetrun leaves one CSV and one
TensorBoard run per rank, the end-of-job summary names every process, and ``fleetrun --plot``
turns the CSVs into a PNG with one line per rank. A parameter-server job gets its table too."""
from __future__ import annotations

import sys
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_fleetrun import fleetrun_cmd, job_pids, kill_all, run, wait_for  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "observe.py"
ENV_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ps_launch_env.py"


def _summary(stderr: str) -> list[list[str]]:
    lines = stderr.splitlines()
    start = lines.index("fleetrun: job summary")
    assert lines[start + 1].split()[:2] == ["role", "rank"]
    rows = []
    for line in lines[start + 2:]:
        if not line.split() or line.split()[0] not in ("trainer", "worker", "server", "heter"):
            break
        rows.append(line.split())
    return rows


def test_example_under_fleetrun_logs_scalars_summary_and_plot(tmp_path):
    res = run(["--nproc_per_node", "2", EXAMPLE, "--steps", "30", "--every", "5",
               "--scalars_dir", tmp_path / "s"], tmp_path, timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = _summary(res.stderr)
    assert [r[:3] for r in rows] == [["trainer", "0", "ok"], ["trainer", "1", "ok"]]
    for r in rows:  # wall time, peak RSS in MiB and a reported samples/s
        assert r[4] == "s" and float(r[3]) > 0 and r[6] == "MiB" and float(r[5]) > 10
        assert float(r[7]) > 0
    for rank in (0, 1):
        csv = (tmp_path / "s" / f"scalars.{rank}.csv").read_text().splitlines()
        assert csv[0].startswith("step,time,loss,samples_per_s") and len(csv) == 1 + 6
        assert any((tmp_path / "s" / "tb" / f"rank{rank}").iterdir())
    plot = run(["--plot", tmp_path / "s", "--out", tmp_path / "p.png"], tmp_path, timeout=120)
    assert plot.returncode == 0, plot.stderr
    data = (tmp_path / "p.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    from fleetx import plot as plot_module
    assert [len(ax.get_lines()) for ax in plot_module.figure(str(tmp_path / "s")).axes] == [2, 2]


def test_parameter_server_job_prints_a_row_per_process(tmp_path):
    token = f"fleetx-ps-test-{uuid.uuid4().hex}"
    try:
        res = run(["--server_num", "1", "--worker_num", "2", ENV_SCRIPT, token, "fail"],
                  tmp_path, timeout=90)
        assert wait_for(lambda: not job_pids(token), 5), f"orphans: {job_pids(token)}"
    finally:
        kill_all(job_pids(token))
    assert res.returncode == 1, res.stdout + res.stderr
    rows = {(r[0], r[1]): r for r in _summary(res.stderr)}
    assert set(rows) == {("server", "0"), ("worker", "0"), ("worker", "1")}
    assert rows[("worker", "1")][2:5] == ["failed", "(exit", "3)"]
    assert rows[("server", "0")][2:4] == ["killed", "(SIGTERM)"]  # fleetrun stopped it
    assert rows[("worker", "1")][-1] == "-"  # it reported no throughput


def test_without_scalars_dir_the_csv_goes_beside_the_logs_and_plot_reads_the_log_folder(
        tmp_path):
    script = tmp_path / "observed.py"
    script.write_text(
        "import torch\n"
        "from fleetx import fleet\n"
        "fleet.init(is_collective=True)\n"
        "model = fleet.distributed_model(torch.nn.Linear(4, 1))\n"
        "opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))\n"
        "with fleet.observe(batch_size=8, every=2, progress=False) as obs:\n"
        "    for _ in range(6):\n"
        "        loss = model(torch.randn(8, 4)).square().mean()\n"
        "        opt.minimize(loss)\n"
        "        obs.step(loss)\n")
    res = run(["--nproc_per_node", "1", script], tmp_path, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    csv = (tmp_path / "log" / "scalars.0.csv").read_text().splitlines()
    assert csv[0].startswith("step,time,loss") and len(csv) == 1 + 3
    assert not (tmp_path / "log" / "tb").exists()  # no TensorBoard run unless asked
    plot = run(["--plot", tmp_path / "log"], tmp_path, timeout=120)
    assert plot.returncode == 0, plot.stderr
    assert (tmp_path / "log" / "scalars.png").read_bytes()[:4] == b"\x89PNG"
