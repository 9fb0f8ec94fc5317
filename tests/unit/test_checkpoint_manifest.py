"""fleetx.checkpoint: atomic saves with a manifest of SHA-256 hashes, verified reads, and a
crash in the middle of a save (SIGKILL of a real process) that leaves the previous save whole."""
import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from fleetx.checkpoint import (Checkpoint, CheckpointError, FileEntry, Manifest, SaveWriter,
                               has_checkpoint)
from fleetx.checkpoint.manifest import write_manifest

ROOT = Path(__file__).resolve().parents[2]


def save(dirname, value):
    w = SaveWriter(dirname)
    w.write_array("arrays/x.npy", np.arange(1000, dtype=np.float32) * value)
    w.write_array("f.npy", np.asfortranarray(np.arange(6.0).reshape(2, 3)) * value)
    w.write_json("meta.json", {"value": value})
    w.write_bytes("raw.bin", b"\x00\x01" * 50)
    return w.commit()


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_round_trip_and_the_hashes_are_plain_sha256_of_the_bytes(tmp_path):
    m = save(tmp_path, 2.0)
    ck = Checkpoint(tmp_path)
    assert ck.save_id == m.save_id and has_checkpoint(tmp_path)
    np.testing.assert_array_equal(ck.read_array("arrays/x.npy"), np.arange(1000) * 2.0)
    np.testing.assert_array_equal(ck.read_array("f.npy"), np.arange(6.0).reshape(2, 3) * 2)
    assert ck.read_json("meta.json") == {"value": 2.0}
    assert ck.read_bytes("raw.bin") == b"\x00\x01" * 50
    for rel, entry in m.files.items():  # any job (any secret) can verify them
        data = (tmp_path / m.folder / rel).read_bytes()
        assert entry.sha256 == hashlib.sha256(data).hexdigest() and entry.nbytes == len(data)
    assert ck.names("arrays/") == ["arrays/x.npy"]


@pytest.mark.parametrize("rel, offset", [("arrays/x.npy", -3), ("arrays/x.npy", 20),
                                         ("f.npy", -1), ("meta.json", 3), ("raw.bin", 0)],
                         ids=["npy-data", "npy-header", "fortran-npy", "json", "bytes"])
def test_a_flipped_byte_is_a_checksum_mismatch_naming_the_file(tmp_path, rel, offset):
    m = save(tmp_path, 1.0)
    path = tmp_path / m.folder / rel
    flip(path, offset % path.stat().st_size)
    ck = Checkpoint(tmp_path)
    read = {"npy": ck.read_array, "json": ck.read_json, "bin": ck.read_bytes}[rel.split(".")[-1]]
    with pytest.raises(CheckpointError, match="checksum mismatch") as e:
        read(rel)
    assert str(path) in str(e.value) and e.value.path == str(path)


def test_a_missing_or_truncated_file_is_refused_when_opening(tmp_path):
    m = save(tmp_path, 1.0)
    path = tmp_path / m.folder / "arrays" / "x.npy"
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(CheckpointError, match=r"checksum mismatch: .*x\.npy is \d+ bytes, the "
                                              r"manifest says \d+ \(truncated or replaced\)"):
        Checkpoint(tmp_path)
    path.unlink()
    with pytest.raises(CheckpointError, match=r"missing file .*arrays/x\.npy \(listed in"):
        Checkpoint(tmp_path)


def test_a_damaged_or_absent_manifest_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint in .*manifest.json is missing"):
        Checkpoint(tmp_path)
    save(tmp_path, 1.0)
    manifest = tmp_path / "manifest.json"
    body = json.loads(manifest.read_text())
    body["files"]["meta.json"]["bytes"] += 1  # an edit that keeps the JSON valid
    manifest.write_text(json.dumps(body))
    with pytest.raises(CheckpointError, match=r"checksum mismatch: .*manifest\.json is damaged"):
        Checkpoint(tmp_path)


def test_saving_again_replaces_the_checkpoint_and_removes_the_old_files(tmp_path):
    first = save(tmp_path, 1.0)
    second = save(tmp_path, 3.0)
    assert first.save_id != second.save_id
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json", second.folder]
    assert Checkpoint(tmp_path).read_json("meta.json") == {"value": 3.0}


def test_names_and_ids_that_could_leave_the_folder_are_refused(tmp_path):
    for bad in ("../x", "/etc/passwd", "a/../../b", "", "a//b", "./a"):
        with pytest.raises(CheckpointError, match="invalid file name"):
            SaveWriter(tmp_path / "c").path(bad)
    for bad in ("..", "a/b", "", "x" * 65, ".hidden", 7):
        with pytest.raises(CheckpointError, match="invalid save id"):
            SaveWriter(tmp_path / "c", bad)
    committed = save(tmp_path / "d", 1.0)
    with pytest.raises(CheckpointError, match="already committed"):
        SaveWriter(tmp_path / "d", committed.save_id)  # would overwrite the committed files


def test_a_manifest_entry_for_a_file_outside_the_save_is_refused(tmp_path):
    m = save(tmp_path, 1.0)
    outside = FileEntry("../../outside", m.files["raw.bin"].sha256, m.files["raw.bin"].nbytes)
    write_manifest(str(tmp_path), Manifest(m.save_id, m.folder, {**m.files, outside.path: outside}))
    with pytest.raises(CheckpointError, match="invalid file name '../../outside'"):
        Checkpoint(tmp_path)


_CRASHING_SAVER = textwrap.dedent("""
    import os, signal, sys, time
    import numpy as np
    from fleetx.checkpoint import SaveWriter
    dirname, where = sys.argv[1], sys.argv[2]
    w = SaveWriter(dirname)
    w.write_array("x.npy", np.full(1000, 1.0))
    w.write_json("meta.json", {"value": 1})
    w.commit()
    w = SaveWriter(dirname)
    w.write_array("x.npy", np.full(1000, 2.0))

    def slow(f):  # half the file, then hang until killed
        f.write(b"y" * 4096)
        print("writing", flush=True)
        time.sleep(600)

    if where == "mid-file":
        w.write("meta.json", slow)
    else:  # every file of the new save complete, the manifest not yet renamed
        w.write_json("meta.json", {"value": 2})
        print("writing", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.mark.parametrize("where", ["mid-file", "before-commit"])
def test_a_save_killed_midway_leaves_the_previous_one_loadable(tmp_path, where):
    p = subprocess.Popen([sys.executable, "-c", _CRASHING_SAVER, str(tmp_path), where],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        assert p.stdout.readline().strip() == "writing", p.stderr.read()
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
    finally:
        p.wait(timeout=30)
    assert p.returncode == -signal.SIGKILL
    assert len(list(tmp_path.glob("save-*"))) == 2  # the committed one and the killed one
    ck = Checkpoint(tmp_path)
    np.testing.assert_array_equal(ck.read_array("x.npy"), np.full(1000, 1.0))
    assert ck.read_json("meta.json") == {"value": 1}
    survivor = save(tmp_path, 5.0)  # the next save cleans up after the killed one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json", survivor.folder]
