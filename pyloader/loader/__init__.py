"""Stage ``loader``: ``pyloader.DataLoader`` over any dataset, staging and device copies.

| file | what it is for |
|---|---|
| ``dataloader.py`` | ``DataLoader``: a subclass of torch's, its constructor; native over a ``PlannedDataset``, else torch's loader |
| ``transfer.py`` | slot pools (pinned or pageable), the copy engine stage, the pinned batch fence |
| ``state.py`` | the resume state of ``state_dict()``/``load_state_dict()`` (NOTE [resume state]) |
| ``packing.py`` | ``PackSpec``, the packed stream and its resume phases (NOTE [packing resume]), ``merge_states`` |
| ``autotune.py`` | ``num_workers="auto"``: threads and read-ahead tuned online under a memory budget (NOTE [autotune]) |

Imports ``read`` through its contract (``read.contract``, ``read.order``), never a dataset class.
"""


__all__ = ["autotune", "dataloader", "packing", "state", "transfer"]  # its modules (pdoc documents the modules named here)
