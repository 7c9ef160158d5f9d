"""What a GPU buffer over several NVLink domains on a torch group decides at creation, with NCCL's
calls faked (no GPU, no libnccl): `deep_ep.comm.nccl_gin.NcclGinTransport` and
`deep_ep.topology.require_gin_features`.

* the device communicator's GIN requirements: contexts (``num_allocated_qps``, 129 / 17 by default),
  ``2 R`` signals and one counter per context, RAIL connections in hybrid mode and FULL in direct
  mode, exclusive contexts, ``sl_idx`` as the traffic class, each at the offset the headers give
  (compiled probes of NCCL 2.28.9's and 2.32.3's headers), and none of the later fields on 2.28.9;
* the errors before anything is allocated: NCCL older than 2.28.7, 2.29 (cannot ask for GIN), 2.30.3
  (cannot set the traffic class), a communicator without GIN (on rails in hybrid mode), hybrid mode on
  nodes of more than 32 ranks;
* one RuntimeWarning that the path has not run on RDMA hardware, the kernels' mode, the window
  (staging, forwarding area and inbox inside it) and the transport arguments;
* `open_nccl_transport` keeps the one-node transport when the LSA team holds every rank;
* the agreement over the group (two ranks' views, each all-reduce given the other's words): one
  rank refusing makes every rank raise before the device communicator, naming the first refusing
  rank; the least ``num_allocated_qps`` is asked for and the least number of GIN contexts given is
  used; a device communicator failing or empty elsewhere stops every rank before the window;
* release in reverse creation order: the window, the device communicator, the lease.
"""
from __future__ import annotations

import re
import struct
import warnings

import pytest
import torch

from deep_ep import jit, topology
from deep_ep.comm import devcomm, nccl_gin

import nccl_wheels


@pytest.fixture
def no_loaded_nccl(tmp_path_factory, monkeypatch):
    from deep_ep.jit import builder
    monkeypatch.setenv("EP_JIT_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "jit-cache"))
    monkeypatch.setattr(builder, "_check_nccl_versions", lambda *args: None)
    jit.clear_memory_cache()


def _layout(version: str) -> devcomm.DevCommLayout:
    try:
        return devcomm._layout(str(nccl_wheels.include_dir(version)))
    except nccl_wheels.FetchError as e:
        pytest.skip(str(e))


def _int(raw: bytes, offset: int) -> int:
    return struct.unpack_from("<i", raw, offset)[0]


# ---------------------------------------------------------------------------------------- requirements
@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "direct"])
def test_requirements_at_the_headers_offsets(no_loaded_nccl, hybrid):
    layout = _layout(nccl_wheels.NEWEST)
    gin = nccl_gin._gin_requirements(16, 129 if hybrid else 17, hybrid, 5)
    raw = devcomm.requirements_bytes(layout, gin)
    offsets = layout.offsets
    assert len(raw) == layout.requirements_size and raw[:16] == layout.requirements[:16]   # size, magic, version
    assert _int(raw, offsets["lsa_barrier_count"]) == 1
    assert _int(raw, offsets["gin_context_count"]) == (129 if hybrid else 17)
    assert _int(raw, offsets["gin_signal_count"]) == 32 and _int(raw, offsets["gin_counter_count"]) == 1
    assert _int(raw, offsets["gin_connection_type"]) == layout.connection_types["rail" if hybrid else "full"]
    assert layout.connection_types == {"full": 1, "rail": 2}
    assert raw[offsets["gin_exclusive_contexts"]] == 1 and _int(raw, offsets["gin_traffic_class"]) == 5
    assert _int(raw, offsets["gin_queue_depth"]) == devcomm.GIN_QUEUE_DEPTH == 1024   # DeepEP V2's depth
    assert _int(layout.requirements, offsets["gin_queue_depth"]) == 0                  # NCCL's default
    # every other byte is NCCL's default
    touched = {offsets[k] + i for k in ("lsa_barrier_count", "gin_context_count", "gin_signal_count",
                                        "gin_counter_count", "gin_connection_type", "gin_queue_depth",
                                        "gin_traffic_class")
               for i in range(4)} | {offsets["gin_exclusive_contexts"]}
    assert all(raw[i] == layout.requirements[i] for i in range(len(raw)) if i not in touched)


def test_oldest_headers_have_no_later_gin_fields(no_loaded_nccl):
    layout = _layout(nccl_wheels.OLDEST)
    assert not {"gin_connection_type", "gin_exclusive_contexts", "gin_queue_depth", "gin_traffic_class"} & \
        set(layout.offsets)
    assert layout.connection_types == {} and layout.properties_railed_gin_type == 0
    with pytest.raises(ValueError, match="traffic class"):
        devcomm.requirements_bytes(layout, nccl_gin._gin_requirements(4, 17, False, 3))
    # the one-node request is unchanged: an LSA barrier, GIN signals and counters per rank or none
    raw = devcomm.requirements_bytes(layout, gin_signals=4)
    assert [_int(raw, layout.offsets[k]) for k in ("lsa_barrier_count", "gin_signal_count", "gin_counter_count",
                                                   "gin_context_count")] == [1, 4, 4, 0]


def test_rails_gin_type_is_read_from_2_29_7_on(no_loaded_nccl):
    """``ncclCommProperties.railedGinType`` arrived with the connection types (2.29.7, the NCCL of
    torch 2.12 and 2.13): hybrid mode asks the rails' GIN type from that release on, not 2.30.7."""
    assert _layout(nccl_wheels.OLDEST).properties_railed_gin_type == 0
    for version in (nccl_wheels.TORCH_2_13, nccl_wheels.NEWEST):
        layout = _layout(version)
        # after size_t size, magic, version, rank, nRanks, cudaDev, nvmlDev, two bools, ginType,
        # nLsaTeams and a bool: offset 48 in both releases' headers
        assert layout.properties_railed_gin_type == 48, version
        assert layout.properties_railed_gin_type > layout.properties_gin_type
        assert {"gin_connection_type", "gin_exclusive_contexts", "gin_queue_depth"} <= set(layout.offsets)
    assert "gin_traffic_class" not in _layout(nccl_wheels.TORCH_2_13).offsets


def test_devcomm_context_count_is_read_where_the_headers_put_it(no_loaded_nccl):
    for version, size in ((nccl_wheels.OLDEST, 1), (nccl_wheels.NEWEST, 4)):
        layout = _layout(version)
        offset, width = layout.devcomm_gin_context_count
        assert width == size and 0 < offset < layout.devcomm_size
        fake = devcomm.DeviceCommunicator.__new__(devcomm.DeviceCommunicator)
        fake.layout = layout
        fake._devcomm = bytearray(layout.devcomm_size)
        fake._devcomm[offset] = 3
        assert fake.gin_context_count == 3


# ---------------------------------------------------------------------------------------- version and GIN checks
_HYBRID = topology.domains_from_nvlink_ranks(8, 5, 4, True)
_DIRECT = topology.domains_from_nvlink_ranks(8, 5, 4, False)


@pytest.mark.parametrize("version, match", [
    (22803, r"rank 5: the group spans 2 NVLink domains of 4 ranks.*GIN needs NCCL >= 2\.28\.7.*2\.28\.3"),
    (22809, r"NCCL >= 2\.29\.0 is needed to report whether its communicator has GIN.*loaded is 2\.28\.9"),
    (22907, r"NCCL >= 2\.30\.3 is needed to set sl_idx=3 as GIN's traffic class.*loaded is 2\.29\.7"),
])
def test_gin_features_the_loaded_nccl_lacks(version, match):
    for domains in (_HYBRID, _DIRECT):
        with pytest.raises(RuntimeError, match=match):
            topology.require_gin_features(domains, 5, version, 1, 3)


def test_a_communicator_without_gin_is_refused():
    with pytest.raises(RuntimeError, match=r"NCCL communicator \(2\.30\.7\) reports no GIN for hybrid mode"):
        topology.require_gin_features(_HYBRID, 5, 23007, 0, 3)
    with pytest.raises(RuntimeError, match="no GIN for direct mode"):
        topology.require_gin_features(_DIRECT, 5, 23007, 0, 3)
    topology.require_gin_features(_DIRECT, 5, 23007, 3, 3)        # GDAKI: nothing raised
    topology.require_gin_features(topology.domains_from_nvlink_ranks(8, 5, 8), 5, 0, 0, 3)  # one domain: never asked


