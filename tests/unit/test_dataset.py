"""InMemoryDataset / QueueDataset / DatasetFactory on one process: settings, loading through pipe
commands with thread and process readers, batches, shuffles, failures."""
from __future__ import annotations

import functools
import os
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fleetx import fleet
from fleetx.data import (BadLineError, DataError, InMemoryDataset, PipeCommandError,
                         QueueDataset, ShuffleError, Slot)
from fleetx.data import dataset as dataset_module
from fleetx.data.readers import ReadOptions

SLOTS = [Slot("ids"), Slot("label", "int64", dense_width=1)]
KINDS = ["thread", "process"]


def write_parts(folder: Path, sizes: list, start: int = 0) -> list:
    """Files part-i of ``sizes[i]`` samples; sample k (counted over all files) has ids
    ``[k] * (k % 3 + 1)`` and label ``k % 2``."""
    paths, k = [], start
    for i, size in enumerate(sizes):
        lines = []
        for _ in range(size):
            n = k % 3 + 1
            lines.append(f"{n} {' '.join([str(k)] * n)} 1 {k % 2}")
            k += 1
        path = folder / f"part-{i}"
        path.write_text("\n".join(lines) + ("\n" if lines else ""))
        paths.append(str(path))
    return paths


def first_ids(dataset) -> list:
    """The first id of every sample, in iteration order."""
    out = []
    for batch in dataset:
        ids = batch["ids"]
        out += ids.values[ids.offsets].tolist()
    return out


def make(cls=InMemoryDataset, files=(), **settings):
    ds = cls()
    ds.init(**{"use_var": SLOTS, **settings})
    ds.set_filelist(list(files))
    return ds


def test_factory_and_exports():
    factory = fleet.DatasetFactory()
    assert type(factory.create_dataset("InMemoryDataset")) is InMemoryDataset
    assert type(factory.create_dataset("QueueDataset")) is QueueDataset
    assert type(factory.create_dataset()) is QueueDataset  # the reference's default
    with pytest.raises(ValueError, match="^datafeed class 'MyOwnDataset' does not exist; valid: "
                                         "InMemoryDataset, QueueDataset$"):
        factory.create_dataset("MyOwnDataset")
    assert fleet.InMemoryDataset is InMemoryDataset and fleet.QueueDataset is QueueDataset


def test_init_defaults_and_errors():
    ds = InMemoryDataset()
    assert (ds.batch_size, ds.thread_num, ds.slots, ds.pipe_command, ds.input_type, ds.fs_name,
            ds.fs_ugi, ds.download_cmd, ds.skip_bad_lines, ds.reader, ds.data_feed_type,
            ds.queue_num) == (1, 1, (), "cat", 0, "", "", "cat", False, None,
                              "MultiSlotInMemoryDataFeed", -1)
    ds.init(batch_size=4, slots=["a", Slot("b", "float32", dense_width=2)])
    assert ds.batch_size == 4 and [s.name for s in ds.slots] == ["a", "b"]
    with pytest.raises(TypeError, match=r"InMemoryDataset: unknown setting\(s\) \['batch'\]; "
                                        r"valid: \['batch_size', 'data_feed_type', "):
        ds.init(batch=4)
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        ds.init(batch_size=0)
    with pytest.raises(TypeError, match=r"thread_num must be an int, got str \('2'\)"):
        ds.init(thread_num="2")
    with pytest.raises(TypeError, match="give the slots once: use_var=.* or slots=.*, not both"):
        ds.init(use_var=["a"], slots=["b"])
    with pytest.raises(ValueError, match="Currently, fleetx datasets only support dtype=float32 "
                                         "and dtype=int64: slot 'x' has dtype 'float64'"):
        ds.init(use_var=[Slot("x", "float64")])
    with pytest.raises(ValueError, match="input_type must be 0 .* or 1, got 2"):
        ds.init(input_type=2)
    with pytest.raises(ValueError, match="pipe_command must be a shell command, got ' '"):
        ds.init(pipe_command=" ")
    with pytest.raises(ValueError, match=r"reader must be one of \['thread', 'process'\] or "
                                         r"None, got 'fork'"):
        ds.init(reader="fork")
    with pytest.raises(TypeError, match="unknown setting"):
        QueueDataset().init(queue_num=2)  # InMemory only


