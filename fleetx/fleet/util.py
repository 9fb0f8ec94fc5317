"""``fleet.util``: host-side collectives and helpers for user code.

Values may be Python numbers, numpy arrays or CPU tensors; each call returns the same kind it was
given. Communication goes over a gloo group, so it works beside NCCL training too. With one process
every collective returns its input's value unchanged.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from fleetx.fleet.api import default_fleet

__all__ = ["UtilBase"]

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
#: bytes a worker may send, or receive, in one ``all_to_all`` (``max_bytes``'s default)
MAX_EXCHANGE_BYTES = 8 << 30
_WORLDS = ("worker",)


def _to_tensor(value: Any) -> tuple[torch.Tensor, Callable[[torch.Tensor], Any]]:
    """A contiguous CPU tensor holding ``value``, and how to turn a result back into its kind."""
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise TypeError(f"fleet.util works on CPU values; got a tensor on {value.device}")
        return value.detach().clone().contiguous(), lambda t: t
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value).copy()), lambda t: t.numpy()
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
        raise TypeError(f"fleet.util expects a number, a numpy array or a CPU tensor; "
                        f"got {type(value).__name__}")
    if isinstance(value, (float, np.floating)):
        return torch.tensor([float(value)], dtype=torch.float64), lambda t: float(t.item())
    return torch.tensor([int(value)], dtype=torch.int64), lambda t: int(t.item())


class UtilBase:
    """Collectives among workers and small job helpers.

    Subclass it as in Paddle, with a plain ``super().__init__()``, and assign an instance to
    ``fleet.util``: the fleet it is assigned to binds it. An instance never assigned serves the
    default fleet (``fleetx.fleet``).

    Args:
        fleet: the :class:`~fleetx.fleet.fleet.Fleet` whose world this uses (None: the one it
            is assigned to, else the default one).

    Example:
        >>> class MyUtil(fleet.UtilBase):
        ...     def get_user_id(self):
        ...         return 10
        >>> fleet.util = MyUtil()
        >>> fleet.util.all_reduce(1)   # summed over the workers
    """

    def __init__(self, fleet: Optional[Any] = None) -> None:
        self._fleet = fleet

    @property
    def _world(self) -> Any:
        """The fleet this util serves (bound on first use when none was given)."""
        if self._fleet is None:
            self._fleet = default_fleet()
        return self._fleet

    def _group(self, comm_world: str) -> Any:
        if comm_world not in _WORLDS:
            raise ValueError(f"comm_world must be one of {list(_WORLDS)}, got {comm_world!r}")
        return self._world._communicator()

    def barrier(self, comm_world: str = "worker") -> None:
        """Wait until every worker arrives; a missing one is named after the timeout."""
        comm = self._group(comm_world)
        if comm is not None:
            comm.barrier()

    def all_reduce(self, input: Any, mode: str = "sum", comm_world: str = "worker") -> Any:
        """Element-wise ``sum``, ``max`` or ``min`` over every worker.

        Example:
            >>> fleet.util.all_reduce(np.array([3, 4]))   # two workers -> array([6, 8])
        """
        if mode not in _OPS:
            raise ValueError(f"mode must be one of {list(_OPS)}, got {mode!r}")
        tensor, back = _to_tensor(input)
        comm = self._group(comm_world)
        if comm is not None:
            comm.check(f"all_reduce({mode})", comm.host_group, [tensor])
            with comm.explaining("fleet.util.all_reduce"):
                dist.all_reduce(tensor, op=_OPS[mode], group=comm.host_group)
        return back(tensor)

    def all_gather(self, input: Any, comm_world: str = "worker") -> list:
        """Every worker's value, in rank order (shapes may differ between workers)."""
        tensor, back = _to_tensor(input)
        comm = self._group(comm_world)
        if comm is None:
            return [back(tensor)]
        group = comm.host_group
        shape = torch.tensor(list(tensor.shape) + [-1] * (8 - tensor.dim()), dtype=torch.int64)
        if tensor.dim() > 8:
            raise ValueError("fleet.util.all_gather supports at most 8 dimensions")
        shapes = [torch.empty_like(shape) for _ in range(comm.world_size)]
        comm.check("all_gather", group, [shape])  # the shapes may differ; their count may not
        with comm.explaining("fleet.util.all_gather"):
            dist.all_gather(shapes, shape, group=group)
        dims = [tuple(int(d) for d in s if d >= 0) for s in shapes]
        longest = max(int(np.prod(d)) for d in dims)
        flat = torch.zeros(longest, dtype=tensor.dtype)
        flat[: tensor.numel()] = tensor.reshape(-1)
        out = [torch.empty_like(flat) for _ in range(comm.world_size)]
        comm.check("all_gather", group, [flat])
        with comm.explaining("fleet.util.all_gather"):
            dist.all_gather(out, flat, group=group)
        return [back(o[: int(np.prod(d))].reshape(d).clone()) for o, d in zip(out, dims)]

    def broadcast(self, input: Any, src: int = 0, comm_world: str = "worker") -> Any:
        """Worker ``src``'s value on every worker (the same shape and dtype everywhere)."""
        tensor, back = _to_tensor(input)
        comm = self._group(comm_world)
        if comm is not None:
            if not 0 <= src < comm.world_size:
                raise ValueError(f"src={src} is outside [0, {comm.world_size})")
            comm.check(f"broadcast(src={src})", comm.host_group, [tensor])
            with comm.explaining("fleet.util.broadcast"):
                dist.broadcast(tensor, src=src, group=comm.host_group)
        return back(tensor)

    def all_to_all(self, inputs: Sequence[Any], comm_world: str = "worker",
                   max_bytes: int = MAX_EXCHANGE_BYTES) -> list:
        """Send ``inputs[j]`` to worker ``j``; return what every worker sent to this one, in
        rank order. Each input is a 1-D numpy array or CPU tensor; all have one dtype, the same
        on every worker; lengths may differ. (A fleetx addition: the global shuffle of
        ``fleetx.data`` exchanges its samples with it, as raw buffers.)

        The workers first share every length (a ``world x world`` table): each checks it
        before anything is allocated, so all refuse alike an exchange in which a worker would
        send or receive more than ``max_bytes``, or a length that is negative.

        Raises:
            ValueError: not one 1-D input per worker, inputs of different dtypes, or an
                exchange over ``max_bytes`` or with a negative length (naming the worker).
            CommError: a worker did not take part in time (it is named).

        Example:
            >>> fleet.util.all_to_all([np.array([r, 0]), np.array([r, 1])])  # 2 workers, rank r
            [array([0, r]), array([1, r])]
        """
        comm = self._group(comm_world)
        world = 1 if comm is None else comm.world_size
        if len(inputs) != world:
            raise ValueError(f"all_to_all takes one input per worker ({world}), got "
                             f"{len(inputs)}")
        pairs = [_to_tensor(x) for x in inputs]
        if any(t.dim() != 1 for t, _ in pairs) or len({t.dtype for t, _ in pairs}) > 1:
            raise ValueError(f"all_to_all inputs must be 1-D and of one dtype; got shapes "
                             f"{[tuple(t.shape) for t, _ in pairs]}, dtypes "
                             f"{sorted({str(t.dtype) for t, _ in pairs})}")
        back = pairs[0][1]
        if comm is None:
            return [back(pairs[0][0])]
        sizes = torch.tensor([t.numel() for t, _ in pairs], dtype=torch.int64)
        table = [torch.empty_like(sizes) for _ in range(world)]  # table[i][j]: i sends to j
        comm.check("all_to_all(sizes)", comm.host_group, [sizes])
        with comm.explaining("fleet.util.all_to_all"):
            dist.all_gather(table, sizes, group=comm.host_group)
        check_exchange([t.tolist() for t in table], pairs[0][0].element_size(), max_bytes)
        got = torch.stack(table)[:, dist.get_rank(group=comm.host_group)].contiguous()
        out = torch.empty(int(got.sum()), dtype=pairs[0][0].dtype)
        send = torch.cat([t for t, _ in pairs])
        comm.check("all_to_all(data)", comm.host_group, [send[:0]])
        with comm.explaining("fleet.util.all_to_all"):
            dist.all_to_all_single(out, send, got.tolist(), sizes.tolist(),
                                   group=comm.host_group)
        return [back(part.clone()) for part in torch.split(out, got.tolist())]

    def get_file_shard(self, files: Sequence[str]) -> list:
        """This worker's contiguous block of ``files``; the first ``len % n`` blocks get one extra.

        Example:
            >>> fleet.util.get_file_shard(["a", "b", "c", "d", "e"])  # 2 workers, rank 0
            ['a', 'b', 'c']
        """
        if not isinstance(files, list):
            raise TypeError("files should be a list of file need to be read.")
        n, index = self._world.worker_num(), self._world.worker_index()
        size, extra = divmod(len(files), n)
        start = index * size + min(index, extra)
        return files[start:start + size + (1 if index < extra else 0)]

    def print_on_rank(self, message: Any, rank_id: int = 0) -> None:
        """Print ``message`` only on worker ``rank_id``."""
        if self._world.worker_index() == rank_id:
            print(message, flush=True)


def check_exchange(table: Sequence[Sequence[int]], itemsize: int, max_bytes: int) -> None:
    """Refuse an all-to-all whose lengths (``table[i][j]``: items worker ``i`` sends to ``j``)
    are negative, or make a worker send or receive more than ``max_bytes``.

    Raises:
        ValueError: naming the worker and the bytes, or the negative length.
    """
    for i, row in enumerate(table):
        for j, n in enumerate(row):
            if n < 0:
                raise ValueError(f"fleet.util.all_to_all: worker {i} announces {n} items for "
                                 f"worker {j}; a length cannot be negative")
    world = len(table)
    for what, total in (("sends", lambda w: sum(table[w])),
                        ("receives", lambda w: sum(row[w] for row in table))):
        for w in range(world):
            if total(w) * itemsize > max_bytes:
                raise ValueError(f"fleet.util.all_to_all: worker {w} {what} "
                                 f"{total(w) * itemsize} bytes in one exchange, more than "
                                 f"max_bytes={max_bytes}; exchange in several parts")