def test_scaleout_support_no_longer_refuses_a_gin_nccl():
    for domains in (_HYBRID, _DIRECT):
        topology.require_scaleout_support(domains, 5, 22807)
        with pytest.raises(RuntimeError, match="GIN needs NCCL"):
            topology.require_scaleout_support(domains, 5, 22806)
    assert topology.NCCL_GIN_FEATURES["GIN traffic class (RDMA service level)"] == \
        topology.NCCL_GIN_TRAFFIC_CLASS_VERSION == 23003
    assert topology.NCCL_GIN_QUERY_VERSION in topology.NCCL_GIN_FEATURES.values()


# ---------------------------------------------------------------------------------------- the transport, faked NCCL
class _Group:
    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


class _Record:
    """What the faked NCCL saw: the device communicators and windows made and destroyed, the lease's
    releases, every call in order (``calls``) and this rank's words of each agreement before the
    all-reduce (``contributed``)."""

    def __init__(self) -> None:
        self.devcomms, self.windows, self.released = [], [], 0
        self.calls, self.contributed = [], []


def _fake_nccl(monkeypatch, record, team=(4, 1), version=23203, gin_types=(3, 3), contexts_given=4, peers=()):
    """NCCL's calls faked for one rank; ``peers[i]`` (a list of words) is what the other ranks put
    into the i-th agreement's all-reduce (MAX), none: they agree with this rank."""
    layout = devcomm.DevCommLayout(version=version, devcomm_size=248, requirements_size=104, transport_args_size=256,
                                   window_offset=248, offsets={}, requirements=b"", properties=b"x",
                                   properties_gin_type=36, devcomm_gin_context_count=(152, 4),
                                   connection_types={"full": 1, "rail": 2}, properties_railed_gin_type=48)

    class Lease:
        comm, private = 0x1234, False

        def release(self):
            record.released += 1
            record.calls.append("lease released")

    class DeviceCommunicator:
        def __init__(self, comm, num_ranks, gin=None):
            record.devcomms.append((comm, num_ranks, gin))
            record.calls.append("devcomm created")
            self.layout, self.gin_context_count = layout, contexts_given

        def devcomm_bytes(self):
            return bytes(range(248))

        def destroy(self):
            record.devcomms.append("destroyed")
            record.calls.append("devcomm destroyed")

    class SymmetricWindow:
        def __init__(self, comm, num_bytes, device, agree=None):
            record.windows.append(num_bytes)
            record.calls.append("window registered")
            self.ptr, self.handle = 0x7000_0000, 0xABC

        def destroy(self):
            record.windows.append("destroyed")
            record.calls.append("window deregistered")

    def all_reduce_max(words, group):
        record.contributed.append(words.tolist())
        record.calls.append("agreement")
        index = len(record.contributed) - 1
        if index < len(peers):
            words.copy_(torch.maximum(words, torch.tensor(peers[index], dtype=words.dtype)))

    monkeypatch.setattr(nccl_gin, "acquire_communicator", lambda group, device: Lease())
    monkeypatch.setattr(nccl_gin, "lsa_team", lambda comm: team)
    monkeypatch.setattr(nccl_gin, "group_lsa_team", lambda group, device: team)
    monkeypatch.setattr(nccl_gin, "devcomm_layout", lambda: layout)
    monkeypatch.setattr(nccl_gin, "comm_gin_types", lambda comm, layout: gin_types)
    monkeypatch.setattr(nccl_gin, "nccl_version", lambda: version)
    monkeypatch.setattr(nccl_gin, "DeviceCommunicator", DeviceCommunicator)
    monkeypatch.setattr(nccl_gin, "SymmetricWindow", SymmetricWindow)
    monkeypatch.setattr(nccl_gin, "_all_reduce_max", all_reduce_max)
    monkeypatch.setattr(nccl_gin, "_device_words", lambda raw, device: (torch.frombuffer(bytearray(raw), dtype=torch.uint8),
                                                                        torch.zeros(2, dtype=torch.int32)))
    return layout


