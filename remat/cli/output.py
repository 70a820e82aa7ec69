"""Files the command line writes: checked before the work starts, written whole or not at all.

Profiling takes minutes, so an ``--out`` that cannot be written must be found before
it starts (:func:`check_writable`), not after. A file is written to a temporary
name in its folder and renamed over the target (:func:`write_atomic`), so an
interrupted or failed write leaves no partial file behind.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from remat.core.errors import RematError

__all__ = ["OutputError", "check_figure_format", "check_writable", "write_atomic"]


class OutputError(RematError):
    """An output path that cannot be written, or a format that cannot be drawn."""


def check_writable(path: str | os.PathLike[str], what: str = "--out") -> Path:
    """``path`` when a file can be created there; else :class:`OutputError` saying why.

    It creates (and removes) a temporary file in the folder: permission bits alone
    do not tell (root writes anywhere, a read-only mount refuses everyone).
    """
    target = Path(path)
    if target.is_dir():
        raise OutputError(f"{what} {str(path)!r} is a folder; give a file name inside it")
    folder = target.parent
    if folder.exists() and not folder.is_dir():
        raise OutputError(f"{what} {str(path)!r}: {str(folder)!r} is a file, not a folder; "
                          "write elsewhere")
    if not folder.is_dir():
        raise OutputError(f"{what} {str(path)!r}: the folder {str(folder)!r} does not exist; "
                          "create it first or write elsewhere")
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=f".{target.name}.", delete=True):
            pass
    except OSError as err:
        raise OutputError(f"{what} {str(path)!r}: cannot write in {str(folder)!r} "
                          f"({err.strerror or err}); choose a writable folder") from None
    return target


def check_figure_format(path: str | os.PathLike[str], what: str = "--out") -> str:
    """The image format of ``path``'s suffix (``png`` without one), when matplotlib can
    write it; else :class:`OutputError` listing the formats it can."""
    from matplotlib.backend_bases import FigureCanvasBase

    suffix = Path(path).suffix.lower().lstrip(".")
    fmt = suffix or "png"
    supported = FigureCanvasBase.get_supported_filetypes()
    if fmt not in supported:
        raise OutputError(f"{what} {str(path)!r}: matplotlib cannot write .{fmt} files; use "
                          f"one of {', '.join('.' + f for f in sorted(supported))}")
    return fmt


def _umask() -> int:
    """The process's file-creation mask (reading it means setting it: put it back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_atomic(path: str | os.PathLike[str], write: Callable[[str], None]) -> None:
    """Call ``write(temporary_path)``, then rename the temporary file to ``path``.

    The file gets the mode a plain ``open(path, "w")`` would give it (``0o666`` less
    the user's umask), not the private ``0o600`` of a temporary file.
    """
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise

