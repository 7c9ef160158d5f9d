"""``python -m deep_ep bench --primitive``: the options, the refusal without a GPU, and the pure
helpers of `deep_ep.bench.primitives` (cases, byte counts, SMs held, floor and overlap arithmetic,
the report lines and the JSON result). The GPU runner itself runs on the device
(``bash tools/device_suite.sh primbench``)."""
from __future__ import annotations

import argparse
import json

import pytest
import torch

from deep_ep.__main__ import build_parser, main
from deep_ep.bench import primitives as prim
from deep_ep.bench.report import write_json

MIB = 1 << 20


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", *argv])


def test_the_flag_takes_each_primitive_and_all():
    assert _args().primitive is None
    for name in ("pp", "agrs", "engram", "all"):
        args = _args("--primitive", name, "--virtual-ranks", "4", "--iters", "7", "--json", "out.json")
        assert (args.primitive, args.virtual_ranks, args.iters, args.json) == (name, 4, 7, "out.json")


def test_an_unknown_primitive_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        _args("--primitive", "allgather")
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_the_bench_refuses_without_cuda():
    with pytest.raises(SystemExit, match="--primitive runs on the GPU"):
        main(["bench", "--primitive", "pp"])
    with pytest.raises(SystemExit, match="--primitive runs on the GPU"):
        main(["bench", "--primitive", "all", "--virtual-ranks", "4"])


@pytest.mark.parametrize("extra, match", [(["--device", "cpu"], "drop --device cpu"),
                                          (["--legacy-ll"], "cannot be combined with --legacy-ll"),
                                          (["--eplb", "8"], "cannot be combined with --eplb"),
                                          (["--sm-sweep", "8,16"], "cannot be combined with --sm-sweep"),
                                          (["--virtual-ranks", "0"], "must be >= 1"),
                                          (["--iters", "0"], "--iters must be >= 1")])
def test_bad_combinations_are_refused_before_cuda(extra, match):
    with pytest.raises(SystemExit, match=match):
        prim.prepare(_args("--primitive", "agrs", *extra))


def test_the_cases_and_their_sizes():
    assert [(c.op, c.num_bytes) for c in prim.cases("pp")] == [("send_recv", 64 << 10), ("send_recv", MIB),
                                                               ("send_recv", 16 * MIB)]
    assert [(c.op, c.num_bytes) for c in prim.cases("agrs")] == [
        ("all_gather", MIB), ("all_gather", 16 * MIB), ("reduce_scatter", MIB), ("reduce_scatter", 16 * MIB)]
    engram = prim.cases("engram")
    assert [(c.dtype, c.tokens, c.entries, c.hidden) for c in engram] == [
        ("bf16", 128, 4, 7168), ("bf16", 128, 16, 7168), ("fp8", 128, 4, 7168)]
    assert prim.cases("pp")[0].label == "pp send+recv 64 KiB bf16 per rank"
    assert prim.cases("agrs")[3].label == "agrs reduce_scatter 16 MiB bf16 (input per rank)"
    assert engram[2].label == "engram fetch 128 tokens x 4 entries, hidden 7168 fp8"
    with pytest.raises(ValueError, match="unknown primitive"):
        prim.cases("nvshmem")


def test_reduce_scatter_rows_are_whole_chunks_per_rank():
    assert prim.reduce_scatter_rows(MIB, 4) == 512
    assert prim.reduce_scatter_rows(MIB, 3) == 510   # 512 rows rounded down to a multiple of 3
    assert prim.reduce_scatter_rows(1000, 8) == 8    # at least one row per rank


