"""Checkpoints you can trust: atomic saves of a folder of files, verified on load.

A save writes its files beside the committed checkpoint and commits them with a manifest of
SHA-256 hashes and a save id (:class:`SaveWriter`); :class:`Checkpoint` opens the committed
save and verifies every file it reads, raising :class:`CheckpointError` ("checksum
mismatch", "missing file") naming the file. Saving again to the same folder replaces the
checkpoint atomically: a crash in the middle of a save leaves the previous one loadable.

Collective jobs save their training state through :mod:`fleetx.checkpoint.training`
(``fleet.save_checkpoint`` / ``fleet.load_checkpoint``): ``torch.distributed.checkpoint``
writes the tensors, this manifest commits them; :mod:`fleetx.checkpoint.background` finishes
an asynchronous save on a thread, and :mod:`fleetx.checkpoint.rotation` keeps the newest k
(``keep_last``), which :func:`has_checkpoint` also recognises. The parameter server's ``save_persistables``
uses it (:mod:`fleetx.ps.checkpoint` decides
what goes in the files); it knows nothing of what the files hold, so any checkpoint made of
files in a folder can use it.

To take a trained model out of the job, :mod:`fleetx.checkpoint.export` (``fleet.export_model``)
writes one consolidated weights file under the plain model's keys, from any layout, with the
same write-then-rename discipline.
"""
from fleetx.checkpoint.api import CheckpointError, FileEntry, Manifest
from fleetx.checkpoint.background import SaveHandle
from fleetx.checkpoint.manifest import Checkpoint, SaveWriter, new_save_id
from fleetx.checkpoint.rotation import has_checkpoint

__all__ = ["CheckpointError", "FileEntry", "Manifest", "Checkpoint", "SaveWriter",
           "has_checkpoint", "new_save_id", "SaveHandle"]
