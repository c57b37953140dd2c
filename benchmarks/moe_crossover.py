"""Where does an FFN rank's MoE layer turn from memory-bound to compute-bound?

An AFD FFN rank serving M attention ranks of decode batch b runs each MoE layer on T = M*b
tokens. While the layer is bound by reading the expert weights, its time hardly grows with T,
so aggregating attention ranks on one FFN rank is nearly free; once the work per expert is
large enough it becomes bound by the matrix units and its time grows with T. This script times
one MoE layer of the FFN rank (router gate, top-k, vLLM's fused MoE kernel over the routed
experts, the shared experts) at a model's shape for a sweep of T, next to a roofline model from
bytes moved and FLOPs, and prints where the two regimes meet.

    python benchmarks/moe_crossover.py --shape deepseek-v2-lite --device cuda \\
        --tokens 16,32,64,128,256,512,768,1024,1536,2048 --json OUT.json
    python benchmarks/moe_crossover.py --shape deepseek-v2-lite --ep 2 ...   # one rank of an
        # expert-parallel FFN group of 2 (half the experts, half the shared MLP)

On a GPU each layer is captured in a CUDA graph (as the FFN rank's graph cache does) and
replayed; `--device cpu` runs a plain torch loop over the experts instead (to try the script,
its figures say nothing about a GPU).

`--routing` picks how tokens reach experts: `uniform` (default) a random router (each token
k distinct experts, about uniform: what a trained model's decode batch is close to; its skew
touches somewhat fewer experts), `balanced` the project's `afd_balanced` benchmark routing
(token t takes experts t*k .. t*k+k-1 mod E), `collapsed` every token the same k experts -
what vLLM's dummy weights (`--load-format dummy`) give DeepSeek-V2 with the checkpoint's
router: its logits are about 1e-5, the bf16 softmax rounds all scores to one value, and the
top-k of a tie picks the same experts for every token (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass

BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class MoEShape:
    hidden: int
    moe_intermediate: int
    experts: int
    top_k: int
    shared: int  # shared experts, run as one MLP of shared * moe_intermediate


SHAPES = {
    # DeepSeek-V2-Lite (benchmarks/make_shape.py's preset of the same name)
    "deepseek-v2-lite": MoEShape(hidden=2048, moe_intermediate=1408, experts=64, top_k=6, shared=2),
    # Qwen3-30B-A3B: no shared experts
    "qwen3-30b-a3b": MoEShape(hidden=2048, moe_intermediate=768, experts=128, top_k=8, shared=0),
    # the tiny CPU shape of the script's smoke test
    "tiny": MoEShape(hidden=64, moe_intermediate=32, experts=8, top_k=2, shared=1),
}


ROUTINGS = ("uniform", "balanced", "collapsed")


def expected_active_experts(tokens: int, experts: int, top_k: int,
                            routing: str = "uniform") -> float:
    """Experts touched by `tokens` tokens, each picking top_k distinct experts: uniformly at
    random, round-robin (`balanced`) or all the same ones (`collapsed`)."""
    if routing == "uniform":
        return experts * (1.0 - (1.0 - top_k / experts) ** tokens)
    if routing == "balanced":
        return float(min(experts, tokens * top_k))
    if routing == "collapsed":
        return float(top_k)
    raise ValueError(f"unknown routing {routing!r}: one of {ROUTINGS}")


@dataclass(frozen=True)
class Roofline:
    tokens: int
    active_experts: float  # on this rank
    weight_bytes: float
    act_bytes: float
    flops: float
    memory_s: float
    compute_s: float

    @property
    def bound_s(self) -> float:
        return max(self.memory_s, self.compute_s)

    @property
    def intensity(self) -> float:
        return self.flops / (self.weight_bytes + self.act_bytes)


def roofline(shape: MoEShape, tokens: int, ep: int = 1, dtype_bytes: int = 2,
             peak_tflops: float = 989.0, peak_tbs: float = 4.8,
             active_experts: float | None = None, routing: str = "uniform") -> Roofline:
    """One MoE layer of one FFN rank (of `ep` expert-parallel ranks) on `tokens` tokens.
    Weights: every touched routed expert (gate+up+down, 3*H*I) once, the rank's shard of the
    shared MLP and the router gate; activations: the layer's input and output and the routed
    experts' intermediate (written and read once)."""
    h, i = shape.hidden, shape.moe_intermediate
    # This rank is rank 0 of the group (experts 0 .. E/ep-1). It gets an even share of the
    # experts and of the (token, expert) pairs, except under collapsed routing, whose k
    # experts (0 .. k-1) are all its own.
    collapsed = routing == "collapsed"
    if active_experts is None:
        active_experts = expected_active_experts(tokens, shape.experts, shape.top_k, routing)
        active_experts /= 1 if collapsed else ep
    routed_pairs = tokens * shape.top_k / (1 if collapsed else ep)
    shared_i = shape.shared * i / ep
    weights = (active_experts * 3 * h * i + 3 * h * shared_i + h * shape.experts) * dtype_bytes
    acts = (2 * tokens * h + routed_pairs * (2 * h + 3 * i)) * dtype_bytes
    flops = 2 * 3 * h * i * routed_pairs + 2 * 3 * h * shared_i * tokens \
        + 2 * h * shape.experts * tokens
    return Roofline(tokens, active_experts, weights, acts, flops,
                    (weights + acts) / (peak_tbs * 1e12), flops / (peak_tflops * 1e12))


