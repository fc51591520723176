"""pyloader native core: shard reader, LZ4 decoder, collation pipeline, pinned staging, copy engine.

Type stub for the pybind11 extension built from ``csrc/bindings/*.cpp``; keep it in step with
those files (``python -m mypy.stubtest pyloader._C`` compares the two). Every blocking call
releases the GIL. DLPack capsules ("dltensor") keep their batch slot alive until the tensor
made from them is freed (NOTE [DLPack lifetime] in csrc/bindings/dlpack_export.h).
"""

from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt
from typing_extensions import Buffer, CapsuleType

# A "dltensor" PyCapsule: pass it to torch.from_dlpack (or numpy.from_dlpack).
_DLPackCapsule: TypeAlias = CapsuleType
# Any contiguous buffer-protocol object. numpy arrays are listed too: numpy's stubs give
# ndarray __buffer__ only for Python >= 3.12, and mypy checks against 3.10.
_BufferLike: TypeAlias = Buffer | npt.NDArray[Any]
# Plan indices: converted to a C-contiguous int32 (shards) or int64 (records) array.
_IndexArray: TypeAlias = npt.NDArray[np.integer[Any]] | Sequence[int]

# register_codec.cpp

def xxh64(data: _BufferLike, *, seed: int = 0, impl: str = "auto") -> int:
    """XXH64 of a contiguous buffer (the checksum of shard format version 1 and of the manifest).

    `impl` picks the 32-byte stripe loop ('auto', 'scalar', 'avx512'; for tests). Releases the GIL.
    """

def xxh3_64(data: _BufferLike, *, impl: str = "auto") -> int:
    """XXH3-64 (seed 0) of a contiguous buffer (the checksum of shard format version 2).

    `impl` picks the long-input loop ('auto', 'scalar', 'sse2', 'avx2'; for tests). Releases the GIL.
    """

def xxh3_64_copy(dst: _BufferLike, src: _BufferLike, *, impl: str = "auto") -> int:
    """Copies src into dst (a writable buffer of the same size, not overlapping src) and returns xxh3_64(src).

    Reads src once (the reader's first-read path). Releases the GIL.
    """

def lz4_decode_block(src: _BufferLike, decoded_size: int) -> bytes:
    """Decodes one raw LZ4 block that must expand to exactly decoded_size bytes. Releases the GIL."""

def lz4_decode_into(src: _BufferLike, dst: _BufferLike, *, repeat: int = 1) -> None:
    """Decodes one LZ4 block into a writable buffer of exactly the decoded size, `repeat` times.

    For benchmarks. Releases the GIL.
    """

# register_http.cpp

def http_available() -> tuple[bool, str]:
    """(whether libcurl.so.4 could be loaded, the reason when not)."""

def http_version() -> str:
    """The version string of libcurl, or '' without it."""

def http_download(fd: int, url: str, size: int, *, parts: Sequence[tuple[int, int]], headers: Sequence[str],
                  connect_timeout: float, stall_timeout: float, write_buffer: int, recv_buffer: int = 4 << 20,
                  ca_file: str = "", cancel: Any,
                  on_bytes: Callable[[int], object] | None) -> dict[str, Any]:
    """One attempt to download `url` (`size` bytes) into `fd` with pwrite()."""

# register_image.cpp

def jpeg_available() -> bool:
    """Whether this build decodes JPEG natively (it found libjpeg-turbo when it was built)."""

def jpeg_header(data: _BufferLike) -> tuple[int, int, int, bool]:
    """(width, height, components, progressive) of a JPEG. Releases the GIL."""

def jpeg_decode_region(
    data: _BufferLike,
    dst: _BufferLike,
    *,
    denom: int,
    x: int,
    y: int,
    width: int,
    height: int,
    channels: int,
    max_pixels: int = 89478485,
) -> None:
    """Decodes the region (x, y, width, height) of a JPEG scaled by 1/denom into dst (HWC uint8).

    An image of more than max_pixels pixels is refused from its header, and a corrupt-data
    warning stops the decode, both as ValueError (NOTE [pixel limit] in core/jpeg_decode.h).
    Releases the GIL.
    """

def normalize_u8(
    src: _BufferLike,
    dst: _BufferLike,
    *,
    height: int,
    width: int,
    mean: Sequence[float],
    std: Sequence[float],
    chw: bool = True,
) -> None:
    """uint8 HWC pixels into float32 (x / 255 - mean) / std, CHW (chw=True) or HWC, in one pass.

    Releases the GIL.
    """

# register_pipeline.cpp

