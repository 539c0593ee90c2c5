"""Atomic checkpoint files that load with ``torch.load(weights_only=True)``: nothing is unpickled
but tensors and plain containers.

Layout, for a checkpoint path ``<dir>/<name>`` (``checkpoint.pt`` when a directory is given)::

    <dir>/<name>            the newest checkpoint, always complete
    <dir>/<name>.prev       the one before it, the fallback
    <dir>/.<name>.*.tmp     a write in progress (or one a crash cut short; never loaded)

A save writes and fsyncs the temp file, renames ``<name>`` to ``<name>.prev``, renames the temp
file to ``<name>`` and fsyncs the directory. Each rename is atomic, so a process killed at any
point leaves ``<name>`` complete or absent, and ``<name>.prev`` complete. Loading checks the
zip's CRC-32 of every record (``torch.load`` does not) and falls back to ``<name>.prev`` when
``<name>`` is missing, truncated or corrupt. One writer per checkpoint path (rank 0).
"""

from __future__ import annotations

import collections
import logging
import os
import random
import tempfile
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch

from autoaccum.errors import AutoAccumError
from autoaccum.jsonio import fsync_dir
from autoaccum.log import rank_level, user_stacklevel
from autoaccum.state import RngState

__all__ = [
    "CHECKPOINT_NAME", "CheckpointError", "check_plain", "check_resumable_dir", "check_writable", "load_checkpoint",
    "rng_from_plain", "rng_to_plain", "save_checkpoint",
]

logger = logging.getLogger(__name__)

CHECKPOINT_NAME = "checkpoint.pt"
_PREV_SUFFIX = ".prev"
_TMP_SUFFIX = ".tmp"

# What weights_only loading rebuilds: exact types only (a subclass such as defaultdict, a
# namedtuple or a numpy scalar may pickle fine and still be refused at load time).
_LEAF_TYPES = (int, float, str, bool, type(None))
_KEY_TYPES = (int, str)
_CONTAINER_TYPES = (dict, collections.OrderedDict, list, tuple)
_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


class CheckpointError(AutoAccumError):
    """Checkpoint files exist but none of them can be read."""


def _checkpoint_path(path_or_dir: str | os.PathLike[str]) -> Path:
    if not isinstance(path_or_dir, (str, os.PathLike)):
        raise TypeError(f"checkpoint path must be a str or os.PathLike, got {path_or_dir!r} "
                        f"({type(path_or_dir).__name__})")
    path = Path(path_or_dir).expanduser()
    return path / CHECKPOINT_NAME if path.is_dir() else path


def check_plain(state: Any, name: str = "state") -> None:
    """Raise TypeError naming the key path of the first value ``weights_only`` loading would refuse.

    Allowed: dict/OrderedDict (str or int keys), list, tuple, int, float, str, bool, None, tensors.
    """
    _check_plain(state, name, set())


def _check_plain(obj: Any, where: str, on_path: set[int]) -> None:
    kind = type(obj)
    if kind in _LEAF_TYPES or kind in _TENSOR_TYPES:
        return
    if kind not in _CONTAINER_TYPES:
        raise TypeError(
            f"{where} is a {kind.__module__}.{kind.__qualname__}, which a weights_only checkpoint cannot hold. "
            f"Allowed: dict, list, tuple, int, float, str, bool, None and torch.Tensor; convert it first "
            f"(e.g. .item()/.tolist()/int()/str(), or its state_dict())."
        )
    if id(obj) in on_path:  # a cycle would recurse forever
        raise ValueError(f"{where} contains itself; a checkpoint must be a tree of values")
    on_path.add(id(obj))
    if kind in (dict, collections.OrderedDict):
        for key, value in obj.items():
            if type(key) not in _KEY_TYPES:
                raise TypeError(f"{where} has a key {key!r} of type {type(key).__name__}; "
                                f"checkpoint keys must be str or int")
            _check_plain(value, f"{where}[{key!r}]", on_path)
    else:
        for i, value in enumerate(obj):
            _check_plain(value, f"{where}[{i}]", on_path)
    on_path.discard(id(obj))