def test_bytes_per_call():
    pp, gather_1m, _, scatter_1m, _ = prim.cases("pp")[1], *prim.cases("agrs")
    bf16, _, fp8 = prim.cases("engram")
    assert prim.bytes_per_rank(pp, 4) == MIB
    assert prim.bytes_per_rank(gather_1m, 4) == 4 * MIB          # the tensor to every rank, its own row included
    assert prim.bytes_per_rank(gather_1m, 1) == MIB
    assert prim.bytes_per_rank(scatter_1m, 4) == MIB             # 512 rows x 1024 bf16
    assert prim.bytes_per_rank(scatter_1m, 3) == 510 * 2048
    assert prim.bytes_per_rank(bf16, 4) == 128 * 4 * 7168 * 2
    assert prim.bytes_per_rank(fp8, 4) == 128 * 4 * (7168 + 4 * 56)   # rows and their float32 factors
    # emulated ranks share one GPU: every rank's bytes; one rank per GPU: its own
    assert prim.process_bytes(gather_1m, 4, emulated=True) == 16 * MIB
    assert prim.process_bytes(gather_1m, 4, emulated=False) == 4 * MIB
    assert prim.peer_bytes(gather_1m, 4) == 3 * MIB
    assert prim.peer_bytes(pp, 2) == MIB
    assert prim.peer_bytes(pp, 1) == 0


def test_sms_held():
    pp_small, pp_1m, _ = prim.cases("pp")
    gather, _, scatter, _ = prim.cases("agrs")
    engram_4, engram_16, _ = prim.cases("engram")
    assert prim.sms_held(gather, 0, 132) == 0 and prim.sms_held(scatter, 8, 132) == 0
    # emulated ranks copy AGRS pieces with a kernel of 64 KiB per block pass, capped at 132 / R SMs
    assert prim.sms_held(gather, 0, 132, emulated_ranks=4) == 16          # 1 MiB
    assert prim.sms_held(scatter, 0, 132, emulated_ranks=4) == 4          # 1 MiB input: 256 KiB chunks
    assert prim.sms_held(prim.cases("agrs")[1], 0, 132, emulated_ranks=4) == 33   # 16 MiB: capped
    assert prim.sms_held(pp_1m, 0, 132) == 0                  # 0: the copy engine
    assert prim.sms_held(pp_1m, 24, 132) == 24
    assert prim.sms_held(pp_small, 64, 132) == 8             # 64 KiB is 8 steps of 8 KiB
    assert prim.sms_held(engram_4, 0, 132) == 64             # 512 rows, 8 per block
    assert prim.sms_held(engram_16, 0, 132) == 132           # 256 blocks, capped at the device's SMs


def test_plain_copies_mirror_the_calls_copy_engine_moves():
    """(source offset, target offset, bytes) of the copy-engine moves one rank's call queues."""
    pp_1m = prim.cases("pp")[1]
    gather_1m, _, scatter_1m, _ = prim.cases("agrs")
    assert prim.plain_copies(pp_1m, 4) == [(0, 0, MIB), (MIB, MIB, MIB)]   # into the ring slot, then out of one
    assert prim.plain_copies(gather_1m, 4) == [(0, 0, MIB), (0, MIB, MIB), (0, 2 * MIB, MIB), (0, 3 * MIB, MIB)]
    assert prim.plain_copies(gather_1m, 1) == [(0, 0, MIB)]
    chunk = 170 * 2048                                                     # 510 rows over 3 ranks
    assert prim.plain_copies(scatter_1m, 3) == [(0, 0, chunk), (chunk, chunk, chunk), (2 * chunk, 2 * chunk, chunk)]
    for case in (gather_1m, scatter_1m):   # the same bytes as the call's
        assert sum(size for _, _, size in prim.plain_copies(case, 4)) == prim.bytes_per_rank(case, 4)
    assert prim.plain_copies(prim.cases("engram")[0], 4) == []             # a gather kernel: no copy engine


def test_plain_copies_queue_their_moves_between_buffers_of_their_own():
    from deep_ep.bench.primitives_timing import PlainCopies
    moves = prim.plain_copies(prim.cases("agrs")[0], 4)
    copies = PlainCopies(moves, torch.device("cpu"))
    assert copies.source.numel() == MIB and copies.target.numel() == 4 * MIB
    source, target = copies.source.data_ptr(), copies.target.data_ptr()
    assert copies.moves == [(target + rank * MIB, source, MIB) for rank in range(4)]


