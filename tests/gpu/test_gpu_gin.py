"""The emulated GIN on a GPU (deep_ep/comm/gin.py, comm/gin.cuh): correct users pass, planted bugs fail.

Emulated ranks ping-pong payloads to the next rank and to themselves through the emulated NIC, which
reads sources late, lands puts in a seeded random order and delays every step. A correct user (strong
signal on the last piece, a weak signal per piece, a counter before reusing the source) receives every
word in every round, for every seed; trusting a weak signal for another put, overwriting a source
before flush, or polling a put's first word as its flag, receives wrong words. Run by `EXTRA_FILES=tests/gpu/test_gpu_gin.py bash tools/device_suite.sh extra`.
"""
from __future__ import annotations

import pytest
import torch

from deep_ep.comm import gin

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ROUNDS = 6
# Delays long against a reader's reaction, so a planted bug shows in every run, not by luck.
DELAYS = dict(min_delay_ns=20_000, max_delay_ns=60_000)


def _assert_clean(result, rounds=ROUNDS):
    assert result["errors"] == [(0, 0, 0, 0)] * len(result["errors"]), result
    assert result["rounds_done"] == [rounds] * len(result["rounds_done"]), result
    assert result["mismatched_words"] == [0] * len(result["mismatched_words"]), result


@pytest.mark.parametrize("mode", ["strong", "weak_each", "counter"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_correct_users_receive_every_word(mode, seed):
    _assert_clean(gin.run_selftest(mode, num_ranks=2, num_contexts=2, rounds=ROUNDS, pieces=4, seed=seed, **DELAYS))


@pytest.mark.parametrize("num_ranks, num_contexts", [(1, 1), (4, 3)])
def test_correct_user_on_other_shapes(num_ranks, num_contexts):
    """A rank alone (every put to itself) and four ranks over three contexts."""
    _assert_clean(gin.run_selftest("strong", num_ranks=num_ranks, num_contexts=num_contexts, rounds=ROUNDS,
                                   pieces=2, seed=7, **DELAYS))


def test_a_full_queue_makes_the_issuer_wait():
    """Eight pieces into queues two deep: issuers wait for the NIC, and every word still arrives."""
    result = gin.run_selftest("strong", num_ranks=2, num_contexts=1, rounds=ROUNDS, pieces=8, queue_depth=2, seed=3,
                              min_delay_ns=2_000, max_delay_ns=8_000)
    _assert_clean(result)
    assert result["full_waits"] > 0, result


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_trusting_a_weak_signal_for_another_put_fails(seed):
    """A weak signal covers its own put only: the NIC lands it first and the other piece later."""
    result = gin.run_selftest("weak_last", num_ranks=2, num_contexts=2, rounds=ROUNDS, pieces=2, seed=seed, **DELAYS)
    assert result["errors"] == [(0, 0, 0, 0)] * 2 and result["rounds_done"] == [ROUNDS] * 2, result
    # the piece landing last after the signal a rank waited for last is read before it lands
    assert all(bad > 0 for bad in result["bad_rounds"]) and sum(result["mismatched_words"]) > 0, result


@pytest.mark.parametrize("num_ranks", [1, 2])
def test_reusing_a_source_before_flush_fails(num_ranks):
    """The NIC reads a source when it executes the put: overwritten right after issue, every round arrives wrong."""
    result = gin.run_selftest("no_flush", num_ranks=num_ranks, num_contexts=2, rounds=ROUNDS, pieces=2, seed=5, **DELAYS)
    assert result["errors"] == [(0, 0, 0, 0)] * num_ranks, result
    assert result["bad_rounds"] == [ROUNDS] * num_ranks, result


def test_polling_a_puts_first_word_fails():
    """A put's words land in no order: a reader polling each 64 KiB payload's first word (no signal)
    and then reading the rest reads words not landed yet in some rounds. The same puts with a strong
    signal waited for arrive whole."""
    bad_rounds = 0
    for seed in (0, 1, 2):
        options = dict(num_ranks=2, num_contexts=2, rounds=12, payload_words=16384, pieces=1, seed=seed, **DELAYS)
        _assert_clean(gin.run_selftest("strong", **options), rounds=12)
        result = gin.run_selftest("first_word", **options)
        assert result["errors"] == [(0, 0, 0, 0)] * 2 and result["rounds_done"] == [12] * 2, result
        bad_rounds += sum(result["bad_rounds"])
    assert bad_rounds > 0


def test_a_wait_that_times_out_records_rank_peer_and_phase():
    """Nothing signals: each rank's first wait (for its left neighbour, on signal 0) gives up and its
    window's error record names it, the neighbour and the phase; no round completes."""
    from deep_ep.backends.gpu.abi import ERR_TIMEOUT
    result = gin.run_selftest("no_signal", num_ranks=3, num_contexts=2, rounds=2, pieces=2, seed=0,
                              min_delay_ns=1_000, max_delay_ns=2_000, timeout_s=0.05)
    assert result["errors"] == [(ERR_TIMEOUT, rank, (rank + 2) % 3, gin.SELFTEST_PHASE) for rank in range(3)], result
    assert result["rounds_done"] == [0, 0, 0], result
