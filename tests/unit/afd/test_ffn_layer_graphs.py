"""The FFN rank's graphs of single layers' blocks (vllm.afd.ffn_runner), for data planes the
host drives (gloo, nixl), without a GPU: which (layer, token count) is captured (the step
graphs' rule: one that recurs within the window), that a replay reads the rows it is
given (copied into the graph's input buffer) and its router logits, and the limits. The capture is replaced by a stand-in whose replay runs the block
on the graph's buffers, as a captured graph does; the GPU oracle with nixl covers real
graphs (tokens equal plain vLLM's, layer-graph replays counted)."""

from __future__ import annotations

import torch

from vllm.afd import ffn_runner

LAYERS = 3


class _Graph:
    def __init__(self, fn):
        self.fn = fn
        self.replays = 0

    def replay(self):
        self.replays += 1
        self.fn()


class _Runner(ffn_runner.FFNModelRunner):
    def __init__(self, max_tokens=16, max_count=2):
        # Only what the layer-graph policy reads (no model, no connector).
        self.layer_graphs_enabled = True
        self.layer_graphs, self.layer_graph_replays, self.steps_served = {}, 0, 0
        self.layer_rule = ffn_runner.CaptureRule(16, max_tokens, max_count * LAYERS)
        self.modules = dict.fromkeys(range(LAYERS))
        self.profiler = None
        self._sync_timing = False
        self.eager: list[tuple[int, int]] = []
        self.captured: list[tuple[int, int]] = []

    @staticmethod
    def block(layer, x, logits):
        y = x * (layer + 2)
        return y if logits is None else y + logits.sum(dim=1, keepdim=True)

    def _block_eager(self, layer_idx, module, x, logits):
        self.eager.append((layer_idx, x.shape[0]))
        return self.block(layer_idx, x, logits)

    def _capture_layer(self, key, module, x, logits):
        self.captured.append(key)
        sx, sl = x.clone(), None if logits is None else logits.clone()
        out = torch.empty_like(sx)
        g = ffn_runner._LayerGraph(
            _Graph(lambda: out.copy_(self.block(key[0], sx, sl))), sx, sl, out
        )
        self.layer_graphs[key] = g
        return g

    def run(self, layer, x, logits=None):
        y = self._layer_graph(layer, None, x, logits)
        return self._block_eager(layer, None, x, logits) if y is None else y


def rows(n, seed):
    return torch.arange(n * 4, dtype=torch.float32).view(n, 4) + seed


def test_a_layer_is_captured_at_a_token_count_that_recurs_and_replayed_after():
    r = _Runner()
    for i in range(2):
        r.run(1, rows(4, i))
    assert r.eager == [(1, 4)] and r.captured == [(1, 4)]
    for i in range(2, 6):  # every replay reads the rows it is given, not the captured ones
        x = rows(4, 10 * i)
        torch.testing.assert_close(r.run(1, x), r.block(1, x, None))
    assert r.layer_graphs[(1, 4)].graph.replays == 5 and r.layer_graph_replays == 5
    # another token count, another layer: each a key of its own
    r.run(1, rows(8, 0))
    r.run(2, rows(4, 0))
    assert r.eager == [(1, 4), (1, 8), (2, 4)] and r.captured == [(1, 4)]
    # the step graphs' rule: a pair that comes back only past the window is not captured,
    # one that then recurs within it is
    r.steps_served = 17
    r.run(1, rows(8, 0))
    assert r.captured == [(1, 4)]
    r.steps_served = 18
    r.run(1, rows(8, 0))
    assert r.captured == [(1, 4), (1, 8)]


def test_router_logits_are_copied_in_too():
    r = _Runner()
    x, logits = rows(4, 0), torch.ones(4, 6)
    r.run(0, x, logits)
    r.run(0, x, logits)
    other = torch.full((4, 6), 3.0)
    torch.testing.assert_close(r.run(0, x, other), r.block(0, x, other))


def test_limits_larger_steps_the_count_and_a_profiled_run_stay_eager():
    r = _Runner(max_tokens=16, max_count=1)
    for _ in range(3):
        r.run(0, rows(32, 0))  # above ffn_cuda_graph_max_tokens
    assert r.captured == [] and len(r.eager) == 3
    for n in (1, 2, 3, 4):  # max_count 1 per layer: LAYERS graphs in all
        for layer in range(LAYERS):
            r.run(layer, rows(n, 0))
            r.run(layer, rows(n, 0))
    assert len(r.captured) == LAYERS and len(r.layer_graphs) == LAYERS
    r2 = _Runner()
    r2.profiler = object()  # a trace is being recorded: no capture
    for _ in range(3):
        r2.run(0, rows(4, 0))
    assert r2.captured == [] and len(r2.eager) == 3


def test_layer_graphs_are_asked_for_and_only_where_no_step_graph_can_be():
    on = {"ffn_layer_graphs": True}
    kinds = ffn_runner.graph_kinds
    assert kinds("cuda", False, on, grouped=False) == (False, True)
    assert kinds("cuda", False, {}, grouped=False) == (False, False)  # default off
    assert kinds("cpu", False, on, grouped=False) == (False, False)
    assert kinds("cuda", True, on, grouped=False) == (True, False)  # step graphs instead
    assert kinds("cuda", True, {}, grouped=False) == (True, False)
    assert kinds("cpu", True, {}, grouped=False) == (False, False)
    assert kinds("cuda", False, on, grouped=True) == (False, False)
    assert kinds("cuda", True, on, grouped=True) == (False, False)
    off = {**on, "ffn_cuda_graphs": False}
    assert kinds("cuda", False, off, grouped=False) == (False, False)
    assert kinds("cuda", True, off, grouped=False) == (False, False)