def test_the_overlap_floor_is_the_matmul_beside_plain_copies():
    """`Timer.overlap` with made-up rounds: the matmul alone 100 us, beside the call 112 us, beside
    the plain copies 109 us: slowdown +12%, the copies' +9%, the excess 112 / 109 - 1. Rounds of 20
    calls of 25 us are lengthened to 2 ms (80 calls, 20 matmuls), the three kinds taking turns."""
    from deep_ep.bench.primitives_timing import OVERLAP_ROUNDS, PlainCopies, Timer
    compute = prim.MATMULS[0]
    copies = [PlainCopies(prim.plain_copies(prim.cases("agrs")[0], 2), torch.device("cpu")) for _ in range(2)]
    calls = [lambda: None, lambda: None]
    seen = []

    def fake_round(round_calls, iters, matmul=None, count=0):
        kind = "copies" if round_calls is copies else "call" if round_calls is calls else "alone"
        seen.append((kind, count) if kind == "alone" else (kind, count, iters))
        matmul_us = {"alone": 100.0, "call": 112.0, "copies": 109.0}[kind]
        transfer_us = {"call": 30.0, "copies": 12.0}.get(kind)
        out = {"matmul_us": matmul_us, "both_us": max(matmul_us * count, (transfer_us or 0.0) * iters),
               "host_us": 1.0, "gate_us": 5000.0}
        if transfer_us:
            out["transfer_us"] = transfer_us
        return out
    timer = Timer.__new__(Timer)
    timer.round = fake_round
    timer.host_per_call_us = {"transfer": 10.0}     # the host queues 2 x 80 calls well within a gate
    figures, beside = timer.overlap(calls, 20, 25.0, compute, copies)
    assert seen[:3] == [("alone", 1), ("alone", 8), ("call", 0, 80)]      # warm-up matmul, probe, host trial
    assert figures["calls_per_round"] == 80 and figures["matmuls_per_round"] == 20   # 80 x 25 us over 100 us
    assert seen[3:] == [("alone", 20), ("call", 20, 80), ("copies", 20, 80)] * OVERLAP_ROUNDS
    assert figures["host_bound"] is False
    assert figures["slowdown_percent"] == pytest.approx(12.0)
    plain = figures["plain_copy"]
    assert plain["copies_per_call"] == 2 and plain["bytes"] == 2 * 2 * MIB and plain["copy_both_us"] == 12.0
    assert plain["slowdown_percent"] == pytest.approx(9.0)
    assert figures["excess_percent"] == pytest.approx((112.0 / 109.0 - 1) * 100)
    assert len(beside) == 2 * OVERLAP_ROUNDS
    seen.clear()
    alone_only, _ = timer.overlap(calls, 20, 25.0, compute)
    assert seen[:2] == [("alone", 8), ("call", 0, 80)]                      # warmed up once per shape
    assert alone_only["plain_copy"] is None and alone_only["excess_percent"] is None
    # a slow host: 2 ranks x 2 ms per call fill half the longest gate (less its minimum) with 61 calls
    timer.host_per_call_us = {"transfer": 2000.0}
    assert timer.overlap(calls, 20, 25.0, compute)[0]["calls_per_round"] == 61
    timer.host_per_call_us = {"transfer": 50000.0}                          # never fewer than --iters
    assert timer.overlap(calls, 20, 25.0, compute)[0]["calls_per_round"] == 20


