"""Permissions of files a user hands to another program.

A model directory (`shellrl export`, a learner checkpoint's servable part) is read by servers that
may run as another user (SGLang, vLLM, an engine in a container). safetensors' writer (0.8: a
temporary file, persisted) creates its files with mode 0600 whatever the umask, and
`shutil.copy2` keeps that mode, so `share_readable` sets the modes explicitly: 0644 for files,
0755 for directories, inside a directory the user owns. Secrets never go through it: the stack's
token file is created 0600 (cli/launcher.py) and stays so.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

FILE_MODE = 0o644
DIRECTORY_MODE = 0o755


def share_readable(directory: str | Path) -> None:
    """Give `directory`, and every directory and regular file below it, the modes above. Symbolic
    links are neither followed nor changed. Raises OSError (the first chmod that fails)."""
    directory = Path(directory)
    os.chmod(directory, DIRECTORY_MODE, follow_symlinks=False)
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            path = os.path.join(root, name)
            mode = os.lstat(path).st_mode
            if stat.S_ISDIR(mode):
                os.chmod(path, DIRECTORY_MODE)
            elif stat.S_ISREG(mode):
                os.chmod(path, FILE_MODE)
