"""Progress bars for long calls (tqdm), a no-op when off."""
from __future__ import annotations

import contextlib
from typing import Iterator


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass


@contextlib.contextmanager
def progress_bar(total: int, enabled: bool, desc: str = "generate") -> Iterator:
    if not enabled:
        yield _NoBar()
        return
    from tqdm import tqdm
    with tqdm(total=total, desc=desc, unit="sample") as bar:
        yield bar