def test_overlap_rounds_shrink_until_the_host_keeps_up():
    """A round the host cannot queue within its gate (a stream's queue full while the gate holds
    the GPU) halves the calls per round, never below --iters; its time per call is not kept; a round
    still host-bound leaves no verdict on the bound."""
    from deep_ep.bench.primitives_timing import Timer
    compute = prim.MATMULS[0]
    calls, trials = [lambda: None], []

    def fake_round(round_calls, iters, matmul=None, count=0):
        if round_calls and not count:
            trials.append(iters)
            timer.host_per_call_us["transfer"] = 999.0
        host_bound = bool(round_calls) and iters > limit
        out = {"matmul_us": 100.0 if not round_calls else 300.0, "both_us": 1000.0,
               "host_us": 9000.0 if host_bound else 1.0, "gate_us": 5000.0}
        if round_calls:
            out["transfer_us"] = 8.0
        return out
    timer = Timer.__new__(Timer)
    timer.round = fake_round
    timer.host_per_call_us = {"transfer": 1.0}
    limit = 100
    figures, _ = timer.overlap(calls, 20, 8.0, compute)      # 2 ms of 8 us calls: 250, halved to 62
    assert trials == [250, 125, 62] and figures["calls_per_round"] == 62 and figures["host_bound"] is False
    assert timer.host_per_call_us["transfer"] == 999.0      # only the fitting round's time is kept
    trials.clear()
    limit = 10                                               # host-bound even at --iters
    figures, _ = timer.overlap(calls, 20, 8.0, compute)
    assert trials == [245, 122, 61, 30] and figures["calls_per_round"] == 20 and figures["host_bound"] is True
    case = prim.cases("agrs")[0]
    row = _row(case, 0, 1.0)
    row["overlap"] = {compute.key: dict(figures, slowdown_percent=200.0)}
    assert prim.bound_verdict(row, compute, False) is None
    assert "not judged: the host queued a round" in "\n".join(prim.format_case(row))


def test_overlap_rounds_last_long_enough_for_many_matmuls():
    from deep_ep.bench.primitives_timing import MAX_OVERLAP_ITERS, overlap_iters
    assert overlap_iters(20, 8.0) == 250 and overlap_iters(20, 7.0) == 286   # 2 ms of calls, rounded up
    assert overlap_iters(20, 500.0) == 20                                    # --iters already lasts longer
    assert overlap_iters(20, 0.01) == MAX_OVERLAP_ITERS
    assert overlap_iters(20, float("nan")) == 20 and overlap_iters(20, 0.0) == 20


def test_floor_and_overlap_arithmetic():
    assert prim.bandwidth_gbps(4 * MIB, 10.0) == pytest.approx(4 * MIB / 1e4)
    assert prim.bandwidth_gbps(MIB, None) is None and prim.bandwidth_gbps(MIB, float("nan")) is None
    assert prim.ratio(30.0, 12.0) == pytest.approx(2.5)
    assert prim.ratio(30.0, None) is None
    assert prim.slowdown_percent(105.0, 100.0) == pytest.approx(5.0)
    assert prim.slowdown_percent(98.0, 100.0) == pytest.approx(-2.0)
    assert prim.matmul_count(20 * 15.0, 90.0) == 3           # rounded down: every matmul beside the transfer
    assert prim.matmul_count(20 * 8.0, 90.0) == 1            # a round shorter than one matmul: one
    assert prim.matmul_count(1e9, 1.0) == prim.MAX_MATMULS_PER_ROUND
    assert prim.matmul_count(100.0, float("nan")) == 1 and prim.matmul_count(100.0, 0.0) == 1


def test_the_overlap_matmuls():
    """The compute-bound matmul does far more flops per byte than an H200's compute / HBM ratio
    (about 990 Tflop/s over 4.8 TB/s: 206); the memory-bound one far fewer."""
    compute, memory = prim.MATMULS
    assert (compute.kind, compute.key, memory.kind, memory.key) == ("compute-bound", "compute_bound",
                                                                     "memory-bound", "memory_bound")
    assert compute.rows >= 2048 and compute.shape == "[2048, 4096] x [4096, 4096]"

    def flops_per_byte(matmul):
        flops = 2 * matmul.rows * matmul.width * matmul.width
        return flops / (2 * (2 * matmul.rows * matmul.width + matmul.width * matmul.width))
    assert flops_per_byte(compute) > 4 * 206 and flops_per_byte(memory) < 206 / 3


