"""The fleet API: ``from fleetx import fleet``.

What it offers: Paddle Fleet's user surface. :class:`Fleet` (``fleet.py``) is one explicit
object: ``init`` reads the role, joins the world and plans the strategies;
``distributed_model`` / ``distributed_optimizer`` wrap the user's module and optimizer
(``model.py``, ``optimizer.py``); ``util`` (``util.py``) serves host-side collectives, and
``utils`` (``utils.py``, Paddle's module of that name) holds ``recompute`` and ``ps_util``
(``DistributedInfer``, distributed inference); the PS
entry points (``init_worker``, ``init_server``, ``run_server``, ``stop_worker``) hand over to
the runtime the plan chose. Those forwarding calls, the role queries and Paddle's optimizer
calls on the fleet live in ``delegation.py``; ``state_bytes`` (the training state this
process holds) in ``memory.py``; the errors, and the default fleet's registration, in
``api.py``. The module-level functions are bound methods of one default :class:`Fleet`; build
your own ``Fleet()`` for tests or for several jobs in one process (they share the process-wide
state listed below). ``save_checkpoint`` / ``load_checkpoint``
(``checkpoints.py``) save and restore the training state of a collective job;
``auto_checkpoint`` / ``start_step`` do it every k optimizer steps and resume a restarted job;
``distributed_loader`` (``loaders.py``) builds a rank's data loader whose position the
checkpoints hold; ``export_model`` (``export.py``) writes the trained model as one
consolidated file. The datasets and data generators (``InMemoryDataset``, ``QueueDataset``, ``DatasetFactory``,
``MultiSlotDataGenerator``...) are :mod:`fleetx.data`'s, re-exported here as in Paddle.

What it may import: torch, :mod:`fleetx.env`, :mod:`fleetx.role_maker`, :mod:`fleetx.strategy`
(its contract, the ``DistributedStrategy`` surface and the planner), :mod:`fleetx.comm` (the
process groups), :mod:`fleetx.optim` (the wrapper base), :mod:`fleetx.metrics` (re-exported
as ``fleet.metrics``, as in Paddle), :mod:`fleetx.data` (the datasets, re-exported),
:mod:`fleetx.parallel` (the hybrid communicate group; ``fleet.meta_parallel``),
:mod:`fleetx.observe` (``fleet.observe``) and :mod:`fleetx.checkpoint` (the format of the
training checkpoints). Those packages must not import ``fleet`` back: a lower layer that needs
the fleet takes what it needs as an argument.

Invariants:

* the engine (``fleet.py``, ``model.py``, ``optimizer.py``) never names a strategy: it asks
  the planner for a plan and runs the :class:`~fleetx.strategy.api.TrainingContext` hook
  points the planned strategies filled in;
* the process-wide state is the default ``Fleet`` and what Paddle's API reaches with no fleet
  in hand, each set in one place: the hybrid communicate group
  (:func:`fleetx.parallel.hcg.get_hcg`, set by ``init`` in ``hybrid.py``, cleared when that
  fleet leaves its world: Paddle's tensor-parallel layers, pipeline and hybrid clipping find
  their groups through it), the util of ``fleet.metrics.*(util=None)``
  (:func:`fleetx.metrics.api.set_default_util`, set by this ``__init__``), the collective-call
  checker (:func:`fleetx.comm.api.set_checker`, installed by the world's process groups under
  ``FLEETX_DEBUG_COLLECTIVES=1``: the DDP comm hooks it checks are built with no handle on
  them), the model-parallel random streams (:func:`fleetx.parallel.random.get_rng_state_tracker`,
  Paddle's), the strategies, model types and fields that strategy modules register as they
  load (:mod:`fleetx.strategy.api`, :mod:`fleetx.strategy.fields`) and, in tests only, the
  recorder of config reads (:func:`fleetx.strategy.config.recording_reads`). Fleets in one
  process share these: the last one to ``init`` owns the hybrid group;
* the wrappers keep the user's objects: ``model.state_dict()`` has the plain model's keys and
  the optimizer's groups and state are the inner optimizer's.

Example:
    >>> from fleetx import fleet
    >>> fleet.init(is_collective=True)
    >>> model = fleet.distributed_model(Net())
    >>> opt = fleet.distributed_optimizer(torch.optim.Adam(model.parameters()))
    >>> opt.minimize(loss_fn(model(x), y))
"""
import sys
import types

from fleetx.fleet.api import FleetError, RuntimeHandlerError, set_default_fleet
from fleetx.fleet.fleet import Fleet
from fleetx.role_maker import (PaddleCloudRoleMaker, Role, RoleMakerBase,
                                     UserDefinedRoleMaker)
from fleetx.fleet.util import UtilBase
from fleetx.strategy.distributed_strategy import DistributedStrategy

_fleet = Fleet()
set_default_fleet(_fleet)  # what a UtilBase or DistributedInfer built without a fleet serves

