"""Stage ``loader``: ``pyloader.DataLoader`` over any dataset, staging and device copies.

| file | what it is for |
|---|---|
| ``dataloader.py`` | ``DataLoader``: a subclass of torch's assembled from the rooms below; its constructor, ``iter()``, epochs, resumption and figures |
| ``options.py`` | ``LoaderOptions``: the constructor's settings, checked once (NOTE [loader options]) |
| ``core.py`` | ``LoaderCore``: the typed state the rooms share, and what one room calls on another |
| ``torch_compat.py`` | room: torch's DataLoader attributes and the generic path over any other dataset, with its state (NOTE [generic loader state]) |
| ``frameworks.py`` | what accelerate finds on a native loader: kept by ``prepare``, checked, seen by its gradient state (NOTE [accelerate keeps a native loader]) |
| ``lightning_loop.py`` | what a native loader reads of Lightning's training loop: the epoch it runs (NOTE [Lightning's epoch]) and the batches it holds ahead of its step (NOTE [batches Lightning holds]) |
| ``native_epoch.py`` | room: an epoch over a ``PlannedDataset``: threads, prefetch, epoch-ahead (NOTE [epoch ahead]), the order |
| ``transform_epoch.py`` | room: an epoch through the per-sample transform workers |
| ``packed_epoch.py`` | room: an epoch of packed rows, and its resumable state |
| ``buffers.py`` | room: the batch and staging slot pools, the copy engine of each epoch, the pinned fence |
| ``iterators.py`` | the epoch iterator and the per-sample views of native batches |
| ``transfer.py`` | slot pools (pinned or pageable), the copy engine stage, the pinned batch fence |
| ``state.py`` | the resume state of ``state_dict()``/``load_state_dict()`` (NOTE [resume state]) |
| ``packing.py`` | ``PackSpec``, the packed stream and its resume phases (NOTE [packing resume]), ``merge_states`` |
| ``autotune.py`` | ``num_workers="auto"``: threads and read-ahead tuned online under a memory budget (NOTE [autotune]) |

Drives datasets through ``pyloader.contract`` (NOTE [dataset contract]), never a dataset class.
"""


__all__ = ["autotune", "buffers", "core", "dataloader", "frameworks", "iterators", "lightning_loop", "native_epoch",
           "options", "packed_epoch", "packing", "state", "torch_compat", "transfer", "transform_epoch"]  # its modules (pdoc documents the modules named here)
