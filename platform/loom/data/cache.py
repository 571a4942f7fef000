"""Where prepared data is cached, and the key a cache entry is found by. Below every option and
the token machinery: the text front ends, chat's rendered stores and the Hugging Face loader's
arrow files share one root. No torch.
"""

from __future__ import annotations

import hashlib
from pathlib import Path


def cache_root(cache_dir: str | None) -> Path:
    return Path(cache_dir).expanduser() if cache_dir else Path.home() / ".cache" / "loom" / "datasets"


def fingerprint(files: list[Path], *extra: object) -> str:
    h = hashlib.sha1()
    for f in files:
        st = f.stat()
        h.update(f"{f}|{st.st_size}|{int(st.st_mtime)}\n".encode())
    for e in extra:
        h.update(repr(e).encode())
    return h.hexdigest()[:16]
