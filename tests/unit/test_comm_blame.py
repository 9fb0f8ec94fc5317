"""Collective progress and blame, in one process: what the flight recorder and the beacon report
about real calls on a 1-process gloo group, how a peer's state is put into words, and the fault
report fleetrun reads."""
import time

import pytest
import torch
import torch.distributed as dist

from fleetx import env
from fleetx.comm import blame, debug, progress
from fleetx.comm.api import Blame, read_fault, write_fault
from fleetx.comm.progress import Call, Record


@pytest.fixture
def world():
    store = dist.HashStore()
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=0, world_size=1)
    yield store
    dist.destroy_process_group()


def test_recent_calls_and_sequence_numbers_come_from_torch(world):
    dist.all_reduce(torch.ones(3))
    dist.broadcast(torch.zeros(2, 4, dtype=torch.int64), src=0)
    assert progress.sequence_numbers() == {"0": 2}
    assert progress.group_name(None) == "0" and progress.groups()["0"][1] == [0]
    calls = [c for c in progress.recent_calls() if c.group == "0"][-2:]
    assert [(c.op, c.seq, c.shapes, c.dtypes) for c in calls] == [
        ("all_reduce", 1, ((3,),), ("float32",)), ("broadcast", 2, ((2, 4),), ("int64",))]
    assert calls[1].describe() == "broadcast #2 (int64 [2, 4])"
    assert 0 < time.time() - calls[1].started < 60


def test_beacon_says_where_a_stalled_rank_is(world):
    beacon = progress.Beacon(world, rank=0, interval=0.05, stall_after=0.0)
    dist.all_reduce(torch.ones(1))
    beacon.publish()
    first = progress.read_record(world, 0)
    assert first.seqs == {"0": 1} and first.latest is None      # moving: no dump
    beacon.publish()                                           # no new call since: stalled
    stalled = progress.read_record(world, 0)
    assert stalled.latest.op == "all_reduce" and stalled.latest.seq == 1
    beacon.start()
    time.sleep(0.3)
    beacon.stop()
    assert progress.read_record(world, 0).time > stalled.time  # the thread kept reporting
    assert progress.read_record(world, 5) is None              # a rank that never reported


def test_a_peers_state_in_words():
    call = Call("all_reduce", "0", 20, ((5,),), ("float32",), started=100.0)
    alive = Record(1, 42, time=109.6, seqs={"0": 20}, latest=call)
    assert alive.state(interval=1.0, now=110.0) == (
        "it is alive (reported 0.4 s ago), its latest call: all_reduce #20 (float32 [5]) on "
        "group 0, entered 10 s ago")
    assert alive.state(interval=1.0, now=125.0) == (
        "it has not reported for 15 s (stopped, frozen or gone)")


def test_collective_failures_and_the_ranks_torch_names():
    assert blame.is_collective_failure(RuntimeError(
        "[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv"))
    assert not blame.is_collective_failure(ValueError("Timed out"))
    assert not blame.is_collective_failure(RuntimeError("CUDA out of memory"))
    assert blame._named_ranks("[Rank 0]: Ranks 1, 3 failed to pass monitoredBarrier in 4000 ms") \
        == [1, 3]
    assert blame._named_ranks("Timed out waiting") == []


def test_fault_reports_belong_to_one_process(tmp_path):
    write_fault(str(tmp_path), Blame(2, 77, (0, 1), "rank 0 did not arrive"))
    assert read_fault(str(tmp_path), 2, 77) == Blame(2, 77, (0, 1), "rank 0 did not arrive")
    assert read_fault(str(tmp_path), 2, 78) is None        # another process's (an earlier job)
    assert read_fault(str(tmp_path), 1, 77) is None        # no report
    (tmp_path / "fault.2.json").write_text('{"reporter": 2}')
    assert read_fault(str(tmp_path), 2, 77) is None        # unreadable


def test_debug_switch_is_0_or_1(monkeypatch):
    monkeypatch.setitem(env.environ, "FLEETX_DEBUG_COLLECTIVES", "1")
    assert debug.requested()
    monkeypatch.setitem(env.environ, "FLEETX_DEBUG_COLLECTIVES", "yes")
    with pytest.raises(env.EnvError, match="FLEETX_DEBUG_COLLECTIVES='yes' must be 0 or 1"):
        debug.requested()
    monkeypatch.delitem(env.environ, "FLEETX_DEBUG_COLLECTIVES")
    assert not debug.requested()


def test_a_peer_is_blamed_only_on_evidence_from_after_the_call_began():
    failed = Call("all_reduce", "0", 12, started=100.0)
    calls = [Call("all_reduce", "0", 11, started=90.0), failed]

    def late(record, now):
        return blame._late_peers(failed, calls, [0, 1], {1: record}, rank=0, waited=20.0,
                                 interval=1.0, now=now)

    # behind, and said so after rank 0 began waiting: did not arrive
    assert late(Record(1, 7, time=119.5, seqs={"0": 11}), now=120.0) == {1: (
        "rank 1 did not arrive at all_reduce #12 on group 0 (ranks [0, 1]) within 20 s; it is "
        "alive (reported 0.5 s ago)")}
    # arrived (its count includes the call): not late
    assert late(Record(1, 7, time=119.5, seqs={"0": 12}), now=120.0) == {}
    # its last report is older than the call and recent: it may have come since (no evidence)
    assert late(Record(1, 7, time=99.8, seqs={"0": 0}), now=100.3) == {}
    # ... but silent for long: named as such
    assert late(Record(1, 7, time=99.8, seqs={"0": 11}), now=120.0)[1].endswith(
        "it has not reported for 20 s (stopped, frozen or gone)")


class _SilentStore:
    """A store whose node is out of reach: every read blocks (until the test ends)."""

    def __init__(self):
        import threading
        self.released = threading.Event()
        self.reads = 0

    def check(self, keys):
        self.reads += 1
        self.released.wait()
        raise RuntimeError("store gone")

    get = check


def test_a_store_that_never_answers_blames_the_network_to_its_node(monkeypatch):
    """A rank cut off from the store's node cannot read its peers' records: the diagnosis
    names the peers and the store's address, within a few report intervals, not a hang."""
    call = Call("all_reduce", "0", 5, ((3,),), ("float32",), started=time.time() - 20,
                timeout=20.0)
    monkeypatch.setattr(progress, "groups", lambda: {"0": (None, [0, 1])})
    monkeypatch.setattr(progress, "sequence_numbers", lambda found=None: {"0": 5})
    monkeypatch.setattr(progress, "recent_calls", lambda: [call])
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    store = _SilentStore()
    try:
        start = time.monotonic()
        found = blame.diagnose(RuntimeError("Timed out waiting 20000ms for recv"), store,
                               rank=0, timeout=300.0, interval=0.2)
        assert time.monotonic() - start < 5 and store.reads == 1
    finally:
        store.released.set()
    assert found.reporter == 0 and found.ranks == (1,)
    assert found.message == (
        "rank 1 did not arrive at all_reduce #5 on group 0 (ranks [0, 1]) within 20 s, and the "
        "job's store at 10.0.0.1:29500 did not answer for 1 s: the network to that node is down "
        "or the node is gone")
    # the same failure with a store that answers but holds no record: no evidence, no blame
    assert blame.diagnose(RuntimeError("Timed out waiting 20000ms for recv"), dist.HashStore(),
                          rank=0, timeout=300.0, interval=0.2) is None
