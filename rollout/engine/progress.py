"""The optional progress bar of generate() and run_episodes()."""

from __future__ import annotations


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def progress(total: int, use_tqdm: bool, unit: str = "prompt"):
    if not use_tqdm:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="rollout", unit=unit)
