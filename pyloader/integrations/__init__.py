"""pyloader under the training frameworks that build, wrap or resume loaders themselves.

Each module imports its framework, so it is imported only when asked for
(docs/integrations.md says what each framework needs and why):

| file | what it holds |
|---|---|
| `transformers.py` | `Trainer` and `PyloaderTrainerMixin`: Hugging Face's Trainer reading pyloader datasets with `pyloader.DataLoader`, resuming mid-epoch exactly |

accelerate needs no module: ``Accelerator.prepare`` keeps a native ``pyloader.DataLoader``
(NOTE [accelerate keeps a native loader] in ``pyloader/loader/frameworks.py``). Lightning and
Fabric need none either: both keep the loader and resume it through its ``state_dict``; under
Lightning's loop a native loader reads the epoch Lightning runs and leaves out of its state the
batch Lightning holds ahead of its step (``pyloader/loader/lightning_loop.py``).
"""

__all__ = ["transformers"]  # its modules (pdoc documents the modules named here)
