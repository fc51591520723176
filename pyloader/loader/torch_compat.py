"""``TorchCompat``: the DataLoader's torch surface -- torch's attributes, and the generic path over any dataset."""

from __future__ import annotations

import base64
import itertools
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data.dataloader import DataLoader as _TorchDataLoader
from torch.utils.data.dataloader import _DatasetKind

from ..errors import ResumeError
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

    # NOTE [generic loader state]: frameworks take a loader with ``state_dict`` and
    # ``load_state_dict`` for a resumable one (Lightning's checkpoints, accelerate's
    # ``DataLoaderAdapter``), so the generic path offers a working state, as torchdata's
    # StatefulDataLoader does for any dataset: ``{"version": 1, "loader": "torch",
    # "epoch": k, "batches": n, "rng": {...}}`` -- the k-th iter() of this loader, of which
    # the caller received n batches (torch's own count, ``_num_yielded``: prefetched
    # batches are not consumed), and the random state the epoch started from: torch's
    # default CPU generator, the loader's ``generator`` and the sampler's, each as it was
    # just before that iter(). torch's samplers and worker seeds draw from those at the
    # epoch's start, so after ``load_state_dict`` the next iter() sets them back to the
    # saved states (torch's global RNG included: the resumed epoch replays its random
    # draws), which gives the same order, and skips the n batches: for a map-style
    # dataset in the sampler, without loading them (a one-epoch torch loader over the same
    # dataset with the first n batches of indices left out), for an iterable dataset by
    # reading and dropping them. An epoch whose last batch was received names the next
    # epoch's start (n = 0, no random state). A sampler with ``set_epoch``
    # (DistributedSampler) orders by its epoch, which the framework sets as before.
    def _iter_torch(self) -> Any:
        inner = self._inner
        assert inner is not None
        resume, self._torch_resume = self._torch_resume, None
        rng = resume["rng"] if resume is not None and resume["batches"] else _rng_snapshot(inner)
        offset = 0
        if resume is not None and resume["batches"]:
            _rng_restore(inner, rng)
            source, offset = self._skipped(inner, resume["batches"])
        else:
            source = iter(inner)
        epoch = self._torch_epoch if resume is None else resume["epoch"]
        self._torch_epoch = epoch + 1
        self._torch_run = (epoch, rng, offset, weakref.ref(source))
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

    def _skipped(self, inner: Any, n: int) -> tuple[Any, int]:
        """(an iterator of the rest of an epoch after its first ``n`` batches, the batches it left out unread)."""
        length = len(inner) if _it.has_len(inner) else None
        if length is not None and n > length:
            raise ResumeError(f"the loader state names batch {n} of an epoch of {length} batches: it was taken "
                              f"on another dataset, batch size or sampler")
        if inner._dataset_kind == _DatasetKind.Iterable:
            source = iter(inner)  # no index to skip: the batches are read and dropped
            for _ in range(n):
                try:
                    next(source)
                except StopIteration:
                    break
            return source, 0
        batched = inner.batch_sampler is not None
        rest = _Skip(inner.batch_sampler if batched else inner.sampler, n)
        once: _TorchDataLoader[Any] = _TorchDataLoader(
            inner.dataset, batch_size=1 if batched else None, sampler=None if batched else rest,
            batch_sampler=rest if batched else None,
            num_workers=inner.num_workers, collate_fn=inner.collate_fn, pin_memory=False, timeout=inner.timeout,
            worker_init_fn=inner.worker_init_fn, multiprocessing_context=inner.multiprocessing_context,
            generator=inner.generator, prefetch_factor=inner.prefetch_factor, in_order=inner.in_order)
        return iter(once), n

    def _torch_state(self) -> dict[str, Any]:
        """The generic path's state (NOTE [generic loader state])."""
        run = self._torch_run
        if run is None:
            resume = self._torch_resume
            return dict(resume) if resume is not None else _torch_state_dict(self._torch_epoch, 0, None)
        epoch, rng, offset, ref = run
        it = ref()
        taken = offset + (int(getattr(it, "_num_yielded", 0)) if it is not None else 0)
        if it is None or _ended(it, taken):
            return _torch_state_dict(epoch + 1, 0, None)
        return _torch_state_dict(epoch, taken, rng)

    def _load_torch_state(self, state: object) -> None:
        """Makes the next iter() read the rest of the state's epoch (NOTE [generic loader state])."""
        if not isinstance(state, Mapping) or state.get("loader") != "torch":
            raise ResumeError("this DataLoader loads a torch dataset (the generic path): it takes a state its "
                              "state_dict() made ({'loader': 'torch', ...}), not a pyloader dataset's state")
        if state.get("version") != 1:
            raise ResumeError(f"unsupported loader state version {state.get('version')!r} (this pyloader reads "
                              "version 1)")
        epoch, batches, rng = state.get("epoch"), state.get("batches"), state.get("rng")
        for key, value in (("epoch", epoch), ("batches", batches)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ResumeError(f"state {key} must be a non-negative int, got {value!r}")
        if batches and (not isinstance(rng, Mapping) or not all(
                k in _RNG_KEYS and isinstance(v, str) for k, v in rng.items()) or "torch" not in rng):
            raise ResumeError("a mid-epoch loader state must carry the epoch's random state ('rng'), as its "
                              "state_dict() made it")
        self._torch_resume = _torch_state_dict(int(epoch), int(batches), dict(rng) if batches else None)  # type: ignore[arg-type]
        self._torch_run = None


_RNG_KEYS = ("torch", "loader_generator", "sampler_generator")


class _Skip:
    """A sampler (or batch sampler) without its first ``n`` items."""

    def __init__(self, sampler: Any, n: int) -> None:
        self.sampler = sampler
        self.n = n

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.sampler), self.n, None)

    def __len__(self) -> int:
        return max(0, len(self.sampler) - self.n)


