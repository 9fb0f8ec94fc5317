"""The contract of ``fleetx.checkpoint``: the manifest's records and the one error type.

A checkpoint is a folder of files written by one or several processes, plus a manifest that
lists every file with its SHA-256 and size and names the save they belong to. The manifest is
the commit point: it is written last, to a temporary name, and renamed over the previous one,
so a reader sees either the whole previous save or the whole new one. Content hashes are plain
SHA-256 of the bytes, never keyed by a job's secret, so a checkpoint written by one job is
verified by any other.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

__all__ = ["CheckpointError", "FileEntry", "Manifest", "MANIFEST", "FORMAT", "check_save_id",
           "check_relpath"]

#: the manifest's file name inside a checkpoint folder
MANIFEST = "manifest.json"
#: manifest format; a reader refuses any other
FORMAT = 1

_SAVE_ID = re.compile(r"[0-9A-Za-z][0-9A-Za-z_.-]{0,63}\Z")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, or is not fit to load (a file is missing, its content
    does not match the manifest, or its data contradicts its metadata).

    Attributes:
        path: the offending file or folder, when there is one.
    """

    def __init__(self, message: str, path: Optional[str] = None) -> None:
        super().__init__(message)
        self.path = path


def check_save_id(save_id: Any) -> str:
    """``save_id`` if it is a valid save id (it names a folder): 1-64 characters from
    ``[0-9A-Za-z_.-]``, starting with a letter or digit.

    Raises:
        CheckpointError: anything else (the message shows the value).
    """
    if not isinstance(save_id, str) or not _SAVE_ID.match(save_id):
        raise CheckpointError(f"invalid save id {save_id!r}: expected 1-64 characters of "
                              "[0-9A-Za-z_.-] starting with a letter or digit")
    return save_id


def check_relpath(rel: Any) -> str:
    """``rel`` if it is a relative path that stays inside its folder (``a/b.npy``; no leading
    ``/``, no ``.`` or ``..`` component, no backslash).

    Raises:
        CheckpointError: anything else.
    """
    parts = rel.split("/") if isinstance(rel, str) else [""]
    if not isinstance(rel, str) or "\\" in rel or "\0" in rel or any(
            p in ("", ".", "..") for p in parts):
        raise CheckpointError(f"invalid file name {rel!r} in a checkpoint: expected a relative "
                              "path without '.', '..' or empty components")
    return rel


@dataclass(frozen=True)
class FileEntry:
    """One file of a save: its path relative to the save's folder, SHA-256 and size."""

    path: str
    sha256: str
    nbytes: int

    def to_json(self) -> dict:
        return {"sha256": self.sha256, "bytes": self.nbytes}

    @classmethod
    def from_json(cls, path: str, d: Any) -> "FileEntry":
        """Raises CheckpointError: a malformed record."""
        record = d if isinstance(d, Mapping) else {}
        sha, nbytes = record.get("sha256"), record.get("bytes")
        if not (isinstance(sha, str) and re.fullmatch(r"[0-9a-f]{64}", sha)
                and isinstance(nbytes, int) and nbytes >= 0):
            raise CheckpointError(f"manifest entry for {path!r} is malformed: {d!r}")
        return cls(check_relpath(path), sha, nbytes)


@dataclass(frozen=True)
class Manifest:
    """A committed save: its id, the folder holding its files (relative to the checkpoint
    folder), every file's entry, and ``info``: a JSON object the writer describes the save with
    (e.g. the parameter server's save mode and the save a delta builds on; empty by default,
    covered by the manifest's own hash)."""

    save_id: str
    folder: str
    files: Mapping[str, FileEntry]
    created: str = ""
    info: Mapping[str, Any] = field(default_factory=dict)
