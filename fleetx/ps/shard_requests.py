"""The requests a server answers from its shard alone: PULL, INIT, SET_LR, SAVE and SHRINK.

None of them waits for another worker or changes who takes part in the job, so they need
nothing of the server but its shard, its configuration and its save root; the sync rounds,
barriers and the workers' registration stay with :class:`fleetx.ps.server.PSServer`, which
calls these on its handler thread (the only thread that touches the shard).
"""
from __future__ import annotations

from typing import Callable

from fleetx.checkpoint import SaveWriter
from fleetx.ps import requests
from fleetx.ps.api import Kind, Message, PSConfig
from fleetx.ps.checkpoint import confine
from fleetx.ps.shard import Shard
from fleetx.ps.transport import Link

__all__ = ["ShardRequests"]


class ShardRequests:
    """Handlers ``(link, msg) -> reply`` of the shard's own requests.

    Args:
        config: the cluster (``max_lr``).
        shard: this server's shard of every table.
        save_root: SAVE writes only under this folder.

    Example:
        >>> handlers = ShardRequests(config, shard, "/ckpt").handlers()  # doctest: +SKIP
        >>> reply = handlers[Kind.PULL](link, msg)
    """

    def __init__(self, config: PSConfig, shard: Shard, save_root: str) -> None:
        self.config, self.shard, self.save_root = config, shard, save_root

    def handlers(self) -> dict[Kind, Callable[[Link, Message], Message]]:
        return {Kind.PULL: self.pull, Kind.INIT: self.init, Kind.SET_LR: self.set_lr,
                Kind.SAVE: self.save, Kind.SHRINK: self.shrink}

    def pull(self, link: Link, msg: Message) -> Message:
        return msg.reply({}, self.shard.pull(msg.meta, msg.bufs))

    def init(self, link: Link, msg: Message) -> Message:
        push = self.shard.parse_push("INIT", msg.meta, msg.bufs)
        if push.nonfinite:
            raise requests.nonfinite_error("INIT", push, "values")
        force = requests.optional_bool("INIT", msg.meta, "force")
        return msg.reply({"applied": self.shard.init(push, force)})

    def set_lr(self, link: Link, msg: Message) -> Message:
        lr, names = requests.parse_set_lr(msg.meta, {**self.shard.sparse, **self.shard.dense},
                                          self.config.max_lr)
        self.shard.set_lr(lr, names)
        return msg.reply()

    def save(self, link: Link, msg: Message) -> Message:
        dirname, save_id, mode = requests.parse_save(msg.meta)
        writer = SaveWriter(confine(dirname, self.save_root), save_id)
        reply = self.shard.save(writer, mode)
        return msg.reply({**reply, "files": {k: e.to_json() for k, e in writer.entries.items()}})

    def shrink(self, link: Link, msg: Message) -> Message:
        return msg.reply({"tables": self.shard.shrink(requests.parse_shrink(msg.meta))})
