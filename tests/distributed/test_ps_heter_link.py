"""Heter workers in one process (server, heter worker and trainers on threads, real loopback
sockets; ``heter_cluster.py``): the lock-step job equals one plain torch process, the heter
worker's link survives strangers (garbage, a wrong secret, a holder of the secret speaking
nonsense, a huge length) and still serves its trainer exactly, and the device guard picks CUDA
when there is one."""
import dataclasses
import queue
import socket
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import heter_cluster as hc  # noqa: E402
from helpers import free_ports  # noqa: E402
from ps_attack import SECRET, frame, read_until_closed  # noqa: E402

from fleetx.ps import AuthError, PSConfig  # noqa: E402
from fleetx.ps.api import HEADER, WIRE_MAGIC, WIRE_VERSION, Kind, Message, StateError  # noqa: E402
from fleetx.ps.handshake import connect  # noqa: E402
from fleetx.ps.transport import Link  # noqa: E402
from fleetx.ps_torch.heter_sections import heter_device  # noqa: E402
from fleetx.ps_torch.layout import ModelLayout  # noqa: E402

LR = 0.5


def cluster(workers: int, mode: str = "sync") -> PSConfig:
    s, h = free_ports(2)
    return PSConfig([f"127.0.0.1:{s}"], workers, mode=mode, heartbeat_interval=0.3,
                    dead_after=3.0, timeout=30.0, secret=SECRET,
                    heter_workers=(f"127.0.0.1:{h}",))


def run_job(config: PSConfig, steps: int, guard: str = "cpu", before_trainers=None,
            save=None, after=None) -> dict:
    roles = hc.Roles()
    roles.start("server", lambda: hc.serve(config, "server", LR))
    roles.start("heter", lambda: hc.serve(config, "heter", LR, guard))
    if before_trainers:
        before_trainers(config)
    for r in range(config.num_workers):
        roles.start(f"trainer {r}", lambda r=r: hc.train(config, r, steps, LR, save, after))
    roles.join()
    assert not roles.errors, "\n".join(f"{k}:\n{v}" for k, v in roles.errors.items())
    return {r: roles.results[f"trainer {r}"] for r in range(config.num_workers)}


def test_the_layout_gives_the_section_its_own_tables():
    model = hc.make()
    layout = ModelLayout.of(model, torch.optim.SGD(model.parameters(), lr=LR))
    assert [t.name for t in layout.tables.dense] == ["dense.0", "heter.0"]
    assert layout.tables.get("heter.0").numel == sum(p.numel() for p in model.mlp.parameters())
    assert layout.heter_tables() == ["heter.0"] and list(layout.heter) == ["mlp"]
    mine = layout.restricted(["dense.0"])
    assert list(mine.dense_values()) == ["dense.0"] and mine.tables is layout.tables


def test_lock_step_heter_job_equals_one_torch_process():
    results = run_job(cluster(workers=2), steps=4)
    expected = hc.reference(4, LR)
    for rank, got in results.items():
        for key, value in expected.items():
            np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-6,
                                       err_msg=f"trainer {rank}: {key}")


def _replies(sock: socket.socket):
    """A Link over an authenticated raw socket, and the queue of what comes back."""
    got: queue.Queue = queue.Queue()
    link = Link(sock, "heter worker", lambda _, m: got.put(m), lambda _, r: got.put(r), 3.0)
    return link.start(), got


