"""Per-sample work on the loader's workers: transforms, image decoding, reproducible randomness.

| file | what it holds |
|---|---|
| ``stage.py`` | what a worker does with one native batch: split, decode, transform, collate (``run_batch``); the stream both executors share and the stage's counters; one thread per worker for the libraries it calls (NOTE [worker threads]) |
| ``collate.py`` | the default collation of transformed samples, torch's types and dtypes (``collate_samples``) |
| ``threads.py`` | the thread executor (NOTE [thread executor]) |
| ``processes.py`` | the process executor's epoch: jobs, results in plan order, dead workers (NOTE [process executor]) |
| ``pool.py`` | the worker processes, kept across epochs, and their shared-memory slots (NOTE [transform pool]) |
| ``reap.py`` | workers told to exit after an epoch's last batch, reaped on a thread while the loop goes on (NOTE [late reaping]) |
| ``auto.py`` | ``executor="auto"``: threads or processes, from a scaling probe (NOTE [executor choice]) |
| ``tuning.py`` | ``num_workers="auto"`` with a transform: the workers' count (NOTE [transform autotune]) |
| ``context.py`` | per-sample seeds and ``SampleContext`` (NOTE [sample seeds]) |
| ``image.py`` | ``ImageDecode``: image fields decoded by Pillow (NOTE [image decode]) |

Nothing here imports the readers: the executors drive any dataset through the contract
(``batches``, ``sample``; NOTE [dataset contract] in ``pyloader.contract``).
"""

from .collate import collate_samples
from .context import SampleContext, sample_seed
from .image import ImageDecode

__all__ = ["ImageDecode", "SampleContext", "collate_samples", "sample_seed"]
