"""Writing a save beside the committed one, committing it with a manifest, reading it back.

Layout of a checkpoint folder::

    dirname/
      manifest.json          the commit point: save id, folder, every file's SHA-256 and size
      save-<save id>/        the committed save's files (any layout below it)

A save writes into ``save-<new id>/`` while ``manifest.json`` still names the previous save,
then renames a new manifest over the old one and removes the other ``save-*`` folders. A
crash at any point before that rename leaves the previous save whole and loadable; a crash
after it leaves the new one. Several processes may write files of the same save (each builds
a :class:`SaveWriter` with the same save id and returns its :attr:`SaveWriter.entries`); one
of them adds the others' entries and commits.

Every file is written to a temporary name, flushed to disk and renamed into place, and hashed
while it is written (no second read). Readers verify each file's hash as they read it.

Example:
    >>> w = SaveWriter("ckpt")                               # doctest: +SKIP
    >>> w.write_array("weights.npy", np.ones(3)); w.write_json("meta.json", {"step": 7})
    >>> w.commit()
    >>> Checkpoint("ckpt").read_array("weights.npy")
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import secrets
import shutil
import time
from typing import Any, BinaryIO, Callable, Iterable, Optional

import numpy as np

from fleetx.checkpoint.api import (FORMAT, MANIFEST, CheckpointError, FileEntry, Manifest,
                                   check_relpath, check_save_id)

__all__ = ["SaveWriter", "Checkpoint", "new_save_id", "has_checkpoint", "write_manifest"]

log = logging.getLogger("fleetx.checkpoint")

_PREFIX = "save-"
_CHUNK = 16 << 20
_MAX_NPY_HEADER = 1 << 16  # numpy writes headers of a few hundred bytes


def file_sha256(f: Any) -> tuple:
    """(SHA-256 hex digest, size) of what is left to read in the binary file ``f``.

    It reads into one reused buffer no larger than the file: a fresh 16 MB ``bytes`` per chunk
    is mapped and unmapped each time, whose page faults and TLB flushes slow the training
    threads beside a background save."""
    sha, size = hashlib.sha256(), 0
    buf = bytearray(max(1, min(_CHUNK, os.fstat(f.fileno()).st_size - f.tell())))
    view = memoryview(buf)
    while True:
        n = f.readinto(buf)
        if not n:
            return sha.hexdigest(), size
        sha.update(view[:n])
        size += n


def new_save_id() -> str:
    """A fresh save id: UTC time (sortable, readable) and 32 random bits."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(4)


def has_checkpoint(dirname: str) -> bool:
    """True if ``dirname`` holds a committed checkpoint (a manifest)."""
    return os.path.isfile(os.path.join(dirname, MANIFEST))


