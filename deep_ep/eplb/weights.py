"""Moving expert weights to a new placement over the EP process group, without ever leaving a rank
with a half-moved placement.

The new local tensors are built in fresh buffers: a slot whose expert this rank already holds is a
local copy, every other slot is received from a rank that holds the expert (replicas are read
round-robin, spreading the sends), one ``all_to_all_single`` per tensor. The old tensors are only
read. Between steps the ranks vote (one small all-reduce): a rank that fails locally (bad input,
out of memory, ...) makes every rank raise instead of leaving the others waiting in the next
exchange, and a rank only returns the new tensors once every rank has built all of its own. A
failure inside the communication itself raises from torch.distributed (or its timeout); the old
tensors are intact in every case. Adopting the new tensors is the caller's explicit, local step
(:meth:`ExpertPlacement.switch`).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from .collective import comm_device, fingerprint, group_info, vote

__all__ = ["ExpertMoveError", "move_expert_weights", "ExpertPlacement", "transfer_sources"]


class ExpertMoveError(RuntimeError):
    """Moving expert weights failed on some rank; every rank raises it and keeps its old tensors."""


def _as_placement(p2l, name: str, world: int) -> np.ndarray:
    if not isinstance(p2l, torch.Tensor) or p2l.dtype != torch.int64:
        raise TypeError(f"{name} must be an int64 tensor")
    if p2l.dim() != 1 or p2l.numel() == 0:
        raise ValueError(f"{name} must be 1-D [N] (one layer), got shape {tuple(p2l.shape)}")
    if p2l.numel() % world:
        raise ValueError(f"{name} has {p2l.numel()} slots, not a multiple of the group size {world}")
    a = p2l.detach().to("cpu").numpy()
    if a.min() < 0:
        raise ValueError(f"{name} holds negative expert ids")
    return a


def transfer_sources(old_physical_to_logical: np.ndarray, new_physical_to_logical: np.ndarray,
                     world_size: int) -> np.ndarray:
    """For every new slot, the old slot its weights come from (int64 ``[N_new]``): a slot of the
    same rank holding the expert if there is one, else the expert's old slots in turn.

    Raises:
        ValueError: a new slot holds an expert the old placement does not.
    """
    old, new = old_physical_to_logical, new_physical_to_logical
    s_old, s_new = old.size // world_size, new.size // world_size
    holders: dict = {}
    for slot, e in enumerate(old.tolist()):
        holders.setdefault(e, []).append(slot)
    src = np.empty(new.size, dtype=np.int64)
    turn: dict = {}
    for q, e in enumerate(new.tolist()):
        slots = holders.get(e)
        if not slots:
            raise ValueError(f"new slot {q} holds expert {e}, which no old slot holds")
        dst = q // s_new
        local = [s for s in slots if s // s_old == dst]
        if local:
            src[q] = local[0]
        else:
            k = turn.get(e, 0)
            src[q] = slots[k % len(slots)]
            turn[e] = k + 1
    return src


def _check_tensors(tensors, rows: int):
    if not isinstance(tensors, dict) or not tensors:
        raise TypeError("tensors must be a non-empty dict of name -> tensor")
    device = None
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {name!r}")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors[{name!r}] must be a torch.Tensor")
        if t.dim() < 1 or t.shape[0] != rows:
            raise ValueError(f"tensors[{name!r}] must have {rows} rows (local slots), got shape {tuple(t.shape)}")
        if device is not None and t.device != device:
            raise ValueError("all expert tensors must be on one device")
        device = t.device


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """``[rows, bytes]`` uint8 view of a tensor's rows (communicated as bytes, any dtype)."""
    t = t.contiguous()
    return t.reshape(t.shape[0], -1).view(torch.uint8) if t.numel() else t.reshape(t.shape[0], 0).to(torch.uint8)


def _pack(t: torch.Tensor, plan: dict, comm_dev) -> tuple:
    """Fresh output rows (local copies done) and the send buffer, for one tensor."""
    rows = _as_rows(t)
    out = torch.empty((plan["s_new"], rows.shape[1]), dtype=torch.uint8, device=t.device)
    if plan["local_dst"].numel():
        out[plan["local_dst"].to(t.device)] = rows[plan["local_src"].to(t.device)]
    send = rows[plan["send_rows"].to(t.device)].to(comm_dev)
    return out, send


def _unpack(name: str, t: torch.Tensor, out: torch.Tensor, recv: torch.Tensor, plan: dict) -> torch.Tensor:
    """Write the received rows into ``out`` and give it ``t``'s dtype and row shape."""
    if plan["recv_dst"].numel():
        out[plan["recv_dst"].to(out.device)] = recv.to(out.device)
    return out.view(t.dtype).reshape(plan["s_new"], *t.shape[1:])


def _schedule(src: np.ndarray, s_old: int, s_new: int, rank: int, world: int) -> dict:
    q = np.arange(src.size)
    dst_rank, src_rank = q // s_new, src // s_old
    mine = dst_rank == rank
    local = mine & (src_rank == rank)
    recv = mine & (src_rank != rank)
    send = (src_rank == rank) & (dst_rank != rank)
    send_q = q[send][np.lexsort((q[send], dst_rank[send]))]            # by destination, then slot
    recv_q = q[recv][np.lexsort((q[recv], src_rank[recv]))]            # by source, then slot
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))  # noqa: E731
    return {
        "s_new": s_new,
        "local_dst": t(q[local] - rank * s_new), "local_src": t(src[local] - rank * s_old),
        "send_rows": t(src[send_q] - rank * s_old), "recv_dst": t(recv_q - rank * s_new),
        # The same on every rank: when no slot crosses ranks, nobody calls the exchange.
        "exchange": bool((dst_rank != src_rank).any()),
        "send_split": np.bincount(dst_rank[send_q], minlength=world).tolist(),
        "recv_split": np.bincount(src_rank[recv_q], minlength=world).tolist(),
    }


