"""``InMemoryDataset``, ``QueueDataset`` and ``DatasetFactory``: Paddle's datasets, yielding
batches of torch tensors.

Both read their files through ``download_cmd`` then ``pipe_command`` (a shell pipeline per
file) with ``thread_num`` parallel readers (``readers.py``) and parse the slot text
(``parse.py``). ``InMemoryDataset`` keeps the samples (in columns, ``block.py``) for shuffles
and several passes; ``QueueDataset`` streams them once per iteration. Iterating either yields
batches (``batches.py``): where Paddle runs ``exe.train_from_dataset(program, dataset)``, a
fleetx script writes ``for batch in dataset: ...``.
"""
from __future__ import annotations

import threading
from typing import Any, Iterator, Optional

from fleetx import env
from fleetx.data.api import DataError, FleetLike, as_slots
from fleetx.data.batches import iter_batches
from fleetx.data.block import SampleBlock
from fleetx.data.readers import READER_KINDS, ParallelReader, ReadOptions, progress_printer
from fleetx.data.shuffle import global_shuffle, local_shuffle, rng_for

__all__ = ["DatasetBase", "InMemoryDataset", "QueueDataset", "DatasetFactory"]

# init's keys and defaults (the reference's), then fleetx's own: slots= (another name for
# use_var), skip_bad_lines, reader ("thread" / "process"; None: the faster for this build).
_INIT = {"batch_size": 1, "thread_num": 1, "use_var": [], "pipe_command": "cat",
         "input_type": 0, "fs_name": "", "fs_ugi": "", "download_cmd": "cat"}
_OWN = {"slots": None, "skip_bad_lines": False, "reader": None}
_IN_MEMORY = {"data_feed_type": "MultiSlotInMemoryDataFeed", "queue_num": -1}
# _init_distributed_settings' keys; those in _UNSUPPORTED are refused when switched on
_DISTRIBUTED = {"merge_size": -1, "parse_ins_id": False, "parse_content": False,
                "fleet_send_batch_size": None, "fleet_send_sleep_seconds": None,
                "fea_eval": False, "candidate_size": 10000}
_UNSUPPORTED = {"merge_size": "merging instances by line id", "parse_ins_id": "instance ids",
                "parse_content": "instance content", "fea_eval": "slots_shuffle"}