@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "direct"])
def test_transport_requirements_window_and_args(monkeypatch, hybrid):
    record = _Record()
    _fake_nccl(monkeypatch, record)
    with pytest.warns(RuntimeWarning, match="not been validated on RDMA hardware") as caught:
        transport = nccl_gin.NcclGinTransport(_Group(5, 8), 64 << 20, torch.device("cpu"), allow_hybrid_mode=hybrid,
                                              sl_idx=2, num_allocated_qps=0)
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1
    (comm, num_ranks, gin), = record.devcomms
    assert (comm, num_ranks) == (0x1234, 8)
    assert gin == devcomm.GinRequirements(contexts=129 if hybrid else 17, signals=16, counters=1, rail=hybrid,
                                          traffic_class=2)
    assert transport.gin_define == (2 if hybrid else 1) and transport.kernel_define == 1
    assert transport.num_nvlink_ranks == 4 and transport.state.node_ranks == 4
    assert transport.state.num_contexts == 4                      # NCCL gave 4 of those asked for
    window = transport.state.window
    assert record.windows == [window.window_bytes] and window.window_bytes % (2 << 20) == 0
    assert transport.num_bytes == 64 << 20 == window.stage_offset     # the buffer's bytes, then staging
    assert window.stage_offset + 8 * window.half_bytes <= window.window_bytes
    if hybrid:
        assert window.forward_offset >= window.stage_offset + 8 * window.half_bytes
        assert window.inbox_offset >= window.forward_offset + 2 * window.half_bytes
        assert window.inbox_offset + 2 * window.half_bytes <= window.window_bytes
    args = transport.kernel_args()
    assert bytes(args.comm) == bytes(range(248)) and args.window == 0xABC
    assert (args.stage_offset, args.half_bytes, args.recv_offset) == (window.stage_offset, window.half_bytes,
                                                                     window.recv_offset)
    assert (args.num_contexts, args.node_ranks, args.max_put_bytes) == (4, 4, nccl_gin.MAX_PUT_BYTES)
    assert args.gin_comm == transport._device_words[0].data_ptr() and args.done == transport._device_words[1].data_ptr()
    if hybrid:
        assert (args.forward_offset, args.inbox_offset) == (window.forward_offset, window.inbox_offset)
    else:
        assert not hasattr(args, "forward_offset")


@pytest.mark.parametrize("kwargs, fake, match", [
    (dict(), dict(gin_types=(0, 0)), "reports no GIN for hybrid mode"),
    (dict(allow_hybrid_mode=False), dict(gin_types=(0, 3)), "reports no GIN for direct mode"),
    (dict(), dict(gin_types=(3, 0)), "reports no GIN for hybrid mode"),      # GIN, but not on rails
    (dict(), dict(version=22907), r"NCCL >= 2\.30\.3 is needed to set sl_idx=3"),
    (dict(), dict(version=22809), r"NCCL >= 2\.29\.0 is needed to report"),
])
def test_refused_before_anything_is_allocated(monkeypatch, kwargs, fake, match):
    record = _Record()
    _fake_nccl(monkeypatch, record, **fake)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                            # no warning before the refusal
        with pytest.raises(RuntimeError, match=match):
            nccl_gin.NcclGinTransport(_Group(5, 8), 64 << 20, torch.device("cpu"), **kwargs)
    assert record.devcomms == [] and record.windows == [] and record.released == 1


def test_hybrid_nodes_of_more_than_32_ranks_are_refused_before_allocation(monkeypatch):
    """The transport refuses hybrid mode on LSA teams of 33 ranks itself too (`ElasticBuffer` does
    first: tests/test_topology.py), before any warning or allocation; direct mode is made."""
    record = _Record()
    _fake_nccl(monkeypatch, record, team=(33, 7))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(NotImplementedError, match=r"rank 40: hybrid mode supports nodes of at most 32 ranks"):
            nccl_gin.NcclGinTransport(_Group(40, 66), 64 << 20, torch.device("cpu"))
    assert record.devcomms == [] and record.windows == [] and record.released == 1
    with pytest.warns(RuntimeWarning):
        transport = nccl_gin.NcclGinTransport(_Group(40, 66), 64 << 20, torch.device("cpu"), allow_hybrid_mode=False)
    assert transport.gin_define == 1 and transport.state.node_ranks == 33


