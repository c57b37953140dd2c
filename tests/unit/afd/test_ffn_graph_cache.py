"""The FFN rank's CUDA-graph cache policy (vllm.afd.ffn_runner), without a GPU: which
steps are captured, replayed or run eager, and when the cache is dropped. The capture
itself is replaced by a recorder; the GPU oracle covers real graphs."""

from __future__ import annotations

import contextlib
import time

import torch

from vllm.afd import ffn_runner
from vllm.afd.protocol import MSG_STEP, Control, ubatch_flags
from vllm.distributed.afd.base import StepPeer


class _Graph:
    def __init__(self):
        self.replays = 0

    def replay(self):
        self.replays += 1


class _Runner(ffn_runner.FFNModelRunner):
    def __init__(self, max_tokens=16, max_count=2, window=16):
        # Only what the cache policy reads (no model, no connector start).
        self.graphs_enabled = True
        self.step_rule = ffn_runner.CaptureRule(window, max_tokens, max_count)
        self.max_pass_tokens = 64
        self.graphs, self._graph_gen = {}, -1
        self.graph_replays = self.steps_served = self.batched_steps = self.ubatched_steps = 0
        self.schedule, self.pingpong_steps = "join", 0
        self.connector = type("C", (), {"generation": 0})()
        self.dtype, self.hidden_size, self.modules, self.gates = torch.float32, 4, {0: None}, {}
        self.eager, self.captured = [], []
        self.profiler = None
        self._lost, self.peers_lost = set(), 0

    def _step_body(self, ready, capture):
        self.eager.append(tuple((p.rank, p.control.num_tokens) for p in ready))
        return 0.0, 0.0

    def _ubatched_body(self, first, peers, count, capture):
        assert not capture
        while len(peers) < count:  # the TCP way: later controls arrive on the way
            peers.append(self._next_ubatch(first, len(peers), count))
        self.eager.append(("ubatched", *(p.control.num_tokens for p in peers)))
        return 0.0, 0.0

    def _interleaved_body(self, ready, capture):
        assert not capture
        self.eager.append(("pingpong", *((p.rank, p.control.num_tokens) for p in ready)))
        return 0.0, 0.0

    def _capture(self, key, body):
        self.captured.append(key)
        self.graphs[key] = _Graph()


class _UBatchConnector:
    """Later micro-batches' controls (token counts 2, 2, ...), up front or not."""

    generation = 0

    def __init__(self, upfront: bool, tokens=(2,)):
        self.ubatch_controls_upfront = upfront
        self.tokens = list(tokens)
        self.asked = 0

    def recv_control(self, first):
        i = self.asked % len(self.tokens)
        self.asked += 1
        return Control(MSG_STEP, first.control.step_id, self.tokens[i], ubatch_flags(i + 1, 2))


def _ubatched(n0, step_id=1):
    return [StepPeer(0, Control(MSG_STEP, step_id, n0, ubatch_flags(0, 2)))]


def _step(*pairs):
    return [StepPeer(r, Control(MSG_STEP, 1, n)) for r, n in pairs]


def test_a_step_is_captured_the_second_time_and_replayed_after():
    r = _Runner()
    for _ in range(2):
        r._run_step(_step((0, 4)))
    assert r.eager == [((0, 4),)] * 2 and r.captured == [((0, 4),)]
    for _ in range(3):
        r._run_step(_step((0, 4)))
    assert len(r.eager) == 2 and r.graphs[((0, 4),)].replays == 3 and r.graph_replays == 3
    assert r.steps_served == 5


def test_a_shape_that_comes_back_once_a_generation_stays_eager():
    # decode.py's generations on one H200: the first prefill step caught the first prompt
    # (64 tokens), the next one the other 15 (960, above the graph limit), then 127 decode
    # steps of 16 tokens. Captured: the decode steps only; the 64-token step came back
    # 129 passes later each time and stayed eager, where it used to be captured (a
    # 50-75 ms stall) inside a timed generation.
    r = _Runner(max_tokens=512, max_count=64, window=16)
    r.max_pass_tokens = 1024  # the engine's max_num_batched_tokens
    for _ in range(3):
        r._run_step(_step((0, 64)))
        r._run_step(_step((0, 960)))
        for _ in range(127):
            r._run_step(_step((0, 16)))
    assert r.captured == [((0, 16),)]
    assert r.eager.count(((0, 64),)) == 3 and r.eager.count(((0, 16),)) == 2
    assert r.graphs[((0, 16),)].replays == 3 * 127 - 2


def test_the_window_counts_every_pass_and_ranks_taking_turns_recur():
    r = _Runner(max_tokens=512, max_count=64, window=4)
    r._run_step(_step((0, 8)))
    for _ in range(4):
        r._run_step(_step((0, 2)))  # captured on its second pass, replayed after
    r._run_step(_step((0, 8)))  # 5 passes after its last eager one: over the window
    assert ((0, 8),) not in r.captured
    r._run_step(_step((0, 2)))
    r._run_step(_step((0, 2)))
    r._run_step(_step((0, 8)))  # 3 passes after: captured
    # Two attention ranks taking turns: each one's key recurs every other pass.
    for _ in range(2):
        r._run_step(_step((1, 4)))
        r._run_step(_step((2, 4)))
    assert r.captured == [((0, 2),), ((0, 8),), ((1, 4),), ((2, 4),)]


def test_a_zero_window_never_captures():
    r = _Runner(window=0)
    for _ in range(4):
        r._run_step(_step((0, 4)))
    assert r.captured == [] and len(r.eager) == 4


def test_the_window_grows_with_the_attention_ranks_served():
    assert ffn_runner.graph_window({}, 1) == 16
    assert ffn_runner.graph_window({}, 3) == 48
    assert ffn_runner.graph_window({"ffn_cuda_graph_window": 4}, 3) == 4


def test_key_is_the_ranks_and_their_token_counts():
    r = _Runner()
    for pairs in [((0, 4),), ((0, 4), (1, 4)), ((1, 4),), ((0, 4), (1, 4))]:
        r._run_step(_step(*pairs))
    assert r.captured == [((0, 4), (1, 4))]
    assert r.batched_steps == 2


def test_interleaved_steps_are_keyed_by_their_ordered_ranks_apart_from_joined_ones():
    # ffn_schedule pingpong: the ranks' steps served interleaved are one graph per ordered
    # composition, never the joined pass's graph of the same ranks and counts.
    r = _Runner(max_count=8)
    r._run_step(_step((0, 4), (1, 4)))  # joined (the default schedule)
    r.schedule = "pingpong"
    for pairs in [((0, 4), (1, 4)), ((1, 4), (0, 4)), ((0, 4), (1, 4)), ((0, 4), (1, 4))]:
        r._run_step(_step(*pairs))
    key = ("pingpong", (0, 4), (1, 4))
    assert r.eager == [((0, 4), (1, 4)), key, ("pingpong", (1, 4), (0, 4)), key]
    assert r.captured == [key] and r.graphs[key].replays == 1
    assert (r.pingpong_steps, r.batched_steps, r.steps_served) == (4, 1, 5)
    r._run_step(_step((0, 4)))  # one rank ready alone: a plain pass
    assert r.eager[-1] == ((0, 4),) and r.pingpong_steps == 4


def test_large_steps_and_a_full_cache_stay_eager():
    r = _Runner(max_tokens=16, max_count=1)
    for _ in range(3):
        r._run_step(_step((0, 17)))  # above graph_max_tokens
    r._run_step(_step((0, 2)))
    r._run_step(_step((0, 2)))  # captured: the one slot
    for _ in range(3):
        r._run_step(_step((0, 3)))  # cache full
    assert r.captured == [((0, 2),)]
    assert r.eager.count(((0, 17),)) == 3 and r.eager.count(((0, 3),)) == 3


def test_a_rejoined_rank_drops_the_graphs():
    r = _Runner()
    for _ in range(3):
        r._run_step(_step((0, 4)))
    assert r.graph_replays == 1
    r.connector.generation += 1  # the attention rank reconnected: its buffers moved
    r._run_step(_step((0, 4)))
    assert r.graphs == {} and r.eager[-1] == ((0, 4),) and r.graph_replays == 1


def test_disabled_cache_never_captures():
    r = _Runner()
    r.graphs_enabled = False
    for _ in range(4):
        r._run_step(_step((0, 4)))
    assert r.captured == [] and len(r.eager) == 4


def test_no_capture_while_profiling():
    r = _Runner()
    r.profiler = object()
    for _ in range(3):
        r._run_step(_step((0, 4)))
    assert r.captured == []
    r.profiler = None
    r._run_step(_step((0, 4)))
    assert r.captured == [((0, 4),)]


def test_micro_batched_steps_announced_up_front_are_captured_per_token_split():
    r = _Runner()
    r.connector = _UBatchConnector(upfront=True)
    for _ in range(4):
        r._run_step(_ubatched(3))
    key = ("ubatched", 0, 3, 2)
    assert r.eager == [("ubatched", 3, 2)] * 2 and r.captured == [key]
    assert r.graphs[key].replays == 2 and r.ubatched_steps == 4 and r.steps_served == 4
    r._run_step(_ubatched(2))  # another split: its own key, eager first
    assert r.eager[-1] == ("ubatched", 2, 2) and r.graph_replays == 2


def test_micro_batched_steps_over_tcp_stay_eager():
    # Later micro-batches' controls arrive mid-step: nothing to key a graph by.
    r = _Runner()
    r.connector = _UBatchConnector(upfront=False)
    for _ in range(3):
        r._run_step(_ubatched(3))
    assert r.captured == [] and r.eager == [("ubatched", 3, 2)] * 3


def test_the_largest_captured_pass_grows_with_the_attention_ranks_served():
    # 3A1F at 256 tokens a rank: the 768-token pass joining all three is captured.
    assert ffn_runner.graph_token_limit({}, 1) == 512
    assert ffn_runner.graph_token_limit({}, 3) == 3 * 512
    assert ffn_runner.graph_token_limit({"ffn_cuda_graph_max_tokens": 64}, 3) == 64


def test_a_capture_is_counted_with_its_time(monkeypatch):
    # The real _capture around a recording stand-in for torch.cuda's graph API: the
    # counters an operator reads to see the stalls (docs/observability.md).
    from vllm.afd import metrics

    class _CUDAGraph:
        def replay(self):
            pass

    monkeypatch.setattr(torch.cuda, "CUDAGraph", _CUDAGraph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "graph", lambda *a, **k: contextlib.nullcontext())
    r = _Runner()
    r._graph_pool = None
    before = dict(metrics.STATS.counters)
    ffn_runner.FFNModelRunner._capture(r, ((0, 4),), lambda: time.sleep(0.02))
    assert isinstance(r.graphs[((0, 4),)], _CUDAGraph)
    assert metrics.STATS.counters["ffn_graph_captures"] == before["ffn_graph_captures"] + 1
    took = metrics.STATS.counters["ffn_graph_capture_seconds"] - before["ffn_graph_capture_seconds"]
    assert 0.02 <= took < 5


def test_old_keys_are_forgotten_once_in_a_while_whatever_the_window(monkeypatch):
    # A window as large as the memory bound: the keys past the window are dropped when the
    # bound plus the window is passed, not again on every eager pass after.
    monkeypatch.setattr(ffn_runner, "GRAPH_SEEN_MAX", 8)
    r = _Runner(max_tokens=1000, max_count=0, window=8)
    r.max_pass_tokens = 1000
    for n in range(1, 17):
        r._run_step(_step((0, n)))  # 16 keys, each once: not past 8 + 8 yet
    assert len(r.step_rule.seen) == 16
    r._run_step(_step((0, 100)))  # the 17th passes it: the 8 past the window go
    assert sorted(n for (((_, n),)) in r.step_rule.seen) == [9, 10, 11, 12, 13, 14, 15, 16, 100]
    for n in range(200, 207):
        r._run_step(_step((0, n)))  # 16 again: kept until the bound is passed once more
    assert len(r.step_rule.seen) == 16
