"""A transform's error carries the same ``__notes__`` under either executor (docs/transforms.md reads them)."""

from __future__ import annotations

from typing import Any

import pytest

import pyloader

FIELDS = {"label": ("int64", ())}


class Fussy(KeyError):
    pass


def fussy(sample: dict[str, Any]) -> dict[str, Any]:
    if int(sample["label"]) == 5:
        raise Fussy("no label 5")
    return sample


def _error(path: str, executor: str) -> BaseException:
    it = iter(pyloader.DataLoader(pyloader.ShardDataset(path), batch_size=4, transform=fussy, num_workers=1,
                                  executor=executor))
    assert next(it)["label"].tolist() == [0, 1, 2, 3]
    with pytest.raises(Fussy) as e:
        next(it)
    assert next(it)["label"].tolist() == [8, 9, 10, 11]  # the iteration goes on
    return e.value


@pytest.mark.timeout(120)
def test_processes_keep_the_notes_as_notes(write_dataset) -> None:
    path = write_dataset(12, FIELDS, lambda i: {"label": i})
    threads, processes = _error(path, "threads"), _error(path, "processes")
    notes = getattr(threads, "__notes__", None)
    assert notes and notes[0].startswith("raised by the transform in pyloader transform worker 0, on the sample at "
                                         "shard "), notes
    assert notes[0].endswith(", record 5 (global index 5)"), notes
    assert getattr(processes, "__notes__", None) == notes
    text = str(processes)
    assert "no label 5" in text and "pyloader transform worker 0" in text  # type, traceback and worker as before
    assert notes[0] not in text  # the note is a note, not folded into the message
