# SPDX-License-Identifier: Apache-2.0
"""Configuration of Attention-FFN Disaggregation (AFD).

Pure Python on purpose (no torch, no pydantic): the same module validates
``--afd-config`` at argument-parse time, lives on ``VllmConfig.afd_config``
and is unit-tested without a vLLM runtime.

Two spellings are accepted:

* ``vllm serve MODEL --afd-config '{"role": "ffn", ...}'``
* ``vllm serve MODEL --additional-config '{"afd": {"role": "ffn", ...}}'``
  (the shape afd-plugin users already have); giving both is an error.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

ROLES = ("attention", "ffn")

# Connector names as users may write them -> canonical connector name.
CONNECTOR_ALIASES = {
    "gloo": "gloo",
    "tcp": "gloo",
    "nccl": "nccl",
    "p2pncclafdconnector": "nccl",
    "cuda_ipc": "cuda_ipc",
    "ipc": "cuda_ipc",
}

# Connectors whose layer exchange is device work only (kernels and copies on
# the current stream, step control included), so it can be captured in a CUDA
# graph. With any other connector the attention role on a GPU runs eager.
GRAPH_CAPABLE_CONNECTORS = ("cuda_ipc",)

# Connectors that serve micro-batched (DBO) steps: the attention side receives a
# micro-batch's reply in the background, the FFN side reads later micro-batches'
# controls. Their classes say dbo_capable = True (register_connector checks both).
DBO_CONNECTORS = ("gloo", "cuda_ipc")
# The connector DBO runs with on each device type (the CPU has no streams to
# overlap device transfers with; on CUDA the exchange must be device work).
DBO_CONNECTOR_OF_DEVICE = {"cpu": "gloo", "cuda": "cuda_ipc"}
# Micro-batches per step the cuda_ipc connector has inboxes for.
IPC_MAX_UBATCHES = 2

# The largest FFN ranks count the NCCL connector serves in this release
# (M:N with several FFN ranks needs expert parallelism between them).
NCCL_MAX_FFN_RANKS = 1


# Bounds of the top-level numbers (README.md, "Keys"), checked at config time: a value
# outside them crashed later or misbehaved (timeout_s 1e10 overflowed a socket timeout
# at connect, 1e-7 spun the heartbeat; 10**9 attention ranks built rank lists of that
# size; a huge rejoin_timeout_s overflowed the same way as timeout_s).
TIMEOUT_S_RANGE = (0.5, 86400.0)  # seconds: a silent peer's bound; at most a day
REJOIN_TIMEOUT_S_MAX = 86400.0  # seconds (0 turns rejoining off)
MAX_RANKS = 1024  # num_attention_ranks, num_ffn_ranks
DBO_MIN_TOKENS_MAX = 2**31 - 1


class AFDConfigError(ValueError):
    """A bad AFD configuration; the message names the key and the fix."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class AFDConfig:
    role: str
    connector: str = "gloo"
    host: str = "127.0.0.1"
    port: int = 29600
    num_attention_ranks: int = 1
    num_ffn_ranks: int = 1
    compute_gate_on_attention: bool = False
    timeout_s: float = 60.0
    connector_extra_config: dict[str, Any] = field(default_factory=dict)
    # Index of this process among the ranks of its role. Optional: it defaults
    # to the data-parallel rank of the engine (0 without data parallelism).
    rank: int | None = None
    # Attention role with --enable-dbo: the smallest step (tokens) that is split into
    # micro-batches. "auto": on CUDA the break-even of the FFN cost model
    # (vllm.afd.dbo.break_even_tokens), on the CPU 0 (vLLM's DBO thresholds alone);
    # an integer sets it (0: vLLM's thresholds alone).
    dbo_min_tokens: int | str = "auto"
    # Attention role: how long a step waits for a lost FFN rank to come back (seconds,
    # from the loss): the attention rank reconnects to it with backoff, re-handshakes
    # and re-runs the interrupted step's FFN exchanges (vllm.afd.rejoin). None: timeout_s;
    # 0: no rejoin, a lost FFN rank ends the engine at once.
    rejoin_timeout_s: float | None = None

    # ------------------------------------------------------------------ parse
    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(cls.__dataclass_fields__)

    @classmethod
    def from_dict(cls, raw: Any, source: str = "--afd-config") -> AFDConfig:
        if isinstance(raw, AFDConfig):
            return raw
        if not isinstance(raw, dict):
            raise AFDConfigError(f"{source}: expected a JSON object, got {type(raw).__name__}")
        unknown = sorted(set(raw) - set(cls.keys()))
        if unknown:
            raise AFDConfigError(
                f"{source}: unknown key(s) {', '.join(map(repr, unknown))}; "
                f"allowed keys: {', '.join(cls.keys())}"
            )
        if "role" not in raw:
            raise AFDConfigError(f"{source}: 'role' is required ('attention' or 'ffn')")
        values = dict(raw)
        if "connector_extra_config" in values and values["connector_extra_config"] is None:
            values["connector_extra_config"] = {}
        cfg = cls(**values)
        cfg.validate(source)
        return cfg

    @classmethod
    def from_json(cls, text: str, source: str = "--afd-config") -> AFDConfig:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise AFDConfigError(f"{source}: not valid JSON ({e.msg} at {e.pos})") from e
        return cls.from_dict(raw, source)

    @classmethod
    def from_engine_args(cls, afd_config: Any, additional_config: Any) -> AFDConfig | None:
        """Merge the two spellings; both at once is an error."""
        from_additional = None
        if isinstance(additional_config, dict) and "afd" in additional_config:
            from_additional = additional_config["afd"]
        if afd_config is not None and from_additional is not None:
            raise AFDConfigError(
                "AFD is configured twice: give either --afd-config or "
                "--additional-config '{\"afd\": ...}', not both"
            )
        if afd_config is not None:
            if isinstance(afd_config, str):
                return cls.from_json(afd_config)
            return cls.from_dict(afd_config)
        if from_additional is not None:
            return cls.from_dict(from_additional, source="--additional-config afd")
        return None

    # --------------------------------------------------------------- validate
    def validate(self, source: str = "--afd-config") -> None:
        """Check every key (raises AFDConfigError naming ``source``) and canonicalise the
        connector name; the checks run in this order, so the first bad key is named."""

        def fail(msg: str) -> None:
            raise AFDConfigError(f"{source}: {msg}")

        self._validate_role_and_connector(fail)
        self._validate_address_and_ranks(fail)
        self._validate_flags_and_timeouts(fail)
        self._validate_rank_and_dbo(fail)
        self._validate_bounds(fail)
        self._validate_extra(fail)

    def _validate_role_and_connector(self, fail) -> None:
        if not isinstance(self.role, str) or self.role not in ROLES:
            fail(f"'role' must be one of {', '.join(ROLES)}; got {self.role!r}")
        if not isinstance(self.connector, str):
            fail(f"'connector' must be a string; got {type(self.connector).__name__}")
        canonical = CONNECTOR_ALIASES.get(self.connector.lower())
        if canonical is None:
            fail(
                f"unknown connector {self.connector!r}; known: "
                f"{', '.join(sorted(CONNECTOR_ALIASES))}"
            )
        object.__setattr__(self, "connector", canonical)

    def _validate_address_and_ranks(self, fail) -> None:
        """host, port, the rank counts and the FFN ranks' ports (port + f)."""
        if not isinstance(self.host, str):
            fail(f"'host' must be a string; got {type(self.host).__name__}")
        if not self.host.strip():
            fail("'host' must not be empty")
        if not _is_int(self.port):
            fail(f"'port' must be an integer; got {self.port!r}")
        if not 1 <= self.port <= 65535:
            fail(f"'port' must be in 1..65535; got {self.port}")
        for key in ("num_attention_ranks", "num_ffn_ranks"):
            value = getattr(self, key)
            if not _is_int(value):
                fail(f"{key!r} must be an integer; got {value!r}")
            if value < 1:
                fail(f"{key!r} must be at least 1; got {value}")
        m, n = self.num_attention_ranks, self.num_ffn_ranks
        if m < n:
            fail(
                f"num_attention_ranks ({m}) must be >= num_ffn_ranks ({n}): "
                "each FFN rank serves one or more attention ranks"
            )
        if m % n:
            fail(
                f"num_attention_ranks ({m}) must be a multiple of num_ffn_ranks ({n}) "
                "so that every FFN rank serves the same number of attention ranks"
            )
        if self.port + n - 1 > 65535:
            fail(f"FFN rank ports {self.port}..{self.port + n - 1} exceed 65535")
        if self.connector == "nccl" and n > NCCL_MAX_FFN_RANKS:
            fail(
                f"connector 'nccl' serves num_ffn_ranks <= {NCCL_MAX_FFN_RANKS} in this "
                f"release; got {n} (use more attention ranks per FFN rank instead)"
            )

    def _validate_flags_and_timeouts(self, fail) -> None:
        """compute_gate_on_attention, timeout_s, rejoin_timeout_s, and that
        connector_extra_config is an object with string keys."""
        if not isinstance(self.compute_gate_on_attention, bool):
            fail(
                "'compute_gate_on_attention' must be true or false; "
                f"got {self.compute_gate_on_attention!r}"
            )
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)):
            fail(f"'timeout_s' must be a number of seconds; got {self.timeout_s!r}")
        if not math.isfinite(self.timeout_s) or self.timeout_s <= 0:
            fail(f"'timeout_s' must be a positive number of seconds; got {self.timeout_s}")
        self._validate_rejoin(fail)
        if not isinstance(self.connector_extra_config, dict):
            fail(
                "'connector_extra_config' must be a JSON object; got "
                f"{type(self.connector_extra_config).__name__}"
            )
        if any(not isinstance(k, str) for k in self.connector_extra_config):
            fail("'connector_extra_config' keys must be strings")

    def _validate_rank_and_dbo(self, fail) -> None:
        if self.rank is not None:
            if not _is_int(self.rank):
                fail(f"'rank' must be an integer; got {self.rank!r}")
            limit = self.num_attention_ranks if self.role == "attention" else self.num_ffn_ranks
            if not 0 <= self.rank < limit:
                fail(f"'rank' {self.rank} is out of range for role {self.role!r} (0..{limit - 1})")
        if self.dbo_min_tokens != "auto" and (
            not _is_int(self.dbo_min_tokens) or self.dbo_min_tokens < 0
        ):
            fail(
                "'dbo_min_tokens' must be \"auto\" or a non-negative integer (tokens of the "
                f"smallest step split into micro-batches); got {self.dbo_min_tokens!r}"
            )

    def _validate_bounds(self, fail) -> None:
        """The top-level numbers within their bounds (their types were checked before;
        port and rank are bounded there)."""
        lo, hi = TIMEOUT_S_RANGE
        if not lo <= self.timeout_s <= hi:
            fail(f"'timeout_s' must be between {lo:g} and {hi:g} seconds; got {self.timeout_s:g}")
        if self.rejoin_timeout_s is not None and self.rejoin_timeout_s > REJOIN_TIMEOUT_S_MAX:
            fail(
                f"'rejoin_timeout_s' must be at most {REJOIN_TIMEOUT_S_MAX:g} seconds (0 turns "
                f"rejoining off); got {self.rejoin_timeout_s:g}"
            )
        for key in ("num_attention_ranks", "num_ffn_ranks"):
            if getattr(self, key) > MAX_RANKS:
                fail(f"{key!r} must be at most {MAX_RANKS}; got {getattr(self, key)}")
        if _is_int(self.dbo_min_tokens) and self.dbo_min_tokens > DBO_MIN_TOKENS_MAX:
            fail(f"'dbo_min_tokens' must be at most {DBO_MIN_TOKENS_MAX}; got {self.dbo_min_tokens}")

    def _validate_extra(self, fail) -> None:
        """The keys of connector_extra_config (docs/connectors.md)."""
        extra = self.connector_extra_config
        window = extra.get("batch_window_ms", 0)
        if isinstance(window, bool) or not isinstance(window, (int, float)) or window < 0:
            fail("connector_extra_config.batch_window_ms must be a non-negative number")
        secret_env = extra.get("secret_env")
        if secret_env is not None and not isinstance(secret_env, str):
            fail("connector_extra_config.secret_env must be the name of an environment variable")
        self._validate_failover(fail)
        for key in ("ffn_cuda_graphs", "early_step_control", "ffn_hot_poll"):
            value = extra.get(key, True)
            if not isinstance(value, bool):
                fail(f"connector_extra_config.{key} must be true or false; got {value!r}")
        per_pass = extra.get("ffn_max_tokens_per_pass")
        if per_pass is not None and (not _is_int(per_pass) or per_pass < 1):
            fail(
                "connector_extra_config.ffn_max_tokens_per_pass must be a positive integer "
                f"(tokens); got {per_pass!r}"
            )
        for key in ("ffn_cuda_graph_max_tokens", "ffn_cuda_graph_max_count",
                    "ffn_cuda_graph_window"):
            value = extra.get(key, 0)
            if not _is_int(value) or value < 0:
                fail(f"connector_extra_config.{key} must be a non-negative integer; got {value!r}")

    def _validate_failover(self, fail) -> None:
        """connector_extra_config.ffn_failover: FFN replicas (num_ffn_ranks > 1 servers,
        each holding every expert) on the gloo connector; an FFN group is refused in
        _verify_parallel (its ranks split the experts, none can serve another's rank)."""
        failover = self.connector_extra_config.get("ffn_failover", False)
        if not isinstance(failover, bool):
            fail(f"connector_extra_config.ffn_failover must be true or false; got {failover!r}")
        if not failover:
            return
        if self.num_ffn_ranks < 2:
            fail(
                "connector_extra_config.ffn_failover needs FFN replicas to fail over to "
                f"(num_ffn_ranks > 1, one FFN server each); got num_ffn_ranks "
                f"{self.num_ffn_ranks}: drop the key (a lost FFN rank is rejoined, "
                "rejoin_timeout_s)"
            )
        if self.connector != "gloo":
            fail(
                "connector_extra_config.ffn_failover is served by connector 'gloo' (tcp) in "
                f"this release; got {self.connector!r}: drop the key"
            )

    @property
    def ffn_failover(self) -> bool:
        """An attention rank whose FFN rank is lost fails over to another FFN replica,
        and an FFN rank takes such ranks as guests (connector_extra_config.ffn_failover)."""
        return self.connector_extra_config.get("ffn_failover", False) is True

    def _validate_rejoin(self, fail) -> None:
        value = self.rejoin_timeout_s
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            fail(
                "'rejoin_timeout_s' must be a number of seconds (0 turns rejoining off: a "
                f"lost FFN rank then ends the attention engine at once); got {value!r}"
            )
        if not math.isfinite(value) or value < 0:
            fail(
                "'rejoin_timeout_s' must be a finite number of seconds >= 0 (how long a step "
                f"waits for a lost FFN rank to come back; 0: not at all); got {value}"
            )

    def rejoin_warning(self, environ: dict[str, str]) -> str | None:
        """Why this attention rank's rejoin window is cut short, if it is: vLLM's executor
        gives up on a step (a held one too) after $VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS
        (default 300) when the worker runs in its own process (``vllm serve``'s default)."""
        try:
            limit = float(environ.get("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "300"))
        except ValueError:
            return None
        if not self.is_attention or self.rejoin_window_s < limit:
            return None
        return (
            f"AFD: rejoin_timeout_s ({self.rejoin_window_s:g} s; default timeout_s) is not "
            f"below VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS ({limit:g} s): vLLM's executor gives up "
            "on a step held that long and ends the engine first. Lower rejoin_timeout_s, or "
            "raise VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS on the attention server"
        )

    @property
    def rejoin_window_s(self) -> float:
        """Seconds a lost FFN rank has to come back (``rejoin_timeout_s``, default
        ``timeout_s``); 0: rejoining is off."""
        return float(self.timeout_s if self.rejoin_timeout_s is None else self.rejoin_timeout_s)

    def verify_with_vllm_config(self, vllm_config: Any) -> None:
        """Refuse combinations this release does not support (duck-typed on
        VllmConfig so that this module needs no vLLM import)."""
        parallel = getattr(vllm_config, "parallel_config", None)
        device_config = getattr(vllm_config, "device_config", None)
        device_type = getattr(device_config, "device_type", "cpu")
        if parallel is not None:
            self._verify_parallel(parallel, device_type)
        if getattr(vllm_config, "speculative_config", None) is not None:
            raise AFDConfigError("AFD: speculative decoding is not supported yet")
        model_config = getattr(vllm_config, "model_config", None)
        if getattr(model_config, "architecture", None):
            # The families AFD serves (pure Python like this module; imported only here,
            # for a real model configuration).
            from vllm.afd.architectures import check_model

            problem = check_model(model_config, self.compute_gate_on_attention)
            if problem:
                raise AFDConfigError(problem)
        import os

        if (warning := self.rejoin_warning(dict(os.environ))) is not None:
            import logging

            logging.getLogger("vllm.afd").warning("%s", warning)
        scheduler = getattr(vllm_config, "scheduler_config", None)
        max_tokens = getattr(scheduler, "max_num_batched_tokens", None)
        if self.is_ffn and _is_int(max_tokens):
            self.ffn_pass_tokens(max_tokens)  # refuses a bound below one step
        if parallel is not None and getattr(parallel, "enable_dbo", False):
            if self.is_ffn:
                raise AFDConfigError(
                    "AFD: --enable-dbo is an attention-server option (the FFN rank serves "
                    "the micro-batches it is sent); drop it from the FFN server"
                )
            self._verify_dbo(parallel, device_type)
        if self.connector in GRAPH_CAPABLE_CONNECTORS and device_type != "cuda":
            raise AFDConfigError(
                f"AFD: connector {self.connector!r} moves activations between CUDA devices of "
                f"one host; this engine runs on {device_type!r}. Use connector 'gloo' there."
            )
        if (
            self.is_attention
            and device_type != "cpu"
            and self.connector not in GRAPH_CAPABLE_CONNECTORS
            and model_config is not None
            and not model_config.enforce_eager
        ):
            # The exchange of this connector is host code inside the forward
            # pass: a replayed CUDA graph would skip it.
            import logging

            logging.getLogger("vllm.afd").warning(
                "AFD attention role on %s: connector %r cannot run inside CUDA graphs; "
                "running eager (as with --enforce-eager). Use connector 'cuda_ipc' "
                "(one host) for CUDA graphs",
                device_type,
                self.connector,
            )
            model_config.enforce_eager = True

    def _verify_parallel(self, parallel: Any, device_type: str) -> None:
        """Tensor parallelism only as an FFN group: one FFN server whose
        ``tensor_parallel_size`` equals ``num_ffn_ranks`` runs every FFN rank as
        one of its workers (worker i is FFN rank i); their experts are split
        between them (expert parallel with --enable-expert-parallel, tensor
        parallel without) and every layer runs on the tokens of all of them."""
        tp = getattr(parallel, "tensor_parallel_size", 1)
        pp = getattr(parallel, "pipeline_parallel_size", 1)
        n = self.num_ffn_ranks
        if pp != 1:
            raise AFDConfigError(
                f"AFD: pipeline parallelism inside a role is not supported "
                f"(got pipeline_parallel_size={pp})"
            )
        if tp == 1:
            return
        if self.ffn_failover:
            raise AFDConfigError(
                f"AFD: connector_extra_config.ffn_failover needs FFN replicas, one FFN server "
                f"per FFN rank each holding every expert; this FFN server is an FFN group "
                f"(tensor_parallel_size={tp}) whose ranks split the experts, so none can "
                "serve another's attention ranks (and the group ends as one): drop the key, "
                "or run num_ffn_ranks servers with tensor_parallel_size 1"
            )
        if not self.is_ffn:
            raise AFDConfigError(
                f"AFD: tensor parallelism on the attention role is not supported yet "
                f"(got tensor_parallel_size={tp}); scale with more attention ranks instead"
            )
        if tp != n:
            raise AFDConfigError(
                f"AFD: an FFN server with tensor_parallel_size={tp} runs that many FFN ranks "
                f"as one group, so num_ffn_ranks must be {tp} (got {n}); or run one FFN "
                "server per FFN rank with tensor_parallel_size 1"
            )
        if getattr(parallel, "data_parallel_size", 1) != 1:
            raise AFDConfigError(
                "AFD: an FFN group (tensor_parallel_size > 1) needs data_parallel_size 1"
            )
        if self.rank is not None:
            raise AFDConfigError(
                "AFD: drop 'rank' from the --afd-config of an FFN group: each of its "
                "tensor_parallel_size workers is the FFN rank of its tensor-parallel rank"
            )
        if self.connector in GRAPH_CAPABLE_CONNECTORS:
            raise AFDConfigError(
                f"AFD: an FFN group (tensor_parallel_size {tp}) runs with connector 'gloo' in "
                f"this release: connector {self.connector!r} maps a peer's buffers by the "
                "device numbering of one process pair, and a group's workers sit on "
                "different GPUs"
            )
        if device_type == "cpu" and getattr(parallel, "enable_expert_parallel", False):
            raise AFDConfigError(
                "AFD: --enable-expert-parallel is not supported on the CPU: vLLM's CPU MoE "
                "kernels ignore the expert map (each rank would compute the wrong experts). "
                "Drop it: the FFN group then splits every expert between its ranks"
            )

    def _verify_dbo(self, parallel: Any, device_type: str) -> None:
        """DBO on the attention role: micro-batches at data-parallel size 1,
        served by the connector of the device type that knows micro-batched
        steps (gloo on the CPU, cuda_ipc on CUDA)."""
        dp = getattr(parallel, "data_parallel_size", 1)
        if dp != 1:
            raise AFDConfigError(
                f"AFD: --enable-dbo on the attention role needs data_parallel_size 1 "
                f"(got {dp}); run one attention server per attention rank instead"
            )
        if self.connector not in DBO_CONNECTORS:
            raise AFDConfigError(
                f"AFD: --enable-dbo is not supported with connector {self.connector!r} yet "
                f"(supported: {', '.join(DBO_CONNECTORS)}); drop --enable-dbo"
            )
        wanted = DBO_CONNECTOR_OF_DEVICE.get(device_type)
        if wanted is None:
            raise AFDConfigError(
                f"AFD: --enable-dbo on {device_type!r} is not supported yet (AFD micro-batches "
                f"run on {' and '.join(DBO_CONNECTOR_OF_DEVICE)}); drop --enable-dbo"
            )
        if self.connector != wanted:
            raise AFDConfigError(
                f"AFD: --enable-dbo on {device_type!r} needs connector {wanted!r} "
                f"(got {self.connector!r})"
            )
        n = getattr(parallel, "num_ubatches", 2)
        if self.connector == "cuda_ipc" and n > IPC_MAX_UBATCHES:
            raise AFDConfigError(
                f"AFD: the cuda_ipc connector serves at most {IPC_MAX_UBATCHES} micro-batches "
                f"per step (this configuration asks for {n})"
            )

    # ---------------------------------------------------------------- derived
    @property
    def is_attention(self) -> bool:
        return self.role == "attention"

    @property
    def is_ffn(self) -> bool:
        return self.role == "ffn"

    @property
    def attention_ranks_per_ffn(self) -> int:
        return self.num_attention_ranks // self.num_ffn_ranks

    def resolved_rank(self, data_parallel_rank: int = 0) -> int:
        return self.rank if self.rank is not None else data_parallel_rank

    def ffn_rank_of(self, attention_rank: int) -> int:
        """FFN rank f serves attention ranks f*k .. f*k+k-1 (k = M/N)."""
        return attention_rank // self.attention_ranks_per_ffn

    def attention_ranks_of(self, ffn_rank: int) -> list[int]:
        k = self.attention_ranks_per_ffn
        return list(range(ffn_rank * k, (ffn_rank + 1) * k))

    def ffn_pass_tokens(self, max_num_tokens: int) -> int:
        """The most tokens an FFN rank runs through its blocks in one pass.

        An FFN rank batches the steps of its k = num_attention_ranks / num_ffn_ranks
        attention ranks, each of up to ``max_num_tokens`` (max_num_batched_tokens, which
        both roles agree on), into one pass: up to k x max_num_tokens tokens, k times the
        activations a plain engine of this configuration ever runs. Steps whose tokens
        together exceed this bound are served in several passes. The bound is
        ``connector_extra_config.ffn_max_tokens_per_pass`` (default max_num_tokens: a
        pass is never larger than a plain engine's step); at least max_num_tokens (one
        attention rank's step is not split); above k x max_num_tokens it changes nothing.
        """
        k = self.attention_ranks_per_ffn
        bound = self.connector_extra_config.get("ffn_max_tokens_per_pass", max_num_tokens)
        if bound < max_num_tokens:
            raise AFDConfigError(
                f"AFD: connector_extra_config.ffn_max_tokens_per_pass ({bound}) must be at "
                f"least max_num_batched_tokens ({max_num_tokens}): one attention rank's step "
                "is served in one pass. Raise it, or lower --max-num-batched-tokens on both "
                "roles"
            )
        return min(bound, k * max_num_tokens)

    def ffn_pass_message(self, ffn_rank: int, max_num_tokens: int, group_size: int = 1) -> str:
        """The start-up line that states the bound of :meth:`ffn_pass_tokens`."""
        k = self.attention_ranks_per_ffn
        bound = self.ffn_pass_tokens(max_num_tokens)
        text = (
            f"AFD FFN rank {ffn_rank}: at most {bound} tokens per pass (k={k} attention "
            f"rank{'s' if k > 1 else ''} x {max_num_tokens} max_num_batched_tokens = "
            f"{k * max_num_tokens}"
        )
        if bound < k * max_num_tokens:
            text += (
                "; steps beyond it are served in several passes, "
                "connector_extra_config.ffn_max_tokens_per_pass raises it"
            )
        if group_size > 1:
            text += (
                f"; a pass of this FFN group gathers up to {group_size * bound} tokens of its "
                f"{group_size} members"
            )
        return text + ")"

    def ffn_port(self, ffn_rank: int) -> int:
        return self.port + ffn_rank

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def compile_factors(self) -> dict[str, Any]:
        """Everything that changes what the model computes or which layers this process
        builds; the address of the peer does not. vLLM 0.34.0's
        ``VllmConfig.compile_factors`` takes them under ``"afd"`` (patch 0001)."""
        return {
            "role": self.role,
            "connector": self.connector,
            "num_attention_ranks": self.num_attention_ranks,
            "num_ffn_ranks": self.num_ffn_ranks,
            "compute_gate_on_attention": self.compute_gate_on_attention,
        }

    def compute_hash(self) -> str:
        """The hash of :meth:`compile_factors` (``VllmConfig.compute_hash`` up to vLLM
        0.33.0, patch 0001)."""
        factors = json.dumps(self.compile_factors(), sort_keys=True)
        return hashlib.sha256(factors.encode()).hexdigest()[:32]

    def __str__(self) -> str:
        d = self.to_dict()
        d.pop("connector_extra_config", None)
        return "AFDConfig(" + ", ".join(f"{k}={v!r}" for k, v in d.items()) + ")"


def parse_afd_config_arg(text: str) -> AFDConfig:
    """argparse ``type=`` for ``--afd-config``: errors surface at parse time."""
    import argparse

    try:
        return AFDConfig.from_json(text)
    except AFDConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
