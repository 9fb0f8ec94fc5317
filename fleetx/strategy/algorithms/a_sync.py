"""Parameter-server training modes (``strategy.a_sync``).

In parameter-server mode workers push gradients to servers and pull parameters back. Three
modes follow from ``a_sync`` and ``a_sync_configs['k_steps']``:

* sync (``a_sync=False``, ``k_steps=0``): servers wait for every worker before updating;
* async (``a_sync=True``, ``k_steps=0``): every push is applied at once, no waiting;
* GEO (``a_sync=True``, ``k_steps>0``): workers train locally for ``k_steps`` steps and push the
  parameter *change*, which servers add.

Assigning ``a_sync`` resets ``k_steps`` to 0, so set ``a_sync`` first and then ``k_steps``. The
default ``k_steps=-1`` (``a_sync`` never assigned) counts as 0. The other keys tune the worker's
communicator: its send queues, merging of queued gradients and threads.

:class:`ParameterServerStrategy` is implicit in parameter-server jobs: it lays the model out as
tables (``nn.Embedding(sparse=True)`` and ``nn.EmbeddingBag(sparse=True)`` become server-side
tables), installs the :class:`~fleetx.ps_torch.runtime.PSRuntime` behind ``fleet.init_worker`` /
``init_server`` / ``run_server`` / ``stop_worker`` / ``save_persistables``, and routes every
optimizer step through it. Without servers (a script started without a launcher) it trains in
the process with the same tables and rules.

With heter workers (``fleetrun --heter_worker_num N``, ``docs/heter.md``) the trainers run the
model up to its :class:`~fleetx.nn.HeterSection` blocks and the heter workers run those, on the
device ``heter_worker_device_guard`` names; async, or sync (lock-step) with one heter worker.
"""
from __future__ import annotations

import dataclasses
from functools import partial
from dataclasses import dataclass
from typing import Optional

from fleetx.ps.api import (CommunicatorConfig, PSConfig, PSSettings, RuleConfig,
                           settings_from_env)
from fleetx.ps_torch.runtime import PSRuntime
from fleetx.strategy.api import Mode, PlanInput, Strategy, TrainingContext, Verdict, register
from fleetx.strategy.config import Config, option

__all__ = ["AsyncConfig", "ParameterServerStrategy", "ps_config"]


@dataclass
class AsyncConfig(Config):
    """``strategy.a_sync_configs``: the GEO interval and the communicator's tuning.

    Example:
        >>> AsyncConfig(k_steps=100).send_queue_size
        16
    """

    section = "a_sync_configs"

    k_steps: int = option(
        -1, "GEO: local steps between pushes (>0); 0: sync/async; -1: a_sync never set (as 0).",
        ge=-1)
    max_merge_var_num: int = option(
        1, "Async: at most this many queued steps are merged (summed) into one push.", ge=1)
    send_queue_size: int = option(
        16, "Async: steps that may wait to be sent; a full queue makes the next step wait.",
        ge=1)
    independent_recv_thread: bool = option(
        False, "Async: receive the dense weights on a schedule of their own (every "
        "min_send_grad_num_before_recv pushes) instead of with every push.")
    min_send_grad_num_before_recv: int = option(
        1, "Async, with independent_recv_thread: the dense weights come back with every "
        "this-many-th push (Paddle: once more than this many sends happened, polled every "
        "10 ms).", ge=1)
    thread_pool_size: int = option(1, "Async: merged pushes in flight at once.", ge=1)
    send_wait_times: int = option(
        1, "Async: polls of 1 ms the sender waits for more queued steps to merge before sending "
        "what it has.", ge=0)
    runtime_split_send_recv: bool = option(
        False, "Paddle: split parameters across servers at run time.",
        no_effect="ids are routed per request")
    launch_barrier: bool = option(
        True, "Paddle: wait for all servers before training.",
        no_effect="workers always wait for the servers, up to FLEETX_TIMEOUT")
    heter_worker_device_guard: str = option(
        "cpu", "Heter workers: the device their HeterSections run on: gpu (CUDA when the heter "
        "worker sees a device, else the CPU, which its log says), xpu (likewise), cpu.",
        choices=("cpu", "gpu", "xpu"))
    lr_decay_steps: int = option(
        10, "Paddle: steps between learning-rate decays on the servers.", ge=1,
        no_effect="use an LR scheduler; its rate reaches the servers")
    use_ps_gpu: int = option(0, "Paddle: keep the sparse tables on GPU workers.", choices=(0, 1),
                             no_effect="GPU parameter servers are not offered")