class ShardSet:
    """The shards of one dataset, each mapped and validated on first use; idle ones stay mapped in LRU order.

    NOTE [working set] in core/shard_reader.h.
    """

    def __init__(
        self,
        *,
        paths: Sequence[str],
        bytes: Sequence[int],
        records: Sequence[int],
        schema: bytes,
        pending: bool = False,
        max_idle: int = 4096,
        shard_schemas: Sequence[bytes] = (),
        schema_of: Sequence[int] = (),
        max_value_bytes: int = 1073741824,
        max_mapped: int = 0,
    ) -> None:
        """shard_schemas/schema_of: shard i equals shard_schemas[schema_of[i]] (NOTE [renamed schemas]).

        max_mapped: a local set unmaps shards no worker holds beyond that many (0: no bound;
        NOTE [mapping bound] in core/shard_reader.h).

        No value may decode to more than max_value_bytes (NOTE [value bounds] in core/shard_reader.h).
        """
    def mark_ready(self, index: int, path: str) -> None:
        """A pending shard's file is verified and in place at `path` (NOTE [shard readiness])."""

    def mark_failed(self, index: int, message: str, errno: int = 0) -> None:
        """A pending shard could not be fetched; readers of it raise ShardIOError(errno, message).

        A FileNotFoundError for ENOENT, a PermissionError for EACCES.
        """

    def retry(self, index: int) -> bool:
        """A failed shard of a pending set becomes pending again, for a later iterator to fetch.

        False if it had not failed.
        """

    def unload(self, index: int, force: bool = False) -> bool:
        """Unmaps shard `index` of a pending set and makes it pending again.

        An idle one, or with force=True one that no worker holds now. False if it cannot be.
        """

    def wait_events(self, timeout: float = 0.0) -> tuple[list[int], list[int], list[tuple[int, str]]]:
        """Waits up to `timeout` seconds for an event; returns (released, waiting, corrupt).

        Shards that became idle, shards a worker waits on now, and (shard, reason) of
        cached copies to fetch again.
        """

    def waiting(self) -> list[int]:
        """The shards a worker waits on now."""

    def trust(self, index: int, dev: int, ino: int, size: int, mtime_ns: int, ctime_ns: int) -> None:
        """Shard `index`, when mapped from a file of exactly this identity, is read without checksum checks.

        The identity is os.stat's st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns of a
        file verified in full before (NOTE [verified files] in core/shard_reader.cpp).
        """

    def newly_verified(self) -> list[tuple[int, tuple[int, int, int, int, int], int]]:
        """Mapped shards whose every record was verified, not reported before.

        (index, (dev, ino, size, mtime_ns, ctime_ns), opened_ns): the file's identity and
        when it was opened (as time.time_ns()). Each is reported once.
        """

    def counts(self) -> dict[str, int]:
        """Mapped, idle and active shards, heals, unloads, the peak of mapped shards, and remaps (NOTE [mapping bound])."""

    def __len__(self) -> int: ...

class SlotPool:
    """Reusable batch buffers."""

    def __init__(self, *, num_fields: int, pinned: bool = False, device: int = 0,
                 cache_bytes: int = 268435456) -> None:
        """pinned=True: page-locked buffers from the CUDA driver (raises without one).

        Cached by size class up to cache_bytes released bytes (NOTE [pinned cache]).
        """

    @property
    def pinned(self) -> bool: ...
    @property
    def created(self) -> int: ...
    def prepare(self, *, count: int, field_bytes: list[int]) -> None:
        """Makes slots until the pool has ``count``, on a thread of its own; returns at once.

        Each field's buffer is reserved for ``field_bytes[i]`` bytes (0: at its first batch)
        (NOTE [prepared slots]).
        """

    @property
    def preparing(self) -> bool:
        """Whether a prepare() thread is still making slots."""

    @property
    def free(self) -> int: ...
    def memory(self) -> dict[str, Any]:
        """The pool's host memory: bytes held (live in slots + cached) and the allocations.

        Also how many allocations and frees reached the system or the CUDA driver (NOTE [pinned cache]),
        the bytes of those allocations and the thread time they took (``driver_alloc_s``).
        """

class HostBatch:
    """One collated batch in its host slot.

    The slot is reused only when this object and every array exported from it are gone.
    Made only by BatchPipeline.next_host(); it has no constructor.
    """

    @property
    def index(self) -> int: ...
    @property
    def rows(self) -> int: ...

def _pipelines_destroyed_on_workers() -> int:
    """How many BatchPipelines were destroyed on a pipeline's worker thread (none may be). For tests."""