def crossover_tokens(shape: MoEShape, ep: int = 1, dtype_bytes: int = 2,
                     peak_tflops: float = 989.0, peak_tbs: float = 4.8,
                     limit: int = 1 << 20, routing: str = "uniform") -> int | None:
    """Smallest token count whose roofline time is compute-bound (None: not up to `limit`)."""
    def compute_bound(t):
        r = roofline(shape, t, ep, dtype_bytes, peak_tflops, peak_tbs, routing=routing)
        return r.compute_s >= r.memory_s
    lo, hi = 1, 1
    while not compute_bound(hi):
        if hi >= limit:
            return None
        lo, hi = hi, min(hi * 2, limit)
    while lo < hi:
        mid = (lo + hi) // 2
        if compute_bound(mid):
            hi = mid
        else:
            lo = mid + 1
    return hi


def knee_tokens(measured: list[tuple[int, float]], factor: float = 1.5) -> int | None:
    """Smallest measured token count whose layer time is at least `factor` x the time at the
    smallest one (None: none is): where aggregating more tokens stops being nearly free."""
    if not measured:
        return None
    pts = sorted(measured)
    base = pts[0][1]
    for t, s in pts:
        if s >= factor * base:
            return t
    return None


# ---------------------------------------------------------------------------- measurement