init = _fleet.init
is_first_worker = _fleet.is_first_worker
worker_index = _fleet.worker_index
worker_num = _fleet.worker_num
node_num = _fleet.node_num
local_rank = _fleet.local_rank
local_device = _fleet.local_device
local_device_ids = _fleet.local_device_ids
world_device_ids = _fleet.world_device_ids
is_worker = _fleet.is_worker
is_server = _fleet.is_server
server_num = _fleet.server_num
server_index = _fleet.server_index
worker_endpoints = _fleet.worker_endpoints
server_endpoints = _fleet.server_endpoints
barrier_worker = _fleet.barrier_worker
rank = _fleet.rank
nranks = _fleet.nranks
world_size = _fleet.world_size
rank_in_node = _fleet.rank_in_node
distributed_model = _fleet.distributed_model
distributed_optimizer = _fleet.distributed_optimizer
consolidated_model = _fleet.consolidated_model
distributed_loader = _fleet.distributed_loader
explain = _fleet.explain
observe = _fleet.observe
save_checkpoint = _fleet.save_checkpoint
load_checkpoint = _fleet.load_checkpoint
auto_checkpoint = _fleet.auto_checkpoint
start_step = _fleet.start_step
export_model = _fleet.export_model
state_bytes = _fleet.state_bytes
get_hybrid_communicate_group = _fleet.get_hybrid_communicate_group
applied_strategies = _fleet.applied_strategies
get_lr = _fleet.get_lr
set_lr = _fleet.set_lr
step = _fleet.step
clear_grad = _fleet.clear_grad
minimize = _fleet.minimize
state_dict = _fleet.state_dict
set_state_dict = _fleet.set_state_dict
init_worker = _fleet.init_worker
init_server = _fleet.init_server
run_server = _fleet.run_server
stop_worker = _fleet.stop_worker
save_persistables = _fleet.save_persistables
save_inference_model = _fleet.save_inference_model
shrink = _fleet.shrink
table_stats = _fleet.table_stats
print_table_stat = _fleet.print_table_stat
prefetch = _fleet.prefetch
_final_strategy = _fleet._final_strategy
_get_applied_meta_list = _fleet._get_applied_meta_list
_get_applied_graph_list = _fleet._get_applied_graph_list


class _FleetModule(types.ModuleType):
    """Makes ``fleet.util`` a live view of the default fleet's util, so that assigning
    ``fleet.util = MyUtil()`` (as Paddle allows) changes what the fleet itself uses."""

    @property
    def util(self) -> UtilBase:
        return _fleet.util

    @util.setter
    def util(self, value: UtilBase) -> None:
        _fleet.util = value


sys.modules[__name__].__class__ = _FleetModule

from fleetx import metrics  # noqa: E402  (fleet.metrics, as in Paddle)
from fleetx.fleet import utils  # noqa: E402  (fleet.utils, Paddle's module; fleet.util above)
from fleetx.fleet import meta_parallel  # noqa: E402  (fleet.meta_parallel, as in Paddle)
from fleetx.parallel.hcg import HybridCommunicateGroup  # noqa: E402  (exported by Paddle's fleet)
from fleetx.metrics.api import set_default_util  # noqa: E402
from fleetx.data.generator import (MultiSlotDataGenerator,  # noqa: E402  (as in Paddle)
                                   MultiSlotStringDataGenerator)
from fleetx.data.dataset import (DatasetBase, DatasetFactory, InMemoryDataset,  # noqa: E402
                                 QueueDataset)

# metrics called with util=None use fleet.util, read at each call (users may replace it); the
# fleet hands it over here so that metrics never import the fleet
set_default_util(lambda: sys.modules[__name__].util)

__all__ = [
    "metrics", "utils", "meta_parallel", "HybridCommunicateGroup", "get_hybrid_communicate_group",
    "Fleet", "FleetError", "RuntimeHandlerError", "DistributedStrategy", "Role", "RoleMakerBase", "PaddleCloudRoleMaker",
    "UserDefinedRoleMaker", "UtilBase", "util", "init", "is_first_worker", "worker_index",
    "worker_num", "node_num", "local_rank", "local_device", "local_device_ids",
    "world_device_ids", "is_worker", "is_server", "server_num", "server_index",
    "worker_endpoints", "server_endpoints", "barrier_worker", "rank", "nranks", "world_size",
    "rank_in_node", "distributed_model", "distributed_optimizer", "consolidated_model",
    "distributed_loader",
    "explain", "state_bytes",
    "applied_strategies", "observe",
    "get_lr", "set_lr", "step", "clear_grad", "minimize", "state_dict", "set_state_dict",
    "init_worker", "init_server", "run_server", "stop_worker", "save_persistables", "prefetch",
    "save_inference_model", "shrink", "table_stats", "print_table_stat", "save_checkpoint",
    "load_checkpoint", "auto_checkpoint", "start_step", "export_model",
    "MultiSlotDataGenerator", "MultiSlotStringDataGenerator", "DatasetBase", "InMemoryDataset",
    "QueueDataset", "DatasetFactory",
]
