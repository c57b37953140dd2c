# SPDX-License-Identifier: Apache-2.0
"""The FFN role's model runner and serve loop.

The runner builds only the FFN blocks (see ``vllm.afd.model_split``), keeps no
KV cache, and serves per-layer FFN calls: for every step it receives the
step-control message of each ready attention rank, then layer by layer
receives their hidden states, runs the block on all of them at once
(attention ranks that are ready together share one FFN pass), and sends each
rank its rows back. With ``connector_extra_config.ffn_schedule: "pingpong"`` the steps
of ranks ready together are interleaved instead, layer by layer (rank A's layer l, rank
B's layer l, A's layer l + 1, ...), so that one rank's attention runs while the FFN
serves another's layer; ``"auto"`` picks either per composition of ranks from the rounds'
measured periods (docs/ping-pong.md).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.profiler import record_function

from vllm.afd import compat, failure, metrics
from vllm.afd.connector_spec import FFN_SCHEDULES
from vllm.afd.model_split import (
    STATE,
    ffn_fingerprint,
    is_routed_moe,
    router_logits_width,
    router_name,
)
from vllm.afd.protocol import MSG_STEP, AFDPeerError, LogThrottle, ubatch_of
from vllm.afd.roles import afd_config
from vllm.distributed.afd.base import ConnectorContext, StepPeer, create_ffn_connector
from vllm.logger import init_logger

logger = init_logger(__name__)

# FFN runners of this process (in-process engines, tests and tools).
ACTIVE: list[FFNModelRunner] = []
# Profiler requests of an FFN server without a profiler: any attention rank (any holder of
# a slot) can send them at will; one WARNING per 10 s at most.
_LOG_NO_PROFILER = LogThrottle()
# ffn_schedule "auto": decisions logged at most once per 10 s.
_LOG_AUTO = LogThrottle()
# Default of connector_extra_config.ffn_cuda_graph_max_tokens: this many per attention
# rank served (vLLM's largest decode capture size by default).
GRAPH_TOKENS_PER_RANK = 512


def graph_token_limit(extra: dict, ranks: int) -> int:
    """The largest pass the FFN rank captures as a CUDA graph: the key
    ffn_cuda_graph_max_tokens, else GRAPH_TOKENS_PER_RANK per attention rank served (a
    guest too), so that a pass joining every rank's decode step is captured (3A1F at 256
    tokens a rank ran its 768-token passes eagerly under a fixed 512: 0.66x the
    replicas on one H200)."""
    return int(extra.get("ffn_cuda_graph_max_tokens", GRAPH_TOKENS_PER_RANK * ranks))


# Default of connector_extra_config.ffn_cuda_graph_window: this many FFN passes per
# attention rank served.
GRAPH_WINDOW_PER_RANK = 16
# Keys remembered for the window: past this many more than the window can hold, the ones
# older than the window are forgotten (at most once per this many new keys).
GRAPH_SEEN_MAX = 4096


def graph_window(extra: dict, ranks: int) -> int:
    """How many FFN passes may lie between a key's two eager passes for it to be captured:
    the key ffn_cuda_graph_window, else GRAPH_WINDOW_PER_RANK per attention rank served (a
    guest too), so that the keys of ranks taking turns still count as recurring."""
    return int(extra.get("ffn_cuda_graph_window", GRAPH_WINDOW_PER_RANK * ranks))


class CaptureRule:
    """Which shape served eagerly is captured as a CUDA graph, for the step graphs and the
    layer graphs alike: one served eagerly again within ``window`` FFN passes of its last
    eager serve (a shape that recurs: decode steps, a steady chunked prefill, ranks taking
    turns; not one that comes back once a generation, such as a first prefill step that
    caught only the first few prompts), of at most ``max_tokens`` tokens, while fewer than
    ``max_count`` graphs are kept. A capture stalls every rank the FFN rank serves (50-75
    ms a step graph on one H200 at DeepSeek-V2-Lite's shape), more than a shape that does
    not recur gains from replaying. Shapes are remembered by the pass they were last
    served in; past GRAPH_SEEN_MAX more than the window, those older than it are
    forgotten."""

    def __init__(self, window: int, max_tokens: int, max_count: int):
        self.window, self.max_tokens, self.max_count = window, max_tokens, max_count
        self.seen: dict[tuple, int] = {}

    def due(self, key: tuple, now: int, tokens: int, kept: int) -> bool:
        """``key`` (of ``tokens`` tokens) is served eagerly at pass ``now`` while ``kept``
        graphs exist: whether to capture it."""
        last = self.seen.get(key)
        self.seen[key] = now
        if len(self.seen) > GRAPH_SEEN_MAX + self.window:
            self.seen = {k: i for k, i in self.seen.items() if now - i <= self.window}
        return (
            last is not None
            and now - last <= self.window
            and tokens <= self.max_tokens
            and kept < self.max_count
        )

    def forget(self) -> None:
        """Every shape starts anew (the graphs kept were dropped)."""
        self.seen.clear()


# A pass over a connector with async_io (TCP) waits this long for the layer inputs of its
# late ranks once the first of its ranks has sent its own (or, when none has, since the
# inputs were posted): then the ranks whose inputs arrived go on, and the late ones become a
# pass of their own, parked until their inputs arrive or their own deadline (timeout_s) ends
# their session. A rank that stops mid-frame so stalls the others of its pass this long,
# once; a slow but live rank (a long prefill among decodes) costs only that pass's sharing.
STRAGGLER_S = 0.25


def ffn_schedule(extra: dict, grouped: bool = False) -> str:
    """connector_extra_config.ffn_schedule (checked against its spec record at
    configuration time; checked here again for a runner built without it). An FFN group
    (tensor_parallel_size > 1) agrees on one joined step a round: it refuses the others."""
    schedule = extra.get("ffn_schedule", "join")
    if schedule not in FFN_SCHEDULES:
        raise ValueError(
            f"connector_extra_config.ffn_schedule must be one of "
            f"{', '.join(map(repr, FFN_SCHEDULES))}; got {schedule!r}"
        )
    if grouped and schedule != "join":
        raise ValueError(
            f"connector_extra_config.ffn_schedule {schedule!r}: an FFN group "
            "(tensor_parallel_size > 1) serves its ranks' steps joined in this release; drop "
            "the key or set it to 'join'"
        )
    return schedule


class AutoSchedule:
    """connector_extra_config.ffn_schedule "auto": per composition of ready ranks (their
    ranks and token counts, several ranks, no micro-batched step), join or interleave
    (pingpong), whichever gave the shorter round. A round's period runs from its start to
    the start of the next round of the same composition (a round of another composition
    in between discards it): the FFN's service, the hand-overs, the ranks' work outside the
    FFN layers and the wait for their next steps, everything the schedule changes. Each
    composition first runs PROBES rounds of each schedule, alternating; then the one whose
    last PROBES periods have the lower median, and every REPROBE-th round the other, so that
    its median follows what changed (graphs captured, contexts grown). The medians discard
    the eager rounds before a composition's graph is captured and the capture."""

    PROBES = 5
    REPROBE = 50
    MAX_KEYS = 4096

    def __init__(self):
        self.periods: dict[tuple, dict[str, deque]] = {}
        self.rounds: dict[tuple, int] = {}
        self.choice: dict[tuple, str] = {}

    def choose(self, key: tuple) -> str:
        if key not in self.periods:
            if len(self.periods) >= self.MAX_KEYS:  # compositions of long past prefills
                self.periods.clear()
                self.rounds.clear()
                self.choice.clear()
            self.periods[key] = {s: deque(maxlen=self.PROBES) for s in ("join", "pingpong")}
        seen = self.periods[key]
        n = self.rounds[key] = self.rounds.get(key, 0) + 1
        short = [s for s, d in seen.items() if len(d) < self.PROBES]
        if short:
            return min(short, key=lambda s: len(seen[s]))  # join first on a tie
        best = min(seen, key=lambda s: statistics.median(seen[s]))
        if self.choice.get(key) != best:
            self.choice[key] = best
            _LOG_AUTO(
                logger.info,
                "AFD FFN role: ffn_schedule 'auto' chose %s for attention ranks and tokens %s "
                "(median round %.2f ms joined, %.2f ms interleaved)",
                best, list(key), statistics.median(seen["join"]) * 1e3,
                statistics.median(seen["pingpong"]) * 1e3,
            )  # fmt: skip
        if n % self.REPROBE == 0:
            return "pingpong" if best == "join" else "join"
        return best

    def record(self, key: tuple, schedule: str, period: float) -> None:
        if key in self.periods:
            self.periods[key][schedule].append(period)


def graph_kinds(device_type: str, graph_capable: bool, extra: dict,
                grouped: bool) -> tuple[bool, bool]:  # fmt: skip
    """Which CUDA graphs the FFN rank captures: (step graphs, layer graphs). Either only on
    a GPU, unless connector_extra_config.ffn_cuda_graphs is false, and not in an FFN group
    (its steps run eagerly in this release). Step graphs (a whole step, the data plane's
    device exchanges in it) where the plane can be captured; graphs of single layers'
    blocks where it cannot (the host drives it) and ffn_layer_graphs asks (default
    false)."""
    allowed = device_type == "cuda" and bool(extra.get("ffn_cuda_graphs", True)) and not grouped
    layers = allowed and not graph_capable and bool(extra.get("ffn_layer_graphs", False))
    return allowed and graph_capable, layers


@dataclass
class _LayerGraph:
    """A CUDA graph of one layer's block at one token count, and its buffers: the rows
    (and router logits) it reads, the output it writes."""

    graph: torch.cuda.CUDAGraph
    x: torch.Tensor
    logits: torch.Tensor | None
    out: torch.Tensor


def split_passes(ready: list, max_tokens: int) -> list[list]:
    """The step peers ``ready`` in arrival order, cut into passes of at most
    ``max_tokens`` tokens each (see AFDConfig.ffn_pass_tokens); a step is never split."""
    passes: list[list] = []
    total = 0
    for peer in ready:
        n = peer.control.num_tokens
        if n > max_tokens:
            raise RuntimeError(
                f"AFD FFN role: a step of attention rank {peer.rank} has {n} tokens, above "
                f"the {max_tokens} tokens of one pass"
            )
        if not passes or total + n > max_tokens:
            passes.append([])
            total = 0
        passes[-1].append(peer)
        total += n
    return passes


class _GivenRouterLogits(torch.nn.Module):
    """Runs an MoE block with router logits computed on the attention role:
    the block's gate (and the MoE runner's internal router) are swapped for
    this module for the duration of one call."""

    def __init__(self, block: torch.nn.Module):
        super().__init__()
        self.name = router_name(block)  # "gate", or "router" (GPT-OSS, Llama 4)
        gate = getattr(block, self.name)
        # Read the shape from the layer's attributes: post-load processing on
        # the CPU may replace the weight by a packed kernel handle.
        self.num_experts = int(getattr(gate, "output_size", None) or gate.out_features)
        self.out_dtype = (
            getattr(gate, "out_dtype", None)
            or getattr(gate, "params_dtype", None)
            or gate.weight.dtype  # a plain nn.Linear (GLM-4.5)
        )
        # vLLM linear layers return (logits, bias) unless built with return_bias=False.
        self.as_tuple = bool(getattr(gate, "return_bias", False))
        self.logits: torch.Tensor | None = None

    def forward(self, block, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        self.logits = logits.to(self.out_dtype)
        try:
            with compat.swap_router(block, self.name, _LogitsStub(self)):
                return block(x)
        finally:
            self.logits = None


class _LogitsStub(torch.nn.Module):
    def __init__(self, owner: _GivenRouterLogits):
        super().__init__()
        self.__dict__["owner"] = owner

    def forward(self, x: torch.Tensor):
        return (self.owner.logits, None) if self.owner.as_tuple else self.owner.logits


def settles_passes(device_type: str, num_attention_ranks: int) -> bool:
    """Whether an FFN rank waits for each pass's device work before choosing the next
    (FFNModelRunner._settle): on CUDA, where passes launch asynchronously, and only with
    several attention ranks to join."""
    return device_type == "cuda" and num_attention_ranks > 1


class FFNModelRunner:
    def __init__(self, vllm_config, device: torch.device):
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.device = device
        self.afd_config = afd_config(vllm_config)
        self.dtype = self.model_config.dtype
        self.hidden_size = self.model_config.get_hidden_size()
        # The most tokens one pass runs; the steps that came together beyond it wait
        # for the next pass (an FFN group holds them in _pending).
        self.max_pass_tokens = self.afd_config.ffn_pass_tokens(
            int(vllm_config.scheduler_config.max_num_batched_tokens)
        )
        self._pending: list = []
        self.split_steps = 0  # rounds of ready steps served in several passes
        self.model = None
        self.modules: dict[int, torch.nn.Module] = {}
        self.connector = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.error: str | None = None
        self.steps_served = 0
        self.batched_steps = 0  # steps that served several attention ranks at once
        self.ubatched_steps = 0  # steps served as micro-batches (DBO)
        # connector_extra_config.ffn_schedule: "join" (one pass over the ranks ready
        # together), "pingpong" (their steps interleaved layer by layer) or "auto"
        # (either, per composition of ranks, by AutoSchedule)
        self.schedule = "join"
        self.pingpong_steps = 0  # rounds of several ranks served interleaved
        self._auto = AutoSchedule()
        self._auto_last: tuple | None = None  # "auto": (composition, schedule, start)
        # Attention ranks lost in the round being served (their rows are zeros, their
        # outputs not sent), and how many sessions were lost so in all.
        self._lost: set[int] = set()
        self.peers_lost = 0
        # async_io connectors: the passes in flight (_Pass, _UbatchedPass), each at its
        # own layer; and how often a pass went on without its late ranks.
        self._tasks: list = []
        self.straggler_splits = 0
        self.gates: dict[int, _GivenRouterLogits] = {}
        self.rank = 0
        self.group = None  # vLLM's tensor-parallel group of an FFN group
        self.group_steps = 0
        self._group_last_step = 0.0  # the group's last step
        self._group_own_step = 0.0  # the last step of this member's attention ranks
        self._group_window = 0.0
        self.profiler = None  # TorchProfilerWrapper while an attention rank profiles
        self._sync_timing = False
        self._profile_lock = threading.Lock()
        self._profile_local: list[bool] = []  # from this server's own /start_profile
        self.on_fatal: list[Callable[[str], None]] = []
        ACTIVE.append(self)

    # -- vLLM worker interface --------------------------------------------
    def load_model(self, load_dummy_weights: bool = False, **kwargs) -> None:
        from vllm.model_executor.model_loader import get_model_loader

        t0 = time.perf_counter()
        load_config = self.vllm_config.load_config
        if load_dummy_weights:
            load_config.load_format = "dummy"
        loader = get_model_loader(load_config)
        self.model = loader.load_model(vllm_config=self.vllm_config, model_config=self.model_config)
        self.modules = dict(sorted(STATE.ffn_modules.items()))
        if self.afd_config.compute_gate_on_attention:
            self.gates = {
                i: _GivenRouterLogits(m) for i, m in self.modules.items() if is_routed_moe(m)
            }
        n_params = sum(p.numel() for m in self.modules.values() for p in m.parameters())
        logger.info(
            "AFD FFN role: built %d FFN blocks (layers %s, %.2f M parameters) in %.1f s",
            len(self.modules),
            list(self.modules),
            n_params / 1e6,
            time.perf_counter() - t0,
        )
        self.start_serving()

    def get_model(self):
        return self.model

    def get_supported_tasks(self):
        return ("generate",)

    # Caches and adapters the FFN role does not have.
    is_pooling_model = False
    lora_config = None
    kv_caches: list = []

    def reset_mm_cache(self) -> None:
        pass

    def reset_encoder_cache(self) -> None:
        pass

    def take_draft_token_ids(self):
        return None

    def list_loras(self) -> set[int]:
        return set()

    def execute_model(self, *args, **kwargs):
        raise RuntimeError("AFD FFN role: the FFN model runner does not execute steps")

    # -- serving -------------------------------------------------------------
    def start_serving(self) -> None:
        cfg = self.afd_config
        rank = cfg.resolved_rank(self.vllm_config.parallel_config.data_parallel_rank)
        # An FFN group: one FFN server of num_ffn_ranks tensor-parallel workers
        # (the config allows tensor parallelism on the FFN role only so); worker
        # i is FFN rank i and every layer runs on the tokens of all of them.
        if self.vllm_config.parallel_config.tensor_parallel_size > 1:
            from vllm.distributed.parallel_state import get_tp_group

            self.group = get_tp_group()
            rank = self.group.rank_in_group
            self._group_window = float(cfg.connector_extra_config.get("batch_window_ms", 5.0)) / 1e3
        ctx = ConnectorContext(
            config=cfg,
            rank=rank,
            fingerprint=ffn_fingerprint(self.vllm_config, list(self.modules)),
            max_num_tokens=int(self.vllm_config.scheduler_config.max_num_batched_tokens),
            device=self.device,
            num_router_logits=router_logits_width(self.vllm_config),
        )
        self.rank = rank
        extra = cfg.connector_extra_config
        self.schedule = ffn_schedule(extra, grouped=self.group is not None)
        self.connector = create_ffn_connector(ctx)
        # FFN-side CUDA graphs, keyed by the step's (attention rank, token count)
        # pairs: a key that recurs is captured (CaptureRule, _maybe_capture). With a data
        # plane the host drives (gloo, nixl: no step graph) and the key ffn_layer_graphs,
        # the FFN rank replays CUDA graphs of each layer's block instead: a (layer, token
        # count) that recurs is captured (_layer_graph, by the same rule as steps, with as
        # many graphs per layer as steps may have). Eager, a MoE block's launches take the
        # host longer than its kernels take the device at decode sizes.
        self.graphs_enabled, self.layer_graphs_enabled = graph_kinds(
            self.device.type, self.connector.graph_capable, extra, self.group is not None
        )
        ranks = len(cfg.attention_ranks_of(rank)) + int(cfg.ffn_failover)
        max_tokens = graph_token_limit(extra, ranks)
        max_count = int(extra.get("ffn_cuda_graph_max_count", 64))
        window = graph_window(extra, ranks)
        self.step_rule = CaptureRule(window, max_tokens, max_count)
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._graph_gen = -1
        self._graph_pool = None
        self.graph_replays = 0
        self.layer_graphs: dict[tuple[int, int], _LayerGraph] = {}
        self.layer_rule = CaptureRule(window, max_tokens, max_count * len(self.modules))
        self.layer_graph_replays = 0
        # Several attention ranks on this FFN rank (a guest too, ffn_failover): each
        # pass's device work ends before the next pass is chosen (see _settle).
        self._settle_passes = settles_passes(self.device.type, ranks)
        self.connector.start()
        metrics.STATS.start("ffn", rank, self.connector.peer_states)
        logger.info(cfg.ffn_pass_message(
            rank, ctx.max_num_tokens, self.group.world_size if self.group is not None else 1
        ))  # fmt: skip
        if self.group is not None:
            logger.info(
                "AFD FFN rank %d of an FFN group of %d (%s): serving attention rank(s) %s; "
                "every layer runs on the tokens of the whole group",
                rank, self.group.world_size,
                "expert parallel"
                if self.vllm_config.parallel_config.enable_expert_parallel
                else "experts split tensor-parallel",
                cfg.attention_ranks_of(rank),
            )  # fmt: skip
        # With nccl, compute time is host-side (kernels run asynchronously).
        self._sync_timing = self.device.type == "cuda" and cfg.connector in ("gloo", "tcp")
        self._thread = threading.Thread(target=self._serve, name="afd-ffn-serve", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            if self.device.type == "cuda":
                torch.accelerator.set_device_index(self.device.index or 0)
            with torch.inference_mode():
                while not self._stop.is_set():
                    with self._profile_lock:
                        local, self._profile_local = self._profile_local, []
                    for start in [*local, *self.connector.take_profile_requests()]:
                        try:
                            self._profile(start)
                        except Exception as e:  # noqa: BLE001 - never end serving for it
                            self.profiler = None
                            logger.warning("AFD FFN role: profiler request failed: %s", e)
                    t0 = time.perf_counter()
                    self._lost.clear()
                    if self.group is not None:
                        self._serve_group_once(t0)
                        continue
                    with record_function("afd.wait_step"):
                        ready = self.connector.wait_step(timeout=self._wait_timeout())
                    served = False
                    if ready or self._tasks:
                        # One span per served step (benchmarks/breakdown.py counts them).
                        with record_function("afd.ffn_step"):
                            served = self._run_step(ready)
                    if served:
                        self._settle()
                        if self.profiler is not None:
                            self.profiler.step()  # counts steps for delay/max iterations
                    else:
                        metrics.STATS.inc("ffn_idle_seconds", time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - reported to the engine
            if self._stop.is_set():
                return
            self.error = f"{type(e).__name__}: {e}"
            logger.error("AFD FFN serve loop stopped: %s", self.error)
            failure.record("ffn", self.rank, str(e))
            for cb in self.on_fatal:
                cb(self.error)

    # -- FFN group (tensor_parallel_size = num_ffn_ranks) --------------------
    # How long a group member waits for its own attention ranks before it
    # tells the others it has nothing: short while steps flow (it bounds the
    # delay a step of another member waits for this one), longer when idle.
    GROUP_POLL_ACTIVE_S = 0.0005
    GROUP_POLL_IDLE_S = 0.02
    GROUP_ACTIVE_S = 1.0

    def _serve_group_once(self, t0: float) -> None:
        """One round of an FFN group: every member polls its own attention
        ranks, the members agree on the step (an all-gather of their token
        counts over the group's CPU channel), and if any has tokens they all
        run it, each contributing its rows (possibly none)."""
        active = time.monotonic() - self._group_last_step < self.GROUP_ACTIVE_S
        if self._pending:  # steps held back from the last pass come first
            ready = self._one_pass([])
        else:
            with record_function("afd.wait_step"):
                ready = self._one_pass(self.connector.wait_step(
                    timeout=self.GROUP_POLL_ACTIVE_S if active else self.GROUP_POLL_IDLE_S
                ))  # fmt: skip
        # A member with no step whose own attention ranks had one within
        # GROUP_ACTIVE_S says so: if another member has a step, those members
        # wait up to the batch window (connector_extra_config.batch_window_ms) for
        # theirs and the group agrees once more, so that steps arriving close
        # together share one group step.
        now = time.monotonic()
        if ready:
            self._group_own_step = now
        waiting = not ready and now - self._group_own_step < self.GROUP_ACTIVE_S
        rows = self._agree(ready, waiting=waiting)
        if (
            any(int(r[0]) for r in rows)
            and any(int(r[2]) for r in rows)
            and self._group_window > 0
        ):
            if waiting:
                ready = self._one_pass(self.connector.wait_step(timeout=self._group_window))
            rows = self._agree(ready, waiting=False)
        counts = [int(r[0]) for r in rows]
        if any(int(r[1]) for r in rows):
            who = [f for f, r in enumerate(rows) if int(r[1])]
            raise AFDPeerError(
                f"AFD FFN rank {self.rank}: the attention rank(s) of FFN rank(s) {who} sent "
                "micro-batched (DBO) steps; an FFN group (tensor_parallel_size > 1) serves "
                "steps without micro-batches in this release: drop --enable-dbo from the "
                "attention servers"
            )
        if not any(counts):
            metrics.STATS.inc("ffn_idle_seconds", time.perf_counter() - t0)
            return
        self._group_last_step = time.monotonic()
        with record_function("afd.ffn_step"):
            transfer, compute = self._group_step_body(ready, counts)
        self.group_steps += 1
        if ready:
            self._account(ready, compute, transfer)
        if self.group_steps == 1:
            logger.info("AFD FFN rank %d: first group step, tokens per member %s",
                        self.rank, counts)  # fmt: skip

    def _one_pass(self, ready: list) -> list:
        """The held-back steps and then ``ready``, up to max_pass_tokens; the rest is
        held back for the next pass."""
        passes = split_passes(self._pending + ready, self.max_pass_tokens)
        if len(passes) > 1 and not self._pending:
            self._count_split(ready, len(passes))
        self._pending = [p for later in passes[1:] for p in later]
        return passes[0] if passes else []

    def _agree(self, ready, waiting: bool) -> list[torch.Tensor]:
        """All-gather (tokens, micro-batched steps, waiting for a step) of every
        member over the group's CPU channel."""
        ubatched = sum(1 for p in ready if ubatch_of(p.control.flags)[1])
        mine = torch.tensor(
            [sum(p.control.num_tokens for p in ready), ubatched, int(waiting)], dtype=torch.int64
        )
        rows = [torch.empty_like(mine) for _ in range(self.group.world_size)]
        torch.distributed.all_gather(rows, mine, group=self.group.cpu_group)
        return rows

    def _group_step_body(self, ready, counts: list[int]):
        """Every layer of one group step: receive this member's rows, gather
        the rows of every member (padded to the largest count), run the block
        on all of them (its own all-reduce combines the members' shares of the
        experts), send this member's rows back."""
        from vllm.forward_context import set_forward_context

        me, world = self.rank, self.group.world_size
        width, total = max(counts), sum(counts)
        start = sum(counts[:me])
        offsets = [0]
        for p in ready:
            offsets.append(offsets[-1] + p.control.num_tokens)
        x_mine = torch.empty((width, self.hidden_size), dtype=self.dtype, device=self.device)
        transfer = compute = 0.0

        def gather(t: torch.Tensor) -> torch.Tensor:
            # Every member's rows (rows past a member's count are padding).
            full = self.group.all_gather(t, dim=0)  # (world * width, ...)
            return torch.cat([full[r * width : r * width + counts[r]] for r in range(world)])

        with set_forward_context(None, self.vllm_config, num_tokens=total):
            for layer_idx, module in self.modules.items():
                t, c = self._layer(layer_idx, module, ready, x_mine, offsets,
                                   self._sync_timing, False, gather=gather, out_start=start)
                transfer += t
                compute += c
        return transfer, compute

    def _settle(self) -> None:
        """With several attention ranks, wait for the pass just launched to finish on the
        device before choosing the next one. The host launches a pass (a graph replay)
        without waiting; it would then choose the next pass while this one still runs,
        find only the ranks this one does not serve ready, and serve the ranks in turn,
        each pass reading every expert for one rank, as replicas do (2A1F on one H200:
        the FFN rank captured graphs for each rank alone and never for both). Settled, the
        ranks of this pass get their outputs together, their next steps arrive within the
        batch window (connector_extra_config.batch_window_ms) and share one pass."""
        if self._settle_passes:
            torch.cuda.current_stream(self.device).synchronize()

    def _round_schedule(self, ready) -> str:
        """The schedule of this round: ffn_schedule, or with "auto" the one AutoSchedule
        chooses for its composition (join where there is nothing to choose: one rank, a
        micro-batched step); the period of the last round is recorded first."""
        if self.schedule != "auto":
            return self.schedule
        now = time.perf_counter()
        key = None
        if len(ready) > 1 and not any(ubatch_of(p.control.flags)[1] for p in ready):
            key = tuple(sorted((p.rank, p.control.num_tokens) for p in ready))
        last, self._auto_last = self._auto_last, None
        if last is not None and key is not None and last[0] == key:
            self._auto.record(key, last[1], now - last[2])
        if key is None:
            return "join"
        schedule = self._auto.choose(key)
        self._auto_last = (key, schedule, now)
        return schedule

    def _run_step(self, ready) -> bool:
        """Serve the steps of ``ready``; True when a layer ran. Micro-batched (DBO) steps
        are served on their own, layer by layer alternating between the micro-batches; the
        others share passes of at most max_pass_tokens, or are interleaved layer by layer
        (the round's schedule "pingpong"). With an async_io connector the passes run side
        by side (_serve_async); else one after another, each layer waiting for its ranks'
        inputs one rank after another."""
        schedule = self._round_schedule(ready) if ready else "join"
        if getattr(self.connector, "async_io", False):
            return self._serve_async(ready, schedule)
        ubatched = [p for p in ready if ubatch_of(p.control.flags)[1]]
        if ubatched:
            for peer in ubatched:
                try:
                    self._run_ubatched(peer)
                except AFDPeerError as e:
                    self._lose_peer(peer, e)
            ready = [p for p in ready if not ubatch_of(p.control.flags)[1]]
        passes = split_passes(ready, self.max_pass_tokens)
        if schedule == "pingpong" and len(ready) > 1:
            # Each rank's step is a pass of its own (split_passes checked its size).
            self._run_interleaved(ready)
            return True
        if len(passes) > 1:
            self._count_split(ready, len(passes))
        for peers in passes:
            self._run_pass(peers)
        return True

    # -- async_io connectors: every rank served as its bytes arrive --------------
    def _serve_async(self, ready, schedule: str = "join") -> bool:
        """Open a pass for the steps of ``ready`` (as _run_step cuts them) and serve the
        passes in flight until each is done or parked (_drive). True when a layer ran."""
        plain = [p for p in ready if not ubatch_of(p.control.flags)[1]]
        for peer in ready:
            if ubatch_of(peer.control.flags)[1]:
                self._open(_UbatchedPass, peer, peer)
        passes = split_passes(plain, self.max_pass_tokens)
        if schedule == "pingpong" and len(plain) > 1:
            # A pass per rank: _drive runs each one's layer as its input arrives, so the
            # ranks' layers interleave (A's layer l, B's layer l, A's layer l + 1, ...).
            passes = [[p] for p in plain]
            self._count_pingpong(plain)
        elif len(passes) > 1:
            self._count_split(plain, len(passes))
        for peers in passes:
            self._open(_Pass, peers[0], peers)
        return self._drive()

    def _open(self, kind, first, arg) -> None:
        try:
            task = kind(self, arg)
        except AFDPeerError as e:
            self._lose_peer(first, e)
            return
        if not task.done:
            self._tasks.append(task)

    def _drive(self) -> bool:
        """Run a layer of every pass whose inputs all arrived, pumping the bytes of all
        ranks meanwhile (connector.pump), until every pass is done or parked (its ranks
        late by STRAGGLER_S: the serve loop takes new steps then, and each wait_step
        comes back as soon as a posted message arrives). A pass's ranks whose inputs
        arrived go on without its late ones (_Pass.advance). True when a layer ran."""
        ran = False
        while self._tasks:
            now = time.monotonic()
            progressed = False
            for task in list(self._tasks):
                try:
                    progressed |= task.advance(now)
                except AFDPeerError as e:  # a micro-batched pass's only rank
                    self._lose_peer(task.first, e)
                    task.done = True
                if task.done:
                    self._tasks.remove(task)
            ran |= progressed
            active = [t for t in self._tasks if not t.parked]
            if not active:
                break
            if not progressed:
                wake = min(t.wake() for t in active)
                with record_function("afd.recv"):
                    self.connector.pump(max(0.0, wake - time.monotonic()))
        return ran

    def _wait_timeout(self) -> float:
        """How long the serve loop's wait_step may wait: 0.2 s, less when a parked pass
        must go on without its late ranks sooner."""
        wakes = [w for t in self._tasks if (w := t.wake()) is not None]
        if not wakes:
            return 0.2
        return min(0.2, max(0.0, min(wakes) - time.monotonic()))

    def _block(self, layer_idx: int, module, x: torch.Tensor, logits) -> torch.Tensor:
        """The FFN block of layer ``layer_idx`` on rows ``x`` (router logits ``logits``
        when the gate runs on the attention role): a replay of its layer graph when there
        is one (layer_graphs_enabled), else eager."""
        with record_function("afd.ffn_compute"):
            y = None
            if self.layer_graphs_enabled and not torch.cuda.is_current_stream_capturing():
                y = self._layer_graph(layer_idx, module, x, logits)
            if y is None:
                y = self._block_eager(layer_idx, module, x, logits)
            if self._sync_timing:
                torch.cuda.current_stream().synchronize()
        return y

    def _block_eager(self, layer_idx: int, module, x: torch.Tensor, logits) -> torch.Tensor:
        from vllm.forward_context import set_forward_context

        router = self.gates.get(layer_idx)
        with set_forward_context(None, self.vllm_config, num_tokens=x.shape[0]):
            return module(x) if router is None else router.forward(module, x, logits)

    def _layer_graph(self, layer_idx: int, module, x: torch.Tensor, logits) -> torch.Tensor | None:
        """The block's output from a replay of the graph of (layer, token count), captured
        when that pair recurs (layer_rule); None when it is served eagerly. The output
        is the graph's own buffer, rewritten by its next replay: every sender copies it
        out on this stream (or to the host) before that replay is enqueued."""
        key = (layer_idx, x.shape[0])
        g = self.layer_graphs.get(key)
        if g is None:
            due = self.layer_rule.due(key, self.steps_served, x.shape[0], len(self.layer_graphs))
            if not due or self.profiler is not None:  # no capture while the profiler records
                return None
            g = self._capture_layer(key, module, x, logits)
            if g is None:
                return None
        g.x.copy_(x)
        if g.logits is not None:
            g.logits.copy_(logits)
        g.graph.replay()
        self.layer_graph_replays += 1
        metrics.STATS.inc("ffn_layer_graph_replays")
        return g.out

    def _capture_layer(self, key: tuple[int, int], module, x: torch.Tensor,
                       logits) -> _LayerGraph | None:  # fmt: skip
        sx = x.clone()
        slogits = None if logits is None else logits.clone()
        try:
            graph, out, took = self._record_graph(
                lambda: self._block_eager(key[0], module, sx, slogits)
            )
        except Exception as e:  # noqa: BLE001 - eager serving goes on
            logger.warning("AFD FFN role: CUDA graph capture of layer %d at %d tokens failed "
                           "(%s); serving every layer eagerly", key[0], key[1], e)  # fmt: skip
            self.layer_graphs_enabled = False
            return None
        g = self.layer_graphs[key] = _LayerGraph(graph, sx, slogits, out)
        if len(self.layer_graphs) == 1 or len(self.layer_graphs) % len(self.modules) == 0:
            logger.info("AFD FFN role: captured CUDA graphs of the FFN layers' blocks (%d so "
                        "far, the last of layer %d at %d tokens in %.1f ms)",
                        len(self.layer_graphs), key[0], key[1], took * 1e3)  # fmt: skip
        return g

    def _note_straggler(self, pos: int, late: list, kept: list) -> None:
        self.straggler_splits += 1
        metrics.STATS.inc("ffn_straggler_splits")
        if self.straggler_splits == 1:
            logger.warning(
                "AFD FFN role: the input of layer position %d from attention rank(s) %s came "
                "%.2f s after that of rank(s) %s of the same pass: those are served on, the "
                "late rank(s) continue on their own as their bytes arrive, or end at their "
                "own deadline (timeout_s); logged once",
                pos, [p.rank for p in late], STRAGGLER_S, [p.rank for p in kept],
            )  # fmt: skip

    def _count_split(self, ready, n: int) -> None:
        if not self.split_steps:
            logger.info(
                "AFD FFN role: %d tokens of %d attention ranks ready at once, served in %d "
                "passes of at most %d tokens (connector_extra_config.ffn_max_tokens_per_pass); "
                "logged once", sum(p.control.num_tokens for p in ready), len(ready), n,
                self.max_pass_tokens,
            )  # fmt: skip
        self.split_steps += 1

    def _run_pass(self, ready) -> None:
        """One pass: the steps of ``ready`` (at most max_pass_tokens) share every layer."""
        key = tuple((p.rank, p.control.num_tokens) for p in ready)
        if self._replay(key, ready):
            return
        transfer, compute = self._step_body(ready, capture=False)
        self._account(ready, compute, transfer)
        if not any(p.rank in self._lost for p in ready):
            self._maybe_capture(key, sum(c for _, c in key), lambda: self._step_body(ready, True))

    # -- the loss of one attention rank ----------------------------------------
    def _lose_peer(self, peer, error: AFDPeerError) -> None:
        """``peer`` failed in the round being served. With a connector that survives
        it, the connector drops that rank (it may connect again) and the round goes
        on for the other ranks; else the error ends the serve loop."""
        if not self.connector.survives_peer_loss:
            raise error
        if peer.rank in self._lost:
            return
        self._lost.add(peer.rank)
        self.peers_lost += 1
        self.connector.drop_peer(peer, str(error))

    def _io(self, call: Callable, peer, t: torch.Tensor) -> bool:
        """``call(peer, t)`` (the connector's recv or send) unless ``peer`` was lost in
        this round; False when it is (or becomes) lost."""
        if peer.rank in self._lost:
            return False
        try:
            call(peer, t)
            return True
        except AFDPeerError as e:
            self._lose_peer(peer, e)
            return False

    def _replay(self, key: tuple, ready, batched: bool = True) -> bool:
        """Replay the FFN graph captured for ``key``; False when there is none."""
        if not self.graphs_enabled:
            return False
        if self.connector.generation != self._graph_gen:
            # An attention rank (re)joined: its buffers moved.
            self.graphs.clear()
            self.step_rule.forget()
            self._graph_gen = self.connector.generation
        graph = self.graphs.get(key)
        if graph is None:
            return False
        with record_function("afd.ffn_graph_replay"):
            graph.replay()
        self.graph_replays += 1
        metrics.STATS.inc("ffn_graph_replays")
        self._account(ready, None, None, batched)
        return True

    def _maybe_capture(self, key: tuple, total: int, body: Callable[[], object]) -> None:
        """Capture the step ``key`` of ``total`` tokens, just served eagerly, when the
        step rule says it recurs (CaptureRule)."""
        if not self.graphs_enabled:
            return
        due = self.step_rule.due(key, self.steps_served, total, len(self.graphs))
        if due and self.profiler is None:  # no capture while the torch profiler records
            self._capture(key, body)

    def _record_graph(self, body: Callable[[], object]) -> tuple[torch.cuda.CUDAGraph, object, float]:
        """``body`` captured as a CUDA graph in the FFN rank's graph pool, what it returned
        (the tensors the graph writes) and the seconds the capture took (counted in the
        metrics); raises what the capture raised."""
        t0 = time.perf_counter()
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool, capture_error_mode="thread_local"):
            result = body()
        took = time.perf_counter() - t0
        metrics.STATS.record({"ffn_graph_captures": 1, "ffn_graph_capture_seconds": took})
        return graph, result, took

    def _capture(self, key: tuple, body: Callable[[], object]) -> None:
        try:
            graph, _, took = self._record_graph(body)
        except Exception as e:  # noqa: BLE001 - eager serving goes on
            logger.warning(
                "AFD FFN role: CUDA graph capture for %s failed (%s); serving it eagerly", key, e
            )
            self.step_rule.max_count = 0
            return
        self.graphs[key] = graph
        logger.info(
            "AFD FFN role: captured a CUDA graph for step %s in %.1f ms (%d graphs)",
            key,
            took * 1e3,
            len(self.graphs),
        )

    def _step_bytes(self, ready) -> tuple[int, int]:
        """Bytes received and sent by one step (hidden states of every FFN layer,
        plus float32 router logits of the gated layers)."""
        total = sum(p.control.num_tokens for p in ready)
        elem = torch.empty((), dtype=self.dtype).element_size()
        n = len(self.modules)
        logits = sum(g.num_experts * 4 for g in self.gates.values())
        return (
            n * total * self.hidden_size * elem + total * logits,
            n * total * self.hidden_size * elem,
        )

    def _account(self, ready, compute, transfer, batched: bool = True) -> None:
        nbytes_in, nbytes_out = self._step_bytes(ready)
        self.steps_served += 1
        counters = {"ffn_steps_served": 1, "bytes_received": nbytes_in,
                    "bytes_sent": nbytes_out}
        if batched and len(ready) > 1:
            self.batched_steps += 1
            counters["ffn_batched_steps"] = 1
        metrics.STATS.record(
            counters,
            None if compute is None else {"ffn_step_compute_seconds": compute,
                                          "ffn_step_transfer_seconds": transfer},
        )

    def _run_ubatched(self, first) -> None:
        """Serve one micro-batched step of one attention rank: for every layer,
        micro-batch 0, 1, ... in turn (the order the attention's micro-batch
        threads send in). Over TCP a later micro-batch's control message arrives
        just before its first layer's data; a connector whose first control
        message announces every micro-batch (``ubatch_controls_upfront``, the
        device channel of cuda_ipc) gives them all at once, so the whole step
        can run as one FFN CUDA graph."""
        index, count = ubatch_of(first.control.flags)
        if index != 0:
            raise AFDPeerError(
                f"AFD attention rank {first.rank} opened a step with micro-batch {index} "
                f"of {count} (expected 0)"
            )
        peers = [first]
        key = None
        if self.connector.ubatch_controls_upfront:
            peers += [self._next_ubatch(first, i, count) for i in range(1, count)]
            key = ("ubatched", first.rank, *(p.control.num_tokens for p in peers))
            if self._replay(key, peers, batched=False):
                self._count_ubatched(first.rank, count)
                return
        transfer, compute = self._ubatched_body(first, peers, count, capture=False)
        self._count_ubatched(first.rank, count)
        self._account(peers, compute, transfer, batched=False)
        if key is not None:
            total = sum(p.control.num_tokens for p in peers)
            self._maybe_capture(key, total, lambda: self._ubatched_body(first, peers, count, True))

    def _next_ubatch(self, first, i: int, count: int):
        ctrl = self.connector.recv_control(first)
        if (
            ctrl.type != MSG_STEP
            or ctrl.step_id != first.control.step_id
            or ubatch_of(ctrl.flags) != (i, count)
        ):
            raise AFDPeerError(
                f"AFD attention rank {first.rank}: expected micro-batch {i} of "
                f"{count} of step {first.control.step_id}, got step "
                f"{ctrl.step_id} flags {ctrl.flags:#x}"
            )
        return StepPeer(first.rank, ctrl)

    def _ubatched_body(self, first, peers: list, count: int, capture: bool):
        """Every layer for micro-batches 0..count-1 in turn; ``peers`` grows by
        the controls received on the way. Returns (transfer, compute)."""
        from vllm.forward_context import set_forward_context

        transfer = compute = 0.0
        sync = self._sync_timing and not capture
        for layer_idx, module in self.modules.items():
            if first.rank in self._lost:
                break
            for i in range(count):
                if len(peers) == i:
                    peers.append(self._next_ubatch(first, i, count))
                peer = peers[i]
                n = peer.control.num_tokens
                x = torch.empty((n, self.hidden_size), dtype=self.dtype, device=self.device)
                with set_forward_context(None, self.vllm_config, num_tokens=n):
                    t, c = self._layer(layer_idx, module, [peer], x, [0, n], sync, capture)
                transfer += t
                compute += c
        return transfer, compute

    def _run_interleaved(self, ready) -> None:
        """Serve the steps of ``ready`` (several ranks, none micro-batched) interleaved
        layer by layer in their order: rank A's layer l, rank B's layer l, ..., A's layer
        l + 1. Each hand-over waits for its own rank's input only, so a rank computes its
        attention for layer l + 1 while the FFN serves the other ranks' layer l. Captured
        as one CUDA graph per ordered composition, keyed apart from the joined ones."""
        key = ("pingpong", *((p.rank, p.control.num_tokens) for p in ready))
        if self._replay(key, ready, batched=False):
            self._count_pingpong(ready)
            return
        transfer, compute = self._interleaved_body(ready, capture=False)
        self._count_pingpong(ready)
        self._account(ready, compute, transfer, batched=False)
        if not any(p.rank in self._lost for p in ready):
            total = sum(p.control.num_tokens for p in ready)
            self._maybe_capture(key, total, lambda: self._interleaved_body(ready, True))

    def _interleaved_body(self, ready, capture: bool):
        """Every layer for the steps of ``ready`` in turn, each on its own rows (its own
        block call: a rank's FFN work is the same as when served alone). A rank lost on
        the way is skipped from then on. Returns (transfer, compute)."""
        from vllm.forward_context import set_forward_context

        transfer = compute = 0.0
        sync = self._sync_timing and not capture
        for layer_idx, module in self.modules.items():
            live = [p for p in ready if p.rank not in self._lost]
            if not live:
                break
            for peer in live:
                n = peer.control.num_tokens
                x = torch.empty((n, self.hidden_size), dtype=self.dtype, device=self.device)
                with set_forward_context(None, self.vllm_config, num_tokens=n):
                    t, c = self._layer(layer_idx, module, [peer], x, [0, n], sync, capture)
                transfer += t
                compute += c
        return transfer, compute

    def _count_pingpong(self, ready) -> None:
        if not self.pingpong_steps:
            logger.info(
                "AFD FFN role: serving the steps of attention ranks %s interleaved layer by "
                "layer (connector_extra_config.ffn_schedule %r); logged once",
                [p.rank for p in ready], self.schedule,
            )
        self.pingpong_steps += 1
        metrics.STATS.inc("ffn_pingpong_steps")

    def _count_ubatched(self, rank: int, count: int) -> None:
        if not self.ubatched_steps:
            logger.info(
                "AFD FFN role: serving micro-batched (DBO) steps of attention rank %d "
                "(%d micro-batches, alternating layer by layer)", rank, count,
            )
        self.ubatched_steps += 1
        metrics.STATS.inc("ffn_ubatched_steps")

    def _step_body(self, ready, capture: bool):
        """Receive, compute and send every layer of one step. With
        ``capture`` this runs inside CUDA graph capture: device work only."""
        from vllm.forward_context import set_forward_context

        counts = [p.control.num_tokens for p in ready]
        total = sum(counts)
        offsets = [0]
        for c in counts:
            offsets.append(offsets[-1] + c)
        x = torch.empty((total, self.hidden_size), dtype=self.dtype, device=self.device)
        sync = self._sync_timing and not capture
        transfer = compute = 0.0
        with set_forward_context(None, self.vllm_config, num_tokens=total):
            for layer_idx, module in self.modules.items():
                t, c = self._layer(layer_idx, module, ready, x, offsets, sync, capture)
                transfer += t
                compute += c
        return transfer, compute

    def _layer(self, layer_idx, module, ready, x, offsets, sync: bool, capture: bool,
               gather: Callable[[torch.Tensor], torch.Tensor] | None = None, out_start: int = 0):
        """One layer for the step peers `ready` (rows offsets[i]:offsets[i+1] of
        x are peer i's): receive, run the block, send. Returns (transfer, compute).
        In an FFN group, ``gather`` turns this member's rows (and router logits)
        into the whole group's, and this member's rows of the block's output
        start at ``out_start``."""
        clock = time.perf_counter
        total = x.shape[0]
        t0 = clock()
        with record_function("afd.recv"):
            # A rank lost in this round contributes zero rows (its outputs are not sent).
            for i, peer in enumerate(ready):
                rows = x[offsets[i] : offsets[i + 1]]
                if not self._io(self.connector.recv, peer, rows):
                    rows.zero_()
            router = self.gates.get(layer_idx)
            logits = None
            if router is not None:
                logits = torch.empty(
                    (total, router.num_experts), dtype=torch.float32, device=self.device
                )
                for i, peer in enumerate(ready):
                    rows = logits[offsets[i] : offsets[i + 1]]
                    if not self._io(self.connector.recv, peer, rows):
                        rows.zero_()
        t1 = clock()
        with record_function("afd.ffn_compute"):
            if gather is not None:
                x = gather(x)
                logits = None if logits is None else gather(logits)
            y = module(x) if router is None else router.forward(module, x, logits)
            if sync:
                # The TCP connector stages through host memory anyway;
                # syncing here only moves the wait into compute time.
                torch.cuda.current_stream().synchronize()
        t2 = clock()
        with record_function("afd.send"):
            for i, peer in enumerate(ready):
                rows = y[out_start + offsets[i] : out_start + offsets[i + 1]]
                self._io(self.connector.send, peer, rows)
        t3 = clock()
        if not capture:
            metrics.STATS.layer(layer_idx, t2 - t1)
        return (t1 - t0) + (t3 - t2), t2 - t1

    def request_profile(self, start: bool) -> None:
        """Start/stop profiling from this FFN server's own profiler controls;
        the serve thread acts on it before its next step."""
        with self._profile_lock:
            self._profile_local.append(start)

    def _profile(self, start: bool) -> None:
        """A profiler request from an attention rank, run in the serve thread
        (the thread whose work the trace must show)."""
        pcfg = getattr(self.vllm_config, "profiler_config", None)
        if pcfg is None or getattr(pcfg, "profiler", None) != "torch":
            _LOG_NO_PROFILER(
                logger.warning,
                "AFD FFN role: asked to %s profiling, but this FFN "
                "server has no torch profiler configured; start it with "
                '--profiler-config \'{"profiler": "torch", "torch_profiler_dir": DIR}\' '
                "to get FFN traces",
                "start" if start else "stop",
            )
            return
        if start:
            if self.profiler is None:
                from vllm.profiler.wrapper import TorchProfilerWrapper

                activities = ["CPU", "CUDA"] if self.device.type == "cuda" else ["CPU"]
                self.profiler = TorchProfilerWrapper(
                    pcfg, worker_name=f"afd-ffn-rank{self.rank}", local_rank=self.rank,
                    activities=activities,
                )  # fmt: skip
                self.profiler.start()
                logger.info(
                    "AFD FFN role: profiler started (traces to %s)", pcfg.torch_profiler_dir
                )
        elif self.profiler is not None:
            profiler, self.profiler = self.profiler, None
            profiler.stop()
            logger.info(
                "AFD FFN role: profiler stopped, trace written to %s", pcfg.torch_profiler_dir
            )

    def stop(self) -> None:
        self._stop.set()
        if self.connector is not None:
            self.connector.close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def shutdown(self) -> None:
        self.stop()


class _Pass:
    """A pass of an async_io connector: the steps of ``peers`` share every layer from
    layer position ``pos`` on. Each layer's inputs are posted (rows of ``x``, and of
    ``logits`` when the gate runs on the attention role); the layer runs once all of
    them arrived. A rank whose input is STRAGGLER_S later than the first of the pass's
    is split off into a pass of its own, parked, which keeps the rows it is receiving
    into and goes on when they arrived."""

    def __init__(self, runner: FFNModelRunner, peers: list, pos: int = 0, split=None):
        self.runner = runner
        self.conn = runner.connector
        self.layers = list(runner.modules.items())
        self.peers = list(peers)
        self.first = self.peers[0]
        self.pos = pos
        self.done = self.parked = False
        self.transfer = self.compute = 0.0
        if split is None:
            self._post()
        else:  # the late ranks of another pass, still receiving into its rows
            self.x, self.logits, self.rows, self.since = split
            self.arrived_at: float | None = None
            self.parked = True

    def _post(self) -> None:
        """Post this layer's inputs of every rank: rows of fresh ``x`` (and logits)."""
        r = self.runner
        idx = self.layers[self.pos][0]
        router = r.gates.get(idx)
        total = sum(p.control.num_tokens for p in self.peers)
        self.x = torch.empty((total, r.hidden_size), dtype=r.dtype, device=r.device)
        self.logits = None
        if router is not None:
            self.logits = torch.empty((total, router.num_experts), dtype=torch.float32,
                                      device=r.device)  # fmt: skip
        self.rows: dict[int, tuple[int, int]] = {}
        end = 0
        for p in list(self.peers):
            start, end = end, end + p.control.num_tokens
            self.rows[p.rank] = (start, end)
            posted = r._io(self.conn.post_recv, p, self.x[start:end])
            if posted and self.logits is not None:
                posted = r._io(self.conn.post_recv, p, self.logits[start:end])
            if not posted:
                self.peers.remove(p)
        self.since = time.monotonic()
        self.arrived_at = None
        self.parked = False
        if not self.peers:
            self.done = True

    def wake(self) -> float | None:
        """When this pass must go on without its late ranks (or park); None while parked
        and none of its inputs arrived (it goes on once they do)."""
        if self.arrived_at is not None:
            return self.arrived_at + STRAGGLER_S
        return None if self.parked else self.since + STRAGGLER_S

    def advance(self, now: float) -> bool:
        """Run this layer if its inputs all arrived, or those that did once the others are
        STRAGGLER_S late; park the pass when none arrived within STRAGGLER_S. True when a
        layer ran (or the pass lost all its ranks)."""
        late = []
        for p in list(self.peers):
            try:
                if not self.conn.arrived(p):
                    late.append(p)
            except AFDPeerError as e:  # its own deadline passed, EOF, a protocol error
                self.runner._lose_peer(p, e)
                self.peers.remove(p)
        if not self.peers:
            self.done = True
            return True
        if not late:
            self._layer()
            return True
        if len(late) < len(self.peers):
            if self.arrived_at is None:
                self.arrived_at = now
            if now - self.arrived_at >= STRAGGLER_S:
                self._split(late)
                self._layer()
                return True
        elif not self.parked and now - self.since >= STRAGGLER_S:
            self.parked = True
        return False

    def _split(self, late: list) -> None:
        kept = [p for p in self.peers if not any(p is q for q in late)]
        self.runner._note_straggler(self.pos, late, kept)
        rows = {p.rank: self.rows[p.rank] for p in late}
        self.runner._tasks.append(
            _Pass(self.runner, late, self.pos, (self.x, self.logits, rows, self.since))
        )
        self.peers = kept

    def _layer(self) -> None:
        """Take this layer's inputs, run the block on them, post each rank its rows of
        the output and the next layer's inputs."""
        r, conn = self.runner, self.conn
        idx, module = self.layers[self.pos]
        t0 = time.perf_counter()
        with record_function("afd.recv"):
            for p in list(self.peers):
                try:
                    conn.take(p)
                except AFDPeerError as e:
                    r._lose_peer(p, e)
                    self.peers.remove(p)
        if not self.peers:
            self.done = True
            return
        spans = [self.rows[p.rank] for p in self.peers]
        x = _rows(self.x, spans)
        logits = None if self.logits is None else _rows(self.logits, spans)
        t1 = time.perf_counter()
        y = r._block(idx, module, x, logits)
        t2 = time.perf_counter()
        with record_function("afd.send"):
            a = 0
            for p in list(self.peers):
                n = p.control.num_tokens
                if not r._io(conn.post_send, p, y[a : a + n]):
                    self.peers.remove(p)
                a += n
        t3 = time.perf_counter()
        metrics.STATS.layer(idx, t2 - t1)
        self.transfer += (t1 - t0) + (t3 - t2)
        self.compute += t2 - t1
        self.pos += 1
        if not self.peers:
            self.done = True
        elif self.pos == len(self.layers):
            self.done = True
            r._account(self.peers, self.compute, self.transfer)
        else:
            self._post()


class _UbatchedPass:
    """A micro-batched (DBO) step of one rank over an async_io connector: for every layer,
    micro-batch 0, 1, ... in turn, as _run_ubatched serves it, each message posted and the
    layer of a micro-batch run once its input arrived (a later micro-batch's control message
    first, at layer 0). Parked when its rank is STRAGGLER_S late: the others are served
    meanwhile."""

    def __init__(self, runner: FFNModelRunner, first):
        index, count = ubatch_of(first.control.flags)
        if index != 0:
            raise AFDPeerError(
                f"AFD attention rank {first.rank} opened a step with micro-batch {index} "
                f"of {count} (expected 0)"
            )
        self.runner = runner
        self.conn = runner.connector
        self.layers = list(runner.modules.items())
        self.first, self.count = first, count
        self.peers = [first]  # one step peer per micro-batch, as their controls arrive
        self.pos = self.i = 0
        self.done = self.parked = False
        self.transfer = self.compute = 0.0
        self._post()

    def _post(self) -> None:
        r = self.runner
        self.x = self.logits = None
        if self.i == len(self.peers):
            self.conn.post_control(self.first)
        else:
            n = self.peers[self.i].control.num_tokens
            router = r.gates.get(self.layers[self.pos][0])
            self.x = torch.empty((n, r.hidden_size), dtype=r.dtype, device=r.device)
            self.conn.post_recv(self.peers[self.i], self.x)
            if router is not None:
                self.logits = torch.empty((n, router.num_experts), dtype=torch.float32,
                                          device=r.device)  # fmt: skip
                self.conn.post_recv(self.peers[self.i], self.logits)
        self.since = time.monotonic()
        self.parked = False

    def wake(self) -> float | None:
        return None if self.parked else self.since + STRAGGLER_S

    def advance(self, now: float) -> bool:
        if not self.conn.arrived(self.first):
            if not self.parked and now - self.since >= STRAGGLER_S:
                self.parked = True
            return False
        r = self.runner
        t0 = time.perf_counter()
        controls = self.conn.take(self.first)
        if self.x is None:  # micro-batch i's control message
            ctrl = controls[-1]
            if (
                ctrl.type != MSG_STEP
                or ctrl.step_id != self.first.control.step_id
                or ubatch_of(ctrl.flags) != (self.i, self.count)
            ):
                raise AFDPeerError(
                    f"AFD attention rank {self.first.rank}: expected micro-batch {self.i} of "
                    f"{self.count} of step {self.first.control.step_id}, got step "
                    f"{ctrl.step_id} flags {ctrl.flags:#x}"
                )
            self.peers.append(StepPeer(self.first.rank, ctrl, self.first.session))
            self._post()
            return True
        idx, module = self.layers[self.pos]
        t1 = time.perf_counter()
        y = r._block(idx, module, self.x, self.logits)
        t2 = time.perf_counter()
        with record_function("afd.send"):
            self.conn.post_send(self.peers[self.i], y)
        t3 = time.perf_counter()
        metrics.STATS.layer(idx, t2 - t1)
        self.transfer += (t1 - t0) + (t3 - t2)
        self.compute += t2 - t1
        self.i += 1
        if self.i == self.count:
            self.i, self.pos = 0, self.pos + 1
        if self.pos == len(self.layers):
            self.done = True
            r._count_ubatched(self.first.rank, self.count)
            r._account(self.peers, self.compute, self.transfer, batched=False)
        else:
            self._post()
        return True


def _rows(t: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """The rows ``spans`` of ``t``, in order: ``t`` itself when they cover it."""
    if spans[0][0] == 0 and spans[-1][1] == t.shape[0] and all(
        a[1] == b[0] for a, b in zip(spans, spans[1:])
    ):
        return t
    if len(spans) == 1:
        return t[spans[0][0] : spans[0][1]]
    return torch.cat([t[a:b] for a, b in spans])