def save_checkpoint(path: str | os.PathLike[str], state: dict) -> None:
    """Write ``state`` to ``path`` atomically, keeping the previous checkpoint as ``<path>.prev``.

    ``state`` is checked first (``check_plain``), so what is written always loads with
    ``weights_only=True``; then it is written as the module docstring says, so that a kill at any
    point leaves the new or the old checkpoint loadable. Temp files left by killed writes are removed.

    Args:
        path: the checkpoint file, or an existing directory (the file is then
            ``<dir>/checkpoint.pt``). Missing parent directories of a file are created.
        state: a dict of tensors and plain containers (model/optimizer/scheduler state dicts,
            counters, ``rng_to_plain`` output).

    Raises:
        TypeError: ``state`` is not a dict, or holds a value weights_only loading would refuse;
            the message names its key path. Nothing is written then.
        OSError: the file could not be written; the previous checkpoint stays loadable.
    """
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict, got {type(state).__name__}")
    check_plain(state)
    path = _checkpoint_path(path)
    directory = path.parent
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=_TMP_SUFFIX)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        if path.exists():
            os.replace(path, path.with_name(path.name + _PREV_SUFFIX))
        # Killed here: <name> is missing and <name>.prev is the newest; load falls back to it.
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(directory)
    # Temp files of writes that were killed: nothing else writes this path (one writer per path).
    for stale in directory.iterdir():
        if stale.name.startswith(f".{path.name}.") and stale.name.endswith(_TMP_SUFFIX):
            stale.unlink(missing_ok=True)
    logger.debug("checkpoint written to %s", path)


def _read(path: Path) -> dict:
    # torch.load does not check the zip records' CRC-32, so a flipped byte inside a tensor would
    # load as a wrong value; testzip reads every record and compares (a checksum pass, cheap next to loading).
    with zipfile.ZipFile(path) as archive:
        bad = archive.testzip()
    if bad is not None:
        raise ValueError(f"CRC mismatch in record {bad}")
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        raise ValueError(f"holds a {type(state).__name__}, not a dict")
    return state


def load_checkpoint(path_or_dir: str | os.PathLike[str]) -> dict | None:
    """The newest readable checkpoint at ``path_or_dir``, or None when there is none.

    Reads ``<name>`` with ``torch.load(weights_only=True, map_location="cpu")``, after checking the
    CRC-32 of every record. When it is missing, truncated or corrupt, reads ``<name>.prev`` instead
    with one warning naming what was skipped and why. Tensors come back on the CPU.

    Args:
        path_or_dir: the checkpoint file given to ``save_checkpoint``, or its directory
            (the file is then ``<dir>/checkpoint.pt``).

    Returns:
        The saved dict, or None when neither ``<name>`` nor ``<name>.prev`` exists.

    Raises:
        CheckpointError: checkpoint files exist but none can be read (each file and reason named).
    """
    path = _checkpoint_path(path_or_dir)
    candidates = [path, path.with_name(path.name + _PREV_SUFFIX)]
    found = False
    skipped: list[str] = []
    for candidate in candidates:
        if not candidate.exists():
            skipped.append(f"{candidate}: missing")
            continue
        found = True
        try:
            state = _read(candidate)
        except Exception as exc:  # a damaged file can fail in many ways (zip, pickle, EOF, ...)
            skipped.append(f"{candidate}: {type(exc).__name__}: {exc}")
            continue
        if candidate != path:
            warnings.warn(f"newest checkpoint unusable, loaded the previous one {candidate} instead "
                          f"(skipped {skipped[0]})", RuntimeWarning, stacklevel=user_stacklevel())
        logger.log(rank_level(logging.INFO), "checkpoint loaded from %s", candidate)
        return state
    if not found:
        return None
    raise CheckpointError(
        "no readable checkpoint: " + "; ".join(skipped)
        + ". Move the damaged files away to start afresh, or point to another checkpoint."
    )


