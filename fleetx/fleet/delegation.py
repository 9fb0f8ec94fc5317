"""What the :class:`~fleetx.fleet.fleet.Fleet` object forwards without deciding anything.

Three mixins of ``Fleet``: :class:`RoleQueries` answers from the role maker
(``worker_index``...), :class:`OptimizerCalls` forwards Paddle's dygraph optimizer calls
(``get_lr``, ``minimize``...) to the optimizer wrapper, and :class:`RuntimeCalls` hands the
parameter-server calls (``init_worker``, ``run_server``, ``save_persistables``...) to the runtime
the plan installed, or, in collective mode, logs what Paddle's collective runtime logs. The
engine itself (joining the world, planning, wrapping) stays in ``fleet.py``.
"""
from __future__ import annotations

import logging
import os
import warnings
from typing import Any, Callable, Optional

import torch

from fleetx.fleet.api import FleetError, RuntimeHandlerError
from fleetx.fleet.optimizer import DistributedOptimizer
from fleetx.role_maker import RoleMakerBase
from fleetx.strategy.api import TrainingContext

__all__ = ["RoleQueries", "OptimizerCalls", "RuntimeCalls"]

_log = logging.getLogger("fleetx")


class RoleQueries:
    """The role maker's answers about this process and the job (``Fleet`` supplies ``_rm``)."""

    _rm: Callable[[str], RoleMakerBase]  # the role maker, or FleetError naming the call

    def is_first_worker(self) -> bool:
        """True on worker 0."""
        return self._rm("is_first_worker")._is_first_worker()

    def worker_index(self) -> int:
        """This worker's index (on a server: the server's index, as in Paddle)."""
        return self._rm("worker_index")._worker_index()

    def worker_num(self) -> int:
        """Number of workers."""
        return self._rm("worker_num")._worker_num()

    def node_num(self) -> int:
        """Number of distinct hosts among the workers."""
        return self._rm("node_num")._node_num()

    def local_rank(self) -> int:
        """This process's rank on its node."""
        return self._rm("local_rank")._get_local_rank()

    def local_device_ids(self) -> Optional[str]:
        """This process's device ids as the launcher wrote them (``PADDLE_LOCAL_DEVICE_IDS``)."""
        return self._rm("local_device_ids")._get_local_device_ids()

    def world_device_ids(self) -> Optional[str]:
        """Every process's device ids (``PADDLE_WORLD_DEVICE_IDS``)."""
        return self._rm("world_device_ids")._get_world_device_ids()

    def is_worker(self) -> bool:
        """True on a worker (trainer) process."""
        return self._rm("is_worker")._is_worker()

    def is_server(self) -> bool:
        """True on a parameter-server process, and on a heter worker (as in Paddle: its script
        takes the server branch, whose ``run_server`` serves the heter sections)."""
        rm = self._rm("is_server")
        return rm._is_server() or rm._is_heter_worker()

    def server_num(self) -> int:
        """Number of parameter servers (0 in a collective job)."""
        return self._rm("server_num")._server_num()

    def server_index(self) -> int:
        """This server's index."""
        return self._rm("server_index")._server_index()

    def worker_endpoints(self, to_string: bool = False) -> Any:
        """Every worker's ``ip:port`` (one comma-joined string with ``to_string=True``)."""
        eps = self._rm("worker_endpoints")._get_trainer_endpoints()
        return ",".join(eps) if to_string else eps

    def server_endpoints(self, to_string: bool = False) -> Any:
        """Every server's ``ip:port`` (one comma-joined string with ``to_string=True``)."""
        eps = self._rm("server_endpoints")._get_pserver_endpoints()
        return ",".join(eps) if to_string else eps

    rank = worker_index
    nranks = worker_num
    world_size = worker_num
    rank_in_node = local_rank


