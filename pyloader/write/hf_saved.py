"""A Hugging Face ``datasets`` folder written by ``save_to_disk``: the Arrow files that hold its rows.

``Dataset.save_to_disk(folder)`` writes the rows as Arrow IPC streams (``data-00000-of-000NN.arrow``)
and two JSON files, ``dataset_info.json`` (features, description) and ``state.json``, whose
``_data_files`` lists the Arrow files in row order (what ``datasets.load_from_disk`` reads).
Converted as a folder of files, such a folder would become three blobs; converted as its
Arrow files, it gives its rows, as converting one ``.arrow`` file does. A ``DatasetDict``
(``dataset_dict.json`` and a folder per split) is refused with the split folders to name.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ..errors import ConvertError

STATE = "state.json"
INFO = "dataset_info.json"
DICT = "dataset_dict.json"


def _json(path: str) -> Any:
    try:
        with open(path, "rb") as f:
            return json.loads(f.read(1 << 20))
    except (OSError, ValueError):
        return None


def hf_saved_files(folder: str) -> list[str] | None:
    """The Arrow files of the Hugging Face dataset ``save_to_disk`` wrote into ``folder``, in row order.

    None when ``folder`` is not such a folder (no ``state.json`` listing ``.arrow`` files).
    Raises ``ConvertError`` for a ``DatasetDict`` (convert one split's folder), a state
    that lists an indices mapping (rows that are not the files' rows) or a data file that
    is missing or lies outside the folder.
    """
    splits = _json(os.path.join(folder, DICT))
    if isinstance(splits, dict) and isinstance(splits.get("splits"), list):
        names = [s for s in splits["splits"] if isinstance(s, str)]
        first = os.path.join(folder, names[0]) if names else os.path.join(folder, "<split>")
        raise ConvertError(f"{folder}: a Hugging Face DatasetDict saved with save_to_disk (splits "
                           f"{', '.join(names) or 'none listed'}): convert one split at a time, e.g. "
                           f"`pyloader convert {first} DST`")
    state = _json(os.path.join(folder, STATE))
    files = state.get("_data_files") if isinstance(state, dict) else None
    if not isinstance(files, list) or not files or not all(
            isinstance(f, dict) and str(f.get("filename", "")).endswith(".arrow") for f in files):
        return None
    if state.get("_indices_data_files"):
        raise ConvertError(f"{folder}: a Hugging Face dataset saved with an indices mapping (a select or shuffle "
                           "not applied to its Arrow files): save it again as its rows, "
                           "dataset.flatten_indices().save_to_disk(...), and convert that")
    root = os.path.realpath(folder)
    paths = []
    for f in files:
        name = f["filename"]
        path = os.path.realpath(os.path.join(root, name))
        if os.path.dirname(path) != root:  # STYLE 9: a name from a file is a path only inside its folder
            raise ConvertError(f"{folder}: {STATE} lists {name!r}, which is not a file of the folder; save the "
                               "dataset again with save_to_disk")
        if not os.path.isfile(path):
            raise ConvertError(f"{folder}: {STATE} lists {name!r}, which is not there: copy the saved dataset's "
                               "folder again whole")
        paths.append(os.path.join(folder, name))
    return paths


__all__ = ["STATE", "INFO", "DICT", "hf_saved_files"]
