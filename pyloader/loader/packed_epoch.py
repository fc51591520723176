"""``PackedEpochs``: a DataLoader epoch of packed token rows (NOTE [packing rule] in csrc/core/packer.h)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

import pyloader._C as _C

from ..contract import PipelineDataset, default_prefetch
from . import iterators as _it
from . import packing as _packing
from . import state as _state
from . import transfer as _transfer
from .core import LoaderCore
from .lightning_loop import held_by_lightning


class PackedEpochs(LoaderCore):
    """``pack=``: its checks, its epochs, and its resumable state (NOTE [packing resume])."""

    def _check_pack(self, name: str) -> None:
        """What packing needs (NOTE [packing rule] in csrc/core/packer.h); ValueError naming what is missing."""
        if not isinstance(self.dataset, PipelineDataset):
            raise ValueError(f"pack= needs a dataset read by the native pipeline (ShardDataset or Mixture), not a {name}")
        if self.batch_size is None:
            raise ValueError("pack= needs batch_size= (packed rows per batch)")
        if self.collate_fn is not None or self.transform is not None or self.dataset.transform is not None:
            raise ValueError("pack= makes the batches natively: collate_fn= and transform= do not apply "
                             "(use batch_transform= on the packed batch)")
        if self._auto_workers:
            raise ValueError("num_workers='auto' does not tune a packing loader yet; give num_workers a number")
        assert self.pack is not None
        self._pack_field = self.pack.resolve_field(self.dataset.fields)

    # -- packing (native path) ----------------------------------------------------------
    def _iter_packed(self, epoch: int, rank: int, world: int) -> _it.LoaderIterator:
        """An epoch of packed rows (NOTE [packing rule] in csrc/core/packer.h, NOTE [packing resume])."""
        ds: PipelineDataset = self.dataset
        spec = self.pack
        assert spec is not None
        phases_in, self._pack_resume = self._pack_resume, []
        phases, items, rows_before = self._phase_plans(epoch, phases_in).resume_items(rank, world)
        entry = phases[-1]["ranks"].get(str(rank))
        if entry is None:
            entry = {"cursor": [int(items.pos[0]), int(items.start[0])] if len(items) else [-1, 0],
                     "window": [], "rows": 0}
        if self._doc_pool is None:  # the documents' buffers, kept across epochs like the batches'
            self._doc_pool = _C.SlotPool(num_fields=len(ds.fields))
        docs = ds.batches(spec.doc_batch, plan=(items.units, items.records), drop_last=False,
                          num_threads=self._threads, prefetch=self._prefetch, pool=self._doc_pool, ragged=True)
        prefetch = self._prefetch if self._prefetch is not None else default_prefetch(self._threads)
        pool, rows = self._pool, self.batch_size
        assert pool is not None and rows is not None  # the native path, batched (_check_pack)
        try:
            packer = _C.Packer(docs=docs.pipeline, field=self._pack_field, pool=pool,
                               pos=items.pos, start=items.start, end=items.end, seq_len=spec.seq_len,
                               rows=rows, lookahead=spec.window, split=spec.split,
                               drop_last=self.drop_last, prefetch=prefetch, pad_id=spec.pad_id)
        except BaseException:
            docs.close()
            raise
        src = _packing.PackedStream(docs, packer, spec, entry, rows_before)
        src.timeout = self.timeout  # as given: messages print it as torch does (See NOTE [timeout message])
        src.on_finish = self._keep_stats
        consumed = _it.ConsumedCount()
        src.consumed = consumed
        self._run = None
        self._pack_run = (epoch, world, rank, phases, src, consumed)
        stage = self._new_stage(True)
        gen: Iterator[Any]
        if stage is None:
            gen = src
        else:
            submit_host = stage.submit_host
            gen = _transfer.Staged(_it.host_batches(src), stage, lambda item: submit_host(*item),
                                   go_on_after_error=False)
        it = self._loader_iterator(gen, None, src, stage, consumed)
        it.len_error = "a packed epoch's number of batches depends on its documents' lengths; it is known at its end"
        return it

    def _phase_plans(self, epoch: int, phases: list[dict[str, Any]]) -> _packing.PhasePlans:
        """The packing phases of ``epoch`` over this loader's epoch order (NOTE [packing resume])."""
        ds = self.dataset

        def plan(r: int, w: int) -> Any:
            return ds.epoch_plan(epoch, r, w, [], shuffle=self.shuffle, seed=self._seed)

        return _packing.PhasePlans(plan, phases)

    def _packed_state(self, fingerprint: str) -> dict[str, Any]:
        """``state_dict()`` of a packing loader (NOTE [packing resume]).

        Under an initialised process group of the loader's world size it is a collective:
        every rank's entry is gathered (a rank that received its epoch's last batch sends
        its final entry), so each rank returns the same state.
        """
        run = self._pack_run
        if run is None:
            epoch, phases = self._next_epoch, self._pack_resume
        else:
            run_epoch, world, rank, run_phases, src, consumed = run
            # Batches Lightning's fetcher holds were not trained on: See NOTE [batches Lightning holds].
            taken = consumed.batches - (0 if src.ended else held_by_lightning(self))
            entry = dict(src.state_after(taken))
            entry["done"] = src.finished_after(taken)
            ranks = {str(rank): entry}
            dist = torch.distributed
            if world > 1 and dist.is_available() and dist.is_initialized() and dist.get_world_size() == world:
                gathered: list[Any] = [None] * world
                dist.all_gather_object(gathered, (rank, entry))
                ranks = {str(r): e for r, e in gathered}
            if len(ranks) == world and all(e["done"] for e in ranks.values()):
                epoch, phases = self._next_epoch, []  # every rank read its whole epoch
            else:
                epoch = run_epoch
                phases = [dict(p) for p in run_phases]
                phases[-1] = {"world": world, "ranks": ranks}
        state = _state.make_state(fingerprint, self.dataset.num_records, self._settings, epoch, [],
                                  parts=self._fingerprint_parts)
        field = self.dataset.fields[self._pack_field].name
        assert self.pack is not None
        state["packing"] = {"spec": self.pack.settings(field), "phases": phases}
        return state

    def _load_packed(self, state: dict[str, Any], epoch: int, segments: list[list[int]]) -> None:
        if self.pack is None:
            raise _state.ResumeError("the state was saved by a packing loader (pack=PackSpec); this loader does not "
                                     "pack: give it the same pack=")
        phases = _packing.check_packing(state, self.pack, self.dataset.fields[self._pack_field].name)
        if segments:
            raise _state.ResumeError("a packing loader's state names its position in its packing phases, not "
                                     "in segments")
        rank, world = self.dataset.rank_and_world()
        self._phase_plans(epoch, phases).resume_items(rank, world)  # a state it cannot resume fails now
        self._next_epoch = epoch
        self._pack_resume = phases
        self._pack_run = None
        self._run = None


__all__ = ["PackedEpochs"]