class OptimizerCalls:
    """Paddle's dygraph optimizer API on the fleet, forwarded to the optimizer wrapper."""

    _dist_optimizer: Optional[DistributedOptimizer]

    def _opt(self, what: str) -> DistributedOptimizer:
        if self._dist_optimizer is None:
            raise FleetError(f"call fleet.distributed_optimizer(...) before fleet.{what}()")
        return self._dist_optimizer

    def get_lr(self) -> float:
        """The learning rate of the optimizer wrapper's first parameter group."""
        return self._opt("get_lr").get_lr()

    def set_lr(self, value: float) -> None:
        """Set the learning rate of every parameter group (servers follow in PS mode)."""
        self._opt("set_lr").set_lr(value)

    def step(self) -> bool:
        """One optimizer step through the plan's strategies; True when the parameters were
        updated (False on a gradient-merge micro-step or a skipped AMP step)."""
        return self._opt("step").step()

    def clear_grad(self) -> None:
        """Clear the gradients (``zero_grad``)."""
        self._opt("clear_grad").zero_grad()

    def minimize(self, loss: torch.Tensor) -> bool:
        """Backward, step and zero_grad in one call; True when the parameters were updated."""
        return self._opt("minimize").minimize(loss)

    def state_dict(self) -> dict:
        """The optimizer wrapper's state dict."""
        return self._opt("state_dict").state_dict()

    def set_state_dict(self, state_dict: dict) -> None:
        """Load an optimizer state dict."""
        self._opt("set_state_dict").load_state_dict(state_dict)


class RuntimeCalls:
    """The parameter-server entry points, handed to the runtime the plan installed."""

    _dist_optimizer: Optional[DistributedOptimizer]
    _ctx: Optional[TrainingContext]
    _role_maker: Optional[RoleMakerBase]
    _rm: Callable[[str], RoleMakerBase]

    def _runtime(self, what: str) -> Any:
        """The parameter-server runtime, or None in collective mode (after checking, as Paddle
        does, that there is a runtime to speak of).

        Raises:
            RuntimeHandlerError: no optimizer was built yet (collective or parameter server),
                or the parameter-server plan installed no runtime.
        """
        rm = self._rm(what)
        if rm.is_collective:
            if rm._is_non_distributed():
                warnings.warn(f"{what}() function doesn't work when use non_distributed fleet.",
                              stacklevel=3)
                return None
            if self._dist_optimizer is None:
                raise RuntimeHandlerError(
                    f"Fleet can not find suitable runtime handler for {what}(): call "
                    f"fleet.distributed_optimizer(...) first")
            return None
        runtime = getattr(self._ctx, "runtime", None) if self._ctx is not None else None
        if runtime is None:
            raise RuntimeHandlerError(
                f"Fleet can not find suitable runtime handler for {what}(): call "
                f"fleet.distributed_optimizer(...) first, in a parameter-server job whose plan "
                f"includes the parameter server")
        return runtime

    def _collective_note(self, what: str) -> None:
        # Paddle's collective runtime logs this and does nothing; the log goes to stderr.
        if not self._role_maker._is_non_distributed():
            _log.warning("You should not call '%s' method for collective mode.", what)

    def init_worker(self) -> None:
        """Parameter server: connect this worker to the servers."""
        runtime = self._runtime("init_worker")
        if runtime is None:
            return self._collective_note("init_worker")
        runtime.init_worker()

    def init_server(self, *args: Any, **kwargs: Any) -> None:
        """Parameter server: build this server's tables (``dirname``: load them)."""
        runtime = self._runtime("init_server")
        if runtime is None:
            return self._collective_note("init_server")
        runtime.init_server(*args, **kwargs)

    def run_server(self) -> None:
        """Parameter server: serve until every worker has stopped."""
        runtime = self._runtime("run_server")
        if runtime is None:
            return self._collective_note("run_server")
        runtime.run_server()

    def stop_worker(self) -> None:
        """Parameter server: flush and disconnect this worker."""
        runtime = self._runtime("stop_worker")
        if runtime is None:
            return self._collective_note("stop_worker")
        runtime.stop_worker()

    def prefetch(self, batches: Any, ids_of: Callable[[Any], Any]) -> Any:
        """Parameter server: iterate ``batches``, pulling the rows of the next batch while the
        current one trains (a fleetx addition, see ``docs/parameter_server.md``).

        Args:
            batches: any iterable of batches.
            ids_of: ``batch -> {embedding module or table name: ids}``, the ids each sparse
                table is looked up with in that batch's forward.

        Example:
            >>> for ids, x, y in fleet.prefetch(loader, lambda b: {"emb": b[0]}):  # doctest: +SKIP
            ...     opt.minimize(loss_fn(model(ids, x), y))
        """
        runtime = self._runtime("prefetch")
        if runtime is None:
            self._collective_note("prefetch")
            return batches
        return runtime.prefetch(batches, ids_of)

    def save_persistables(self, *args: Any, **kwargs: Any) -> None:
        """Parameter server: save dense parameters and sparse tables (``(dirname, mode=0)``).

        Paddle's form ``(executor, dirname, main_program=None, mode=0)`` is accepted too: a
        leading argument that is not a path is taken for the executor and ignored, as is
        ``main_program`` (a torch model has no program).

        Example:
            >>> fleet.save_persistables(exe, "ckpt", None, 0)  # doctest: +SKIP
        """
        args, kwargs = _save_persistables_args(args, kwargs)
        runtime = self._runtime("save_persistables")
        if runtime is None:
            return self._collective_note("save_persistables")
        runtime.save_persistables(*args, **kwargs)

    def save_inference_model(self, *args: Any, **kwargs: Any) -> None:
        """Parameter server: export the model for serving to ``dirname`` (a plain
        ``state_dict`` and ``.npy`` tables, readable without fleetx; ``docs/ps_tables.md``).
        Paddle's leading ``executor`` is accepted and ignored (a first argument that is not a
        path)."""
        args, kwargs, _ = _without_executor(args, kwargs, _EXPORT_FORMS)
        runtime = self._runtime("save_inference_model")
        if runtime is None:
            return self._collective_note("save_inference_model")
        runtime.save_inference_model(*args, **kwargs)

    def shrink(self, threshold: Optional[int] = None) -> Optional[dict]:
        """Parameter server: end a pass on every server (every worker calls it): decay
        show/click, delete rows unseen too long or scoring too low, forget pending ids (see
        ``docs/ps_tables.md``). Returns what went, per table, on worker 0."""
        runtime = self._runtime("shrink")
        if runtime is None:
            return self._collective_note("shrink")
        return runtime.shrink(threshold)

    def table_stats(self) -> Optional[dict]:
        """Parameter server: the memory report (rows and bytes per table and server)."""
        runtime = self._runtime("table_stats")
        if runtime is None:
            return self._collective_note("table_stats")
        return runtime.table_stats()

    def print_table_stat(self) -> Optional[dict]:
        """Parameter server: print the memory report on this worker, and return it."""
        runtime = self._runtime("print_table_stat")
        if runtime is None:
            return self._collective_note("print_table_stat")
        return runtime.print_table_stat()


