"""Reading a dataset the user saved with ``save_to_disk``, with one clear error for what cannot be read."""
from __future__ import annotations

from pathlib import Path

import datasets


def load_saved_dataset(path: str | Path, keep_in_memory: bool = False):
    """``datasets.load_from_disk(path)``; FileNotFoundError when `path` does not exist, ValueError
    naming `path` when it is not a folder or cannot be read. A split saved without rows has no data
    file, which ``load_from_disk`` fails on (an IndexError): the error says so."""
    if not Path(path).exists():
        raise FileNotFoundError(f"data_dir {str(path)!r} does not exist")
    if not Path(path).is_dir():
        raise ValueError(f"data_dir {str(path)!r} is a file, not a save_to_disk folder (a folder holding "
                         "dataset_dict.json or state.json)")
    try:
        return datasets.load_from_disk(str(path), keep_in_memory=keep_in_memory)
    except IndexError:
        raise ValueError(f"data_dir {str(path)!r} is a save_to_disk folder with a split of no rows, which datasets "
                         "saves without a data file and cannot read back: save it without the empty split") from None
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"data_dir {str(path)!r} looks like a save_to_disk folder but cannot be loaded "
                         f"({err.__class__.__name__}: {err})") from None
