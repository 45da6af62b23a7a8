"""Reading and writing the embedded policy's weights as safetensors directories.

Invariants:
- `load_checkpoint` returns tensors that match the model exactly (every expected name, no extra
  names, same shapes and dtypes, finite values) or raises `WeightsError`; it never mutates the model,
  so a refused directory leaves the engine on its old weights.
- `save_weights` writes through a temporary file and renames it, so a reader never sees half a file; a
  write that fails (a full disk) leaves no temporary file and raises `OSError`.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from app.engines.embedded.model import SENTINEL

CHECKPOINT_FILE = "model.safetensors"


class WeightsError(ValueError):
    """A checkpoint directory that cannot be loaded into the model (message names the problem)."""


def save_weights(model: nn.Module, directory: str | os.PathLike[str]) -> Path:
    """Write `model`'s state dict to `directory/model.safetensors`; return the file path."""
    tensors = {name: t.detach().cpu().contiguous().clone() for name, t in model.state_dict().items()}
    return _write(tensors, Path(directory))


def save_sentinel(directory: str | os.PathLike[str], value: float) -> Path:
    """Write a checkpoint holding only the sentinel tensor (for sentinel-mode engines)."""
    return _write({SENTINEL: torch.tensor(float(value), dtype=torch.float32)}, Path(directory))


def _write(tensors: dict[str, torch.Tensor], directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / CHECKPOINT_FILE
    tmp = directory / f".{CHECKPOINT_FILE}.tmp"
    try:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    except (SafetensorError, OSError) as exc:
        tmp.unlink(missing_ok=True)  # the part written would hold the space the next try needs
        if isinstance(exc, OSError):
            raise
        # its I/O errors ("... No space left on device (os error 28)") are an OSError, as any write's
        found = re.search(r"os error (\d+)", str(exc))
        code = int(found.group(1)) if found else errno.EIO
        raise OSError(code, os.strerror(code), str(tmp)) from exc
    os.replace(tmp, target)
    return target


def checkpoint_files(directory: Path) -> list[Path]:
    """`model.safetensors` if present, else every `*.safetensors` in the directory (sorted)."""
    if not directory.is_absolute():
        raise WeightsError(f"checkpoint path {str(directory)!r} is not absolute")
    if not directory.is_dir():
        raise WeightsError(f"checkpoint directory {str(directory)!r} does not exist or is not a directory")
    main = directory / CHECKPOINT_FILE
    if main.is_file():
        return [main]
    files = sorted(p for p in directory.glob("*.safetensors") if p.is_file())
    if not files:
        raise WeightsError(f"no *.safetensors file in {str(directory)!r}")
    return files


def read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(directory):
        try:
            part = load_file(str(path))
        except (SafetensorError, OSError) as exc:
            raise WeightsError(f"cannot read {str(path)!r}: {exc}") from exc
        duplicated = sorted(set(part) & set(tensors))
        if duplicated:
            raise WeightsError(
                f"{str(path)!r} repeats tensors already read from another file: {duplicated[:5]}"
            )
        tensors.update(part)
    return tensors


def load_checkpoint(
    directory: str | os.PathLike[str], expected: Mapping[str, torch.Tensor], *, only: set[str] | None = None
) -> dict[str, torch.Tensor]:
    """Read and validate a checkpoint against `expected` (the model's state dict).

    With `only`, just those names are required and returned; other tensors in the files are ignored.
    """
    where = str(directory)
    tensors = read_tensors(Path(directory))
    wanted = set(expected) if only is None else only
    missing = sorted(wanted - set(tensors))
    if missing:
        raise WeightsError(f"checkpoint {where!r} lacks {len(missing)} tensors, e.g. {missing[:5]}")
    if only is None:
        unexpected = sorted(set(tensors) - set(expected))
        if unexpected:
            raise WeightsError(f"checkpoint {where!r} has tensors the model lacks, e.g. {unexpected[:5]}")
    loaded: dict[str, torch.Tensor] = {}
    for name in sorted(wanted):
        got, want = tensors[name], expected[name]
        if tuple(got.shape) != tuple(want.shape):
            raise WeightsError(
                f"checkpoint {where!r}: tensor {name!r} has shape {tuple(got.shape)}, "
                f"the model needs {tuple(want.shape)}"
            )
        if got.dtype != want.dtype:
            raise WeightsError(
                f"checkpoint {where!r}: tensor {name!r} has dtype {got.dtype}, the model needs {want.dtype}"
            )
        if got.is_floating_point() and not bool(torch.isfinite(got).all()):
            raise WeightsError(f"checkpoint {where!r}: tensor {name!r} holds NaN or infinite values")
        loaded[name] = got
    return loaded
