"""The command line: ``fleetrun [flags] training_script [script args...]``.

The parser is generated from :class:`LaunchConfig`'s fields (flag, aliases, help, group), so
the command line, ``--help``, the start-up banner and the flag table in ``docs/launch.md`` all
come from one place. Every flag spelled with underscores is also accepted with dashes
(``--nproc-per-node``, as torchrun spells it). Exit codes (:data:`EXIT_CODES`): 0 success, 1 a
process failed or the job could not start, 2 bad flags, 128+N a signal.
"""
from __future__ import annotations

import argparse
import sys
import textwrap
from dataclasses import MISSING, Field, fields
from importlib import metadata
from typing import Optional, Sequence

from fleetx import __version__, env
from fleetx.launch import banner, launch
from fleetx.launch.api import EXIT_FAILED, EXIT_OK, EXIT_USAGE, ConfigError, LaunchError
from fleetx.launch.config import LaunchConfig

__all__ = ["build_parser", "parse_config", "flags_markdown", "flag_names", "main", "version",
           "EXIT_CODES", "ENV_READ"]

_DESCRIPTION = ("Start a training script as a distributed job: collective (torch elastic agent) "
                "or parameter server. Each process's stdout and stderr go to "
                "<log_dir>/workerlog.<rank>; rank 0's are also shown here (--log_ranks, --tee). "
                "Logs of an earlier job in <log_dir> are moved to <log_dir>/earlier/<date>/ first.")

_EXAMPLES = """\
examples:
  fleetrun --nproc_per_node 2 train.py --epochs 3     2 CPU processes (gloo)
  fleetrun --nproc-per-node 2 -m mypkg.train          a module, as python -m runs it
  fleetrun --gpus 0,1,2,3 train.py                    one process per GPU (nccl)
  fleetrun --nproc_per_node 4 --log_ranks 0,3 t.py    show ranks 0 and 3 here ([rank N] lines)
  fleetrun --ips 10.0.0.1,10.0.0.2 --gpus 0,1 t.py    two nodes: the same command on each
  fleetrun --server_num 2 --worker_num 2 train.py     parameter servers and workers
  fleetrun --dry-run --nproc_per_node 8 train.py      print the strategy plan, run nothing
  fleetrun --k8s --image IMG --nnodes 2 --gpus 0,1 /app/train.py | kubectl apply -f -
                                                      the same job as Kubernetes manifests
  fleetrun --plot runs/exp1 [--out f.png]             plot fleet.observe's scalars (a PNG)"""

#: fleetrun's exit codes and what each means (``--help`` and ``docs/launch.md`` list them).
EXIT_CODES = (
    (str(EXIT_OK), "every process exited 0"),
    (str(EXIT_FAILED), "a process failed, or the job could not start (fleetrun: error: ...)"),
    (str(EXIT_USAGE), "a bad flag or flag value, named in the message"),
    ("128+N", "fleetrun was stopped by signal N (130: SIGINT, 143: SIGTERM); the processes "
              "were stopped"),
)

#: Variables fleetrun itself reads (the others it only passes on or sets).
ENV_READ = ("FLEETX_TIMEOUT", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME",
            "NCCL_SOCKET_IFNAME", "FLEETX_PS_SECRET", "FLEETX_PS_SECRET_FILE")


def version() -> str:
    """``fleetrun 0.1.0 (torch 2.x, Python 3.x)``; torch's version is read from its package
    metadata, so asking costs no torch import."""
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "not installed"
    python = ".".join(map(str, sys.version_info[:3]))
    return f"fleetrun {__version__} (torch {torch_version}, Python {python})"


def _epilog() -> str:
    sets = sorted(v.name for v in env.VARIABLES.values() if "fleetrun" in v.writer)
    wrap = textwrap.TextWrapper(width=96, initial_indent="  ", subsequent_indent="    ")
    lines = [_EXAMPLES, "", "environment (docs/environment.md says what each means):",
             wrap.fill("read by fleetrun: " + ", ".join(ENV_READ)),
             wrap.fill("set for the processes (those of the job's mode): " + ", ".join(sets)),
             "", "exit codes:"]
    lines += [f"  {code:<6} {meaning}" for code, meaning in EXIT_CODES]
    lines += ["", "Everything after the script belongs to the script. Details: docs/launch.md"]
    return "\n".join(lines)