def test_the_gate_scales_with_calls_and_host_time():
    """The gate's expected host time: calls x the slowest time per call seen in the case, a generous
    guess before any was measured."""
    from deep_ep.bench import primitives_timing
    timer = primitives_timing.Timer.__new__(primitives_timing.Timer)
    timer.host_per_call_us = {}
    guess = primitives_timing.HOST_GUESS_US
    assert timer._host_us("transfer", 8) == 8 * guess["transfer"]
    assert timer._host_us("compute_bound", 3) == 3 * guess["matmul"]
    timer.host_per_call_us = {"transfer": 450.0, "memory_bound": 12.0}
    assert timer._host_us("transfer", 4 * 20) == pytest.approx(36_000.0)   # 4 ranks x 20 calls
    assert timer._host_us("memory_bound", 10) == pytest.approx(120.0)


def _overlap(matmul, slowdown, copy_slowdown=None):
    """An overlap entry; with ``copy_slowdown``, the matmul beside plain copies (2 per rank per call)."""
    plain, excess = None, None
    if copy_slowdown is not None:
        plain = {"copies_per_call": 2, "bytes": 4 * 2 * MIB, "copy_both_us": 9.5, "matmul_both_us": 100.0 + copy_slowdown,
                 "round_us": 401.0, "slowdown_percent": copy_slowdown}
        excess = prim.slowdown_percent(100.0 + slowdown, 100.0 + copy_slowdown)
    return {"matmul_rows": matmul.rows, "matmul_width": matmul.width, "matmuls_per_round": 4, "matmul_us": 100.0,
            "matmul_both_us": 100.0 + slowdown, "transfer_both_us": 21.0, "matmul_round_us": 400.0,
            "both_round_us": 401.0 + 4 * slowdown, "slowdown_percent": slowdown, "plain_copy": plain,
            "excess_percent": excess}


def _row(case, sms, slowdown, check="check passed", time_us=20.0, memory_slowdown=30.0, emulated=False,
         copy_slowdowns=(None, None)):
    nbytes = prim.process_bytes(case, 4, True)
    compute, memory = prim.MATMULS
    return {"primitive": case.primitive, "op": case.op, "label": case.label, "time_us": time_us, "bytes": nbytes,
            "gbps": prim.bandwidth_gbps(nbytes, time_us), "floor_us": 10.0, "floor_ratio": prim.ratio(time_us, 10.0),
            "sms_held": sms, "emulated": emulated, "host_bound": False, "check": check,
            "overlap": {compute.key: _overlap(compute, slowdown, copy_slowdowns[0]),
                        memory.key: _overlap(memory, memory_slowdown, copy_slowdowns[1])}}


def test_report_lines():
    gather = prim.cases("agrs")[0]
    lines = prim.format_case(_row(gather, 0, 2.0))
    assert lines[0].startswith("agrs all_gather 1 MiB bf16 per rank: 20.0 us/call, 16.78 MB, 838.9 GB/s; "
                               "copy floor 10.0 us (ratio 2.00); SMs held 0 per rank (copy engines)")
    assert lines[1] == ("  overlap, compute-bound matmul [2048, 4096] x [4096, 4096] bf16 x 4 per round: alone "
                        "100.0 us each; beside the transfer 102.0 us each (transfer 21.0 us/call, alone 20.0); "
                        "round 409.0 us; compute-bound matmul slowdown +2.0% (within the 5% bound of a zero-SM "
                        "transfer)")
    assert lines[2] == ("  overlap, memory-bound matmul [64, 7168] x [7168, 7168] bf16 x 4 per round: alone 100.0 "
                        "us each; beside the transfer 130.0 us each (transfer 21.0 us/call, alone 20.0); round "
                        "521.0 us; memory-bound matmul slowdown +30.0% (informational: it shares HBM bandwidth "
                        "with the transfer's copies)")
    assert lines[3] == "  check passed"
    assert "OVER the 5% bound" in prim.format_case(_row(gather, 0, 7.5))[1]
    scatter = prim.cases("agrs")[2]
    scatter_lines = prim.format_case(_row(scatter, 0, 7.5))
    assert "the fp32 sum in the handle runs one kernel" in scatter_lines[0]
    assert "5% bound" not in scatter_lines[1] and "no bound: the sum in the handle runs on SMs" in scatter_lines[1]
    pp = prim.cases("pp")[0]
    pp_lines = prim.format_case(_row(pp, 1, 30.0, check="check: FAILED: pp_recv's tensor: 3 of 65536 bytes differ"))
    assert "SMs held 1 per rank" in pp_lines[0] and "5% bound" not in pp_lines[1]   # the bound is for zero-SM paths
    assert pp_lines[3] == "  check: FAILED: pp_recv's tensor: 3 of 65536 bytes differ"
    missing = prim.format_case(_row(pp, 1, 0.0, check=None, time_us=float("nan")))
    assert "nan us/call" not in missing[0] and "n/a us/call" in missing[0] and len(missing) == 3