def _torch_state_dict(epoch: int, batches: int, rng: dict[str, str] | None) -> dict[str, Any]:
    return {"version": 1, "loader": "torch", "epoch": epoch, "batches": batches, "rng": rng}


def _encode(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def _decode(text: str) -> torch.Tensor:
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError):
        raise ResumeError("the loader state's random state is not base64 text") from None
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def _sampler_generator(inner: Any) -> torch.Generator | None:
    gen = getattr(inner.sampler, "generator", None)
    return gen if isinstance(gen, torch.Generator) and gen is not inner.generator else None


def _rng_snapshot(inner: Any) -> dict[str, str]:
    """The random state an epoch of ``inner`` starts from (NOTE [generic loader state])."""
    snap = {"torch": _encode(torch.get_rng_state())}
    if isinstance(inner.generator, torch.Generator):
        snap["loader_generator"] = _encode(inner.generator.get_state())
    gen = _sampler_generator(inner)
    if gen is not None:
        snap["sampler_generator"] = _encode(gen.get_state())
    return snap


def _rng_restore(inner: Any, snap: Mapping[str, str]) -> None:
    try:
        torch.set_rng_state(_decode(snap["torch"]))
        if "loader_generator" in snap and isinstance(inner.generator, torch.Generator):
            inner.generator.set_state(_decode(snap["loader_generator"]))
        gen = _sampler_generator(inner)
        if "sampler_generator" in snap and gen is not None:
            gen.set_state(_decode(snap["sampler_generator"]))
    except RuntimeError as e:
        raise ResumeError(f"the loader state's random state cannot be restored: {e}") from None


def _ended(it: Any, taken: int) -> bool:
    """Whether torch's iterator ``it`` gave its last batch (its length when it has one, else its end flags)."""
    try:
        return taken >= len(it)
    except TypeError:
        pass
    fetcher = getattr(it, "_dataset_fetcher", None)
    if fetcher is not None:
        return bool(getattr(fetcher, "ended", False))
    status = getattr(it, "_workers_status", None)
    return bool(getattr(it, "_shutdown", False)) or (status is not None and not any(status))


__all__ = ["TorchCompat"]