class _HashingWriter:
    """A write-only file object that hashes and counts what passes through it."""

    def __init__(self, raw: BinaryIO) -> None:
        self._raw, self._sha, self.nbytes = raw, hashlib.sha256(), 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self._sha.update(view)
        self._raw.write(view)
        self.nbytes += len(view)
        return len(view)

    def hexdigest(self) -> str:
        return self._sha.hexdigest()


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SaveWriter:
    """The files of one save, written beside the committed checkpoint until :meth:`commit`.

    Args:
        dirname: the checkpoint folder (created if needed).
        save_id: join a save another process started (its id); None starts a new one.

    Raises:
        CheckpointError: ``save_id`` is malformed, or the folder cannot be created.
    """

    def __init__(self, dirname: str, save_id: Optional[str] = None) -> None:
        self.dirname = os.path.abspath(dirname)
        self.save_id = check_save_id(save_id) if save_id is not None else new_save_id()
        self.folder = os.path.join(self.dirname, _PREFIX + self.save_id)
        self.entries: dict[str, FileEntry] = {}
        if save_id is not None and _committed_id(self.dirname) == save_id:
            raise CheckpointError(f"save {save_id} is already committed in {self.dirname}; "
                                  "a new save needs a new id", self.dirname)
        try:
            os.makedirs(self.folder, exist_ok=True)
        except OSError as e:
            raise CheckpointError(f"cannot create checkpoint folder {self.folder}: {e}",
                                  self.folder) from None

    def path(self, rel: str) -> str:
        """Absolute path of file ``rel`` of this save."""
        return os.path.join(self.folder, check_relpath(rel))

    def write(self, rel: str, fill: Callable[[Any], None]) -> FileEntry:
        """Write file ``rel``: ``fill(f)`` writes its bytes to the file object ``f``.

        The bytes go to a temporary name, are flushed to disk, and the file is renamed into
        place; a reader of this save never sees half a file.

        Raises:
            CheckpointError: the file cannot be written (names it).
        """
        path = self.path(rel)
        tmp = f"{path}.tmp-{os.getpid()}"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb") as raw:
                out = _HashingWriter(raw)
                fill(out)
                raw.flush()
                os.fsync(raw.fileno())
            os.replace(tmp, path)
        except OSError as e:
            raise CheckpointError(f"cannot write {path}: {e}", path) from None
        entry = FileEntry(rel, out.hexdigest(), out.nbytes)
        self.entries[rel] = entry
        return entry

    def write_bytes(self, rel: str, data: bytes) -> FileEntry:
        return self.write(rel, lambda f: f.write(data))

    def write_json(self, rel: str, obj: Any) -> FileEntry:
        return self.write_bytes(rel, json.dumps(obj, indent=1, sort_keys=True).encode())

    def write_array(self, rel: str, array: np.ndarray) -> FileEntry:
        """An ``.npy`` file (``allow_pickle=False``: object arrays are refused)."""
        return self.write(rel, lambda f: np.save(f, np.asarray(array), allow_pickle=False))

    def add(self, entries: Iterable[FileEntry]) -> None:
        """Files of this save written by other processes (their :attr:`entries`)."""
        for e in entries:
            self.entries[check_relpath(e.path)] = e

    def commit(self, info: Optional[dict] = None) -> Manifest:
        """Make this save the checkpoint: check every file is there with its size, write the
        manifest (with ``info``, a JSON object describing the save) and rename it over the
        previous one, then remove older saves.

        Raises:
            CheckpointError: a file is missing or has another size than recorded.
        """
        for e in self.entries.values():
            path = self.path(e.path)
            size = os.path.getsize(path) if os.path.isfile(path) else None
            if size != e.nbytes:
                raise CheckpointError(f"cannot commit save {self.save_id}: {path} is "
                                      f"{'missing' if size is None else f'{size} bytes'}, "
                                      f"expected {e.nbytes} bytes", path)
        for root, _, _ in os.walk(self.folder):
            _fsync_dir(root)  # the renames into place are on disk before the manifest names them
        manifest = Manifest(self.save_id, _PREFIX + self.save_id, dict(self.entries),
                            time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), dict(info or {}))
        write_manifest(self.dirname, manifest)
        self._remove_older()
        return manifest

    def _remove_older(self) -> None:
        for name in os.listdir(self.dirname):
            path = os.path.join(self.dirname, name)
            stale = (name.startswith(_PREFIX) and path != self.folder) or \
                name.startswith(MANIFEST + ".tmp")
            if stale:
                try:
                    shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
                except OSError as e:  # the new save is committed; a leftover only costs space
                    log.warning("checkpoint %s: could not remove %s: %s", self.dirname, path, e)


def _manifest_digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"))
                          .encode()).hexdigest()


