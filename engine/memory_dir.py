"""Where a server keeps small files it writes on every request: /dev/shm (memory) where it exists and
is writable, else the system's temporary directory. Used for gunicorn's worker heartbeat files and the
gateway's limits store; on a disk file system each such write may wait on the journal or fault in a
page that was written back meanwhile."""
from __future__ import annotations

import os

SHM = "/dev/shm"


def memory_dir() -> str | None:
    """/dev/shm where it exists and is writable, else None (tempfile's own choice)."""
    return SHM if os.path.isdir(SHM) and os.access(SHM, os.W_OK) else None
