"""Small filesystem helpers shared by the commands that write files."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .errors import TreeflashError


def ensure_writable_dir(path: str | Path) -> Path:
    """Create `path` if needed and prove files can be written in it (before any model loads)."""
    path = Path(path).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=path)  # own name: processes sharing `path` do not race
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise TreeflashError(f"cannot write to output directory {str(path)!r}: not writable "
                             f"({e.strerror or e})") from None
    return path