def test_a_window_too_small_is_refused_before_allocation(monkeypatch):
    record = _Record()
    _fake_nccl(monkeypatch, record)
    with pytest.raises(ValueError, match="too small"):
        nccl_gin.NcclGinTransport(_Group(5, 8), 1 << 20, torch.device("cpu"))
    assert record.devcomms == [] and record.windows == [] and record.released == 1


def test_no_gin_context_given_is_an_error(monkeypatch):
    record = _Record()
    _fake_nccl(monkeypatch, record, contexts_given=0)
    with pytest.warns(RuntimeWarning), pytest.raises(RuntimeError, match="holds no GIN context"):
        nccl_gin.NcclGinTransport(_Group(5, 8), 64 << 20, torch.device("cpu"))
    assert record.devcomms[-1] == "destroyed" and record.windows == [] and record.released == 1


def test_open_nccl_transport_picks_by_the_lsa_team(monkeypatch):
    from types import SimpleNamespace
    record = _Record()
    _fake_nccl(monkeypatch, record, team=(8, 5))
    made = []
    monkeypatch.setattr(nccl_gin, "NcclLsaTransport", lambda *args: made.append(("lsa", args)) or "lsa")
    config = SimpleNamespace(allow_hybrid_mode=True, sl_idx=3, num_allocated_qps=9)
    assert nccl_gin.open_nccl_transport(_Group(5, 8), 64 << 20, torch.device("cpu"), config) == "lsa"
    _fake_nccl(monkeypatch, record, team=(4, 1))
    with pytest.warns(RuntimeWarning):
        transport = nccl_gin.open_nccl_transport(_Group(5, 8), 64 << 20, torch.device("cpu"), config)
    assert isinstance(transport, nccl_gin.NcclGinTransport) and record.devcomms[-1][2].contexts == 9


# ---------------------------------------------------------------------------------------- agreement over the group
def _view(monkeypatch, rank: int, size: int = 8, peers=(), **fake):
    """Rank ``rank``'s creation with faked NCCL (``fake``) and the others' words (``peers``):
    ``(its record, the transport or the exception it raised)``."""
    record = _Record()
    _fake_nccl(monkeypatch, record, peers=peers, **fake)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return record, nccl_gin.NcclGinTransport(_Group(rank, size), 64 << 20, torch.device("cpu"))
        except Exception as error:  # noqa: BLE001 - the test compares what each rank raised
            return record, error


@pytest.mark.parametrize("refusing, cls, own, reason", [
    (dict(gin_types=(0, 0)), RuntimeError, "reports no GIN for hybrid mode", "cannot run GIN in this mode"),
    (dict(team=(4, 2)), ValueError, r"LSA team \(index 2 of 4\)", "does not split the group"),
    (dict(team=(3, 2)), ValueError, "cannot split a group of 8", "does not split the group"),
    (dict(version=22809), RuntimeError, r"NCCL >= 2\.29\.0", "cannot run GIN in this mode"),
], ids=["no-gin", "permuted-team", "unequal-teams", "old-nccl"])
def test_one_rank_refusing_makes_every_rank_raise(monkeypatch, refusing, cls, own, reason):
    """Rank 5 refuses, rank 1 passes its own checks: both raise before the device communicator
    (each rank's view sees the other's words in the agreement's all-reduce)."""
    alone5, _ = _view(monkeypatch, 5, **refusing)
    alone1, _ = _view(monkeypatch, 1)
    (words5,), words1 = alone5.contributed, alone1.contributed[0]     # rank 1 alone goes on to a second
    assert words5[5] > 0 and words5[:5] + words5[6:8] == [0] * 7 and words5[8] == 0
    assert words1 == [0] * 8 + [-129]                    # passed; 129 contexts (hybrid's default)
    record5, error5 = _view(monkeypatch, 5, peers=[words1], **refusing)
    record1, error1 = _view(monkeypatch, 1, peers=[words5])
    assert type(error5) is cls and type(error1) is cls
    assert re.search(own, str(error5)) and not hasattr(error5, "__notes__")     # its own error, alone
    assert str(error1).startswith("rank 1: rank 5 of the group refused the scale-out transport over NCCL's GIN")
    assert reason in str(error1) and "refused on ranks [5]" in str(error1)
    for record in (record5, record1):
        assert record.calls == ["agreement", "lease released"] and record.devcomms == [] and record.windows == []


