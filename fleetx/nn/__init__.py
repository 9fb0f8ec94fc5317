"""Layers whose state lives outside the process: :class:`SparseEmbedding` and
:class:`SparseEmbeddingBag` (parameter-server tables), and :class:`HeterSection` (a block a heter
worker runs, ``docs/heter.md``).

What it offers: ``torch.nn.Module`` s that look their rows up through a *backend* bound to them
(anything with ``lookup(table, ids)``; optionally ``defer``, which batches the lookups of many
tables into one request per server, through ``deferred.DeferredRows``), and hand each lookup's
de-duplicated ``(ids, grads)`` over after backward (``pop_gradients``).

What it may import: torch, numpy, its own modules, :mod:`fleetx.ps.api` for the table's
declared configuration (``InitConfig``, ``RuleConfig``: plain data) and :mod:`fleetx.ps.kernels`
(the C segment sum of a lookup's backward). Importing those runs ``fleetx/ps/__init__.py``,
which loads the numpy-only core, its client and server included; nothing here uses them, nor
the parameter-server runtime (:mod:`fleetx.ps_torch`), ``fleet`` or ``strategy``, none of
which it imports: whatever binds a backend (the parameter-server adapter, or a local table in
one process) imports this package, not the reverse.

Invariants:

* the layers hold no ``nn.Parameter``: their rows are the servers' business, never the local
  optimizer's, and never in the module's ``state_dict``;
* a row's initial value depends only on ``(init.seed, id)``, so every worker and server agrees
  on a row nobody has written yet;
* the gradient handed over has one row per unique id (autograd sums the occurrences).
"""
from fleetx.nn.heter import HeterSection
from fleetx.nn.sparse_embedding import SparseEmbedding, SparseEmbeddingBag

__all__ = ["HeterSection", "SparseEmbedding", "SparseEmbeddingBag"]
