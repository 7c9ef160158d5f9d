"""`deep_ep.ElasticBuffer`'s all-gather / reduce-scatter sessions (agrs_*, all_gather, reduce_scatter).

A session is a stretch of collective calls whose outputs are laid out one after another in the
session's space (``num_max_session_bytes`` bytes, `agrs_set_config`): an all-gather of a tensor of
``nbytes`` bytes takes ``align(R * nbytes, 32)`` bytes at the session's running offset, rank ``r``'s
copy at ``r * nbytes`` inside it, and the gathered ``[R, *shape]`` tensor is a view of those bytes.
Every session starts again at offset 0, so outputs stay valid until the next session reuses the
space. Each call returns at once with a handle that waits for its data; handles may be waited in any
order, and the session's end (`destroy_agrs_session`) waits for those left. This module keeps the
per-rank bookkeeping and every check (all before anything is sent); backends move the bytes (CPU:
`deep_ep.backends.cpu.agrs` over gloo; GPU: `deep_ep.backends.gpu.agrs`, copy engines and stream
memory operations on the caller's stream (small kernels on emulated ranks), within one NVLink
domain: on a GPU buffer across NVLink domains every method raises NotImplementedError).
"""
from __future__ import annotations

import contextlib
import math

import torch

from .. import checks, topology
from .agrs_session import AgrsHandle, _check_dtype, _parse_shapes, _Session

__all__ = ["AllGatherReduceScatterMixin", "AgrsHandle", "AGRS_TENSOR_ALIGNMENT", "AGRS_MAX_OPS_PER_SESSION"]

#: Every tensor's room in the session space is rounded up to this many bytes (DeepEP's value).
AGRS_TENSOR_ALIGNMENT = 32
#: The most all-gathers / reduce-scatters one session may hold (DeepEP's signal slots).
AGRS_MAX_OPS_PER_SESSION = 32
#: dtypes `reduce_scatter` sums (in float32).
REDUCE_SCATTER_DTYPES = (torch.bfloat16, torch.float32)