class Layer:
    """One MoE layer of one FFN rank with random weights (router gate, top-k, routed experts,
    shared MLP)."""

    def __init__(self, shape: MoEShape, ep: int, device: str, dtype, seed: int = 0,
                 routing: str = "uniform"):
        import torch

        if shape.experts % ep:
            raise SystemExit(f"--ep {ep} does not divide the {shape.experts} experts")
        self.torch = torch
        self.shape, self.ep, self.device, self.dtype = shape, ep, device, dtype
        if routing not in ROUTINGS:
            raise ValueError(f"unknown routing {routing!r}: one of {ROUTINGS}")
        self.routing = routing
        g = torch.Generator(device="cpu").manual_seed(seed)
        h, i, e = shape.hidden, shape.moe_intermediate, shape.experts
        local = e // ep

        def rand(*size):
            return (torch.randn(*size, generator=g) * 0.02).to(device=device, dtype=dtype)

        self.gate = rand(e, h)
        self.w1 = rand(local, 2 * i, h)  # gate and up projections, vLLM's layout
        self.w2 = rand(local, h, i)
        si = shape.shared * i // ep
        self.ws1 = rand(2 * si, h) if si else None
        self.ws2 = rand(h, si) if si else None
        # This rank holds experts [0, local): the expert map sends the others to -1.
        emap = torch.full((e,), -1, dtype=torch.int32)
        emap[:local] = torch.arange(local, dtype=torch.int32)
        self.expert_map = emap.to(device) if ep > 1 else None
        self.fused = None
        if device != "cpu":
            from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts
            self.fused = fused_experts

    def route(self, x):
        """Router weights and expert ids; the gate GEMM and softmax run for every routing
        (the FFN rank computes them), `balanced` and `collapsed` then replace the choice."""
        torch = self.torch
        logits = torch.nn.functional.linear(x, self.gate)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        w, ids = torch.topk(probs, self.shape.top_k, dim=-1)
        k, n = self.shape.top_k, x.shape[0]
        if self.routing == "balanced":  # the benchmarks' strategy itself (seed 0, its default)
            from vllm.afd.routing import balanced_topk
            _, ids = balanced_topk(n, self.shape.experts, k, 0, x.device)
        elif self.routing == "collapsed":
            ids = torch.arange(k, device=x.device).repeat(n, 1)
        return w, ids.to(torch.int32)

    def shared_mlp(self, x):
        torch = self.torch
        if self.ws1 is None:
            return torch.zeros_like(x)
        a, b = torch.nn.functional.linear(x, self.ws1).chunk(2, dim=-1)
        return torch.nn.functional.linear(torch.nn.functional.silu(a) * b, self.ws2)

    def routed_reference(self, x, w, ids):
        """The routed experts in plain torch (a loop over this rank's experts)."""
        torch = self.torch
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        local = self.w1.shape[0]
        for e in range(local):
            tok, slot = (ids == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            a, b = torch.nn.functional.linear(x[tok], self.w1[e]).chunk(2, dim=-1)
            y = torch.nn.functional.linear(torch.nn.functional.silu(a) * b, self.w2[e])
            out.index_add_(0, tok, y.float() * w[tok, slot, None])
        return out.to(x.dtype)

    def routed(self, x, w, ids):
        if self.fused is None:
            return self.routed_reference(x, w, ids)
        return self.fused(x, self.w1, self.w2, w, ids,
                          global_num_experts=self.shape.experts, expert_map=self.expert_map)

    def forward(self, x):
        w, ids = self.route(x)
        return self.routed(x, w, ids) + self.shared_mlp(x)

    def active_experts(self, x) -> int:
        _, ids = self.route(x)
        local = self.w1.shape[0]
        u = self.torch.unique(ids)
        return int((u < local).sum())


def time_layer(layer: Layer, tokens: int, iters: int, graphs: bool) -> float:
    """Mean seconds per layer call on `tokens` tokens."""
    torch = layer.torch
    x = (torch.randn(tokens, layer.shape.hidden) * 0.5).to(layer.device, layer.dtype)
    if layer.device == "cpu":
        layer.forward(x)
        t0 = time.perf_counter()
        for _ in range(iters):
            layer.forward(x)
        return (time.perf_counter() - t0) / iters
    for _ in range(3):  # Triton compiles the kernel's configuration for this size here
        layer.forward(x)
    torch.cuda.synchronize()
    def run():
        layer.forward(x)

    if graphs:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            layer.forward(x)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            layer.forward(x)
        run = g.replay
        run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def check_kernel(layer: Layer, tokens: int = 64) -> float:
    """Max |fused - torch reference| of the routed experts on one batch (GPU only)."""
    torch = layer.torch
    x = (torch.randn(tokens, layer.shape.hidden) * 0.5).to(layer.device, layer.dtype)
    w, ids = layer.route(x)
    ref = layer.routed_reference(x, w, ids).float()
    got = layer.routed(x, w, ids).float()
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6))


def parse_ints(text: str, what: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"{what}: expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise SystemExit(f"{what}: expected positive integers, got {text!r}")
    return sorted(set(vals))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="deepseek-v2-lite")
    ap.add_argument("--tokens", default="16,32,64,128,192,256,384,512,768,1024,1536,2048",
                    help="token counts per layer call (M attention ranks x batch b)")
    ap.add_argument("--routing", choices=ROUTINGS, default="uniform",
                    help="how tokens pick experts (module docstring)")
    ap.add_argument("--ep", type=int, default=1,
                    help="this rank is one of an expert-parallel FFN group of EP ranks")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(BYTES))
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--no-graphs", action="store_true", help="time eager calls (GPU)")
    ap.add_argument("--peak-tflops", type=float, default=989.0,
                    help="dense matrix peak for the roofline (H200 bf16 spec: 989)")
    ap.add_argument("--peak-tbs", type=float, default=4.8,
                    help="memory bandwidth for the roofline, TB/s (H200 spec: 4.8)")
    ap.add_argument("--batches", default="64,128,256,512",
                    help="decode batches per attention rank for the M:N reading")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--analytic", action="store_true",
                    help="the roofline model alone (no torch needed)")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    tokens = parse_ints(args.tokens, "--tokens")
    batches = parse_ints(args.batches, "--batches")
    if args.ep < 1:
        raise SystemExit("--ep must be at least 1")
    if args.iters < 1:
        raise SystemExit("--iters must be at least 1")
    shape = SHAPES[args.shape]
    if shape.experts % args.ep:
        raise SystemExit(f"--ep {args.ep} does not divide the {shape.experts} experts")
    peaks = dict(peak_tflops=args.peak_tflops, peak_tbs=args.peak_tbs)
    layer = None if args.analytic else make_layer(args, shape)
    xover = crossover_tokens(shape, args.ep, BYTES[args.dtype], routing=args.routing, **peaks)
    print(f"shape {args.shape}: {asdict(shape)}, ep {args.ep}, routing {args.routing}, "
          f"{args.dtype}; roofline "
          f"{args.peak_tflops:g} TFLOP/s, {args.peak_tbs:g} TB/s -> compute-bound from "
          f"T = {xover} tokens")
    rows = measure_rows(args, shape, layer, tokens, peaks)
    result = {"shape": args.shape, **asdict(shape), "ep": args.ep, "routing": args.routing,
              "dtype": args.dtype,
              "device": args.device, "graphs": args.device == "cuda" and not args.no_graphs,
              **peaks, "roofline_crossover_tokens": xover, "rows": rows}
    if layer is not None:
        meas = [(r["tokens"], r["layer_us"]) for r in rows]
        knee = knee_tokens(meas)
        result["knee_tokens_1_5x"] = knee
        print(f"layer time reaches 1.5x its time at T={tokens[0]} at T = {knee}")
        result["m_n"] = m_n_reading(dict(meas), batches)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


