"""Stage ``bench``: ``pyloader bench``, what the data path delivers and what bounds it.

| file | what it is for |
|---|---|
| ``measure.py`` | shared measurement pieces: dataset profiles, timed rounds interleaved side by side, environment, storage read, copy and decode capacity |
| ``stages.py`` | the stage-by-stage measurement (storage, decode, collation, end to end, torch's DataLoader), the diagnosis, accelerator utilization |
| ``cli.py`` | the ``pyloader bench`` command: arguments, table, JSON and plot |

Imports from every lower stage (read, loader, write); nothing but the CLI imports it.
"""


__all__ = ["cli", "measure", "stages"]  # its modules (pdoc documents the modules named here)
