"""``TorchCompat``: the DataLoader's torch surface -- torch's attributes, and the generic path over any dataset."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data.dataloader import DataLoader as _TorchDataLoader

from . import iterators as _it
from . import transfer as _transfer
from .core import LoaderCore
from .options import OPTION_NAMES

# Attributes torch reads when it makes an iterator: assigned after construction, they are
# passed on to the generic path's torch loader, so the next iter() uses them as torch's would.
_PASSED_ON = frozenset({"num_workers", "collate_fn", "timeout", "worker_init_fn", "generator", "prefetch_factor",
                        "in_order", "pin_memory_device"})
# torch freezes these once the loader is built (its __setattr__ raises ValueError).
_FROZEN = frozenset({"batch_size", "sampler", "batch_sampler", "drop_last", "dataset", "persistent_workers"})


class TorchCompat(LoaderCore):
    """torch's DataLoader attributes and the generic path (NOTE [torch's DataLoader attributes])."""

    # NOTE [torch's DataLoader attributes]: pyloader.DataLoader subclasses torch's DataLoader
    # (isinstance checks and frameworks that re-build a loader from its attributes, as
    # Lightning and Accelerate do, see a torch DataLoader) without running its __init__. The
    # constructor arguments are public attributes of the same names, as torch's; torch's
    # __setattr__ refuses batch_size, sampler, batch_sampler, drop_last, dataset and
    # persistent_workers once built (``_DataLoader__initialized``); the private attributes
    # torch's own methods and iterators read (``_dataset_kind``, ``_iterator``,
    # ``_IterableDataset_len_called``, ``multiprocessing_context``) are kept here, and on
    # the generic path are those of the torch loader that does the loading, to which later
    # assignments of the attributes torch reads at iter() are passed on (``_PASSED_ON``).
    # An option assigned after construction is checked by its rule (NOTE [loader options]).
    def __setattr__(self, attr: str, val: Any) -> None:
        d = self.__dict__
        if attr in OPTION_NAMES and attr not in _FROZEN and d.get("_DataLoader__initialized"):
            d["_options"] = d["_options"].replace(**{attr: val})
            val = getattr(d["_options"], attr)
        super().__setattr__(attr, val)  # torch's: raises ValueError for the attributes it freezes
        if attr in _PASSED_ON:
            inner = d.get("_inner")
            if inner is not None:
                setattr(inner, attr, val)

    @property
    def multiprocessing_context(self) -> Any:
        """The ``multiprocessing_context`` of torch (a context object once set; None on the native path)."""
        inner = self.__dict__.get("_inner")
        return self.__dict__.get("_mp_context") if inner is None else inner.multiprocessing_context

    @multiprocessing_context.setter
    def multiprocessing_context(self, value: Any) -> None:
        inner = self.__dict__.get("_inner")
        if inner is not None:
            inner.multiprocessing_context = value  # torch validates it against num_workers
        elif self.__dict__.get("executor") == "processes":
            self._mp_context = value
        elif value is not None:
            raise ValueError(f"DataLoader over a {type(self.dataset).__name__}: multiprocessing_context is not "
                             f"supported; the native path starts no processes")

    @property
    def _iterator(self) -> Any:
        """The persistent workers' iterator (torch's ``_iterator``; None on the native path)."""
        inner = self.__dict__.get("_inner")
        return None if inner is None else inner._iterator

    @_iterator.setter
    def _iterator(self, value: Any) -> None:
        inner = self.__dict__.get("_inner")
        if inner is not None:
            inner._iterator = value

    @property
    def _IterableDataset_len_called(self) -> int | None:  # noqa: N802 - torch's name
        """What ``len()`` last reported for an iterable dataset (torch warns when iteration yields more)."""
        inner = self.__dict__.get("_inner")
        return self._len_called if inner is None else inner._IterableDataset_len_called

    @_IterableDataset_len_called.setter
    def _IterableDataset_len_called(self, value: int | None) -> None:  # noqa: N802 - torch's name
        inner = self.__dict__.get("_inner")
        if inner is None:
            self._len_called = value
        else:
            inner._IterableDataset_len_called = value

    def _init_torch(self, shuffle: bool | None, sampler: Any, batch_sampler: Any, multiprocessing_context: Any) -> None:
        # torch's DataLoader does the loading (and its own argument checks); pyloader's copy
        # engine does the pinning and the device copies, so torch's pin thread is off.
        inner: _TorchDataLoader[Any] = _TorchDataLoader(
            self.dataset, batch_size=self.batch_size, shuffle=shuffle, sampler=sampler, batch_sampler=batch_sampler,
            num_workers=self.num_workers, collate_fn=self.collate_fn, pin_memory=False, drop_last=self.drop_last,
            timeout=self.timeout, worker_init_fn=self.worker_init_fn,
            multiprocessing_context=multiprocessing_context, generator=self.generator,
            prefetch_factor=self.prefetch_factor, persistent_workers=self.persistent_workers, in_order=self.in_order)
        self._inner = inner
        self.dataset = inner.dataset
        self.batch_size = inner.batch_size
        self.drop_last = inner.drop_last
        self.sampler = inner.sampler
        self.batch_sampler = inner.batch_sampler
        self.collate_fn = inner.collate_fn
        self.prefetch_factor = inner.prefetch_factor

    def _iter_torch(self) -> Any:
        assert self._inner is not None
        source = iter(self._inner)
        stage = self._new_stage(in_slots=False)
        if stage is None and self.batch_transform is None:
            return source  # torch's own iterator: nothing to add
        gen: Iterator[Any] = source if stage is None else _transfer.Staged(source, stage, stage.submit_tree,
                                                                            go_on_after_error=True)
        if self.batch_transform is not None:
            gen = _it.BatchTransformed(gen, self.batch_transform)
        it = _it.LoaderIterator(gen, len(self._inner) if _it.has_len(self._inner) else None, source, stage)
        it.fence = self._fence(stage)
        return it


__all__ = ["TorchCompat"]