def flag_names(f: Field) -> list[str]:
    """Every spelling of a field's flag: ``--name``, its aliases, then the dashed form of each
    one spelled with underscores (``--nproc-per-node``), without repeats."""
    names = [f"--{f.name}", *f.metadata["aliases"]]
    dashed = [n[:2] + n[2:].replace("_", "-") for n in names if n.startswith("--") and "_" in n]
    return list(dict.fromkeys(names + dashed))


def _default(f: Field) -> Optional[str]:
    if f.default is MISSING or f.default is None or f.default == ():
        return None
    return ",".join(f.default) if isinstance(f.default, tuple) else str(f.default)


def _help(f: Field) -> str:
    default = _default(f)
    return f.metadata["help"] + (f" (default: {default})" if default is not None else "")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser, one argument per :class:`LaunchConfig` field."""
    # No abbreviations: a script option such as --worker must never be taken for one of ours.
    parser = argparse.ArgumentParser(
        prog="fleetrun", description=textwrap.fill(_DESCRIPTION, 96), epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    parser.add_argument("--version", action="version", version=version())
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in fields(LaunchConfig):
        meta = f.metadata
        if meta["positional"]:
            continue
        if meta["group"] not in groups:
            groups[meta["group"]] = parser.add_argument_group(f"{meta['group']} arguments")
        group = groups[meta["group"]]
        if meta["switch"]:
            group.add_argument(*flag_names(f), dest=f.name, default=f.default,
                               action="store_true", help=meta["help"])
        else:
            group.add_argument(*flag_names(f), dest=f.name,
                               default=f.default, metavar=meta["metavar"], help=_help(f))
    for f in fields(LaunchConfig):
        if f.metadata["positional"]:
            action = parser.add_argument(f.name, help=f.metadata["help"],
                                         nargs=argparse.REMAINDER if f.metadata["rest"] else None)
            # argparse counts a remainder as required; an empty one is fine, so with no
            # arguments at all only the script is reported missing.
            action.required = not f.metadata["rest"]
    return parser


def parse_config(argv: Optional[Sequence[str]] = None,
                 parser: Optional[argparse.ArgumentParser] = None) -> LaunchConfig:
    """The :class:`LaunchConfig` of a command line; exits 2 with the flag named on bad input."""
    parser = parser or build_parser()
    namespace = parser.parse_args(argv)
    try:
        return LaunchConfig(**vars(namespace))
    except ConfigError as exc:
        parser.error(str(exc))


def flags_markdown() -> str:
    """The flag reference as a Markdown table (``docs/launch.md`` embeds it)."""
    rows = ["| flag | group | default | meaning |", "|---|---|---|---|"]
    for f in fields(LaunchConfig):
        meta = f.metadata
        if meta["positional"]:
            name = f"`{f.name}` (positional)"
        else:
            name = " / ".join(f"`{flag}`" for flag in flag_names(f))
        rows.append(f"| {name} | {meta['group']} | {_default(f) or ''} | {meta['help']} |")
    return "\n".join(rows)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``fleetrun``: parse, print the configuration, launch; returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--plot"]:  # not a job: python -m fleetx.plot's command line
        from fleetx import plot

        return plot.main(args[1:])
    parser = build_parser()
    config = parse_config(args, parser)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)  # rank 0's output is interleaved live
    if not config.k8s:  # with --k8s, stdout carries the manifests alone (kubectl apply -f -)
        print(banner.configuration_banner(config.arguments()), flush=True)
    # Every process inherits it (the elastic agent and the parameter-server controller pass
    # fleetrun's environment on): rank 0 may draw a progress bar although its stdout is a file.
    env.apply({"FLEETX_TTY": "1" if sys.stdout.isatty() else "0"})
    try:
        return launch(config)
    except ConfigError as exc:
        parser.error(str(exc))
    except LaunchError as exc:
        print(f"fleetrun: error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    except KeyboardInterrupt:  # before the agent took over the signals
        print("fleetrun: interrupted", file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