def _align(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


def _group_size(group) -> int:
    from ..backends import group_rank_and_size
    return group_rank_and_size(group)[1]


class AllGatherReduceScatterMixin:
    """Methods of `deep_ep.ElasticBuffer` (a mixin: it uses the buffer's backend and window)."""

    # ------------------------------------------------------------------ sizes
    @staticmethod
    def get_agrs_num_max_session_bytes(group, shapes, dtype: torch.dtype) -> int:
        """Bytes one session needs to all-gather tensors of ``shapes`` (the local shapes, before
        gathering) and ``dtype``: the sum over shapes of ``R * numel * itemsize`` rounded up to 32.

        Args:
            group: the buffer's group (only its size is used). shapes: one shape (tuple of ints) or
                a sequence of shapes (batched mode). dtype: a `torch.dtype`.

        A reduce-scatter with output shape ``s`` takes the room of an all-gather of ``s``.

        Raises:
            TypeError / ValueError: a bad group, shape or dtype.
        """
        num_ranks = _group_size(group)
        parsed, _ = _parse_shapes("shapes", shapes)
        dtype = _check_dtype("dtype", dtype)
        return sum(_align(num_ranks * math.prod(shape) * dtype.itemsize, AGRS_TENSOR_ALIGNMENT) for shape in parsed)

    @staticmethod
    def get_agrs_buffer_size_hint(group, num_max_session_bytes: int) -> int:
        """Buffer bytes (``num_bytes``) for sessions of ``num_max_session_bytes``: that number plus
        what a GPU window holds before the session space (its control region and the AGRS flag
        words, `deep_ep.backends.gpu.agrs.window_bytes`), rounded up to 2 MiB
        (`deep_ep.checks.BUFFER_ALIGNMENT`); 0 for 0. DeepEP's hint leaves out the first part (its
        flags live outside the buffer), so this one is 2 MiB larger when the space is close to a
        multiple of 2 MiB.

        Raises:
            TypeError / ValueError: a bad group, or ``num_max_session_bytes`` not an int >= 0.
        """
        num_ranks = _group_size(group)
        checks.check_int("num_max_session_bytes", num_max_session_bytes, minimum=0, maximum=None)
        if not num_max_session_bytes:
            return 0
        from ..backends.gpu.agrs import window_bytes
        return _align(window_bytes(num_ranks, _align(num_max_session_bytes, AGRS_TENSOR_ALIGNMENT)),
                      checks.BUFFER_ALIGNMENT)

    # ------------------------------------------------------------------ sessions
    def _agrs(self, method: str) -> _Session:
        """The session state, once the buffer is known to be alive and on a backend that has AGRS."""
        self._alive()
        self._agrs_on_gpu(method)
        session = getattr(self, "_agrs_session", None)
        if session is None:
            session = self._agrs_session = _Session()
        return session

    def _agrs_on_gpu(self, method: str) -> bool:
        """True for a GPU buffer, False for a CPU one; any other backend, or a GPU buffer across NVLink
        domains (`deep_ep.topology.require_one_nvlink_domain`), raises NotImplementedError."""
        from ..backends.cpu import CPUBackend
        if isinstance(self._backend, CPUBackend):
            return False
        from ..backends.gpu import GPUBackend
        if isinstance(self._backend, GPUBackend):
            topology.require_one_nvlink_domain(method, "all-gather / reduce-scatter", self._backend)
            return True
        raise NotImplementedError(f"ElasticBuffer.{method}: all-gather / reduce-scatter sessions are not implemented "
                                  f"for this backend ({type(self._backend).__name__}); GPU buffers and the CPU "
                                  f"backend have them")

    def _agrs_moves(self):
        """The backend's AGRS data mover (made on first use)."""
        moves = getattr(self, "_agrs_mover", None)
        if moves is None:
            if self._agrs_on_gpu("agrs"):
                from ..backends.gpu.agrs import GPUAgrsMoves
                moves = self._agrs_mover = GPUAgrsMoves(self._backend)
            else:
                from ..backends.cpu.agrs import CPUAgrsMoves
                moves = self._agrs_mover = CPUAgrsMoves(self._backend)
        return moves

    def _agrs_pp_mark(self):
        """What pipeline send/recv did to the window so far (GPU: PP's slots and counters share the
        region after the control words with AGRS): the channels (the object itself, kept alive, so a
        new configuration never compares equal) and the tensors moved."""
        pipeline = getattr(self, "_pp_pipeline", None)
        if pipeline is None:
            return None
        return pipeline, sum(getattr(pipeline, "sent", ())), sum(getattr(pipeline, "received", ()))

    def _agrs_check_window(self, method: str) -> None:
        """GPU only, before anything is queued: no earlier GPU error, and nothing wrote over the AGRS
        region since agrs_set_config (dispatch, combine, pipeline send/recv)."""
        if not self._agrs_on_gpu(method):
            return
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"deep_ep: {method} cannot be captured in a CUDA graph on a GPU buffer: its flags "
                               f"carry the session's number, which every replay would repeat (replays would not "
                               f"wait for the peers); call it outside the capture")
        self._agrs_moves().check(method)
        if self._agrs_pp_mark() != getattr(self, "_agrs_pp_configured", None):
            raise RuntimeError(f"deep_ep: {method}: pipeline send/recv ran on this buffer since the last "
                               f"agrs_set_config, and on a GPU buffer it writes over the AGRS region of the window; "
                               f"call agrs_set_config on every rank after it, before the next session")

    def _release_primitives(self) -> None:
        """Close an open session without waiting for its handles and drop the session space
        (`ElasticBuffer.destroy`); on CPU, outputs the caller still holds keep their bytes (on GPU
        they are views of the window the backend frees, once the stream waits already queued are
        done: TimeoutError naming a peer that never arrived)."""
        session = getattr(self, "_agrs_session", None)
        if session is not None:
            session.open = False
            session.handles = []
            session.space = None
            session.num_max_session_bytes = 0
        release = getattr(getattr(self, "_agrs_mover", None), "release", None)
        self._agrs_mover = None
        if release is not None:
            release()

    def _agrs_in_session(self, method: str) -> _Session:
        session = self._agrs(method)
        if not session.open:
            raise RuntimeError(f"deep_ep: {method}: no AGRS session is open, and it must be called inside an AGRS "
                               f"session (create_agrs_session() or `with buffer.agrs_new_session():`)")
        return session

    def agrs_set_config(self, num_max_session_bytes: int, num_max_all_gathers_per_session: int) -> None:
        """Set the session space and the most all-gathers per session (collective: every rank calls
        it with the same values; it also flushes, as a barrier does).

        Args:
            num_max_session_bytes: > 0; rounded up to 32 (`get_agrs_num_max_session_bytes` computes
                it). Not above ``num_bytes`` when the buffer was given a window size. GPU: the space
                is at most what the window holds after its header; a call beyond it raises.
            num_max_all_gathers_per_session: 1..32; each `all_gather` / `reduce_scatter` call counts
                once, a batched one too.

        The CPU backend allocates the space here (a host tensor); outputs of earlier sessions keep
        the old space alive. On a GPU buffer the space is a region of the window (after its control
        region and the AGRS flag words; `get_agrs_buffer_size_hint` counts them): the call waits on
        the host for this rank's streams, meets the other ranks, compares their values and clears
        the flags; it cannot be captured in a CUDA graph, and is needed again after a dispatch,
        combine or pipeline send/recv on the buffer (they write over the region). Unlike DeepEP's
        GPU path, one rank is allowed.

        Raises:
            TypeError / ValueError: bad values; a space larger than the buffer's ``num_bytes`` (GPU:
            less ``num_cpu_bytes``), or a GPU window with no room after its header. RuntimeError: a session is open, another primitive holds the window, a
            destroyed buffer, CUDA-graph capture (GPU), or (on every rank) ranks that disagree on
            the values. TimeoutError: a rank did not arrive within ``num_cpu_timeout_secs``.
            NotImplementedError: a backend other than CPU and GPU, or a GPU buffer across NVLink
                domains.
        """
        session = self._agrs("agrs_set_config")
        backend = self._backend
        backend.calls += 1
        checks.check_int("num_max_session_bytes", num_max_session_bytes, minimum=1, maximum=None)
        checks.check_int("num_max_all_gathers_per_session", num_max_all_gathers_per_session, minimum=1,
                         maximum=AGRS_MAX_OPS_PER_SESSION)
        on_gpu = self._agrs_on_gpu("agrs_set_config")
        space = size = _align(num_max_session_bytes, AGRS_TENSOR_ALIGNMENT)   # ranks compare ``size``
        if on_gpu:   # as DeepEP, any size up to the buffer's; the space is what the header leaves
            from ..backends.gpu.agrs import space_offset
            usable = backend.transport.num_bytes - self.num_cpu_bytes   # Engram's storage ends the window
            room = (usable - space_offset(self.num_ranks)) // AGRS_TENSOR_ALIGNMENT * AGRS_TENSOR_ALIGNMENT
            if num_max_session_bytes > usable or room < AGRS_TENSOR_ALIGNMENT:
                raise ValueError(f"num_max_session_bytes ({num_max_session_bytes}) does not fit a GPU window of "
                                 f"{usable} bytes beside num_cpu_bytes={self.num_cpu_bytes} (Engram's storage), "
                                 f"{space_offset(self.num_ranks)} of them control words and AGRS flags; size "
                                 f"it with get_agrs_buffer_size_hint (plus num_cpu_bytes)")
            space = min(size, room)
        elif self.num_bytes and num_max_session_bytes > self.num_bytes:
            raise ValueError(f"num_max_session_bytes ({num_max_session_bytes}) exceeds the buffer's num_bytes "
                             f"({self.num_bytes}); size the buffer with get_agrs_buffer_size_hint")
        if session.open:
            raise RuntimeError("deep_ep: agrs_set_config cannot be called while an AGRS session is open; "
                               "call destroy_agrs_session first")
        self._window_use.check_free("agrs")
        if on_gpu and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("agrs_set_config waits on the host for every rank and cannot be captured in a CUDA "
                               "graph; call it outside the capture")
        session.space = None   # a failed configuration leaves none
        session.num_max_session_bytes = 0
        session.space = self._agrs_moves().configure(size, num_max_all_gathers_per_session, backend.calls, space)
        session.num_max_session_bytes = space
        session.num_max_ops = num_max_all_gathers_per_session
        self._agrs_pp_configured = self._agrs_pp_mark()

    def create_agrs_session(self) -> None:
        """Open a session (local; pair it with `destroy_agrs_session`, or use `agrs_new_session`).
        The buffer's window is held until the session ends: dispatch, combine and the other
        primitives raise meanwhile.

        On a GPU buffer it queues, on the current stream, this rank's "entered" flag into every
        rank's window: peers write this session's data into this rank's space only after the work
        queued before it (reading the previous session's outputs) is done.

        Raises:
            RuntimeError: a session is already open, `agrs_set_config` was not called, another
            primitive holds the window, a destroyed buffer, or (GPU) a dispatch, combine or pipeline
            send/recv since agrs_set_config, or an earlier GPU error. TimeoutError: (GPU) as
            `all_gather`. NotImplementedError: a backend other than CPU and GPU, or a GPU buffer
            across NVLink domains.
        """
        session = self._agrs("create_agrs_session")
        if session.open:
            raise RuntimeError("deep_ep: an AGRS session is already open; call destroy_agrs_session first")
        if not session.num_max_session_bytes:
            raise RuntimeError("deep_ep: call agrs_set_config before create_agrs_session")
        self._window_use.check_free("agrs")
        self._agrs_check_window("create_agrs_session")
        self._window_use.hold("agrs", "an all-gather / reduce-scatter session is open; destroy_agrs_session "
                                      "(or leaving agrs_new_session) releases it")
        session.open = True
        session.index += 1
        session.offset = 0
        session.num_ops = 0
        session.handles = []
        begin = getattr(self._agrs_moves(), "begin_session", None)
        if begin is not None:
            begin(session.index)

    def destroy_agrs_session(self) -> None:
        """End the open session (collective): wait for every handle not waited yet, check that all
        ranks made the same calls in it, release the window. The session is closed even when this
        raises. Outputs stay valid until the next session's calls reuse the space.

        On a GPU buffer the waits are queued on the current stream (the host does not wait), and
        ranks whose sessions differ are not detected (their outputs are undefined).

        Raises:
            RuntimeError: no session is open, a destroyed buffer, or (CPU, on every rank) ranks whose
            sessions differ. TimeoutError: (CPU) a peer did not arrive.
            NotImplementedError: a backend other than CPU and GPU, or a GPU buffer across NVLink
                domains.
        """
        session = self._agrs_in_session("destroy_agrs_session")
        backend = self._backend
        backend.calls += 1
        try:
            for handle in list(session.handles):
                handle._finish()
            self._agrs_moves().end_session(session.index, session.num_ops, session.offset, backend.calls)
        finally:
            session.open = False
            session.handles = []
            self._window_use.release("agrs")

    @contextlib.contextmanager
    def agrs_new_session(self, enabled: bool = True):
        """Context manager: `create_agrs_session` on entry, `destroy_agrs_session` on exit (also on an
        exception). ``enabled=False`` makes it a no-op.

        Raises:
            TypeError: ``enabled`` not a flag. NotImplementedError: a backend other than CPU and GPU,
            or a GPU buffer across NVLink domains (``enabled`` or not); otherwise what the two
            methods raise.
        """
        self._agrs("agrs_new_session")
        if not checks.check_bool("enabled", enabled):
            yield
            return
        self.create_agrs_session()
        try:
            yield
        finally:
            self.destroy_agrs_session()

    # ------------------------------------------------------------------ in-place tensors
    def _agrs_room(self, session: _Session, sizes: list, method: str) -> list:
        """Offsets of ``sizes`` (bytes per rank) placed from the session's offset; raises when the
        session's space or its count of calls would be exceeded."""
        offsets, offset = [], session.offset
        for nbytes in sizes:
            offsets.append(offset)
            offset += _align(nbytes * self.num_ranks, AGRS_TENSOR_ALIGNMENT)
        if session.num_ops >= session.num_max_ops:
            raise RuntimeError(f"deep_ep: {method}: this AGRS session already holds {session.num_ops} all-gathers / "
                               f"reduce-scatters, the most agrs_set_config allows "
                               f"(num_max_all_gathers_per_session={session.num_max_ops}); end the session first")
        if offset > session.num_max_session_bytes:
            raise RuntimeError(f"deep_ep: {method} needs {offset - session.offset} bytes of the session space, "
                               f"{session.num_max_session_bytes - session.offset} are left of "
                               f"a space of {session.num_max_session_bytes} bytes; end the session first, or configure "
                               f"more (agrs_set_config; on GPU within the window: get_agrs_buffer_size_hint)")
        return offsets

    def agrs_get_inplace_tensor(self, shapes, dtype: torch.dtype):
        """This rank's slot of the next all-gather in the session space: write the local data there
        and pass the tensor to `all_gather`, which then skips copying it in.

        Args:
            shapes: one shape, or a sequence of shapes (batched mode: the slots of one batched
                `all_gather` of those tensors, in order). dtype: their dtype.

        Returns:
            A tensor of ``dtype`` and the shape (a view of the session space; its contents are not
            defined until written), or a tuple of them in batched mode.

        Raises:
            TypeError / ValueError: bad shapes or dtype. RuntimeError: outside a session, or the
            session's space or call count would be exceeded. NotImplementedError: a backend other
            than CPU and GPU, or a GPU buffer across NVLink domains.
        """
        session = self._agrs_in_session("agrs_get_inplace_tensor")
        parsed, batched = _parse_shapes("shapes", shapes)
        dtype = _check_dtype("dtype", dtype)
        sizes = [math.prod(shape) * dtype.itemsize for shape in parsed]
        offsets = self._agrs_room(session, sizes, "agrs_get_inplace_tensor")
        out = tuple(self._agrs_slot(session, offset, nbytes).view(dtype).view(shape)
                    for offset, nbytes, shape in zip(offsets, sizes, parsed))
        return out if batched else out[0]

    def _agrs_slot(self, session: _Session, offset: int, nbytes: int) -> torch.Tensor:
        start = offset + nbytes * self.rank_idx
        return session.space[start:start + nbytes]

    # ------------------------------------------------------------------ collectives
    def _agrs_inputs(self, t, method: str) -> tuple:
        """``(list of tensors, batched)``, each checked to be a contiguous tensor on the buffer's device."""
        batched = not isinstance(t, torch.Tensor)
        if batched and not isinstance(t, (tuple, list)):
            raise TypeError(f"{method}: t must be a tensor or a sequence of tensors, got {type(t).__name__}")
        tensors = list(t) if batched else [t]
        if not tensors:
            raise ValueError(f"{method}: t must hold at least one tensor, got an empty sequence")
        for index, tensor in enumerate(tensors):
            name = f"{method}: t[{index}]" if batched else f"{method}: t"
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
            if tensor.device != self.device:
                raise ValueError(f"{name} must be on {self.device} (the buffer's device), got {tensor.device}")
            if not tensor.is_contiguous():
                raise ValueError(f"{name} must be contiguous, got strides {tensor.stride()}")
        return tensors, batched

    def _agrs_place(self, session: _Session, tensor: torch.Tensor, offset: int) -> bool:
        """Whether ``tensor`` is this rank's in-place slot at ``offset``; raises for a tensor inside
        the session space anywhere else (it would be overwritten while it is sent)."""
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0 or session.space is None:
            return False
        start = session.space.data_ptr()
        where = tensor.data_ptr() - start
        if not 0 <= where < session.num_max_session_bytes:
            return False
        if where != offset + nbytes * self.rank_idx:
            raise ValueError("deep_ep: all_gather: a tensor inside the AGRS session space must be the one "
                             "agrs_get_inplace_tensor returned for this call (same order, same shapes); "
                             "clone other views of the space (earlier outputs) first")
        return True

    def all_gather(self, t):
        """All-gather inside the open session (collective; every rank passes tensors of the same shapes
        and dtypes, any dtype).

        Args:
            t: a contiguous tensor on the buffer's device, or a sequence of them (batched mode: one
                call, one handle). A tensor from `agrs_get_inplace_tensor` is sent from its slot.

        Returns:
            ``(gathered, handle)`` for one tensor, ``(*gathered, handle)`` for a sequence: each
            ``gathered`` is ``[R, *t.shape]`` of ``t.dtype``, row ``r`` rank ``r``'s tensor; a view of
            the session space, defined once ``handle()`` returned, valid until a later session reuses
            the space (clone it to keep it). On a GPU buffer the space is part of the window: a
            dispatch, combine or pipeline send/recv writes over it, and `destroy` frees it.

        On a GPU buffer no SM moves the data: the copies (one per rank and tensor, copy engines)
        and a flag per rank are queued on the current stream and the call returns; ``t`` may be
        changed by work queued after the call on that stream. ``handle()`` queues the wait for
        every rank's flag on the stream current at its call.

        Raises:
            TypeError / ValueError: bad tensors (before any communication). RuntimeError: outside a
            session, the session's space or call count exceeded, a destroyed buffer, (CPU, on every
            rank) ranks passing different shapes or dtypes (not detected on GPU: the outputs are
            then undefined), or (GPU) a dispatch, combine or pipeline send/recv since agrs_set_config.
            TimeoutError: (GPU) this rank's stream has waited over ``num_cpu_timeout_secs`` for a
            peer's call (named) that never came. NotImplementedError: a backend other than CPU and GPU,
            or a GPU buffer across NVLink domains.
        """
        session = self._agrs_in_session("all_gather")
        backend = self._backend
        backend.calls += 1
        tensors, batched = self._agrs_inputs(t, "all_gather")
        sizes = [tensor.numel() * tensor.element_size() for tensor in tensors]
        offsets = self._agrs_room(session, sizes, "all_gather")
        in_place = [self._agrs_place(session, tensor, offset) for tensor, offset in zip(tensors, offsets)]
        self._agrs_check_window("all_gather")
        wait = self._agrs_moves().all_gather(session, tensors, offsets, in_place, backend.calls)
        gathered = tuple(session.space[offset:offset + nbytes * self.num_ranks].view(tensor.dtype)
                         .view(self.num_ranks, *tensor.shape)
                         for tensor, offset, nbytes in zip(tensors, offsets, sizes))
        handle = self._agrs_record(session, "all_gather", wait, offsets, sizes)
        return (*gathered, handle) if batched else (gathered[0], handle)

    def reduce_scatter(self, t, *, average: bool = False):
        """Reduce-scatter inside the open session (collective; a deep_ep extension, DeepEP has none).
        PyTorch's ``reduce_scatter_tensor`` convention: the input is ``[R * n, *rest]``, rank ``r``
        receives the sum over ranks of rows ``[r * n, (r + 1) * n)``.

        Args:
            t: a contiguous bf16 or float32 tensor ``[R * n, *rest]`` (``n >= 0``) on the buffer's
                device, or a sequence of them (batched mode: one call, one handle). Same shapes and
                dtypes on every rank.
            average: (keyword, default False) divide the float32 sum by R before the final cast.

        Returns:
            ``(reduced, handle)`` or ``(*reduced, handle)``: ``reduced`` is a new ``[n, *rest]``
            tensor of ``t.dtype``, filled once ``handle()`` returned (or the session ended). The sum
            is deterministic: float32, ranks added in rank order (0, 1, ..., R-1), one rounding to
            the input dtype at the end (the same bits on CPU and GPU). Its received chunks take
            ``align(t.nbytes, 32)`` bytes of the session space and it counts as one call of the
            session.

        On a GPU buffer the chunks move on copy engines as in `all_gather`; ``handle()`` queues the
        wait and then the sum (one small kernel per tensor: the only SM work of AGRS) on the stream
        current at its call.

        Raises:
            TypeError / ValueError: bad tensors or flag (before any communication), an input inside
            the unused part of the session space. RuntimeError: as `all_gather`.
            NotImplementedError: a backend other than CPU and GPU, or a GPU buffer across NVLink
                domains.
        """
        session = self._agrs_in_session("reduce_scatter")
        backend = self._backend
        backend.calls += 1
        average = checks.check_bool("average", average)
        tensors, batched = self._agrs_inputs(t, "reduce_scatter")
        for index, tensor in enumerate(tensors):
            name = f"reduce_scatter: t[{index}]" if batched else "reduce_scatter: t"
            if tensor.dtype not in REDUCE_SCATTER_DTYPES:
                raise TypeError(f"{name} must be bfloat16 or float32, got {tensor.dtype}")
            if tensor.dim() == 0 or tensor.shape[0] % self.num_ranks:
                raise ValueError(f"{name} must be [R * n, ...] with R={self.num_ranks} ranks, got shape "
                                 f"{list(tensor.shape)}")
        sizes = [tensor.numel() * tensor.element_size() // self.num_ranks for tensor in tensors]
        offsets = self._agrs_room(session, sizes, "reduce_scatter")
        if session.space is not None:
            unused = (session.space.data_ptr() + session.offset, session.space.data_ptr() + session.num_max_session_bytes)
            for tensor in tensors:
                if tensor.numel() and unused[0] <= tensor.data_ptr() < unused[1]:
                    raise ValueError("deep_ep: reduce_scatter: an input must not lie in the unused part of the AGRS "
                                     "session space (agrs_get_inplace_tensor serves all_gather only)")
        self._agrs_check_window("reduce_scatter")
        reduced, wait = self._agrs_moves().reduce_scatter(session, tensors, offsets, average, backend.calls)
        handle = self._agrs_record(session, "reduce_scatter", wait, offsets, sizes)
        return (*reduced, handle) if batched else (reduced[0], handle)

    def _agrs_record(self, session: _Session, op: str, wait, offsets: list, sizes: list) -> AgrsHandle:
        """Advance the session past a started call; its handle."""
        session.offset = offsets[-1] + _align(sizes[-1] * self.num_ranks, AGRS_TENSOR_ALIGNMENT)
        session.num_ops += 1
        handle = AgrsHandle(session, f"{op} #{session.num_ops}", wait)
        session.handles.append(handle)
        return handle