def test_every_refusing_rank_raises_its_own_error_and_names_the_others(monkeypatch):
    alone2, _ = _view(monkeypatch, 2, team=(4, 3))
    _, error5 = _view(monkeypatch, 5, peers=alone2.contributed, gin_types=(0, 0))
    assert isinstance(error5, RuntimeError) and "reports no GIN" in str(error5)
    assert error5.__notes__ == ["ranks [2, 5] of the group refused the scale-out transport"]
    alone5, _ = _view(monkeypatch, 5, gin_types=(0, 0))
    words = torch.maximum(torch.tensor(alone2.contributed[0]), torch.tensor(alone5.contributed[0])).tolist()
    _, error0 = _view(monkeypatch, 0, peers=[words], team=(4, 0))
    assert isinstance(error0, ValueError)                  # the first refusing rank's class and reason
    assert "rank 0: rank 2 of the group refused" in str(error0) and "refused on ranks [2, 5]" in str(error0)


def test_the_least_qps_and_contexts_are_agreed(monkeypatch):
    """Rank 5 asks for 9 contexts and NCCL gives it 4; another rank asked for 6 and got 3: every
    rank asks NCCL for 6 and its kernels use 3."""
    record = _Record()
    others_ask, others_got = [0] * 8 + [-6], [0] * 8 + [-3]
    _fake_nccl(monkeypatch, record, contexts_given=4, peers=[others_ask, others_got])
    with pytest.warns(RuntimeWarning):
        transport = nccl_gin.NcclGinTransport(_Group(5, 8), 64 << 20, torch.device("cpu"), num_allocated_qps=9)
    assert record.contributed == [[0] * 8 + [-9], [0] * 8 + [-4]]
    assert record.devcomms[0][2].contexts == 6
    assert transport.state.num_contexts == 3 and transport.kernel_args().num_contexts == 3
    assert record.calls == ["agreement", "devcomm created", "agreement", "window registered"]


@pytest.mark.parametrize("peer_code, match", [
    (1, r"rank 5: NCCL could not create the device communicator on ranks \[3\]"),
    (2, r"rank 5: NCCL's device communicator holds no GIN context on ranks \[3\] \(129 asked for\)"),
])
def test_a_device_communicator_failing_elsewhere_stops_every_rank(monkeypatch, peer_code, match):
    record = _Record()
    after = [0] * 8 + [0]
    after[3] = peer_code
    _fake_nccl(monkeypatch, record, peers=[[0] * 8 + [-129], after])
    with pytest.warns(RuntimeWarning), pytest.raises(RuntimeError, match=match):
        nccl_gin.NcclGinTransport(_Group(5, 8), 64 << 20, torch.device("cpu"))
    assert record.contributed[1] == [0] * 8 + [-4]          # this rank got 4 contexts
    assert record.calls == ["agreement", "devcomm created", "agreement", "devcomm destroyed", "lease released"]


def test_release_in_reverse_creation_order(monkeypatch):
    """The window, registered after the device communicator, is deregistered before it is destroyed;
    the lease goes last."""
    record = _Record()
    _fake_nccl(monkeypatch, record)
    monkeypatch.setattr(nccl_gin.NcclGinTransport, "host_barrier", lambda self: record.calls.append("barrier"))
    with pytest.warns(RuntimeWarning):
        transport = nccl_gin.NcclGinTransport(_Group(5, 8), 64 << 20, torch.device("cpu"))
    del record.calls[:]
    transport.destroy()
    assert record.calls == ["barrier", "window deregistered", "devcomm destroyed", "lease released"]
    transport.destroy()                 # again: no NCCL call, the lease (idempotent itself) released again
    assert record.calls[4:] == ["lease released"]
    assert transport.window is None and transport.devcomm is None and transport._device_words == []