def test_update_settings_and_distributed_settings():
    ds = make(batch_size=3, pipe_command="cat")
    ds.update_settings(pipe_command="cat1", batch_size=2, fleet_send_batch_size=800)
    assert (ds.pipe_command, ds.batch_size, ds.slots[0].name) == ("cat1", 2, "ids")
    assert ds.distributed_settings["fleet_send_batch_size"] == 800
    ds.update_settings(fs_name="afs://x", fs_ugi="u,p")
    assert (ds.fs_name, ds.fs_ugi) == ("afs://x", "u,p")
    with pytest.raises(ValueError, match="fs_name is changed together with fs_ugi"):
        ds.update_settings(fs_name="y")
    ds._init_distributed_settings(fleet_send_sleep_seconds=2, merge_size=-1)
    with pytest.raises(NotImplementedError, match="merge_size=2: fleetx datasets do not "
                                                  "implement merging instances by line id"):
        ds.update_settings(merge_size=2)
    with pytest.raises(NotImplementedError, match="parse_ins_id=True: .* instance ids"):
        ds._init_distributed_settings(parse_ins_id=True)
    with pytest.raises(TypeError, match=r"unknown distributed setting\(s\) \['merge'\]"):
        ds._init_distributed_settings(merge=1)


@pytest.mark.parametrize("kind", KINDS)
def test_load_batches_and_sizes(tmp_path, kind):
    files = write_parts(tmp_path, [5, 0, 7, 3])
    ds = make(files=files, batch_size=4, thread_num=3, reader=kind)
    ds.load_into_memory()
    assert len(ds) == ds.get_memory_data_size() == 15 and ds.get_shuffle_data_size() == 0
    batches = list(ds)
    assert [len(b["label"]) for b in batches] == [4, 4, 4, 3]
    first = batches[0]
    assert first["ids"].values.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert first["ids"].offsets.tolist() == [0, 1, 3, 6]
    assert first["ids"].lengths.tolist() == [1, 2, 3, 1]
    assert first["label"].tolist() == [[0], [1], [0], [1]] and first["label"].dtype == torch.int64
    assert first_ids(ds) == list(range(15))  # file order, twice over
    first["ids"].values.zero_()  # batches own their memory
    assert first_ids(ds) == list(range(15))
    ds.load_into_memory()  # adds to what is there
    assert len(ds) == 30
    ds.release_memory()
    assert len(ds) == 0 and list(ds) == []


def test_file_order_whatever_the_readers_speed(tmp_path):
    files = write_parts(tmp_path, [20] * 6)
    # early files are slow to download: later files finish first
    slow = tmp_path / "slow_cat.sh"
    slow.write_text('case "$1" in *part-0|*part-1) sleep 0.6;; esac; cat "$1"\n')
    for kind in KINDS:
        ds = make(files=files, batch_size=7, thread_num=4, reader=kind,
                  download_cmd=f"sh {slow}")
        ds.load_into_memory()
        assert first_ids(ds) == list(range(120)), kind


def test_shuffles_are_seeded_permutations(tmp_path):
    ds = make(files=write_parts(tmp_path, [30, 30]), batch_size=8)
    ds.load_into_memory()
    ds.local_shuffle(seed=5)
    once = first_ids(ds)
    assert sorted(once) == list(range(60)) and once != list(range(60))
    assert ds.get_shuffle_data_size() == 60
    again = make(files=ds.filelist, batch_size=8)
    again.load_into_memory()
    again.local_shuffle(seed=5)
    assert first_ids(again) == once
    again.release_memory()
    again.load_into_memory()
    again.global_shuffle(None, seed=5)  # no fleet: a local shuffle, from the same seed
    assert first_ids(again) == once
    again.local_shuffle(seed=6)
    assert first_ids(again) != once
    again.load_into_memory(is_shuffle=True)
    assert sorted(first_ids(again)) == sorted(list(range(60)) * 2)


