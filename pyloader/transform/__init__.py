"""Per-sample work on the loader's workers: transforms, image decoding, reproducible randomness.

| file | what it holds |
|---|---|
| ``stage.py`` | what a worker does with one native batch: split, decode, transform, collate (``run_batch``, ``collate_samples``); the stream both executors share and the stage's counters |
| ``threads.py`` | the thread executor (NOTE [thread executor]) |
| ``processes.py`` | the process executor: worker processes, shared-memory slots (NOTE [process executor]) |
| ``context.py`` | per-sample seeds and ``SampleContext`` (NOTE [sample seeds]) |
| ``image.py`` | ``ImageDecode``: image fields decoded by Pillow (NOTE [image decode]) |

Nothing here imports the readers: the executors drive any dataset through the contract
(``batches``, ``sample``; NOTE [dataset contract] in ``pyloader.contract``).
"""

from .context import SampleContext, sample_seed
from .image import ImageDecode
from .stage import collate_samples

__all__ = ["ImageDecode", "SampleContext", "collate_samples", "sample_seed"]