def _attack(config: PSConfig) -> None:
    """Strangers call on the heter worker before its trainer does."""
    host, port = config.heter_workers[0].rsplit(":", 1)
    sock = connect(host, int(port), "heter worker 0", 30.0, SECRET.encode())  # up and listening
    link, got = _replies(sock)
    nonsense = [(Message(Kind.PULL, 1, {}), "unexpected PULL frame"),
                (Message(Kind.HETER_FORWARD, 2, {"section": "mlp"}),
                 "HETER_FORWARD before HETER_HELLO"),
                (Message(Kind.HETER_HELLO, 3, {"rank": 5}),
                 "trainer rank 5 is not one of this heter worker's trainers [0]"),
                (Message(Kind.HETER_HELLO, 4, {"rank": 0, "fingerprint": "x", "mode": "sync"}),
                 "trainer 0 has another table layout or mode"),
                (Message(Kind.HETER_STEP, 5, {"step": 0}), "HETER_STEP before HETER_HELLO")]
    for msg, words in nonsense:
        link.send(msg)
        reply = got.get(timeout=10)
        assert reply.is_error and words in reply.meta["message"], reply
    link.close()
    garbage = socket.create_connection((host, int(port)), timeout=10)  # no handshake at all
    garbage.sendall(b"GET / HTTP/1.0\r\n\r\n" + bytes(range(256)) * 8)
    data, closed = read_until_closed(garbage)
    assert closed and data[:4] == b"FXPA"  # the challenge, then the door shuts
    with pytest.raises(AuthError, match="rejected this process's secret"):
        connect(host, int(port), "heter worker 0", 10.0, b"not the secret")
    huge = connect(host, int(port), "heter worker 0", 10.0, SECRET.encode())
    huge.sendall(HEADER.pack(WIRE_MAGIC, WIRE_VERSION, int(Kind.HETER_FORWARD), 0, 1, 1, 2,
                             1 << 40) + frame(Kind.HEARTBEAT)[HEADER.size:])
    assert read_until_closed(huge)[1]  # cut before anything is allocated
    raw_meta = connect(host, int(port), "heter worker 0", 10.0, SECRET.encode())
    raw_meta.sendall(frame(Kind.HETER_HELLO, [1, 2]))  # a list where an object belongs
    data, _ = read_until_closed(raw_meta, timeout=2)
    assert b"the meta block must be a JSON object" in data


def test_strangers_are_refused_and_the_trainer_is_still_served_exactly():
    config = cluster(workers=1)
    results = run_job(config, steps=3, before_trainers=_attack)
    expected = hc.reference(3, LR)
    for key, value in expected.items():
        np.testing.assert_allclose(results[0][key], value, rtol=1e-5, atol=1e-6, err_msg=key)


def test_a_heter_jobs_save_loads_into_a_job_without_heter_workers(tmp_path):
    config = dataclasses.replace(cluster(workers=2, mode="async"), save_root=str(tmp_path))
    trained = run_job(config, steps=5, save=str(tmp_path / "ckpt"))
    plain = dataclasses.replace(config, heter_workers=(), servers=(
        f"127.0.0.1:{free_ports(1)[0]}",))
    roles = hc.Roles()
    roles.start("server", lambda: hc.serve_save(plain, str(tmp_path / "ckpt"), LR))
    for r in range(2):
        roles.start(f"worker {r}", lambda r=r: hc.score(plain, r, LR))
    roles.join()
    assert not roles.errors, roles.errors
    for r in range(2):  # the MLP, now run by the workers, holds the weights the heter pushed
        got = roles.results[f"worker {r}"]
        for key, value in got.items():
            np.testing.assert_array_equal(value, trained[0][key], err_msg=key)


def test_after_turning_to_inference_saves_of_every_kind_and_exports_work(tmp_path):
    def after(rt):
        if rt.index != 0:
            return None
        rt.save_persistables(str(tmp_path / "base"), mode=1)
        rt.save_persistables(str(tmp_path / "delta"), mode=2)
        rt.save_inference_model(str(tmp_path / "export"))
        with pytest.raises(StateError, match=r"shrink\(\) after DistributedInfer"):
            rt.shrink()
        return rt.table_stats()["tables"]["emb"]["rows"]

    config = dataclasses.replace(cluster(workers=2, mode="async"), save_root=str(tmp_path))
    results = run_job(config, steps=4, save=str(tmp_path / "ckpt"), after=after)
    assert results[0]["after"] == hc.VOCAB  # the report of the servers' rows, read in inference
    for folder in ("ckpt", "base", "delta", "export"):
        assert (tmp_path / folder / "manifest.json").is_file(), folder
    assert torch.load(next((tmp_path / "export").glob("save-*/model.pt")))["pre.weight"].shape \
        == (hc.DIM, hc.NDENSE)


