"""`deep_ep.ElasticBuffer`'s pipeline-parallel send/recv (pp_set_config, pp_send, pp_recv, get_pp_buffer_size_hint).

DeepEP V2's experimental PP primitive: a byte copy of a contiguous tensor to the previous or next
rank of the ring, first in, first out per channel (an ordered pair of neighbours), at most
``num_max_inflight_tensors`` tensors in flight per channel. The CPU backend runs it over gloo
(`deep_ep.backends.cpu.pp`); the GPU backend on the caller's stream (`deep_ep.backends.gpu.pp`),
with the copy engine and stream memory operations (``num_sms=0``, no SM held) or one kernel of
``num_sms`` blocks, for ranks emulated on one GPU and NCCL windows alike, within one NVLink domain
(on a GPU buffer across NVLink domains every method raises NotImplementedError).

Window: a rank that sent or received a PP tensor holds the buffer's window (dispatch, combine and
the other primitives raise) until the next `pp_set_config`, which is collective and frees it on
every rank once every tensor sent was received. A rank cannot tell on its own when its peers are
done (a receiver does not know what more is coming, a sender learns of receipts late), so the only
point where every rank agrees that nothing is in flight is that collective flush.
"""
from __future__ import annotations

import torch

from .. import checks, topology

__all__ = ["PipelineMixin", "PP_SLOT_ALIGNMENT"]

#: Bytes each tensor slot is rounded up to (DeepEP's 256-bit loads).
PP_SLOT_ALIGNMENT = 32

_HOLD_DETAIL = ("pipeline send/recv moved tensors since the last pp_set_config; after the last pp_recv, "
                "call pp_set_config on every rank to flush them and free the window")