class OneWorker:
    """A fleet of one worker whose util counts its calls."""

    def __init__(self, workers=1):
        self.workers, self.calls = workers, []
        self.util = self

    def worker_num(self):
        return self.workers

    def worker_index(self):
        return 0

    def all_reduce(self, value, mode="sum"):
        self.calls.append(("all_reduce", mode))
        return value * self.workers  # as if every worker held as many

    def barrier(self):
        self.calls.append(("barrier",))


def test_sizes_and_shuffle_with_a_fleet(tmp_path):
    ds = make(files=write_parts(tmp_path, [10]))
    ds.load_into_memory()
    assert ds.get_memory_data_size(OneWorker(3)) == 30
    ds.global_shuffle(OneWorker(1), seed=1)  # one worker: nothing to exchange
    assert ds.get_shuffle_data_size(OneWorker(2)) == 20
    with pytest.raises(ShuffleError, match="global_shuffle\\(fleet=...\\) needs the fleet "
                                           "\\(fleetx.fleet or a Fleet\\): str has no "
                                           "'worker_num'"):
        ds.global_shuffle("fleet")


def test_preload(tmp_path):
    files = write_parts(tmp_path, [50, 50])
    ds = make(files=files, download_cmd="sleep 0.3; cat")
    ds.preload_into_memory(thread_num=2)
    with pytest.raises(DataError, match="iterating: preload_into_memory\\(\\) is running; call "
                                        "wait_preload_done\\(\\) first"):
        iter(ds)
    ds.wait_preload_done()
    assert len(ds) == 100
    ds.set_filelist([str(tmp_path / "missing")])
    ds.preload_into_memory()
    with pytest.raises(PipeCommandError, match="missing: command 'sleep 0.3; cat .*missing' "
                                              "exited with status 1"):
        ds.wait_preload_done()
    assert len(ds) == 100  # a failed load keeps nothing of itself


def test_thread_num_clamps(tmp_path):
    files = write_parts(tmp_path, [3, 3])
    ds = make(files=files, thread_num=0)
    ds.load_into_memory()
    assert ds.thread_num == 1 and len(ds) == 6
    q = make(QueueDataset, files, thread_num=0)
    assert len(first_ids(q)) == 6 and q.thread_num == 1
    q.init(use_var=SLOTS, thread_num=-1)
    with pytest.raises(ValueError, match="thread_num must be >= 0, got -1"):
        list(q)


@pytest.mark.parametrize("kind", KINDS)
def test_queue_dataset_streams_in_order_across_chunks(tmp_path, kind, monkeypatch):
    monkeypatch.setattr(dataset_module, "ReadOptions",
                        functools.partial(ReadOptions, chunk_bytes=50))  # ~5 lines a chunk
    files = write_parts(tmp_path, [23, 1, 40])
    q = make(QueueDataset, files, batch_size=6, thread_num=2, reader=kind)
    assert first_ids(q) == list(range(64)) and first_ids(q) == list(range(64))
    for method in ("local_shuffle", "global_shuffle"):
        word = method.split("_")[0]
        with pytest.raises(NotImplementedError, match=f"QueueDataset does not support {word} "
                                                      f"shuffle, please use InMemoryDataset for "
                                                      f"{method}"):
            getattr(q, method)()


