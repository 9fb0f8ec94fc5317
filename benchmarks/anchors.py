"""Where the benchmarks find the reference scripts they run ("anchors"), and the error when absent.

The anchors are the scripts that measured the baselines fleetx is compared with: the quiet-machine
harness (``harness.py``), Paddle's parameter-server job (``paddle_ps_run.py``, which starts
``paddle_ps_ctr.py`` reading through ``paddle_ps_reader.py``), the plain-torch trainers. They carry
no licence, so they are not copied into this repository: they live in
``../shared/reference/anchors`` beside the clone, or in the folder named by ``FLEETX_ANCHORS``.
``benchmarks/README.md`` says how to set them up.

Example:
    >>> import anchors
    >>> anchors.require("harness.py")        # doctest: +SKIP
    PosixPath('/work/shared/reference/anchors/harness.py')
"""
from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The variable that names the anchors' folder (benchmarks only: fleetx itself never reads it).
VARIABLE = "FLEETX_ANCHORS"
#: Where the anchors are when ``FLEETX_ANCHORS`` is not set: ``shared/`` beside the clone.
DEFAULT = ROOT.parent / "shared" / "reference" / "anchors"
#: What Paddle's parameter-server side of ``ps_ctr.py compare`` runs.
PADDLE_PS = ("paddle_ps_run.py", "paddle_ps_ctr.py", "paddle_ps_reader.py")


class MissingAnchor(SystemExit):
    """A reference script a benchmark needs is not there; the message names it and the fix.

    A ``SystemExit`` so that a benchmark stops with the message alone (exit status 1), no
    traceback: the fix is on the user's side, not in the code.
    """


def folder() -> Path:
    """The anchors' folder: ``$FLEETX_ANCHORS`` when set, else :data:`DEFAULT`."""
    value = os.environ.get(VARIABLE)  # benchmark scripts only; not part of fleetx's contract
    return Path(value) if value else DEFAULT


def require(*names: str) -> Path:
    """The path of anchor ``names[0]``, after checking that every one of ``names`` exists.

    Args:
        names: file names inside the anchors' folder, e.g. ``"harness.py"``.

    Raises:
        MissingAnchor: one is absent; the message names the file, the folder searched, how that
            folder was chosen, and the fix.
    """
    where = folder()
    for name in names:
        if not (where / name).is_file():
            chosen = (f"{VARIABLE}={os.environ[VARIABLE]}" if os.environ.get(VARIABLE)
                      else f"{VARIABLE} unset, so ../shared/reference/anchors beside the clone")
            raise MissingAnchor(
                f"benchmark needs the reference script {name}, not found in {where} ({chosen}). "
                f"Fix: put the reference scripts there or set {VARIABLE} to the folder that holds "
                f"{name}; see benchmarks/README.md, section 'Reference scripts'.")
    return where / names[0]
