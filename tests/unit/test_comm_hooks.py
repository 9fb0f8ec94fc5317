"""The gradient-communication composer: rules, stage nesting, traffic counts (one process)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fleetx.comm import hooks
from fleetx.comm.hooks import (Channels, CommHookError, GradientCodec, AllReducePath, Traffic,
                               compose, done)
from fleetx.strategy.algorithms.fp16_allreduce import Fp16Codec


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """A one-process gloo world: real groups and collectives, no peers."""
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


class FakeBucket:
    """What DDP hands a comm hook: a flat buffer of gradients laid out parameter by parameter."""

    def __init__(self, params, index=0, last=True):
        self._params = params
        self._buffer = torch.cat([p.grad.reshape(-1) for p in params])
        self._index, self._last = index, last

    def buffer(self):
        return self._buffer

    def parameters(self):
        return self._params

    def gradients(self):
        return list(self._buffer.split([p.numel() for p in self._params]))

    def index(self):
        return self._index

    def is_last(self):
        return self._last


def param(*values):
    p = torch.nn.Parameter(torch.zeros(len(values)))
    p.grad = torch.tensor(values, dtype=torch.float32)
    return p


class Recorder(GradientCodec):
    """Notes the dtype it sees and scales what comes back, to show the nesting order."""

    def __init__(self, order, log, factor):
        self.order, self.log, self.factor = order, log, factor

    def run(self, bucket, tensor, link):
        self.log.append((self.order, tensor.dtype))
        return link.all_reduce(tensor).then(lambda f: f.value() * self.factor)


class Summing(AllReducePath):
    """A topology pretending there are two ranks holding the same tensor."""

    def __init__(self):
        self.seen = []

    def connect(self, group, channels):
        self.channels = channels

    def all_reduce(self, tensor, channel, traffic):
        self.seen.append((channel, tensor.dtype))
        traffic.record("all_reduce", tensor, 2, channel)
        return done(tensor * 2)


def test_nothing_to_compose():
    assert compose([], group=None) is None


def test_a_plain_hook_alone_passes_through():
    def my_hook(state, bucket):
        return done(bucket.buffer())
    assert compose([("s", my_hook)], group=None) == ("s", my_hook)


def test_a_plain_hook_does_not_mix_with_stages():
    def my_hook(state, bucket):
        return done(bucket.buffer())
    with pytest.raises(CommHookError, match=r"plain DDP comm hook cannot be composed with "
                                            r"other gradient communication stages "
                                            r"\(my_hook, Fp16Codec\)"):
        compose([(None, my_hook), (None, Fp16Codec())], group=None)


def test_one_topology_and_one_channel_setting_at_most():
    with pytest.raises(CommHookError, match="only one of these gradient topologies can be "
                                            "used: Summing, Summing"):
        compose([(None, Summing()), (None, Summing())], group=None)
    with pytest.raises(CommHookError, match="channel settings"):
        compose([(None, Channels(2)), (None, Channels(3))], group=None)
    with pytest.raises(ValueError, match="Channels.count must be >= 1, got 0"):
        Channels(0)


def test_codecs_nest_in_the_order_given_and_the_topology_is_innermost(group):
    log, topo = [], Summing()
    # The first given is outermost (strategies add their codecs in plan order); the topology
    # is innermost wherever it is listed.
    state, hook = compose([(None, Recorder(10, log, 3.0)), (None, topo),
                           (None, Recorder(50, log, 10.0))], group)
    bucket = FakeBucket([param(1.0, 2.0)])
    result = hook(state, bucket).wait()
    assert [o for o, _ in log] == [10, 50]
    # world size 1: no division; topology doubles, then x10 (inner), then x3 (outer)
    assert result.tolist() == [60.0, 120.0]
    assert result is bucket.buffer()  # written back into DDP's bucket
    assert state.describe() == "Recorder -> Recorder -> Summing"


def test_fp16_codec_sends_half_precision_and_returns_float32(group):
    topo = Summing()
    state, hook = compose([(None, Fp16Codec()), (None, topo)], group)
    bucket = FakeBucket([param(1.5, -2.25, 3.0)])
    result = hook(state, bucket).wait()
    assert topo.seen == [(0, torch.float16)]
    assert result.dtype == torch.float32 and result.tolist() == [3.0, -4.5, 6.0]
    assert state.traffic.payload_bytes == 3 * 2


def test_buckets_go_round_robin_over_channels(group):
    topo = Summing()
    state, hook = compose([(None, topo), (None, Channels(3))], group)
    assert topo.channels == 3
    for i in range(5):
        hook(state, FakeBucket([param(1.0)], index=i, last=i == 4)).wait()
    assert [c for c, _ in topo.seen] == [0, 1, 2, 0, 1]
    assert state.traffic.rounds == 1 and state.traffic.per_channel == {0: 2, 1: 2, 2: 1}


def test_flat_topology_creates_a_group_per_extra_channel(group):
    state, hook = compose([(None, Channels(2))], group)
    assert len(state.flat.groups) == 2 and state.flat.groups[0] is group
    out = hook(state, FakeBucket([param(1.0, 2.0)], index=1)).wait()
    assert out.tolist() == [1.0, 2.0]  # one rank: the sum is itself
    assert state.traffic.per_channel == {1: 1}


def test_traffic_wire_model_and_state_dict():
    t = Traffic()
    t.record("all_reduce", torch.zeros(100), 4)      # 400 B, ring: 2 * 3/4
    t.record("all_gather", torch.zeros(10), 4, 1)    # 40 B, forwarded to 3 others
    t.record("broadcast", torch.zeros(10, dtype=torch.float16), 2)
    assert t.payload_bytes == 460
    assert t.wire_bytes == pytest.approx(400 * 1.5 + 40 * 3 + 20 * 0.5)
    copy = Traffic()
    copy.load_state_dict(t.state_dict())
    assert copy.state_dict() == t.state_dict() == {
        "payload_bytes": 460, "wire_bytes": 730.0, "collectives": 3, "rounds": 0,
        "per_channel": {0: 2, 1: 1}}


def test_module_surface():
    assert set(hooks.__all__) >= {"compose", "GradientCodec", "AllReducePath", "Channels",
                                  "Traffic"}
