"""Where sdcreplay keeps a person's own files: the trust secret, the device ledger.

``$SDCREPLAY_HOME`` when set (a cluster shares one through it), else
``~/.config/sdcreplay``. Nothing here creates the directory: each file's owner does, when it
first writes.
"""

from __future__ import annotations

import os
from pathlib import Path

HOME_ENV = "SDCREPLAY_HOME"


def home_dir() -> Path:
    home = os.environ.get(HOME_ENV)
    return Path(home) if home else Path.home() / ".config" / "sdcreplay"
