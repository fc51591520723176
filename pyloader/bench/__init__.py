"""Stage ``bench``: ``pyloader bench``, what the data path delivers and what bounds it.

| file | what it is for |
|---|---|
| ``measure.py`` | shared measurement pieces: dataset profiles, timed rounds interleaved side by side, environment, storage read, copy and decode capacity |
| ``stages.py`` | the stage-by-stage measurement (storage, decode, collation, end to end, torch's DataLoader), accelerator utilization runs |
| ``diagnosis.py`` | what the figures say: the stage that binds, the advice this machine and dataset can take, warnings (no torch) |
| ``au.py`` | the accelerator workloads and the search for the most accelerators a loader keeps busy (no torch) |
| ``cli.py`` | the ``pyloader bench`` command: arguments, table, JSON and plot (its parser imports no torch) |

Imports from every lower stage (read, loader, write); nothing but the CLI imports it.
"""


__all__ = ["au", "cli", "diagnosis", "measure", "stages"]  # its modules (pdoc documents the modules named here)
