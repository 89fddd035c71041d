"""Local data files a recipe's `dataset` may name, by extension (apart from config.py: the
tasks read them too, and config.py resolves its defaults from the tasks)."""

from __future__ import annotations

import os

DATA_FILE_TYPES = {"json": "json", "jsonl": "json", "csv": "csv", "parquet": "parquet"}


def data_file_type(name: str) -> str | None:
    """The `datasets` builder of a data file by its extension, whatever its case; None: not
    a data file."""
    return DATA_FILE_TYPES.get(os.path.splitext(name)[1].lstrip(".").lower())


def is_data_file(name: str) -> bool:
    return data_file_type(name) is not None