def _check_int(key: str, value: Any, low: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{key} must be an int, got {type(value).__name__} ({value!r})")
    if low is not None and value < low:
        raise ValueError(f"{key} must be >= {low}, got {value}")
    return value


def _check_str(key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{key} must be a str, got {type(value).__name__} ({value!r})")
    return value


class DatasetBase:
    """What both datasets share: settings, the file list, reading and batching.

    Settings are attributes after :meth:`init` (``batch_size``, ``thread_num``, ``slots``,
    ``pipe_command``, ``download_cmd``, ``input_type``, ``fs_name``, ``fs_ugi``,
    ``skip_bad_lines``, ``reader``); ``filelist`` after :meth:`set_filelist`; ``skipped_lines``
    counts the malformed lines skipped so far (``skip_bad_lines=True``).
    """

    _keys = {**_INIT, **_OWN}

    def __init__(self) -> None:
        self.filelist: list = []
        self.skipped_lines = 0
        self._apply(self._keys)

    def init(self, **kwargs: Any) -> None:
        """Set every setting; keys not given take their defaults.

        Args:
            batch_size: samples per batch (default 1).
            thread_num: parallel readers (default 1; at most one per file is used).
            use_var: the slots, in the order the lines hold them: :class:`fleetx.data.Slot`
                objects, or names (sparse int64 slots). ``slots=`` is the same, by another
                name.
            pipe_command: the shell command each file's content is piped through, typically
                ``"python my_generator.py"`` (default ``"cat"``).
            download_cmd: the command reading a file, given its path (default ``"cat"``).
            input_type, fs_name, fs_ugi: accepted, no effect (see docs/datasets.md).
            skip_bad_lines: skip malformed lines and count them in ``skipped_lines`` (default
                False: a malformed line is a :class:`BadLineError`).
            reader: ``"thread"`` or ``"process"`` readers (default: the faster for this build).

        Raises:
            TypeError: an unknown key (the valid ones are listed) or a value of the wrong type.
            ValueError: a bad value (a slot dtype other than int64 / float32, a batch size < 1).
        """
        self._apply({**self._keys, **kwargs})

    def _apply(self, settings: dict) -> None:
        unknown = sorted(set(settings) - set(self._keys))
        if unknown:
            raise TypeError(f"{type(self).__name__}: unknown setting(s) {unknown}; valid: "
                            f"{sorted(self._keys)}")
        if settings.get("slots") is not None and settings.get("use_var"):
            raise TypeError("give the slots once: use_var=[...] or slots=[...], not both")
        for key, value in settings.items():
            self._set(key, value)

    def _set(self, key: str, value: Any) -> None:
        if key == "batch_size":
            value = _check_int(key, value, 1)
        elif key in ("thread_num", "queue_num"):
            value = _check_int(key, value)
        elif key in ("use_var", "slots"):
            if value is None:  # slots=None: use_var decides
                return
            key, value = "slots", as_slots(value)
        elif key == "input_type":
            if value not in (0, 1):
                raise ValueError(f"input_type must be 0 (one sample a line) or 1, got {value!r}")
        elif key in ("pipe_command", "download_cmd", "fs_name", "fs_ugi", "data_feed_type"):
            value = _check_str(key, value)
            if key in ("pipe_command", "download_cmd") and not value.strip():
                raise ValueError(f"{key} must be a shell command, got {value!r}")
        elif key == "skip_bad_lines":
            value = bool(value)
        elif key == "reader" and value is not None and value not in READER_KINDS:
            raise ValueError(f"reader must be one of {list(READER_KINDS)} or None, got "
                             f"{value!r}")
        setattr(self, key, value)

    def set_filelist(self, filelist: list) -> None:
        """The files this worker reads (``fleet.util.get_file_shard(all_files)`` gives a
        worker its share).

        Raises:
            TypeError: not a list of str.
        """
        if not isinstance(filelist, (list, tuple)) or not all(isinstance(f, str)
                                                               for f in filelist):
            raise TypeError(f"set_filelist takes a list of file names (str), got {filelist!r}")
        self.filelist = list(filelist)

    def _readers(self) -> int:
        return self.thread_num

    def _reader(self, bound: int = 0, threads: Optional[int] = None) -> ParallelReader:
        if not self.slots:
            raise DataError(f"{type(self).__name__}: no slots declared; call init(use_var=[...])"
                            f" or init(slots=[...]) first")
        silent = env.get_limit("FLEETX_TIMEOUT")  # a hung command is an error
        options = ReadOptions(self.slots, self.download_cmd, self.pipe_command,
                              self.skip_bad_lines, timeout=silent)
        return ParallelReader(self.filelist, options, threads or self._readers(), self.reader,
                              bound)

    def _read_blocks(self, reader: ParallelReader, what: str) -> Iterator[SampleBlock]:
        report = progress_printer(env.get_float("FLEETX_LOG_INTERVAL"), what)
        try:
            for _, block in reader:
                report(reader)
                yield block
        finally:
            self.skipped_lines += reader.skipped
        report(reader, final=True)


class InMemoryDataset(DatasetBase):
    """Load the files into memory; shuffle locally or across workers; iterate batches, as often
    as wanted.

    Example:
        >>> dataset = fleet.DatasetFactory().create_dataset("InMemoryDataset")
        >>> dataset.init(batch_size=32, thread_num=2, pipe_command="python reader.py",
        ...              use_var=[Slot("dense", "float32", dense_width=13), "C1", "C2",
        ...                       Slot("label", "int64", dense_width=1)])
        >>> dataset.set_filelist(fleet.util.get_file_shard(files))
        >>> dataset.load_into_memory()
        >>> dataset.global_shuffle(fleet)
        >>> for batch in dataset:
        ...     loss = loss_fn(model(batch["dense"], batch["C1"], batch["C2"]), batch["label"])
    """

    _keys = {**_INIT, **_OWN, **_IN_MEMORY}

    def __init__(self) -> None:
        super().__init__()
        self.distributed_settings = dict(_DISTRIBUTED)
        self._data = SampleBlock.empty(())
        self._shuffled = 0
        self._preload: Optional[threading.Thread] = None
        self._preload_error: Optional[BaseException] = None

    def _readers(self) -> int:
        if self.thread_num <= 0:  # the reference's clamp
            self.thread_num = 1
        return self.thread_num

    def _init_distributed_settings(self, **kwargs: Any) -> None:
        """The reference's distributed settings: ``fleet_send_batch_size`` and
        ``fleet_send_sleep_seconds`` are accepted with no effect (the exchange is one
        all-to-all); ``merge_size > 0``, ``parse_ins_id``, ``parse_content`` and ``fea_eval``
        are not implemented and refused.

        Raises:
            TypeError: an unknown key. NotImplementedError: an unimplemented one switched on.
        """
        unknown = sorted(set(kwargs) - set(_DISTRIBUTED))
        if unknown:
            raise TypeError(f"unknown distributed setting(s) {unknown}; valid: "
                            f"{sorted(_DISTRIBUTED)}")
        for key, what in _UNSUPPORTED.items():
            value = kwargs.get(key, _DISTRIBUTED[key])
            if (value > 0 if key == "merge_size" else bool(value)):
                raise NotImplementedError(f"{key}={value!r}: fleetx datasets do not implement "
                                          f"{what}")
        self.distributed_settings.update(kwargs)

    def update_settings(self, **kwargs: Any) -> None:
        """Change some settings (init's keys and the distributed ones); the others stay.

        Raises:
            TypeError / ValueError: as :meth:`init`; ``fs_name`` without ``fs_ugi``.
        """
        if "fs_name" in kwargs and "fs_ugi" not in kwargs:
            raise ValueError("update_settings: fs_name is changed together with fs_ugi")
        distributed = {k: kwargs.pop(k) for k in list(kwargs) if k in _DISTRIBUTED}
        self._apply(kwargs)
        if distributed:
            self._init_distributed_settings(**{**self.distributed_settings, **distributed})

    def _idle(self, what: str) -> None:
        if self._preload is not None:
            raise DataError(f"{what}: preload_into_memory() is running; call "
                            f"wait_preload_done() first")

    def load_into_memory(self, is_shuffle: bool = False) -> None:
        """Read every file of the list into memory (added to what is there already), then
        shuffle locally if ``is_shuffle``.

        Raises:
            PipeCommandError, BadLineError: a file could not be read (nothing of this load is
                kept).
        """
        self._idle("load_into_memory")
        self._load(None)
        if is_shuffle:
            self.local_shuffle()

    def _load(self, threads: Optional[int]) -> None:
        reader = self._reader(threads=threads)
        if self._data.size and self._data.slots != self.slots:
            raise DataError("load_into_memory: the samples in memory have other slots than "
                            "those declared now; call release_memory() first")
        loaded = list(self._read_blocks(reader, "load_into_memory"))
        self._data = SampleBlock.concat(self.slots, [self._data] * bool(self._data.size) +
                                        loaded)
        self._shuffled = 0

    def preload_into_memory(self, thread_num: Optional[int] = None) -> None:
        """Start :meth:`load_into_memory` in the background (with ``thread_num`` readers);
        :meth:`wait_preload_done` waits for it."""
        self._idle("preload_into_memory")

        def run() -> None:
            try:
                self._load(thread_num)
            except BaseException as exc:  # raised by wait_preload_done
                self._preload_error = exc
        self._preload_error = None
        self._preload = threading.Thread(target=run, name="fleetx-data-preload", daemon=True)
        self._preload.start()

    def wait_preload_done(self) -> None:
        """Wait for :meth:`preload_into_memory`; raise what it raised."""
        if self._preload is not None:
            self._preload.join()
            self._preload = None
        if self._preload_error is not None:
            error, self._preload_error = self._preload_error, None
            raise error

    def local_shuffle(self, seed: Optional[int] = None) -> None:
        """Shuffle the samples in memory (``seed``, a fleetx addition: the same order every
        time; None: fresh entropy)."""
        self._idle("local_shuffle")
        self._data = local_shuffle(self._data, rng_for(seed))
        self._shuffled = self._data.size

    def global_shuffle(self, fleet: Optional[FleetLike] = None, thread_num: int = 12,
                       seed: Optional[int] = None) -> None:
        """Exchange samples among the workers so that each holds a uniform random sample of
        all of them (``docs/datasets.md``); every worker must call it. ``fleet``: the fleet
        (``fleetx.fleet``); None: a local shuffle. ``thread_num``: no effect. ``seed`` (a
        fleetx addition): the same exchange and order every time.

        Raises:
            CommError: a worker did not join within ``FLEETX_TIMEOUT`` seconds (it is named).
            ShuffleError: another worker declared other slots.
        """
        self._idle("global_shuffle")
        self._data = global_shuffle(self._data, fleet, seed)
        self._shuffled = self._data.size

    def release_memory(self) -> None:
        """Drop the samples in memory."""
        self._idle("release_memory")
        self._data, self._shuffled = SampleBlock.empty(()), 0

    def get_memory_data_size(self, fleet: Optional[FleetLike] = None) -> int:
        """Samples in memory here, or summed over the workers of ``fleet``."""
        self._idle("get_memory_data_size")
        return self._summed(self._data.size, fleet)

    def get_shuffle_data_size(self, fleet: Optional[FleetLike] = None) -> int:
        """Samples in memory after the last shuffle (0 when none since the last load), here
        or summed over the workers of ``fleet``."""
        self._idle("get_shuffle_data_size")
        return self._summed(self._shuffled, fleet)

    @staticmethod
    def _summed(count: int, fleet: Optional[FleetLike]) -> int:
        if fleet is None:
            return int(count)
        return int(fleet.util.all_reduce(count, "sum"))

    def __len__(self) -> int:
        return self._data.size

    def __iter__(self) -> Iterator[dict]:
        """Batches of ``batch_size`` samples, in memory order."""
        self._idle("iterating")
        return iter_batches([self._data], self.batch_size)


class QueueDataset(DatasetBase):
    """Stream the files: each iteration reads them again, batch by batch, holding at most a
    few chunks per reader in memory. No shuffles (use :class:`InMemoryDataset`).

    Example:
        >>> dataset = fleet.QueueDataset()
        >>> dataset.init(batch_size=32, thread_num=2, use_var=["words", Slot("label", "int64",
        ...              dense_width=1)], pipe_command="python reader.py")
        >>> dataset.set_filelist(["part-0", "part-1"])
        >>> for batch in dataset: ...
    """

    _BOUND = 4  # chunks a reader may hold ahead of the consumer, per file

    def _readers(self) -> int:
        if self.thread_num < 0:
            raise ValueError(f"thread_num must be >= 0, got {self.thread_num}")
        if self.thread_num == 0:  # the reference's clamp
            self.thread_num = 1
        return self.thread_num

    def local_shuffle(self) -> None:
        raise NotImplementedError("QueueDataset does not support local shuffle, please use "
                                  "InMemoryDataset for local_shuffle")

    def global_shuffle(self, fleet: Optional[FleetLike] = None, thread_num: int = 12) -> None:
        raise NotImplementedError("QueueDataset does not support global shuffle, please use "
                                  "InMemoryDataset for global_shuffle")

    def __iter__(self) -> Iterator[dict]:
        """Batches of ``batch_size`` samples, in file order, read as they are consumed."""
        return iter_batches(self._read_blocks(self._reader(bound=self._BOUND), "reading"),
                            self.batch_size)


class DatasetFactory:
    """Creates datasets by name, as the reference's ``fluid.DatasetFactory``.

    Example:
        >>> dataset = fleet.DatasetFactory().create_dataset("InMemoryDataset")
    """

    _KINDS = {"InMemoryDataset": InMemoryDataset, "QueueDataset": QueueDataset}

    def create_dataset(self, datafeed_class: str = "QueueDataset") -> DatasetBase:
        """A new dataset of the class named ``datafeed_class``.

        Raises:
            ValueError: an unknown name (the valid ones are listed).
        """
        if datafeed_class not in self._KINDS:
            raise ValueError(f"datafeed class {datafeed_class!r} does not exist; valid: "
                             f"{', '.join(sorted(self._KINDS))}")
        return self._KINDS[datafeed_class]()