def _align(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


def _check_sizes(num_max_tensor_bytes, num_max_inflight_tensors) -> None:
    checks.check_int("num_max_tensor_bytes", num_max_tensor_bytes, minimum=1, maximum=None)
    checks.check_int("num_max_inflight_tensors", num_max_inflight_tensors, minimum=1)


class PipelineMixin:
    """Methods of `deep_ep.ElasticBuffer` (a mixin: it uses the buffer's backend and window)."""

    @staticmethod
    def get_pp_buffer_size_hint(num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> int:
        """(Experimental) Bytes of window that pipeline send/recv needs, rounded up to 2 MiB.

        Each slot holds ``num_max_tensor_bytes`` rounded up to 32 bytes; there are
        ``num_max_inflight_tensors`` slots for each of the two neighbours, on the send side and on
        the receive side: ``align(align(num_max_tensor_bytes, 32) * num_max_inflight_tensors * 4, 2 MiB)``,
        DeepEP's number. Pass it (or more) as ``num_bytes`` to a buffer used for PP; a CPU buffer
        with ``num_bytes=0`` needs none.

        Args:
            num_max_tensor_bytes: int >= 1, the largest tensor one pp_send / pp_recv moves, in bytes.
            num_max_inflight_tensors: int >= 1, the most tensors in flight per channel.

        Returns:
            int, bytes (a multiple of 2 MiB).

        Raises:
            TypeError / ValueError: an argument that is not a positive int.
        """
        _check_sizes(num_max_tensor_bytes, num_max_inflight_tensors)
        num_slot_bytes = _align(num_max_tensor_bytes, PP_SLOT_ALIGNMENT)
        return _align(num_slot_bytes * num_max_inflight_tensors * 2 * 2, checks.BUFFER_ALIGNMENT)

    # ------------------------------------------------------------------ helpers
    def _pp_on_gpu(self, method: str) -> bool:
        """True for a GPU buffer, False for a CPU one; any other backend, or a GPU buffer across NVLink
        domains (`deep_ep.topology.require_one_nvlink_domain`), raises NotImplementedError."""
        from ..backends.cpu import CPUBackend
        if isinstance(self._backend, CPUBackend):
            return False
        from ..backends.gpu import GPUBackend
        if isinstance(self._backend, GPUBackend):
            topology.require_one_nvlink_domain(method, "pipeline send/recv", self._backend)
            return True
        raise NotImplementedError(
            f"ElasticBuffer.{method}: pipeline send/recv is not implemented for this backend "
            f"({type(self._backend).__name__}); GPU buffers and the CPU backend have it")

    def _pp_checked_pipeline(self, method: str, t, peer, peer_name: str, num_sms):
        """The configured pipeline after checking one pp_send / pp_recv call's arguments."""
        self._alive()
        self._pp_on_gpu(method)
        pipeline = getattr(self, "_pp_pipeline", None)
        if pipeline is None:
            raise RuntimeError(f"{method}: pipeline send/recv is not configured on this buffer; call "
                               f"pp_set_config(num_max_tensor_bytes, num_max_inflight_tensors) on every rank first")
        checks.check_int("num_sms", num_sms, minimum=0)
        checks.check_int(peer_name, peer, maximum=None)   # the range: the neighbour check names the ranks to pass
        if peer not in (pipeline.prev_rank, pipeline.next_rank):
            raise ValueError(f"{method}: {peer_name}={peer} is not a neighbour of rank {self.rank_idx} in the ring of "
                             f"{self.num_ranks} ranks; pass the previous rank {pipeline.prev_rank} or the next rank "
                             f"{pipeline.next_rank}")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{method}: t must be a torch.Tensor, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise TypeError(f"{method}: t must be a dense (strided) tensor, got layout {t.layout}")
        if t.device != self.device:
            raise ValueError(f"{method}: t is on {t.device}, this buffer's tensors live on {self.device}; move it "
                             f"with .to('{self.device}')")
        if not t.is_contiguous():
            raise ValueError(f"{method}: t (shape {tuple(t.shape)}, strides {t.stride()}) must be contiguous; pass "
                             f"t.contiguous() (pp_recv fills t in place, so receive into a contiguous tensor and "
                             f"copy it where it belongs)")
        if t.nbytes > pipeline.num_slot_bytes:
            raise ValueError(f"{method}: t holds {t.nbytes} bytes (shape {tuple(t.shape)}, {t.dtype}), more than the "
                             f"configured num_max_tensor_bytes ({pipeline.num_slot_bytes} after rounding up to "
                             f"{PP_SLOT_ALIGNMENT}); call pp_set_config with a larger num_max_tensor_bytes on every "
                             f"rank")
        return pipeline

    def _release_primitives(self) -> None:
        """Drop the PP channels (`ElasticBuffer.destroy`); tensors still in flight are abandoned."""
        release = getattr(getattr(self, "_pp_pipeline", None), "release", None)
        self._pp_pipeline = None
        if release is not None:
            release()

    # ------------------------------------------------------------------ public methods
    def pp_set_config(self, num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> None:
        """(Experimental) Configure pipeline send/recv (collective: every rank calls it).

        Flushes earlier PP traffic first: every rank reports what it sent to and received from each
        rank; if any tensor sent was not received, every rank raises (the earlier configuration
        stays: make the missing pp_recv calls and call again). Otherwise each rank waits until its
        sends are acknowledged, starts fresh channels and frees the buffer's window (see the docstring of
        `deep_ep.primitives.pp`): call it between PP traffic and dispatch / combine. Also the only way to change
        the sizes. On a GPU buffer it also waits on the host for this rank's current stream and
        communication stream, cannot be captured in a CUDA graph, and is needed after a dispatch or
        combine before the next PP traffic (they write over the slots).

        Args:
            num_max_tensor_bytes: int >= 1, the largest tensor in bytes (rounded up to 32).
            num_max_inflight_tensors: int >= 1, tensors sent and not yet received allowed per
                channel (an ordered pair of neighbours); a pp_send beyond waits for the receiver.

        Raises:
            TypeError / ValueError: a bad size, or (a buffer with a window, ``num_bytes > 0``; every
                GPU buffer) sizes that need more than ``num_bytes`` (`get_pp_buffer_size_hint`): before
                any communication.
            RuntimeError: destroyed buffer; another primitive holds the window; during CUDA-graph
                capture (GPU); on every rank, ranks that disagree on the sizes, or tensors sent and
                not received.
            TimeoutError: a rank did not arrive within ``num_cpu_timeout_secs``; a GPU wait of an
                earlier pp_send / pp_recv gave up (GPU).
            NotImplementedError: a backend other than CPU and GPU, or a GPU buffer across NVLink
                domains (as pp_send and pp_recv), on every rank before anything else.
        """
        self._alive()
        on_gpu = self._pp_on_gpu("pp_set_config")
        backend = self._backend
        backend.calls += 1   # collective: counted like dispatch, a refused call too
        _check_sizes(num_max_tensor_bytes, num_max_inflight_tensors)
        num_slot_bytes = _align(num_max_tensor_bytes, PP_SLOT_ALIGNMENT)
        num_window_bytes = num_slot_bytes * num_max_inflight_tensors * 2 * 2
        if on_gpu:
            from ..backends.gpu import pp as gpu_pp
            # the GPU rings need half the hint's slot sets, after the control region
            num_window_bytes = gpu_pp.pp_layout(backend.num_ranks, num_slot_bytes, num_max_inflight_tensors).end
        # on a GPU buffer the window's last num_cpu_bytes hold Engram's storage
        usable = self.num_bytes - (self.num_cpu_bytes if on_gpu else 0)
        if (self.num_bytes or on_gpu) and num_window_bytes > usable:
            raise ValueError(f"pp_set_config: {num_max_inflight_tensors} tensors of {num_slot_bytes} bytes in flight "
                             f"per direction and neighbour (send and receive slots for both neighbours) need "
                             f"{num_window_bytes} bytes of window, the buffer has {usable} (num_bytes="
                             f"{self.num_bytes}, less num_cpu_bytes on a GPU buffer); create it with num_bytes >= "
                             f"ElasticBuffer.get_pp_buffer_size_hint({num_max_tensor_bytes}, "
                             f"{num_max_inflight_tensors}) (plus num_cpu_bytes) or lower the sizes")
        self._window_use.check_free("pp")
        if on_gpu:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("pp_set_config waits on the host for every rank and cannot be captured in a CUDA "
                                   "graph; call it before the capture (pp_send / pp_recv can be captured)")
            self._pp_pipeline = gpu_pp.configure(backend, getattr(self, "_pp_pipeline", None), num_slot_bytes,
                                                 num_max_inflight_tensors)
        else:
            from ..backends.cpu import pp as cpu_pp
            self._pp_pipeline = cpu_pp.configure(backend.comm, backend.calls, getattr(self, "_pp_pipeline", None),
                                                 num_slot_bytes, num_max_inflight_tensors)
        self._window_use.release("pp")

    def pp_send(self, t: torch.Tensor, dst_rank_idx: int, num_sms: int = 0) -> None:
        """(Experimental) Send tensor ``t``'s bytes to a ring neighbour.

        The bytes are copied before the call returns, so ``t`` may be reused at once. Tensors reach
        ``dst_rank_idx`` in the order they were sent. When ``num_max_inflight_tensors`` tensors sent
        to ``dst_rank_idx`` are still unreceived, the call waits (at most ``num_cpu_timeout_secs``)
        until the receiver takes the oldest. With 2 ranks the previous and the next rank are the
        same rank: one channel each way. With 1 rank the tensor loops back to this rank.

        On a GPU buffer the call only queues work on the current stream and returns: the stream
        waits for a free slot, the bytes are copied into the receiver's window and published; ``t``
        may be reused by work queued after it on the same stream. With ``num_sms=0`` the copy
        engine moves the bytes and stream memory operations wait and signal (no SM held, no GPU
        timeout: the stream waits until the receiver frees a slot). With ``num_sms > 0`` a kernel
        of that many blocks does it and gives up after ``num_gpu_timeout_secs``; the next PP call
        (or pp_set_config) raises that timeout. The two may be mixed on one channel.

        Args:
            t: any dtype and shape (0-dim and empty included), contiguous, on the buffer's device,
                at most ``num_max_tensor_bytes`` (rounded up to 32) bytes.
            dst_rank_idx: int, the previous (``(rank - 1) % num_ranks``) or next (``(rank + 1) %
                num_ranks``) rank.
            num_sms: int >= 0; 0 (default): the copy engine, no SM (inside a CUDA-graph capture,
                and after one until the next pp_set_config, the copy kernel with one block: the
                copy engine's sequence numbers are fixed when queued); > 0: blocks of the GPU's copy
                kernel (fewer for a small tensor; emulated ranks: at most the device's SMs / ranks).
                Ignored on CPU.

        Raises (argument errors before any communication):
            TypeError / ValueError: bad ``t``, ``dst_rank_idx`` or ``num_sms``.
            RuntimeError: destroyed or unconfigured buffer; another primitive holds the window; a
                1-rank group with the in-flight limit reached; a failed connection; (GPU) a
                dispatch or combine since the last pp_set_config.
            TimeoutError: the receiver did not take the oldest tensor in time (the buffer's PP
                traffic is then unusable).
        """
        pipeline = self._pp_checked_pipeline("pp_send", t, dst_rank_idx, "dst_rank_idx", num_sms)
        self._window_use.check_free("pp")
        # the GPU pipeline's own checks (blocks, a dispatch since the flush) come before the hold
        blocks = (pipeline.check("pp_send", t, dst_rank_idx, num_sms),) if self._pp_on_gpu("pp_send") else ()
        self._window_use.hold("pp", _HOLD_DETAIL)
        pipeline.send(t, dst_rank_idx, *blocks)

    def pp_recv(self, t: torch.Tensor, src_rank_idx: int, num_sms: int = 0) -> None:
        """(Experimental) Receive the oldest tensor a ring neighbour sent to this rank, into ``t``.

        Waits (at most ``num_cpu_timeout_secs``) for it to arrive, then fills ``t`` in place with
        its bytes. ``t`` must have the sent tensor's byte count; its dtype and shape are the
        caller's (the copy is byte-wise). On a GPU buffer the call queues work on the current
        stream that waits on the GPU for the tensor, fills ``t`` and hands the slot back to the
        sender; work queued after it on the stream sees ``t`` filled. ``num_sms`` as in
        `pp_send`: 0 the copy engine (no GPU timeout), > 0 a kernel (at most
        ``num_gpu_timeout_secs``).

        Args:
            t: the output, contiguous, on the buffer's device, at most ``num_max_tensor_bytes``
                (rounded up to 32) bytes.
            src_rank_idx: int, the previous or next rank (as in `pp_send`).
            num_sms: int >= 0; 0 (default): the copy engine, no SM; > 0: blocks of the GPU's copy
                kernel. Ignored on CPU.

        Raises (argument errors before any communication):
            TypeError / ValueError: bad ``t``, ``src_rank_idx`` or ``num_sms``; ValueError also when
                the tensor that arrived has another byte count than ``t`` (it is consumed; on CPU
                and with ``num_sms > 0`` ``t`` is unchanged, the copy engine fills it with the
                slot's bytes anyway). On a GPU buffer that is found after the call, and the next PP
                call raises the ValueError; the buffer is then unusable.
            RuntimeError: destroyed or unconfigured buffer; another primitive holds the window; a
                1-rank group with nothing in flight; a failed connection.
            TimeoutError: nothing arrived in time (the buffer's PP traffic is then unusable).
        """
        pipeline = self._pp_checked_pipeline("pp_recv", t, src_rank_idx, "src_rank_idx", num_sms)
        self._window_use.check_free("pp")
        # the GPU pipeline's own checks (blocks, a dispatch since the flush) come before the hold
        blocks = (pipeline.check("pp_recv", t, src_rank_idx, num_sms),) if self._pp_on_gpu("pp_recv") else ()
        self._window_use.hold("pp", _HOLD_DETAIL)
        pipeline.recv(t, src_rank_idx, *blocks)