def make_layer(args, shape: MoEShape) -> Layer:
    """The MoE layer timed on ``args.device`` (torch imported here: --analytic needs none)."""
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (--device cpu or --analytic)")
    layer = Layer(shape, args.ep, args.device, getattr(torch, args.dtype), routing=args.routing)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (torch loop)"
    print(f"device: {name}")
    if args.device == "cuda":
        print(f"fused MoE vs torch reference, 64 tokens: max rel. diff "
              f"{check_kernel(layer):.2e}")
    return layer


def measure_rows(args, shape: MoEShape, layer: Layer | None, tokens: list[int],
                 peaks: dict) -> list[dict]:  # fmt: skip
    """Per token count: the roofline, and the layer's time where one is measured (a
    table line printed for each)."""
    nbytes = BYTES[args.dtype]
    print(f"{'T':>6} {'experts':>8} {'weights MB':>10} {'FLOP/B':>7} {'bound us':>9}"
          + ("" if layer is None else f" {'layer us':>9} {'us/token':>9} {'TB/s':>6}"
             f" {'TFLOP/s':>8} {'x bound':>8}"))
    rows = []
    for t in tokens:
        active = None
        if layer is not None:
            x = (layer.torch.randn(t, shape.hidden) * 0.5).to(layer.device, layer.dtype)
            active = layer.active_experts(x)
        r = roofline(shape, t, args.ep, nbytes, active_experts=active, routing=args.routing,
                     **peaks)
        row = {"tokens": t, "active_experts": r.active_experts,
               "weight_bytes": r.weight_bytes, "act_bytes": r.act_bytes, "flops": r.flops,
               "intensity": r.intensity, "bound_us": r.bound_s * 1e6,
               "memory_us": r.memory_s * 1e6, "compute_us": r.compute_s * 1e6}
        line = (f"{t:>6} {r.active_experts:>8.1f} {r.weight_bytes / 1e6:>10.1f} "
                f"{r.intensity:>7.1f} {r.bound_s * 1e6:>9.1f}")
        if layer is not None:
            s = time_layer(layer, t, args.iters, args.device == "cuda" and not args.no_graphs)
            row.update(layer_us=s * 1e6, us_per_token=s * 1e6 / t,
                       tbs=(r.weight_bytes + r.act_bytes) / s / 1e12,
                       tflops=r.flops / s / 1e12, x_bound=s / r.bound_s)
            line += (f" {s * 1e6:>9.1f} {s * 1e6 / t:>9.3f} {row['tbs']:>6.2f} "
                     f"{row['tflops']:>8.1f} {row['x_bound']:>8.2f}")
        rows.append(row)
        print(line, flush=True)
    return rows


def m_n_reading(per: dict[int, float], batches: list[int]) -> list[dict]:
    """M attention ranks of batch b aggregate on one FFN rank (T = M*b): the layer time at
    T and the cost per token against one rank, where both T were measured."""
    print("M:N reading (measured T only): FFN layer us for M ranks x batch b, "
          "and the cost per token against 1 rank")
    mn = []
    for b in batches:
        for m in (1, 2, 3, 4):
            if m * b in per and b in per:
                ratio = (per[m * b] / (m * b)) / (per[b] / b)
                mn.append({"batch": b, "ranks": m, "tokens": m * b,
                           "layer_us": per[m * b], "per_token_vs_1": ratio})
                print(f"  b={b:<4} M={m}: T={m * b:<5} {per[m * b]:8.1f} us, "
                      f"per-token cost {ratio:.2f}x of 1 rank")
    return mn


if __name__ == "__main__":
    sys.exit(main())