@pytest.mark.parametrize("kind", KINDS)
def test_bad_lines_named_or_skipped(tmp_path, kind, monkeypatch):
    monkeypatch.setattr(dataset_module, "ReadOptions",
                        functools.partial(ReadOptions, chunk_bytes=40))
    files = write_parts(tmp_path, [30, 30])
    text = Path(files[1]).read_text().splitlines()
    text[17] = "2 5 1 0"   # ids announces 2 values, then the label's count is taken as one
    text[25] = "1 7 1"     # the label is missing
    Path(files[1]).write_text("\n".join(text) + "\n")
    ds = make(files=files, thread_num=2, reader=kind)
    with pytest.raises(BadLineError) as err:
        ds.load_into_memory()
    assert (err.value.file, err.value.line) == (files[1], 18)
    assert err.value.reason.startswith("slot 'label' has count 0; every slot needs at least")
    assert len(ds) == 0
    ds.init(use_var=SLOTS, thread_num=2, reader=kind, skip_bad_lines=True)
    ds.load_into_memory()
    assert len(ds) == 58 and ds.skipped_lines == 2


@pytest.mark.parametrize("kind", KINDS)
def test_failing_commands_are_named(tmp_path, kind):
    files = write_parts(tmp_path, [5, 5])
    crash = tmp_path / "crash.py"
    crash.write_text("import sys\nfor i, line in enumerate(sys.stdin):\n"
                     "    print(line, end='')\n    if i == 2:\n"
                     "        raise RuntimeError('generator broke on purpose')\n")
    cases = [
        ({"pipe_command": f"{sys.executable} {crash}"}, files[0],
         f"{sys.executable} {crash}", 1, "RuntimeError: generator broke on purpose"),
        ({"pipe_command": "no_such_generator_cmd"}, files[0], "no_such_generator_cmd", 127,
         "no_such_generator_cmd: not found"),
        ({"download_cmd": "cat"}, str(tmp_path / "gone"), f"cat {tmp_path / 'gone'}", 1,
         "No such file or directory"),
    ]
    for settings, file, command, status, stderr in cases:
        ds = make(files=[file, files[1]], thread_num=2, reader=kind, **settings)
        start = time.monotonic()
        with pytest.raises(PipeCommandError) as err:
            ds.load_into_memory()
        assert time.monotonic() - start < 30
        e = err.value
        assert (e.file, e.command, e.returncode) == (file, command, status)
        assert stderr in e.stderr and stderr in str(e)
        assert str(e).startswith(f"reading {file}: command {command!r} exited with status "
                                 f"{status}; its stderr ends with:\n")