def move_expert_weights(tensors: dict, old_physical_to_logical: torch.Tensor,
                        new_physical_to_logical: torch.Tensor, group=None) -> dict:
    """Collective: this rank's expert tensors for a new placement of one layer, in fresh buffers.

    Args:
        tensors: ``{name: tensor [N_old / world_size, ...]}``, row ``s`` the weights of local slot
            ``s`` (global slot ``rank * N_old / world_size + s``); any dtypes, one device. The same
            names and row shapes on every rank. Only read.
        old_physical_to_logical: int64 ``[N_old]``, the placement ``tensors`` follow.
        new_physical_to_logical: int64 ``[N_new]``, the placement to move to; every expert in it
            must be held somewhere in the old one. N_old and N_new multiples of the group size.
        group: the EP process group (``None``: default), gloo or NCCL.

    Returns:
        ``{name: tensor [N_new / world_size, ...]}``: new tensors, same dtypes, device and row
        shapes. Returned on a rank only once every rank has built its own.

    Raises:
        TypeError / ValueError: bad arguments on this rank (raised on every rank: the others get a
            ValueError saying another rank rejected its arguments), or ranks passing different
            placements, names, dtypes or row shapes.
        ExpertMoveError: a step failed on some rank (every rank raises; nothing was changed).
    """
    group, rank, world = group_info(group)
    error, plan, names = None, None, []
    try:
        old = _as_placement(old_physical_to_logical, "old_physical_to_logical", world)
        new = _as_placement(new_physical_to_logical, "new_physical_to_logical", world)
        s_old, s_new = old.size // world, new.size // world
        _check_tensors(tensors, s_old)
        names = sorted(tensors)
        src = transfer_sources(old, new, world)
        plan = _schedule(src, s_old, s_new, rank, world)
        digest = fingerprint(old_physical_to_logical, new_physical_to_logical,
                             [(n, str(tensors[n].dtype), tuple(tensors[n].shape[1:])) for n in names])
        device = next(iter(tensors.values())).device
    except (TypeError, ValueError) as exc:
        error, digest, device = exc, 0, None
    dev = comm_device(group, device)
    ok, same = vote(group, error is None, dev, digest)
    if error is not None:
        raise error
    if not ok:
        raise ValueError("another rank rejected its arguments to move_expert_weights (see its error)")
    if not same:
        raise ValueError("ranks passed different placements, tensor names, dtypes or row shapes to "
                         "move_expert_weights")
    staged: dict = {}
    failure = None
    for name in names:
        t = tensors[name]
        out = send = None
        if failure is None:
            try:
                out, send = _pack(t, plan, dev)
            except Exception as exc:  # noqa: BLE001 - reported to every rank by the vote
                failure = exc
        if not vote(group, failure is None, dev)[0]:
            raise ExpertMoveError(f"moving expert weights failed on some rank before exchanging {name!r}; "
                                  "the old tensors are unchanged") from failure
        recv = torch.empty((sum(plan["recv_split"]), send.shape[1]), dtype=torch.uint8, device=dev)
        if plan["exchange"]:
            dist.all_to_all_single(recv, send, output_split_sizes=plan["recv_split"],
                                   input_split_sizes=plan["send_split"], group=group)
        try:
            staged[name] = _unpack(name, t, out, recv, plan)
        except Exception as exc:  # noqa: BLE001 - reported to every rank by the vote
            failure = exc
    if not vote(group, failure is None, dev)[0]:
        raise ExpertMoveError("moving expert weights failed on some rank; the old tensors are unchanged") from failure
    return staged


class ExpertPlacement:
    """The expert tensors of one layer on this rank and the placement they follow, with a
    two-step change: :meth:`prepare` (collective) builds the new tensors aside, :meth:`switch`
    (local) adopts them. Until ``switch`` the current tensors stay valid and unchanged; a failed
    ``prepare`` leaves everything as it was on every rank.

    Args:
        tensors: ``{name: tensor [N / world_size, ...]}`` for ``physical_to_logical``.
        physical_to_logical: int64 ``[N]``, this layer's current placement.
        group: the EP process group (``None``: default).
    """

    def __init__(self, tensors: dict, physical_to_logical: torch.Tensor, group=None):
        self.group, _, world = group_info(group)
        _as_placement(physical_to_logical, "physical_to_logical", world)
        _check_tensors(tensors, physical_to_logical.numel() // world)
        self.tensors = dict(tensors)
        self.physical_to_logical = physical_to_logical.detach().to("cpu").clone()
        self._staged = None

    @property
    def staged(self):
        """``(tensors, physical_to_logical)`` prepared and not yet switched to, or None."""
        return self._staged

    def prepare(self, new_physical_to_logical: torch.Tensor) -> dict:
        """Collective: build the tensors for ``new_physical_to_logical`` (see
        :func:`move_expert_weights`, whose errors it raises) and keep them for :meth:`switch`."""
        self._staged = None
        staged = move_expert_weights(self.tensors, self.physical_to_logical, new_physical_to_logical, self.group)
        self._staged = (staged, new_physical_to_logical.detach().to("cpu").clone())
        return staged

    def switch(self) -> dict:
        """Adopt the prepared tensors and placement (local; every rank whose ``prepare`` returned
        may switch). Returns the new tensors. Raises RuntimeError if nothing is prepared."""
        if self._staged is None:
            raise RuntimeError("nothing prepared: call prepare() first")
        self.tensors, self.physical_to_logical = self._staged
        self._staged = None
        return self.tensors

    def discard(self) -> None:
        """Drop prepared tensors without switching."""
        self._staged = None
