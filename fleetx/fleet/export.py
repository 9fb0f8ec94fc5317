"""``fleet.export_model``: the trained model out of the job, as one consolidated file.

A mixin of :class:`~fleetx.fleet.fleet.Fleet`. It finds the user's module behind what
``fleet.distributed_model`` returned and hands it to :mod:`fleetx.checkpoint.export`, where
the gathering and the atomic writing live.
"""
from __future__ import annotations

import os
from typing import Optional

from torch import nn

from fleetx.fleet.api import FleetError

__all__ = ["ExportCalls", "user_module"]


def user_module(model: nn.Module) -> nn.Module:
    """The user's module behind a fleet wrapper: ``DistributedModel.module``, the stage of a
    ``PipelineParallel``, or ``model`` itself."""
    from fleetx.fleet.model import DistributedModel
    from fleetx.parallel.pipeline_parallel import PipelineParallel
    if isinstance(model, DistributedModel):
        return model.module
    if isinstance(model, PipelineParallel):
        return model._layers
    return model


class ExportCalls:
    """Exports of the trained model (mixed into ``Fleet``)."""

    def export_model(self, path: str, format: str = "safetensors",
                     model: Optional[nn.Module] = None) -> str:
        """Write the trained model's full weights to one file, under the keys of the plain,
        unsplit model's ``state_dict()`` (every rank calls; a collective; rank 0 writes).

        From any layout: data parallel, sharding stages 1, 2 and 3, tensor parallel (fleetx's
        parallel layers, also as a model's own plan applied them) and pipeline parallel (a
        pipeline's keys are those of ``nn.Sequential(*layers)``). Rank 0 gathers the whole
        model in CPU memory, writes it to a temporary name in the same folder, flushes it to
        disk and renames it, so ``path`` never holds half a file; every rank returns once it
        is written.

        Every rank must call it: called under ``if rank == 0:`` it is a ``CommError`` naming
        the ranks that did not call it, within seconds where they went on into another
        collective, else after ``FLEETX_TIMEOUT``.

        What ``path`` is: for a Hugging Face model (a ``transformers.PreTrainedModel``) a
        directory that ``from_pretrained(path)`` reads: ``config.json``,
        ``generation_config.json`` (a model that generates), and ``model.safetensors``
        (``pytorch_model.bin`` with ``format="torch"``); an existing directory keeps its other
        files (a tokenizer), the new ones replacing theirs. For any other model, the file
        itself, whatever its name.

        Tied weights: ``"torch"`` keeps every key (tied keys share one tensor, as in
        ``torch.save(model.state_dict())``); ``"safetensors"`` writes a tie once, as Hugging
        Face does (the key a Hugging Face model lists in ``_tied_weights_keys``, else every
        alias after the first, is left out): read it with
        ``safetensors.torch.load_model(model, file)`` (strict; it fills the tie from the key
        that was kept) or ``from_pretrained``. A model without ties also loads with
        ``model.load_state_dict(safetensors.torch.load_file(file), strict=True)``.

        Args:
            path: the Hugging Face directory, or the file.
            format: ``"safetensors"`` (default) or ``"torch"``.
            model: the model to export (what ``distributed_model`` returned, or the module
                given to it); default: the one model given to ``fleet.distributed_model``.

        Returns:
            The path of the weights file written (on every rank).

        Raises:
            ValueError: an unknown ``format`` (before any communication).
            FleetError: no model given to ``fleet.distributed_model`` (or several, and no
                ``model``).
            IsADirectoryError, NotADirectoryError, FileExistsError: ``path`` is a directory
                for a plain model, or a file for a Hugging Face one, or a directory holding a
                weights file ``from_pretrained`` would read first (rank 0 raises it, the other
                ranks a ``RuntimeError`` that names it).

        Example:
            >>> fleet.export_model("gpt.safetensors")          # every rank
            >>> fleet.export_model("out/llama")                 # a Hugging Face model
        """
        module = user_module(model) if model is not None else self._exported_module()
        self._enter("fleet.export_model")
        from fleetx.checkpoint.export import export_model
        return export_model(module, os.fspath(path), format)

    def _exported_module(self) -> nn.Module:
        models = [m.module for m in getattr(self, "_models", [])] + list(
            getattr(self, "_claimed", []))
        distinct = list({id(m): m for m in models}.values())
        if not distinct:
            raise FleetError("fleet.export_model() writes the model given to "
                             "fleet.distributed_model(...): call that first")
        if len(distinct) > 1:
            raise FleetError(f"fleet.export_model(): {len(distinct)} models were given to "
                             f"fleet.distributed_model; name the one to write with "
                             f"model=...")
        return distinct[0]
