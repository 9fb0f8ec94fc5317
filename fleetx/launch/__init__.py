"""``fleetrun``: start a training script as a distributed job.

Three thin layers: the command line (``cli.py``) becomes a :class:`LaunchConfig`
(``config.py``); :func:`launch` picks the controller for its run mode; the collective controller
(``collective.py``, its decisions in ``collective_plan.py``) hands the processes to the torch
elastic agent, and the parameter-server controller (``ps.py``, its decisions in
``ps_plan.py``) runs servers and trainers. Every process starts in ``bootstrap.py``, which sets
its ``PADDLE_*`` variables and sends its output to ``<log_dir>/workerlog.<rank>``.

Example:
    >>> from fleetx.launch import LaunchConfig, launch
    >>> launch(LaunchConfig(training_script="train.py", nproc_per_node=2))  # doctest: +SKIP
    0
"""
from __future__ import annotations


from fleetx.launch.api import ConfigError, LaunchError, RunMode
from fleetx.launch.config import LaunchConfig

__all__ = ["launch", "LaunchConfig", "LaunchError", "ConfigError", "RunMode"]


def launch(config: LaunchConfig) -> int:
    """Run the job ``config`` describes and return fleetrun's exit code.

    A collective ``config.dry_run`` does not return: the script replaces the calling process
    (``os.execve``), as it replaces ``fleetrun``.

    Raises:
        ConfigError: the flags cannot be served on this node.
        LaunchError: the job could not be started (e.g. its mode is not available).
    """
    if config.k8s:  # manifests for the job, printed; nothing runs here
        from fleetx.launch import k8s

        return k8s.launch(config)
    if config.resolved_mode() is RunMode.PS:
        from fleetx.launch import ps  # imports torch only when a job really starts

        return ps.dry_run(config) if config.dry_run else ps.launch(config)
    from fleetx.launch import collective  # imports torch only when a job really starts

    if config.dry_run:
        return collective.dry_run(config)
    return collective.launch(config)
