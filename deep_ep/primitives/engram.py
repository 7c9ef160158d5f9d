"""`deep_ep.ElasticBuffer`'s Engram remote-memory fetch (engram_write, engram_fetch, get_engram_storage_size_hint).

Every rank owns a shard of a table (``num_entries`` rows of ``hidden`` bf16 or FP8 values); global
entry ``owner * num_entries + local`` is row ``local`` of rank ``owner``'s shard. `engram_write`
publishes the shards (collective), `engram_fetch` gathers any entries from their owners. The CPU
backend (`deep_ep.backends.cpu.engram`: shared memory) is the executable specification; GPU buffers
(`deep_ep.backends.gpu.engram`) keep each shard in the last ``num_cpu_bytes`` of the rank's window
or, with ``storage_location="host"``, in ``num_cpu_bytes`` of pinned host memory (DeepEP's place),
and gather with one kernel on the caller's stream, within one NVLink domain (a GPU buffer across
NVLink domains raises NotImplementedError). Argument checks live here, for both. Out-of-range
indices: the CPU checks them on the host before reading; a GPU kernel checks them while it gathers
(an index is never read outside the table), and the next fetch on that rank raises.
`engram_fetch_reference` is the per-rank semantics of a fetch, given the whole table.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from .. import checks, shapes, topology
from ..backends.engram_table import STORAGE_LOCATIONS

__all__ = ["EngramMixin", "EngramFetchHook", "engram_fetch_reference"]

_BUFFER_ALIGNMENT = 2 * 1024 * 1024   # DeepEP's size hints come in 2 MiB units
_ENTRY_ALIGNMENT = 32                  # DeepEP's entries are sized in 32-byte loads
_STORAGE_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)
_SF_DTYPES = (torch.float32, torch.int32)


def engram_fetch_reference(table: torch.Tensor, sf_table: Optional[torch.Tensor], indices: torch.Tensor,
                           use_tma_aligned_col_major_sf: bool = False) -> tuple:
    """What `EngramMixin.engram_fetch`'s hook returns, from the whole table.

    Args:
        table: ``[num_ranks * num_entries, hidden]`` (every rank's shard, in rank order).
        sf_table: ``[num_ranks * num_entries, num_sf_packs]`` or None.
        indices: int ``[T, E]``, every value a row of ``table``.
        use_tma_aligned_col_major_sf: lay the gathered factors out column-major, strides ``(1, align(T, 4))``.

    Returns:
        ``(data [T, E * hidden], sf [T, E * num_sf_packs] or None)``.
    """
    num_tokens, num_per_token = indices.shape
    flat = indices.reshape(-1).long()
    bits = shapes.as_bits(table)
    data = bits.index_select(0, flat).view(num_tokens, num_per_token * table.shape[1]).view(table.dtype)
    if sf_table is None:
        return data, None
    gathered = sf_table.index_select(0, flat).view(num_tokens, -1)
    if not use_tma_aligned_col_major_sf:
        return data, gathered.contiguous()
    token_stride = shapes.align_up(num_tokens, 4)
    room = torch.zeros(gathered.shape[1] * token_stride, dtype=sf_table.dtype, device=sf_table.device)
    sf = room.as_strided(tuple(gathered.shape), (1, token_stride))
    sf.copy_(gathered)
    return data, sf


class EngramFetchHook:
    """What `EngramMixin.engram_fetch` returns: call it (no arguments) for ``(data, sf)``.

    The first call releases the buffer's window; later calls return the same tensors. On a GPU
    buffer every call also makes the caller's current stream wait for the fetch's kernel."""

    __slots__ = ("_result", "_window_use", "_pending", "_done", "__weakref__")

    def __init__(self, result: tuple, window_use, done=None) -> None:
        self._result = result
        self._window_use = window_use
        self._pending = True
        self._done = done   # a torch.cuda.Event recorded after the gather (GPU), or None

    def __call__(self) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        if self._done is not None:
            torch.cuda.current_stream(self._result[0].device).wait_event(self._done)
        if self._pending:
            self._pending = False
            self._window_use.release("engram")
        return self._result


class EngramMixin:
    """Methods of `deep_ep.ElasticBuffer` (a mixin: it uses the buffer's backend and window)."""

    @staticmethod
    def get_engram_storage_size_hint(num_entries: int, hidden: int, num_max_tokens_per_rank: int,
                                     dtype: torch.dtype = torch.bfloat16) -> Tuple[int, int]:
        """(Experimental) Bytes an Engram table needs, DeepEP's numbers, each rounded up to 2 MiB.

        An entry takes ``hidden * dtype.itemsize`` bytes rounded up to 32.

        Args:
            num_entries: rows of each rank's shard (>= 0).
            hidden: values per entry (>= 0).
            num_max_tokens_per_rank: the most entries one fetch gathers, ``T * E`` (>= 0).
            dtype: ``torch.bfloat16`` (default) or ``torch.float8_e4m3fn``.

        Returns:
            ``(num_gpu_bytes, num_cpu_bytes)``: the fetch's receive area (part of ``num_bytes``) and
            the shard's storage (``num_cpu_bytes``). A buffer for Engram takes
            ``num_bytes=num_gpu_bytes + num_cpu_bytes, num_cpu_bytes=num_cpu_bytes``.

        Raises:
            TypeError: a count that is not an int, or another dtype. ValueError: a negative count.
        """
        checks.check_int("num_entries", num_entries, minimum=0, maximum=None)
        checks.check_int("hidden", hidden, minimum=0, maximum=None)
        checks.check_int("num_max_tokens_per_rank", num_max_tokens_per_rank, minimum=0, maximum=None)
        if dtype not in _STORAGE_DTYPES:
            raise TypeError(f"dtype must be torch.bfloat16 or torch.float8_e4m3fn, got {dtype!r}")
        entry_bytes = shapes.align_up(hidden * dtype.itemsize, _ENTRY_ALIGNMENT)
        return (shapes.align_up(entry_bytes * num_max_tokens_per_rank, _BUFFER_ALIGNMENT),
                shapes.align_up(entry_bytes * num_entries, _BUFFER_ALIGNMENT))

    def engram_write(self, storage: torch.Tensor, sf: Optional[torch.Tensor] = None, *,
                     storage_location: str = "device") -> None:
        """(Experimental) Publish this rank's shard of the Engram table. Collective: every rank calls
        it, with the same shapes and format; it includes a barrier before and after, so every rank
        can fetch every rank's new entries once it returns. A later call replaces the table.

        Args:
            storage: ``[num_entries, hidden]`` on the buffer's device, contiguous, ``torch.bfloat16``
                or ``torch.float8_e4m3fn``; at most ``num_cpu_bytes`` (the buffer's) bytes. Copied:
                the caller may change or free it afterwards.
            sf: FP8 only (required then, refused for bf16): the scale factors of every rank's entries,
                replicated, ``[num_ranks * num_entries, num_sf_packs]`` row-major contiguous, each pack
                an opaque 4-byte value (``torch.float32``, or ``torch.int32`` holding four UE8M0
                exponents). Copied; a fetch takes the factors from this rank's copy.

            storage_location: where a GPU buffer keeps the shard (every rank the same): ``"device"``
                (default: the last ``num_cpu_bytes`` of the window, in GPU memory, read over NVLink)
                or ``"host"`` (DeepEP's place: ``num_cpu_bytes`` of pinned host memory, allocated at
                the first such write and kept until `destroy`; peers' GPUs read it over PCIe or C2C;
                run on a GPU with the ranks of one process, not yet across processes, so not yet the
                default). A CPU buffer keeps every shard in host
                memory whatever this says.

        On a GPU buffer the call blocks the host: it waits for this rank's earlier fetches and
        kernels, and cannot be captured in a CUDA graph. Host storage for ranks in separate
        processes is shared with the CUDA driver's virtual memory API and ``pidfd_getfd``, which
        needs the ranks to be allowed to trace each other (same user, ``kernel.yama.ptrace_scope``
        0 or ``CAP_SYS_PTRACE``); else pass ``storage_location="device"``.

        Raises:
            NotImplementedError: a backend without Engram; a GPU buffer across NVLink domains;
                ranks on several hosts (CPU backend).
            TypeError / ValueError: bad arguments (``storage_location`` neither ``"host"`` nor
                ``"device"`` included), raised on this rank before any communication;
                on a GPU buffer also a window with less than 64 KiB + 64 bytes before its last
                ``num_cpu_bytes`` (the control region and the write's header).
            RuntimeError: destroyed buffer; or, on every rank, ranks that disagree on the shapes,
            format or ``storage_location``, or that are at different calls; (GPU) during CUDA-graph
            capture, or an earlier GPU error made the buffer unusable; (GPU, on this rank only) host
            memory that cannot be allocated or mapped. OSError: (GPU, separate processes, on this
            rank only) a peer's host storage that cannot be shared. TimeoutError: a peer did not
            call it, or failed on its own.
        """
        self._alive()
        backend, on_gpu = self._engram_backend("engram_write")
        backend.calls += 1   # collective: every call counts, a refused one too (as dispatch's)
        device = backend.device
        if not isinstance(storage_location, str):
            raise TypeError(f"storage_location must be a str, got {type(storage_location).__name__}")
        if storage_location not in STORAGE_LOCATIONS:
            raise ValueError(f"storage_location must be one of {STORAGE_LOCATIONS}, got {storage_location!r}")
        checks.check_tensor("storage", storage, dtype=_STORAGE_DTYPES, shape=(None, None), device=device)
        num_entries, hidden = storage.shape
        if num_entries < 1 or hidden < 1:
            raise ValueError(f"storage must have at least one entry of at least one value, got shape "
                             f"{list(storage.shape)}")
        if self.num_ranks * num_entries > checks.INT32_MAX:
            raise ValueError(f"num_ranks * num_entries = {self.num_ranks * num_entries} does not fit the int32 "
                             f"indices of engram_fetch")
        if storage.dtype == torch.float8_e4m3fn:
            if sf is None:
                raise ValueError("FP8 storage needs sf, the replicated scale factors "
                                 "[num_ranks * num_entries, num_sf_packs] (float32 or int32)")
            checks.check_tensor("sf", sf, dtype=_SF_DTYPES, shape=(self.num_ranks * num_entries, None),
                                device=device)
            if sf.shape[1] < 1:
                raise ValueError(f"sf must have at least one pack per entry, got shape {list(sf.shape)}")
        elif sf is not None:
            raise ValueError(f"sf is for FP8 storage only; storage is {storage.dtype}")
        num_bytes = storage.numel() * storage.element_size()
        if num_bytes > self.num_cpu_bytes:
            need = EngramMixin.get_engram_storage_size_hint(num_entries, hidden, 0, storage.dtype)[1]
            raise ValueError(f"storage takes {num_bytes} bytes, more than the buffer's num_cpu_bytes "
                             f"({self.num_cpu_bytes}); create the buffer with num_cpu_bytes={need} "
                             f"(ElasticBuffer.get_engram_storage_size_hint) and num_bytes including it")
        table = self._engram_table(on_gpu)
        if not on_gpu:
            table.write(backend.comm, backend.calls, storage, sf)
            return
        from ..backends.gpu import engram as gpu_engram
        from ..backends.gpu.abi import CTRL_BYTES
        room = gpu_engram.storage_offset(backend)
        if room < CTRL_BYTES + gpu_engram.HEADER_BYTES:
            raise ValueError(f"engram_write on a GPU buffer needs {CTRL_BYTES + gpu_engram.HEADER_BYTES} bytes of "
                             f"window before the storage (num_bytes - num_cpu_bytes = {self.num_bytes} - "
                             f"{self.num_cpu_bytes} = {room}); size the buffer with "
                             f"ElasticBuffer.get_engram_storage_size_hint and num_max_tokens_per_rank >= 1")
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("engram_write waits on the host for every rank and cannot be captured in a CUDA "
                               "graph; call it before the capture")
        backend.raise_if_broken()
        table.write(backend.calls, storage, sf, storage_location)

    def engram_fetch(self, indices: torch.Tensor, num_qps: int = 0,
                     use_tma_aligned_col_major_sf: bool = False) -> Callable:
        """(Experimental) Gather Engram entries from their owners.

        The fetch is one-sided, like DeepEP's RDMA gets: it reads the owners' storage (shared
        memory on the CPU, their host memory or windows on a GPU) and involves no other rank (ranks fetch
        independently, any number of times, any shapes). On a GPU buffer it queues one gather
        kernel on the current stream and returns without waiting; the hook makes the current stream
        wait for it. Between this call and its hook's first call the buffer's window is held:
        dispatch, combine and the other primitives raise `RuntimeError` meanwhile, and so does a
        second `engram_fetch` (DeepEP gathers every fetch into the same receive area). A hook
        dropped uncalled ends the hold at the buffer's next use, whose stream then waits for the
        fetch as the hook would have made it.

        Args:
            indices: int32 ``[T, E]`` on the buffer's device, contiguous: token ``t`` concatenates
                entries ``indices[t, 0..E-1]`` along hidden; each a global entry
                ``owner * num_entries + local`` in ``[0, num_ranks * num_entries)``.
            num_qps: RDMA queue pairs (0 = all allocated); validated, no effect (no RDMA path).
            use_tma_aligned_col_major_sf: FP8 only: the factors in the TMA-aligned column-major
                layout (strides ``(1, align(T, 4))``), else row-major.

        Returns:
            hook: call it (no arguments) for ``(data, sf)``: ``data`` ``[T, E * hidden]`` in the
            storage's dtype (entry ``e`` of token ``t`` at columns ``e * hidden`` onwards; DeepEP's
            docstring says ``[T * E, hidden]``, the same bytes, while its code returns this shape),
            ``sf`` ``[T, E * num_sf_packs]`` in sf's dtype for FP8 (pack ``p`` of entry ``e`` at
            column ``e * num_sf_packs + p``), else None. Calling the hook releases the window; later
            calls return the same tensors. Fresh tensors, on the buffer's device.

        Raises:
            NotImplementedError: a backend without Engram; a GPU buffer across NVLink domains.
            TypeError / ValueError: bad arguments, an index out of range, or a receive area too small
            (``T * E * hidden * itemsize`` over ``num_bytes - num_cpu_bytes``; not checked on CPU
            buffers made without ``num_bytes``, which allocate per call); all before anything is read.
            On a GPU buffer the kernel checks the range as it gathers: an index out of range is not
            read, its row and factors come back zeroed, and this rank's next `engram_fetch` raises
            the `ValueError` (naming the index and its position) before its own launch.
            RuntimeError: destroyed buffer, no `engram_write` yet, or the window held (by an earlier
            fetch whose hook is alive and was not called, or by another primitive); (GPU) during CUDA-graph
            capture, or an earlier GPU error made the buffer unusable.
        """
        self._alive()
        backend, on_gpu = self._engram_backend("engram_fetch")
        checks.check_int("num_qps", num_qps, minimum=0)
        col_major = checks.check_bool("use_tma_aligned_col_major_sf", use_tma_aligned_col_major_sf)
        table = self._engram_table(on_gpu)
        if on_gpu:
            backend.raise_if_broken()
            table.raise_bad_index()   # found by an earlier fetch's kernel
        if not table.written:
            raise RuntimeError("engram_fetch needs an Engram table: call engram_write (on every rank) first")
        checks.check_tensor("indices", indices, dtype=torch.int32, shape=(None, None), device=backend.device)
        num_tokens, num_per_token = indices.shape
        num_total = table.num_ranks * table.num_entries
        if on_gpu:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("engram_fetch on a GPU buffer cannot be captured in a CUDA graph yet; call it "
                                   "outside the capture")
        elif indices.numel():
            low, high = int(indices.min()), int(indices.max())
            if low < 0 or high >= num_total:
                bad = low if low < 0 else high
                where = (indices == bad).nonzero()[0].tolist()
                raise ValueError(f"indices holds entry {bad} at {where}: entries must be in [0, {num_total}) "
                                 f"({table.num_ranks} ranks x {table.num_entries} entries)")
        self._check_receive_area(num_tokens * num_per_token * table.hidden * table.dtype.itemsize)
        self._window_use.settle()   # a dropped hook's hold (see below)
        if self._window_use.holder == "engram":
            raise RuntimeError("engram_fetch: an earlier fetch's hook has not been called; call it first (both "
                               "would gather into the buffer's one receive area)")
        self._window_use.hold("engram", "Engram entries fetched; calling the hook engram_fetch returned ends it")
        try:
            result = table.fetch(indices, col_major)
        except BaseException:
            self._window_use.release("engram")
            raise
        if on_gpu:
            data, sf, done = result
            hook = EngramFetchHook((data, sf), self._window_use, done)
        else:
            hook, done = EngramFetchHook(result, self._window_use), None
        # A hook dropped uncalled releases the window at the buffer's next use, whose stream then
        # waits for the fetch first, as the hook's call would have made it.
        device = hook._result[0].device
        self._window_use.end_with(hook, None if done is None else
                                  lambda: torch.cuda.current_stream(device).wait_event(done))
        return hook

    # ------------------------------------------------------------------ helpers
    def _engram_backend(self, method: str) -> tuple:
        """``(backend, on_gpu)``; NotImplementedError naming ``method`` for a backend without Engram or
        a GPU buffer across NVLink domains (`deep_ep.topology.require_one_nvlink_domain`), before any
        communication."""
        from ..backends.cpu import CPUBackend
        backend = self._backend
        if isinstance(backend, CPUBackend):
            return backend, False
        from ..backends.gpu import GPUBackend
        if isinstance(backend, GPUBackend):
            topology.require_one_nvlink_domain(method, "Engram", backend)
            return backend, True
        raise NotImplementedError(
            f"ElasticBuffer.{method} (Engram) is not implemented for this backend ({type(backend).__name__}); "
            f"GPU buffers and the CPU backend (a gloo group with CPU tensors) have it")

    def _release_primitives(self) -> None:
        """Unmap every rank's Engram shard (CPU) or wait for this rank's last fetch (GPU), and drop the
        table (`ElasticBuffer.destroy`); tensors a fetch returned are copies and stay valid."""
        table = getattr(self, "_engram", None)
        if table is not None:
            table.release()
        self._engram = None

    def _engram_table(self, on_gpu: bool):
        table = getattr(self, "_engram", None)
        if table is None:
            if on_gpu:
                from ..backends.gpu.engram import GPUEngramTable
                table = self._engram = GPUEngramTable(self._backend)
            else:
                from ..backends.cpu.engram import EngramTable
                table = self._engram = EngramTable(self.rank_idx, self.num_ranks)
        return table

    def _check_receive_area(self, num_fetched_bytes: int) -> None:
        if self.num_bytes <= 0:
            return   # a CPU buffer made without num_bytes: fetches allocate their own outputs
        area = self.num_bytes - self.num_cpu_bytes
        if num_fetched_bytes > area:
            raise ValueError(f"engram_fetch gathers {num_fetched_bytes} bytes, more than the buffer's receive "
                             f"area num_bytes - num_cpu_bytes = {self.num_bytes} - {self.num_cpu_bytes} = "
                             f"{area}; size the buffer with ElasticBuffer.get_engram_storage_size_hint")