def test_report_lines_of_the_plain_copy_floor():
    """Emulated ranks: the bound judges the call's slowdown in excess of the plain copies'; one rank
    per GPU: the slowdown itself, the floor informational."""
    gather = prim.cases("agrs")[0]
    lines = prim.format_case(_row(gather, 0, 20.0, emulated=True, copy_slowdowns=(17.6, 40.0)))
    assert len(lines) == 6
    assert lines[1].endswith("compute-bound matmul slowdown +20.0% (emulated ranks: the 5% bound judges the excess "
                             "over a plain copy, below)")
    assert lines[2] == ("    plain copy floor: 2 cuMemcpyDtoDAsync per rank per call (8.39 MB per call on this GPU, "
                        "9.5 us/call beside the matmul); compute-bound matmul 117.6 us each; matmul slowdown beside a "
                        "plain copy-engine copy of the same bytes: +17.6%; the call's slowdown in excess of it: +2.0% "
                        "(within the 5% bound of a zero-SM transfer, judged on the excess: emulated ranks share one "
                        "GPU's HBM and copy engines)")
    assert "informational: it shares HBM bandwidth" in lines[3]
    assert lines[4].endswith("matmul slowdown beside a plain copy-engine copy of the same bytes: +40.0%; the call's "
                             "slowdown in excess of it: -7.1%")
    over = prim.format_case(_row(gather, 0, 20.0, emulated=True, copy_slowdowns=(8.0, 40.0)))
    assert "excess of it: +11.1% (OVER the 5% bound of a zero-SM transfer, judged on the excess" in over[2]
    ep1 = prim.format_case(_row(gather, 0, 2.0, copy_slowdowns=(1.0, 25.0)))
    assert ep1[1].endswith("slowdown +2.0% (within the 5% bound of a zero-SM transfer)")
    assert ep1[2].endswith("the call's slowdown in excess of it: +1.0% (informational: at one rank per GPU the "
                           "bound judges the slowdown)")
    assert "OVER the 5% bound" in prim.format_case(_row(gather, 0, 7.5, copy_slowdowns=(6.0, 25.0)))[1]
    scatter = prim.cases("agrs")[2]
    scatter_lines = prim.format_case(_row(scatter, 0, 20.0, emulated=True, copy_slowdowns=(10.0, 25.0)))
    assert "no bound: the sum in the handle runs on SMs" in scatter_lines[1]
    assert scatter_lines[2].endswith("excess of it: +9.1%") and "5% bound" not in scatter_lines[2]


def test_the_bound_verdict():
    compute, memory = prim.MATMULS
    gather, _, scatter, _ = prim.cases("agrs")
    emulated = _row(gather, 0, 20.0, emulated=True, copy_slowdowns=(17.6, 40.0))
    assert prim.bound_verdict(emulated, compute, True) == {"judged_on": "excess", "percent": pytest.approx(
        (120.0 / 117.6 - 1) * 100), "within": True}
    assert prim.bound_verdict(emulated, compute, False) == {"judged_on": "slowdown", "percent": 20.0, "within": False}
    assert prim.bound_verdict(emulated, memory, True) is None
    assert prim.bound_verdict(_row(scatter, 0, 1.0, copy_slowdowns=(0.5, 1.0)), compute, False) is None
    assert prim.bound_verdict(_row(prim.cases("engram")[0], 64, 1.0), compute, False) is None
    assert prim.bound_verdict(_row(gather, 0, 1.0), compute, True) is None   # no floor measured: no verdict