def test_async_heter_job_trains():
    results = run_job(cluster(workers=2, mode="async"), steps=6)
    for got in results.values():
        assert np.isfinite(got["losses"]).all()
        assert not np.allclose(got["mlp.0.weight"], hc.weights(hc.make())["mlp.0.weight"])


def test_the_device_guard_picks_the_device_and_says_why():
    assert heter_device("cpu") == (torch.device("cpu"), "heter_worker_device_guard='cpu': CPU")
    assert heter_device("gpu", cuda=True)[0] == torch.device("cuda", 0)
    assert heter_device("gpu", cuda=False) == (
        torch.device("cpu"), "heter_worker_device_guard='gpu', but no CUDA device: CPU")
    assert heter_device("xpu", xpu=False)[1].endswith("but no XPU device: CPU")
    with pytest.raises(ValueError, match=r"heter_worker_device_guard='tpu': expected one of "
                                         r"cpu, gpu, xpu"):
        heter_device("tpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_heter_worker_runs_the_section_there_and_trains_alike():
    results = run_job(cluster(workers=2), steps=4, guard="gpu")
    expected = hc.reference(4, LR)
    for got in results.values():
        for key, value in expected.items():  # GPU kernels round differently: 1e-5, not bits
            np.testing.assert_allclose(got[key], value, rtol=1e-4, atol=1e-5, err_msg=key)


def test_the_ps_config_carries_the_heter_workers():
    config = cluster(workers=2)
    assert config.num_heter_workers == 1 and config.connection_limit == 2 * 3 + 16
    with pytest.raises(ValueError, match=r"PSConfig.heter_workers: 'nowhere' is not host:port"):
        dataclasses.replace(config, heter_workers=("nowhere",))


def test_a_save_right_after_async_training_holds_every_section_step(tmp_path, monkeypatch):
    """The heter worker's pushes are slowed down (0.3 s each): without HETER_FLUSH the save
    would miss the steps still queued there."""
    from fleetx.ps_torch import heter_worker

    def slow_communicator(*args, **kwargs):
        comm = make(*args, **kwargs)
        push = comm.client.push

        def slow_push(*a, **kw):
            time.sleep(0.3)
            return push(*a, **kw)
        comm.client.push = slow_push
        return comm
    make = heter_worker.make_communicator
    monkeypatch.setattr(heter_worker, "make_communicator", slow_communicator)

    def trainer(config):
        rt, model = hc.runtime(config, "worker", 0, LR)
        rt.init_worker()
        for step in range(4):
            hc.loss_of(model, *hc.batch(step)).backward()
            rt.step()
            rt.zero_grad()
        rt.save_persistables(str(tmp_path / "ckpt"))  # right away: steps still queued
        rt.init_inference()  # BYE: every step reached the servers; the MLP comes back
        out = hc.weights(model)
        rt.stop_worker()
        return out

    config = dataclasses.replace(cluster(workers=1, mode="async"), save_root=str(tmp_path))
    roles = with_heter_worker(config, lambda: trainer(config))
    assert not roles.errors, roles.errors
    final = roles.results["trainer 0"]
    assert not np.allclose(final["mlp.0.weight"], hc.weights(hc.make())["mlp.0.weight"])
    plain = dataclasses.replace(config, heter_workers=(), servers=(
        f"127.0.0.1:{free_ports(1)[0]}",))
    roles = hc.Roles()
    roles.start("server", lambda: hc.serve_save(plain, str(tmp_path / "ckpt"), LR))
    roles.start("worker 0", lambda: hc.score(plain, 0, LR))
    roles.join()
    assert not roles.errors, roles.errors
    saved = roles.results["worker 0"]
    for key in ("mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias"):
        np.testing.assert_array_equal(saved[key], final[key], err_msg=key)


def test_a_heter_worker_that_stops_answering_is_named_after_the_timeout(monkeypatch):
    """Its link stays alive (heartbeats) while its section never returns: the trainer's
    forward fails after FLEETX_TIMEOUT (here 2 s) naming the heter worker, not a hang."""
    import threading

    from fleetx.ps import PSTimeoutError
    from fleetx.ps_torch import heter_sections
    gate = threading.Event()
    call = heter_sections.Section.__call__

    def stuck(self, inputs):
        gate.wait(60)
        return call(self, inputs)
    monkeypatch.setattr(heter_sections.Section, "__call__", stuck)
    config = dataclasses.replace(cluster(workers=1, mode="async"), timeout=2.0)

    def trainer():
        rt, model = hc.runtime(config, "worker", 0, LR)
        rt.init_worker()
        start = time.monotonic()
        try:
            with pytest.raises(PSTimeoutError, match=rf"heter worker 0 \({config.heter_workers[0]}"
                                                     r"\) did not answer HETER_FORWARD of trainer "
                                                     r"0 within 2 s \(FLEETX_TIMEOUT\)"):
                hc.loss_of(model, *hc.batch(0))
            return time.monotonic() - start
        finally:
            gate.set()
            rt.stop_worker()

    roles = with_heter_worker(config, trainer)
    assert "trainer 0" not in roles.errors, roles.errors["trainer 0"]
    assert 1.9 < roles.results["trainer 0"] < 10


def with_heter_worker(config, trainer) -> "hc.Roles":
    """A server, a heter worker and ``trainer`` (trainer 0) on threads, joined."""
    roles = hc.Roles()
    roles.start("server", lambda: hc.serve(config, "server", LR))
    roles.start("heter", lambda: hc.serve(config, "heter", LR))
    roles.start("trainer 0", trainer)
    roles.join()
    return roles


def test_pending_graphs_are_capped_without_a_deadlock(monkeypatch):
    """A trainer's training forwards wait for their backward on the heter worker, at most
    MAX_PENDING (here 4) at once: one more is refused at once (waiting would deadlock: only
    this trainer's backward frees room), a backward or a step frees room, evaluation forwards
    keep nothing."""
    from fleetx.ps import RemoteError
    from fleetx.ps_torch import heter_worker
    monkeypatch.setattr(heter_worker, "MAX_PENDING", 4)
    config = cluster(workers=1, mode="async")
    x = torch.rand(2, 3 * hc.DIM)

    def trainer():
        rt, _ = hc.runtime(config, "worker", 0, LR)
        rt.init_worker()
        client = rt._session.heter
        try:
            seqs = [client.forward("mlp", [x], True, [True])[0] for _ in range(4)]
            with pytest.raises(RemoteError, match=r"HETER_FORWARD: trainer 0 \(pid \d+ on .*\) "
                                                  r"has 4 forwards waiting for their backward "
                                                  r"\(at most 4\)"):
                client.forward("mlp", [x], True, [True])
            for _ in range(10):  # no graph kept: never refused
                client.forward("mlp", [x], False, [False])
            grad, = client.backward(seqs[0], [torch.ones(2, 1)])
            assert grad.shape == x.shape
            client.forward("mlp", [x], True, [True])  # room again
            client.step()  # a finished step drops the graphs still waiting
            return [client.forward("mlp", [x], True, [True])[0] for _ in range(4)]
        finally:
            rt.stop_worker()

    roles = with_heter_worker(config, trainer)
    assert not roles.errors, roles.errors
    assert len(roles.results["trainer 0"]) == 4
