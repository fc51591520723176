"""Per-sample work on the loader's workers: transforms, image decoding, reproducible randomness.

``stage`` is what a worker does with one batch; ``threads`` and ``processes`` are the two
executors that run it (docs/transforms.md); ``context`` gives every sample its seed;
``image`` decodes encoded image fields.
"""

from .context import SampleContext, sample_seed
from .image import ImageDecode
from .stage import collate_samples

__all__ = ["ImageDecode", "SampleContext", "collate_samples", "sample_seed"]