def test_json_result(tmp_path):
    rows = [_row(prim.cases("agrs")[0], 0, 1.0, emulated=True, copy_slowdowns=(-3.0, 28.0))]
    result = prim.build_result(["agrs"], rows, [], runner="gpu/emulated x4", device="H200", num_ranks=4,
                               emulated=True, iters=20, checked=True)
    path = tmp_path / "bench_primitives.json"
    write_json(str(path), result)
    back = json.loads(path.read_text())
    assert back["mode"] == "primitives" and back["primitives"] == ["agrs"] and back["num_ranks"] == 4
    assert back["check"] == {"enabled": True, "passed": True, "failures": []}
    assert back["cases"][0]["overlap"]["compute_bound"]["slowdown_percent"] == 1.0
    assert back["cases"][0]["overlap"]["memory_bound"]["slowdown_percent"] == 30.0
    compute = back["cases"][0]["overlap"]["compute_bound"]
    assert compute["plain_copy"]["slowdown_percent"] == -3.0 and compute["plain_copy"]["copies_per_call"] == 2
    assert compute["excess_percent"] == pytest.approx((101.0 / 97.0 - 1) * 100)
    assert compute["bound"] == {"judged_on": "excess", "percent": pytest.approx(4.1237, abs=1e-3), "within": True}
    assert back["cases"][0]["overlap"]["memory_bound"]["bound"] is None
    assert back["zero_sm_slowdown_bound_percent"] == 5.0
    assert back["zero_sm_bound_judges"] == "excess over a plain copy-engine copy"
    assert back["overlap_matmuls"] == {"compute_bound": {"rows": 2048, "width": 4096, "dtype": "bf16"},
                                       "memory_bound": {"rows": 64, "width": 7168, "dtype": "bf16"}}
    failed = prim.build_result(["pp"], [], ["rank 1, pp: differs"], runner="r", device="d", num_ranks=2,
                               emulated=True, iters=5, checked=True)
    assert failed["check"]["passed"] is False and failed["zero_sm_bound_judges"] == "excess over a plain copy-engine copy"
    ep1 = prim.build_result(["agrs"], [_row(prim.cases("agrs")[0], 0, 6.0, copy_slowdowns=(1.0, 2.0))], [],
                            runner="r", device="d", num_ranks=1, emulated=False, iters=5, checked=True)
    assert ep1["zero_sm_bound_judges"] == "slowdown"
    assert ep1["cases"][0]["overlap"]["compute_bound"]["bound"] == {"judged_on": "slowdown", "percent": 6.0,
                                                                    "within": False}


def test_the_check_names_the_first_differing_byte(monkeypatch):
    from deep_ep.bench import primitives_gpu
    monkeypatch.setattr(primitives_gpu, "wait", lambda stream=None: None)   # CPU tensors: nothing to wait for
    want = torch.arange(64, dtype=torch.int16).to(torch.bfloat16).reshape(4, 16)
    assert primitives_gpu._compare(want.clone(), want, "out") is None
    got = want.clone()
    got.view(torch.uint8).view(-1)[37] ^= 0x10
    got.view(torch.uint8).view(-1)[90] ^= 0x01
    expected_byte = int(want.view(torch.uint8).view(-1)[37])
    assert primitives_gpu._compare(got, want, "pp_recv's tensor") == (
        f"pp_recv's tensor: 2 of 128 bytes differ, first at byte 37 (got {expected_byte ^ 0x10}, "
        f"expected {expected_byte})")
    assert "shape (2, 32)" in primitives_gpu._compare(want.reshape(2, 32), want, "out")
    assert primitives_gpu._compare(None, None, "sf") is None
    assert primitives_gpu._compare(None, want, "sf") == "sf: missing"