def check_resumable_dir(directory: str | os.PathLike[str]) -> None:
    """Raise ValueError where ``directory`` holds no checkpoint to resume from (neither ``checkpoint.pt``
    nor ``checkpoint.pt.prev``): ``resume=True`` never starts afresh silently."""
    path = Path(directory).expanduser()
    if any((path / name).exists() for name in (CHECKPOINT_NAME, CHECKPOINT_NAME + _PREV_SUFFIX)):
        return
    what = "does not exist" if not path.exists() else "is not a directory" if not path.is_dir() else \
        f"holds no {CHECKPOINT_NAME}"
    raise ValueError(f"resume=True, but checkpoint_dir {str(directory)!r} {what}: there is no checkpoint to resume "
                     f"from. Pass checkpoint_dir= the folder of the run to resume, resume=False to start afresh, or "
                     f"resume='auto' to resume where a checkpoint exists and start afresh where none does (a job "
                     f"that may be restarted)")


def check_writable(directory: str | os.PathLike[str]) -> Path:
    """Create ``directory`` if needed and make sure files can be written there; return it.

    Called before training starts, so that an unusable checkpoint directory fails before any
    work is done (invariant 7).

    Raises:
        TypeError: ``directory`` is not a str or os.PathLike.
        ValueError: it cannot be created or written, naming the path and the reason.
    """
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"checkpoint_dir must be a str or os.PathLike, got {directory!r} "
                        f"({type(directory).__name__})")
    path = Path(directory).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        # mkstemp is the operation save_checkpoint needs; permission bits alone say nothing for root.
        with tempfile.TemporaryFile(dir=path, prefix=".autoaccum-write-test."):
            pass
    except OSError as exc:
        raise ValueError(
            f"Invalid checkpoint_dir: {str(path)!r} cannot be written ({type(exc).__name__}: {exc.strerror or exc}). "
            f"Pass a directory you can write to, or fix its permissions."
        ) from exc
    return path.resolve()


def rng_to_plain(rng: RngState) -> dict:
    """``rng`` as tensors and plain values, so that it survives ``weights_only`` loading.

    Python's ``random.getstate()`` is ``(version, tuple of 625 ints, gauss_next)``; the tuple of
    ints (each < 2**32) becomes an int64 tensor. The torch generator states are byte tensors already.
    """
    version, internal, gauss_next = rng.python
    return {
        "python_version": int(version),
        "python_state": torch.tensor(internal, dtype=torch.int64),
        "python_gauss_next": gauss_next,
        "cpu": rng.cpu.detach().to("cpu", copy=True),
        "cuda": None if rng.cuda is None else [t.detach().to("cpu", copy=True) for t in rng.cuda],
    }


def rng_from_plain(plain: dict) -> RngState:
    """The ``RngState`` that ``rng_to_plain`` turned into ``plain``, bit for bit.

    Raises:
        ValueError: ``plain`` lacks a key ``rng_to_plain`` writes.
    """
    missing = [k for k in ("python_version", "python_state", "python_gauss_next", "cpu", "cuda") if k not in plain]
    if missing:
        raise ValueError(f"Invalid RNG state: missing {', '.join(missing)}; expected the dict rng_to_plain returns")
    ints = plain["python_state"]
    ints = ints.tolist() if isinstance(ints, torch.Tensor) else list(ints)
    python = (int(plain["python_version"]), tuple(int(x) for x in ints), plain["python_gauss_next"])
    random.Random().setstate(python)  # raises here, on a bad state, rather than at restore time
    cuda = plain["cuda"]
    return RngState(python, plain["cpu"].to(torch.uint8), None if cuda is None else tuple(cuda))