def descendants(name: str) -> list:
    """Processes called ``name`` below this one (children, grandchildren...)."""
    parent, names = {}, {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        names[int(pid)] = stat[stat.index("(") + 1:stat.rindex(")")]
        parent[int(pid)] = int(stat[stat.rindex(")") + 2:].split()[1])
    found = []
    for pid, comm in names.items():
        up = parent.get(pid)
        while up not in (None, 0, 1, os.getpid()):
            up = parent.get(up)
        if comm == name and up == os.getpid():
            found.append(pid)
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def test_a_consumer_that_stops_kills_the_pipe_commands(tmp_path):
    (tmp_path / "f").write_text("")
    for kind in KINDS:
        # a pipe command that never ends, with a helper that never writes (no SIGPIPE for it)
        q = make(QueueDataset, [str(tmp_path / "f")], batch_size=2, reader=kind,
                 pipe_command="sleep 300 & yes '1 5 1 0'")
        stream = iter(q)
        assert next(stream)["ids"].values.tolist() == [5, 5]
        started = descendants("yes") + descendants("sleep")
        assert len(started) == 2, kind
        stream.close()
        deadline = time.monotonic() + 10
        while any(map(alive, started)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(map(alive, started)), kind
    # a for loop broken off does the same, once its iterator is dropped
    q = make(QueueDataset, [str(tmp_path / "f")], batch_size=2, pipe_command="yes '1 5 1 0'")
    for batch in q:
        started = descendants("yes")
        break
    assert len(started) == 1
    deadline = time.monotonic() + 10
    while alive(started[0]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(started[0])


@pytest.mark.parametrize("kind", KINDS)
def test_a_slow_generator_streams_and_stops(tmp_path, kind):
    (tmp_path / "f").write_text("")
    q = make(QueueDataset, [str(tmp_path / "f")], reader=kind,
             pipe_command="echo '1 5 1 0'; exec sleep 300")  # one line, then silence
    start = time.monotonic()
    stream = iter(q)
    assert next(stream)["ids"].values.tolist() == [5]  # not held back for a full chunk
    sleeper = descendants("sleep")
    while not sleeper and time.monotonic() - start < 20:  # the shell execs sleep after echo
        time.sleep(0.05)
        sleeper = descendants("sleep")
    assert len(sleeper) == 1 and time.monotonic() - start < 20
    stream.close()  # the reader waits on a silent command: closing kills it
    # SIGKILL is sent by the time close returns; the kernel ends the process a moment later
    # (on a loaded machine, when it is next scheduled)
    while alive(sleeper[0]) and time.monotonic() - start < 30:
        time.sleep(0.05)
    assert not alive(sleeper[0])


def test_a_reader_process_that_dies_is_named(tmp_path):
    files = write_parts(tmp_path, [3])
    # the pipe command's parent is the reader process (never this one: reader="process")
    ds = make(files=files, reader="process", pipe_command="kill -9 $PPID; sleep 5")
    with pytest.raises(DataError, match=r"the reader process reading .*part-0 exited with status "
                                        r"-9; its stderr ends with:"):
        ds.load_into_memory()


def test_generator_script_as_pipe_command(tmp_path):
    raw = tmp_path / "raw.csv"
    raw.write_text("1,5,6\n0,7\n1,8,9,10\n")
    reader = tmp_path / "reader.py"
    reader.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
        from fleetx.data import MultiSlotDataGenerator

        class Reader(MultiSlotDataGenerator):
            def generate_sample(self, line):
                def local_iter():
                    label, *ids = line.strip().split(",")
                    yield [("ids", [int(i) for i in ids]), ("label", [int(label)])]
                return local_iter

        Reader().run_from_stdin()
    """))
    ds = make(files=[str(raw)], batch_size=3, pipe_command=f"{sys.executable} {reader}")
    ds.load_into_memory()
    batch = next(iter(ds))
    assert batch["ids"].values.tolist() == [5, 6, 7, 8, 9, 10]
    assert batch["ids"].lengths.tolist() == [2, 1, 3]
    assert batch["label"].flatten().tolist() == [1, 0, 1]


def test_progress_lines(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FLEETX_LOG_INTERVAL", "0.000001")
    ds = make(files=write_parts(tmp_path, [4, 6]))
    ds.load_into_memory()
    out = capsys.readouterr().out
    assert "fleetx data: load_into_memory: 10 lines from 2/2 files in " in out
    assert " lines/s" in out
    monkeypatch.setenv("FLEETX_LOG_INTERVAL", "0")
    ds.load_into_memory()
    assert capsys.readouterr().out == ""


def test_no_slots_declared(tmp_path):
    ds = InMemoryDataset()
    ds.set_filelist(write_parts(tmp_path, [1]))
    with pytest.raises(DataError, match=r"InMemoryDataset: no slots declared; call "
                                        r"init\(use_var=\[...\]\) or init\(slots=\[...\]\) "
                                        r"first"):
        ds.load_into_memory()
    with pytest.raises(TypeError, match="set_filelist takes a list of file names"):
        ds.set_filelist("part-0")


def test_slots_feed_an_embedding_bag(tmp_path):
    ds = make(files=write_parts(tmp_path, [9]), batch_size=4)
    ds.load_into_memory()
    bag = torch.nn.EmbeddingBag(10, 3, mode="sum")
    batch = next(iter(ds))
    ids = batch["ids"]
    expected = torch.stack([bag.weight[ids.values[o:o + n]].sum(0)
                            for o, n in zip(ids.offsets.tolist(), ids.lengths.tolist())])
    torch.testing.assert_close(bag(ids.values, ids.offsets), expected)
    assert np.array_equal(batch["label"].numpy().ravel(), [0, 1, 0, 1])