#: the two call forms of each method that accepts Paddle's executor, for the error messages
_SAVE_FORMS = ("save_persistables(dirname, mode=0)",
               "save_persistables(executor, dirname, main_program=None, mode=0)")
_EXPORT_FORMS = ("save_inference_model(dirname, feeded_var_names=None, target_vars=None, ...)",
                 "save_inference_model(executor, dirname, feeded_var_names, target_vars, ...)")


def _without_executor(args: tuple, kwargs: dict, forms: tuple[str, str]
                      ) -> tuple[tuple, dict, bool]:
    """Drop Paddle's leading ``executor`` (a first positional argument that is not a path, or
    ``executor=``); the flag says whether the call was in Paddle's form.

    Raises:
        TypeError: a first argument that is not a path with no ``dirname`` after it (``None``
            for a path, say): it names the argument's type and the two ``forms``.
    """
    kwargs = dict(kwargs)
    paddle_form = "executor" in kwargs
    kwargs.pop("executor", None)
    if args and not isinstance(args[0], (str, os.PathLike)):
        if len(args) == 1 and "dirname" not in kwargs:
            raise TypeError(f"{forms[0].split('(')[0]}: the first argument, of type "
                            f"{type(args[0]).__name__}, is not a path, and no dirname follows "
                            f"it to take it for Paddle's executor; call {forms[0]} or "
                            f"{forms[1]}")
        args, paddle_form = args[1:], True
    return args, kwargs, paddle_form


def _save_persistables_args(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``save_persistables``'s arguments as ``(dirname, mode=0)``, from either form (Paddle's
    ``main_program`` has no effect: a torch model has no program)."""
    args, kwargs, paddle_form = _without_executor(args, kwargs, _SAVE_FORMS)
    if paddle_form:
        kwargs.pop("main_program", None)
        args = args[:1] + args[2:]
    return args, kwargs