class BatchPipeline:
    """Collates the planned records into batches on native threads; yields them in plan order."""

    def __init__(
        self,
        *,
        shards: ShardSet,
        pool: SlotPool,
        shard_idx: _IndexArray,
        record_idx: _IndexArray,
        batch_size: int,
        drop_last: bool = False,
        num_threads: int = 1,
        prefetch: int = 2,
        ahead: int = -1,
        early: bool = False,
        active_threads: int = 0,
        ragged: bool = False,
    ) -> None: ...
    @property
    def threads(self) -> int:
        """How many of the started workers collate, 1..num_threads (set: clamped; the others wait)."""
    @threads.setter
    def threads(self, value: int) -> None: ...
    def __len__(self) -> int: ...
    @property
    def ahead(self) -> int:
        """Batches the workers may collate ahead of the consumer, 1..prefetch (set: clamped to that range)."""
    @ahead.setter
    def ahead(self, value: int) -> None: ...
    def hand_over(self, next: BatchPipeline, ahead: int) -> None:
        """Once every batch of this pipeline is claimed, its first idle worker sets ``next.ahead = ahead``.

        At once if that moment has passed: the next epoch's pipeline then runs at full read-ahead
        without the consumer waking its threads.
        """
    def adopt(self, ahead: int) -> None:
        """A pipeline made ahead begins its epoch: read-ahead ``ahead`` from the next take, and its pool may grow."""
    def set_ahead(self, n: int, *, later: bool = False) -> None:
        """Sets ``ahead`` (clamped to 1..prefetch); later=True: from the consumer's next take on, waking no thread now."""
    def next(self, timeout: float = 0.0) -> tuple[int, int, list[_DLPackCapsule], list[_DLPackCapsule | None]] | None:
        """The next batch as (index, rows, [capsule per field], [lengths capsule per field or None]).

        None at the end. Releases the GIL while waiting. The capsules view the slot's memory
        (NOTE [DLPack lifetime] in bindings/dlpack_export.h).
        """

    def next_host(
        self, timeout: float = 0.0
    ) -> tuple[HostBatch, list[_DLPackCapsule], list[_DLPackCapsule | None]] | None:
        """Like next(), but returns (HostBatch, arrays, lengths).

        The HostBatch can be handed to a CopyEngine, which keeps its slot until the copies completed.
        """

    def close(self) -> None: ...
    def counters(self) -> dict[str, int]: ...

# register_packer.cpp

_PackState: TypeAlias = tuple[int, int, npt.NDArray[np.int64], int]

class Packer:
    """Packs the documents a BatchPipeline reads into rows of seq_len tokens on its own thread.

    NOTE [packing rule] in core/packer.h.
    """

    def __init__(
        self,
        *,
        docs: BatchPipeline,
        field: int,
        pool: SlotPool,
        pos: _IndexArray,
        start: _IndexArray,
        end: _IndexArray,
        seq_len: int,
        rows: int,
        lookahead: int = 1,
        split: bool = True,
        drop_last: bool = False,
        prefetch: int = 2,
        pad_id: int = 0,
    ) -> None: ...
    def next(self, timeout: float = 0.0) -> tuple[int, int, list[_DLPackCapsule], _PackState] | None:
        """The next packed batch as (index, rows, [capsule per output], state), or None at the end.

        Outputs: tokens, position_ids, document_ids, cu_seqlens; state: (cursor_pos, cursor_tok,
        window [k, 3], rows) after this batch (NOTE [packing state]).
        """

    def next_host(
        self, timeout: float = 0.0
    ) -> tuple[HostBatch, list[_DLPackCapsule], list[None], _PackState] | None:
        """Like next(), but returns (HostBatch, arrays, lengths, state), the HostBatch for a CopyEngine."""

    @property
    def names(self) -> list[str]: ...
    def close(self) -> None: ...
    def counters(self) -> dict[str, int]: ...

# register_copy.cpp

def cuda_driver_error() -> str | None:
    """None when the CUDA driver (libcuda.so.1) loaded and sees a device, else why not."""

class CopyEngine:
    """A native thread that copies batches to their destination (NOTE [copy ordering])."""

    def __init__(self, *, backend: str, device: int = 0, depth: int = 2, staging: SlotPool) -> None:
        """Starts the engine thread; raises DeviceError if it cannot start (backend="cuda")."""

    def submit(
        self,
        segments: Sequence[tuple[int, int, int]],
        *,
        stream: int | None = None,
        source: HostBatch | None = None,
        stage: bool = False,
        timeout: float = 0.0,
    ) -> int:
        """Queues copies [(src, dst, bytes)] ordered after the work queued on `stream`; returns a ticket.

        `stream` (a CUstream handle, e.g. torch.cuda.current_stream().cuda_stream) is required
        with backend="cuda" (ValueError without it); the CPU backend ignores it. Waits until job
        ticket - depth's copies completed (NOTE [copy ordering]). `source` (a HostBatch) stays
        referenced until the copies completed; with stage=True the sources are packed into a
        staging slot first, and must stay alive until take().
        """

    def take(
        self, ticket: int, *, stream: int | None = None, timeout: float = 0.0
    ) -> list[_DLPackCapsule | None] | None:
        """Waits for job `ticket` (the oldest not taken), orders `stream` after its copies.

        `stream` is required with backend="cuda", as for submit().

        For staged jobs returns one uint8 DLPack capsule per segment whose staged copy is the
        result (None for the others); else None.
        """

    def close(self) -> None: ...
    @property
    def depth(self) -> int: ...
    @property
    def submitted(self) -> int:
        """Jobs accepted so far: the ticket the next accepted submit() returns."""
    @property
    def taken(self) -> int: ...
    @property
    def backend(self) -> str: ...
    def counters(self) -> dict[str, int]: ...

# -- epoch orders (register_order.cpp) -----------------------------------------------------

def global_order(n: int, state: int, lo: int, hi: int) -> npt.NDArray[np.int64]:
    """Positions [lo, hi) of the ids 0..n-1 sorted by mix64(id ^ state) (NOTE [native global order])."""

def locate(ids: _IndexArray, ends: _IndexArray) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int64]]:
    """(shard int32, record int64) of each id, given ends = the running sum of records per shard."""
