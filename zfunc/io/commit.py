"""Checkpoint directories committed so that no crash loses the last complete checkpoint.

The protocol (rank 0 does the file-system steps; the data itself is written by every rank):

1. ``check_target``: ``path`` must be absent, an empty directory or a complete zfunc checkpoint;
   anything else (a file, a directory of the user's) is refused before anything is written.
2. The new checkpoint is written beside it, into ``path.tmp-<token>``, and marked complete
   (the ``COMPLETE`` file is written last, after an fsync of everything else).
3. ``commit``: what the user keeps in ``path`` beside zfunc's files (a tokenizer, notes) is moved
   into the new checkpoint; ``path`` -> ``path.old-<token>`` (rename), ``path.tmp-<token>`` ->
   ``path`` (rename), then the old one is discarded (its marker first, so a half-deleted
   directory is never taken for a complete one).

A crash before step 3's first rename leaves the old checkpoint at ``path``; a crash between the
renames leaves no ``path`` but two complete siblings, and ``locate`` (what `zfunc.load` reads
through) then finds the new one; after the second rename ``path`` is the new one. The next
`zfunc.save` to the same path first finishes such an interrupted commit (``recover``). A save
deletes only the files a save writes (``ours``): a directory holding anything else is kept.
"""

from __future__ import annotations

import glob
import os

from zfunc.errors import CheckpointError

__all__ = ["MARKER", "META", "is_complete", "locate", "check_target", "recover", "commit", "discard", "ours"]

MARKER = "COMPLETE"
META = "meta.json"


def is_complete(d: str) -> bool:
    """Whether ``d`` is a zfunc checkpoint whose save finished.

    Examples:
        >>> import tempfile
        >>> is_complete(tempfile.mkdtemp())
        False
    """
    return os.path.isdir(d) and os.path.isfile(os.path.join(d, MARKER)) and os.path.isfile(os.path.join(d, META))


def _siblings(path: str, kind: str) -> list[str]:
    found = [d for d in glob.glob(glob.escape(path) + f".{kind}-*") if is_complete(d)]
    return sorted(found, key=os.path.getmtime, reverse=True)


def locate(path: str) -> str | None:
    """The complete checkpoint that ``path`` stands for: ``path`` itself, or, after a commit
    interrupted between its two renames, the new one beside it (else the old one).

    Examples:
        >>> import tempfile
        >>> locate(tempfile.mkdtemp() + "/none") is None
        True
    """
    if is_complete(path):
        return path
    for kind in ("tmp", "old"):
        found = _siblings(path, kind)
        if found:
            return found[0]
    return None


def check_target(path: str) -> None:
    """Refuse a ``path`` that `zfunc.save` must not replace (nothing is touched).

    Examples:
        >>> import tempfile
        >>> d = tempfile.mkdtemp()
        >>> open(d + "/notes.txt", "w").close()
        >>> try:
        ...     check_target(d)
        ... except CheckpointError as e:
        ...     print(str(e)[len(d):].split(" (")[0])
        : exists and is not a zfunc checkpoint
    """
    if os.path.lexists(path) and not os.path.isdir(path):
        raise CheckpointError(f"{path}: exists and is not a directory; save refuses to replace it. Choose "
                              "another path, or remove it yourself")
    if os.path.isdir(path) and os.listdir(path) and not is_complete(path):
        raise CheckpointError(
            f"{path}: exists and is not a zfunc checkpoint (it holds {sorted(os.listdir(path))[:3]}...); save "
            "writes only to a new path, an empty directory or an earlier zfunc checkpoint. Nothing was touched")


def recover(path: str) -> None:
    """Finish a commit that a crash interrupted between its renames (rank 0, before a save)."""
    if os.path.lexists(path):
        return
    found = locate(path)
    if found is not None:
        os.replace(found, path)


def commit(tmp: str, path: str, token: str) -> None:
    """Put the complete checkpoint ``tmp`` at ``path``, replacing the one there (see above)."""
    old = f"{path}.old-{token}"
    if os.path.isdir(path):
        for name in os.listdir(path):  # the user's files go on with the checkpoint that replaces ours
            if not _written_by_save(name) and not os.path.lexists(os.path.join(tmp, name)):
                os.replace(os.path.join(path, name), os.path.join(tmp, name))
        os.replace(path, old)
    os.replace(tmp, path)
    discard(old)
    for kind in ("tmp", "old"):  # what earlier interrupted saves left behind
        for d in glob.glob(glob.escape(path) + f".{kind}-*"):
            if ours(d):
                discard(d)


def _written_by_save(name: str) -> bool:
    """Whether a file of this name in a checkpoint directory is one a zfunc save writes."""
    return name in (MARKER, META, "extra.pt", ".metadata") or name.endswith(".distcp")


def ours(d: str) -> bool:
    """Whether directory ``d`` holds nothing but what a zfunc save writes.

    Examples:
        >>> import tempfile
        >>> d = tempfile.mkdtemp()
        >>> open(d + "/meta.json", "w").close()
        >>> ours(d)
        True
        >>> open(d + "/tokenizer.json", "w").close()
        >>> ours(d)
        False
    """
    return os.path.isdir(d) and all(_written_by_save(n) for n in os.listdir(d))


def discard(d: str) -> None:
    """Delete the files a save wrote in directory ``d``, its completion marker first, and the
    directory once empty; anything else in it (and so ``d``) is left where it is.

    Examples:
        >>> import os, tempfile
        >>> d = tempfile.mkdtemp()
        >>> for name in ("COMPLETE", "meta.json", "notes.txt"):
        ...     open(os.path.join(d, name), "w").close()
        >>> discard(d)
        >>> os.listdir(d)
        ['notes.txt']
    """
    if not os.path.isdir(d):
        return
    names = sorted(os.listdir(d), key=lambda n: n != MARKER)  # the marker first
    for name in names:
        if _written_by_save(name):
            try:
                os.remove(os.path.join(d, name))
            except (FileNotFoundError, IsADirectoryError, PermissionError):
                pass
    try:
        os.rmdir(d)
    except OSError:
        pass  # not empty: it holds something a save did not write
