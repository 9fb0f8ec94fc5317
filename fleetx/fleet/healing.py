"""The fleet's side of in-job healing (``fleetrun --fault_tolerance heal``): it starts the
process's :class:`~fleetx.comm.heal.Healer` at ``fleet.init``, keeps the role (rank, world size,
endpoints) and the communicator in step with each generation, falls back to restarting the
group when the plan holds state that dies with a rank, and hands the training state to a
restarted process (which then resumes at ``fleet.start_step()``).

Rank numbers after a heal: ``fleet.worker_index()`` is the process's position among the live
processes, ordered by launch rank, and ``fleet.worker_num()`` their count; when every process
is back they are the launch ranks again.
"""
from __future__ import annotations

from typing import Any, Optional

from fleetx import env
from fleetx.strategy.api import registered

__all__ = ["HealCalls"]


class HealCalls:
    """Mixed into ``Fleet``: the healing job's hooks (all no-ops outside one)."""

    _healer: Optional[Any] = None
    _healed_in = False  # this process received its state from a live rank

    def _start_healing(self, rm: Any) -> None:
        """Join the healing job: the first generation, or (a restarted process) nothing yet:
        it asks to join from ``distributed_optimizer``."""
        from fleetx.comm import heal

        self._heal_endpoints = list(rm._get_trainer_endpoints())
        self._healer = heal.start(rm._worker_index(), rm._worker_num(),
                                  env.get_int("FLEETX_HEAL_RESTARTS"), log=_say)
        self._healer.on_generation.append(self._heal_generation)
        if self._healer.gen >= 0:
            self._heal_generation(self._healer)

    def _heal_generation(self, healer: Any) -> None:
        """A new generation: the role and the communicator follow its ranks."""
        from fleetx.comm.groups import ProcessGroups

        rm = self._role_maker
        rm._current_id, rm._num_workers = healer.rank, healer.size
        if self._heal_endpoints:
            rm._worker_endpoints = [self._heal_endpoints[s] for s, _ in healer.members]
        self._comm = ProcessGroups._with_groups(healer.rank, healer.size, "gloo",
                                                list(rm._worker_endpoints), env.timeout(),
                                                owned=True)

    def _heal_check(self, plan: Any, strategy: Any, world_size: int) -> None:
        """Fall back to restarting the group when the plan keeps state only its rank holds."""
        healer = self._healer
        if healer is None or healer.mode != "heal":
            return
        reasons = [f"{name}: {registered(name).heal_fallback}" for name in plan.applied
                   if registered(name).heal_fallback]
        from fleetx.strategy.api import StrategyError
        from fleetx.strategy.topology import resolve

        try:
            topo = resolve(strategy, world_size)
        except (StrategyError, ValueError):
            topo = None
        if topo is not None and topo.mp_degree * topo.pp_degree > 1:
            reasons.append(f"mp_degree={topo.mp_degree} x pp_degree={topo.pp_degree}: each rank "
                           f"holds the only copy of its part of the model")
        if reasons:
            healer.fall_back("; ".join(reasons))
            _say(f"fleetx heal: --fault_tolerance heal falls back to restart (a failure "
                 f"restarts every rank): {'; '.join(reasons)}")

    def _heal_attach(self, optimizer: Any) -> None:
        """After ``distributed_optimizer``: a restarted process joins and receives the state;
        the first processes start equal (rank 0's parameters, as DDP does); every process
        admits joiners at the step boundaries (after the gradients are cleared)."""
        healer = self._healer
        if healer is None or healer.mode != "heal":
            return
        healer.state_source, healer.state_sink = self._heal_state, self._heal_load
        if healer.gen < 0:
            healer.join()
        elif healer.done == 0:
            import torch.distributed as dist

            for model in self._models:
                for tensor in list(model.module.parameters()) + list(model.module.buffers()):
                    dist.broadcast(tensor.data, src=0)
        optimizer.after_zero_grad.append(healer.at_boundary)

    def _heal_state(self) -> dict:
        model = self._models[-1].module if self._models else None
        return {"model": model.state_dict() if model is not None else None,
                "optimizer": self._dist_optimizer.state_dict(), "steps": self._steps_taken}

    def _heal_load(self, state: dict) -> None:
        if state["model"] is not None and self._models:
            self._models[-1].module.load_state_dict(state["model"])
        self._dist_optimizer.load_state_dict(state["optimizer"])
        self._steps_taken = self._start_step = int(state["steps"])
        self._healed_in = True
        self._record()


def _say(message: str) -> None:
    print(message, flush=True)