def ps_config(strategy, world, settings: Optional[PSSettings] = None) -> Optional[PSConfig]:
    """The cluster of a parameter-server world, or None when it has no servers.

    Liveness and logging come from the launcher contract's variables, as ``world.environ``
    captured them when the world was made (``settings``: as :func:`settings_from_env` read
    them from there; given, they are not read again): ``FLEETX_TIMEOUT`` (servers coming up,
    workers registering, the longest wait for a silent peer in a sync round or barrier),
    ``FLEETX_PS_HEARTBEAT_INTERVAL``, ``FLEETX_PS_DEAD_AFTER`` and ``FLEETX_LOG_INTERVAL``;
    request limits and the save root from ``FLEETX_PS_MAX_LR``, ``FLEETX_PS_MAX_ROWS``,
    ``FLEETX_PS_NONFINITE`` and ``FLEETX_PS_SAVE_ROOT``; the shared secret and the frame limit
    from ``FLEETX_PS_SECRET`` / ``FLEETX_PS_SECRET_FILE`` and ``FLEETX_PS_MAX_FRAME_MB`` (the
    secret is checked only when a connection is made).

    Raises:
        fleetx.env.EnvError: a variable is malformed.
        fleetx.ps.api.PSConfigError: the values contradict each other.
    """
    if not world.server_num:
        return None
    settings = settings_from_env(world.environ) if settings is None else settings
    return settings.config(
        world.server_endpoints, world.world_size, mode=strategy.ps_mode(),
        heter_workers=world.heter_endpoints)


def _heter_part(mode: str, world, configs) -> tuple[str, str]:
    """``(the heter workers' part of the plan's reason, why they cannot run)``; both empty
    without heter workers. They cannot run in GEO mode, nor several of them in lock-step."""
    count = len(world.heter_endpoints)
    if not count:
        return "", ""
    if mode == "geo":
        return "", ("heter workers train in sync or async mode, not GEO (Paddle's heter PS is "
                    "async only); set a_sync_configs k_steps to 0")
    if mode == "sync" and count > 1:
        return "", (f"a sync (lock-step) job takes one heter worker, not {count}: several would "
                    "each push a part of every step; use async mode, or --heter_worker_num 1")
    return (f", {count} heter worker(s) on {configs['heter_worker_device_guard']} "
            f"({'lock-step' if mode == 'sync' else 'async'})"), ""


def _communicator(cfg: AsyncConfig) -> CommunicatorConfig:
    """The worker's sending knobs: the ``a_sync_configs`` keys the communicator declares (the
    others say why they have no effect where they are declared)."""
    return CommunicatorConfig.from_a_sync_configs(
        {f.name: getattr(cfg, f.name) for f in dataclasses.fields(CommunicatorConfig)})


@register
class ParameterServerStrategy(Strategy):
    """Parameter-server training in the mode ``a_sync`` / ``a_sync_configs`` select.

    Implicit in parameter-server jobs (``fleet.init()`` without ``is_collective=True``).
    """

    name = "parameter_server"
    config = AsyncConfig
    paddle_name = "ParameterServerOptimizer"
    implicit = True

    def can_apply(self, plan_input: PlanInput) -> Verdict:
        world = plan_input.world
        if world.mode is not Mode.PS:
            return Verdict.skip("collective mode: gradients are all-reduced among workers")
        try:
            mode = self.strategy.ps_mode()
            opt = plan_input.optimizer
            if opt.class_name:  # the servers apply the optimizer: it needs a server-side rule
                RuleConfig.from_param_group(opt.class_name, dict(opt.defaults))
        except ValueError as e:  # PSConfigError is a ValueError too
            return Verdict.fail(str(e))
        sparse = plan_input.model.sparse_modules
        tables = f"sparse tables: {', '.join(sparse)}" if sparse else "no sparse tables"
        if not world.server_num:
            return Verdict.ok(f"no servers: trains in this process with local tables ({tables})")
        heter, problem = _heter_part(mode, world, self.strategy.a_sync_configs)
        if problem:
            return Verdict.fail(problem)
        k = f", k_steps={self.strategy.a_sync_configs['k_steps']}" if mode == "geo" else ""
        return Verdict.ok(f"{mode} mode{k}: {world.server_num} server(s), {world.world_size} "
                          f"worker(s){heter}; {tables}")

    def apply(self, ctx: TrainingContext) -> None:
        world = ctx.world  # its environ holds the launcher's settings: nothing is read here
        cfg = self.strategy.typed_config("a_sync")
        heter, guard = world.is_heter_worker, cfg.heter_worker_device_guard
        settings = settings_from_env(world.environ, servers=bool(world.server_num))
        runtime = PSRuntime(
            ctx.model, ctx.optimizer, ps_config(self.strategy, world, settings),
            is_server=world.is_server, index=world.rank - world.world_size if heter else world.rank,
            comm=_communicator(cfg), log_interval=settings.log_interval,
            heter_device=guard if heter else None)
        ctx.runtime = runtime
        for kind in ("pull", "push"):
            for q in ("p50", "p99"):
                ctx.scalars[f"ps_{kind}_{q}_ms"] = partial(runtime.latency_ms, kind.upper(), q)
        for direction in ("sent", "received"):
            ctx.scalars[f"ps_{direction}_mb"] = partial(runtime.traffic_mb, direction)
        ctx.optimizer = runtime.optimizer
        ctx.forward_contexts.append(runtime.forward_scope)
        ctx.model_wrappers.append(runtime.wrap_model)
        ctx.loss_listeners.append(runtime.progress.loss)
        ctx.lr_listeners.append(runtime.set_lr)