def write_manifest(dirname: str, manifest: Manifest) -> None:
    """Write ``dirname/manifest.json`` atomically (temporary name, flush, rename, flush the
    folder). The manifest carries a hash of its own content, so a damaged manifest is
    recognised as such."""
    body = {"format": FORMAT, "save_id": manifest.save_id, "folder": manifest.folder,
            "created": manifest.created,
            "files": {k: e.to_json() for k, e in sorted(manifest.files.items())}}
    if manifest.info:  # absent when empty: manifests without it read (and hash) as before
        body["info"] = dict(manifest.info)
    body["manifest_sha256"] = _manifest_digest(body)
    path = os.path.join(dirname, MANIFEST)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(body, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(dirname)
    except OSError as e:
        raise CheckpointError(f"cannot write {path}: {e}", path) from None


def _committed_id(dirname: str) -> Optional[str]:
    try:
        return _read_manifest(dirname).save_id
    except CheckpointError:
        return None


def _read_manifest(dirname: str) -> Manifest:
    path = os.path.join(dirname, MANIFEST)
    try:
        with open(path, "rb") as f:
            body = json.loads(f.read())
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint in {dirname}: {MANIFEST} is missing (not a "
                              "fleetx checkpoint, or no save was ever completed there)",
                              path) from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checksum mismatch: {path} is damaged ({e})", path) from None
    if not isinstance(body, dict) or body.get("manifest_sha256") != _manifest_digest(
            {k: v for k, v in body.items() if k != "manifest_sha256"}):
        raise CheckpointError(f"checksum mismatch: {path} is damaged (its content does not "
                              "match its own hash)", path)
    if body.get("format") != FORMAT:
        raise CheckpointError(f"{path}: manifest format {body.get('format')!r}, this version "
                              f"reads {FORMAT}", path)
    save_id = check_save_id(body.get("save_id"))
    if body.get("folder") != _PREFIX + save_id or not isinstance(body.get("files"), dict):
        raise CheckpointError(f"{path}: malformed manifest (folder {body.get('folder')!r})", path)
    files = {k: FileEntry.from_json(k, v) for k, v in body["files"].items()}
    info = body.get("info", {})
    if not isinstance(info, dict):
        raise CheckpointError(f"{path}: malformed manifest ('info' is not an object)", path)
    return Manifest(save_id, body["folder"], files, str(body.get("created", "")), info)


class Checkpoint:
    """A committed checkpoint, opened for reading; every read verifies the file's hash.

    Opening checks the manifest and that every file it lists exists with its recorded size.

    Args:
        dirname: the checkpoint folder.

    Raises:
        CheckpointError: no manifest, a damaged one, or a missing or resized file (named).
    """

    def __init__(self, dirname: str) -> None:
        self.dirname = os.path.abspath(dirname)
        self.manifest = _read_manifest(self.dirname)
        self.save_id = self.manifest.save_id
        self.folder = os.path.join(self.dirname, self.manifest.folder)
        for e in self.manifest.files.values():
            path = self.path(e.path)
            if not os.path.isfile(path):
                raise CheckpointError(f"missing file {path} (listed in the manifest of save "
                                      f"{self.save_id})", path)
            size = os.path.getsize(path)
            if size != e.nbytes:
                raise CheckpointError(f"checksum mismatch: {path} is {size} bytes, the manifest "
                                      f"says {e.nbytes} (truncated or replaced)", path)

    def names(self, prefix: str = "") -> list[str]:
        """The files of the save (relative paths) that start with ``prefix``, sorted."""
        return sorted(n for n in self.manifest.files if n.startswith(prefix))

    def __contains__(self, rel: str) -> bool:
        return rel in self.manifest.files

    def path(self, rel: str) -> str:
        return os.path.join(self.folder, check_relpath(rel))

    def _entry(self, rel: str) -> FileEntry:
        entry = self.manifest.files.get(rel)
        if entry is None:
            raise CheckpointError(f"missing file {self.path(rel)}: not part of save "
                                  f"{self.save_id} (its manifest does not list it)", self.path(rel))
        return entry

    def _mismatch(self, rel: str, got: str) -> CheckpointError:
        path = self.path(rel)
        return CheckpointError(f"checksum mismatch: {path} has SHA-256 {got[:16]}..., the "
                               f"manifest of save {self.save_id} says "
                               f"{self._entry(rel).sha256[:16]}...", path)

    def verify(self, rel: str) -> None:
        """Hash file ``rel`` and compare with the manifest.

        Raises:
            CheckpointError: "checksum mismatch" naming the file, or a missing file.
        """
        with self._open(rel) as f:
            digest, _ = file_sha256(f)
        if digest != self._entry(rel).sha256:
            raise self._mismatch(rel, digest)

    def read_bytes(self, rel: str) -> bytes:
        """The verified content of file ``rel``."""
        with self._open(rel) as f:
            data = f.read()
        got = hashlib.sha256(data).hexdigest()
        if got != self._entry(rel).sha256:
            raise self._mismatch(rel, got)
        return data

    def read_json(self, rel: str) -> Any:
        try:
            return json.loads(self.read_bytes(rel))
        except ValueError as e:
            raise CheckpointError(f"{self.path(rel)} is not valid JSON: {e}",
                                  self.path(rel)) from None

    def read_array(self, rel: str) -> np.ndarray:
        """The verified array in ``.npy`` file ``rel``, read once straight into its memory."""
        entry = self._entry(rel)
        with self._open(rel) as f:
            header = self._npy_header(rel, f, entry.nbytes)
            if header is None:  # unreadable header: the hash tells whether bytes were damaged
                self.verify(rel)
                raise CheckpointError(f"{self.path(rel)} is not a valid .npy file of numbers",
                                      self.path(rel))
            head, shape, fortran, dtype = header
            sha = hashlib.sha256(head)
            buf = np.empty(shape[::-1] if fortran else shape, dtype)
            view = memoryview(buf.reshape(-1).view(np.uint8))
            for start in range(0, len(view), _CHUNK):
                part = view[start:start + _CHUNK]
                f.readinto(part)
                sha.update(part)
        if sha.hexdigest() != entry.sha256:
            raise self._mismatch(rel, sha.hexdigest())
        return buf.T if fortran else buf

    def _npy_header(self, rel: str, f, nbytes: int) -> Optional[tuple]:
        """``(header bytes, shape, fortran, dtype)``, or None when the header is damaged or
        does not account for exactly the file's size."""
        try:
            version = np.lib.format.read_magic(f)
            read = {(1, 0): np.lib.format.read_array_header_1_0,
                    (2, 0): np.lib.format.read_array_header_2_0}[version]
            shape, fortran, dtype = read(f, max_header_size=_MAX_NPY_HEADER)
        except (ValueError, KeyError, SyntaxError, TypeError, OSError):
            return None
        head_len = f.tell()
        if dtype.hasobject or head_len + math.prod(shape) * dtype.itemsize != nbytes:
            return None
        f.seek(0)
        return f.read(head_len), shape, fortran, dtype

    def _open(self, rel: str) -> BinaryIO:
        self._entry(rel)
        path = self.path(rel)
        try:
            return open(path, "rb")
        except FileNotFoundError:
            raise CheckpointError(f"missing file {path} (listed in the manifest of save "
                                  f"{self.save_id})", path) from None

