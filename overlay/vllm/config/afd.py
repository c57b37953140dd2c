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

from vllm.afd import connector_spec
from vllm.afd.connector_spec import ConnectorSpec

ROLES = ("attention", "ffn")

# Connector facts (names, aliases, devices, CUDA graphs, DBO, failover, the FFN ranks
# served, the connector_extra_config keys) live in one spec record per connector:
# vllm.afd.connector_spec.


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
    # One "host:port" per FFN rank (DNS names allowed, "[v6]:port" for IPv6): attention
    # ranks dial FFN rank f at ffn_addresses[f], resolving the name again on every dial;
    # FFN rank f listens on its entry's port on the interface ``host``. None: FFN rank f
    # at host:port+f.
    ffn_addresses: list[str] | None = None

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
        try:
            spec = connector_spec.resolve(self.connector)
        except ValueError as e:
            fail(str(e))
        object.__setattr__(self, "connector", spec.name)

    @property
    def spec(self) -> ConnectorSpec:
        """The spec record of this configuration's connector."""
        return connector_spec.resolve(self.connector)

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
        if self.ffn_addresses is None and self.port + n - 1 > 65535:
            fail(f"FFN rank ports {self.port}..{self.port + n - 1} exceed 65535")
        limit = self.spec.max_ffn_ranks
        if limit is not None and n > limit:
            fail(
                f"connector {self.connector!r} serves num_ffn_ranks <= {limit} in this "
                f"release; got {n} (use more attention ranks per FFN rank instead)"
            )
        self._validate_ffn_addresses(fail)

    def _validate_ffn_addresses(self, fail) -> None:
        """ffn_addresses: a list of num_ffn_ranks distinct "host:port" strings."""
        addresses = self.ffn_addresses
        if addresses is None:
            return
        if not isinstance(addresses, list) or not all(isinstance(a, str) for a in addresses):
            fail(f"'ffn_addresses' must be a list of \"host:port\" strings; got {addresses!r}")
        if len(addresses) != self.num_ffn_ranks:
            fail(
                f"'ffn_addresses' has {len(addresses)} entr{'y' if len(addresses) == 1 else 'ies'}"
                f"; it needs one per FFN rank (num_ffn_ranks {self.num_ffn_ranks})"
            )
        seen: dict[tuple[str, int], int] = {}
        for f, text in enumerate(addresses):
            try:
                where = split_address(text)
            except ValueError as e:
                fail(f"'ffn_addresses'[{f}]: {e}")
            if where in seen:
                fail(
                    f"'ffn_addresses'[{f}] {text!r} is also FFN rank {seen[where]}'s address; "
                    "each FFN rank needs its own host:port"
                )
            seen[where] = f

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
        """The keys of connector_extra_config, each checked against the connector's spec
        record (its own keys and the channel's: kind, bounds; unknown keys refused)."""
        why = self.spec.check_extra(self.connector_extra_config)
        if why is not None:
            fail(why)
        self._validate_failover(fail)

    def _validate_failover(self, fail) -> None:
        """connector_extra_config.ffn_failover: FFN replicas (num_ffn_ranks > 1 servers,
        each holding every expert) on a connector whose spec says failover; an FFN group
        is refused in _verify_parallel (its ranks split the experts, none can serve
        another's rank)."""
        if not self.ffn_failover:
            return
        if self.num_ffn_ranks < 2:
            fail(
                "connector_extra_config.ffn_failover needs FFN replicas to fail over to "
                f"(num_ffn_ranks > 1, one FFN server each); got num_ffn_ranks "
                f"{self.num_ffn_ranks}: drop the key (a lost FFN rank is rejoined, "
                "rejoin_timeout_s)"
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
        spec = self.spec
        if device_type not in spec.devices:
            raise AFDConfigError(
                f"AFD: connector {self.connector!r} runs on {' and '.join(spec.devices)} "
                f"({spec.summary}); this engine runs on {device_type!r}. Use one of: "
                + ", ".join(s.name for s in connector_spec.all_specs() if device_type in s.devices)
            )
        if (
            self.is_attention
            and device_type != "cpu"
            and not spec.graph_capable
            and model_config is not None
            and not model_config.enforce_eager
        ):
            # The exchange of this connector is host code inside the forward
            # pass: a replayed CUDA graph would skip it.
            import logging

            logging.getLogger("vllm.afd").warning(
                "AFD attention role on %s: connector %r cannot run inside CUDA graphs; "
                "running eager (as with --enforce-eager). Graph-capable connectors: "
                + ", ".join(s.name for s in connector_spec.all_specs() if s.graph_capable),
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
        if not self.spec.ffn_group:
            raise AFDConfigError(
                f"AFD: an FFN group (tensor_parallel_size {tp}) runs with connector "
                + " or ".join(repr(s.name) for s in connector_spec.all_specs() if s.ffn_group)
                + f" in this release, not {self.connector!r} (its spec record declares no "
                "FFN group: cuda_ipc maps a peer's buffers by the device numbering of one "
                "process pair, and a group's workers sit on different GPUs)"
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
        spec = self.spec
        if device_type not in spec.dbo_devices:
            serving = [
                f"{s.name} on {'/'.join(s.dbo_devices)}"
                for s in connector_spec.all_specs()
                if s.dbo_devices
            ]
            raise AFDConfigError(
                f"AFD: --enable-dbo on {device_type!r} is not supported with connector "
                f"{self.connector!r} (micro-batched steps are served by: "
                f"{', '.join(serving)}); drop --enable-dbo"
            )
        n = getattr(parallel, "num_ubatches", 2)
        if spec.max_ubatches is not None and n > spec.max_ubatches:
            raise AFDConfigError(
                f"AFD: the {self.connector} connector serves at most {spec.max_ubatches} "
                f"micro-batches per step (this configuration asks for {n})"
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

    def ffn_address(self, ffn_rank: int) -> tuple[str, int]:
        """(host, port) where attention ranks dial FFN rank ``ffn_rank``: its entry of
        ffn_addresses, else host:port+ffn_rank. The host may be a DNS name; the
        connectors resolve it on every dial."""
        if self.ffn_addresses is not None:
            return split_address(self.ffn_addresses[ffn_rank])
        return self.host, self.port + ffn_rank

    def ffn_listen_address(self, ffn_rank: int) -> tuple[str, int]:
        """(interface, port) FFN rank ``ffn_rank`` listens on: ``host`` and the port of
        its address."""
        return self.host, self.ffn_address(ffn_rank)[1]

    def ffn_port(self, ffn_rank: int) -> int:
        return self.ffn_address(ffn_rank)[1]

    def ffn_address_text(self, ffn_rank: int) -> str:
        return join_address(*self.ffn_address(ffn_rank))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def compile_factors(self) -> dict[str, Any]:
        """Everything that changes what the model computes or which layers this process
        builds; the address of the peer does not. vLLM 0.34.0's
        ``VllmConfig.compile_factors`` takes them under ``"afd"`` (patch ``afd-config``)."""
        return {
            "role": self.role,
            "connector": self.connector,
            "num_attention_ranks": self.num_attention_ranks,
            "num_ffn_ranks": self.num_ffn_ranks,
            "compute_gate_on_attention": self.compute_gate_on_attention,
        }

    def compute_hash(self) -> str:
        """The hash of :meth:`compile_factors` (``VllmConfig.compute_hash`` up to vLLM
        0.33.0, patch ``afd-config``)."""
        factors = json.dumps(self.compile_factors(), sort_keys=True)
        return hashlib.sha256(factors.encode()).hexdigest()[:32]

    def __str__(self) -> str:
        d = self.to_dict()
        d.pop("connector_extra_config", None)
        return "AFDConfig(" + ", ".join(f"{k}={v!r}" for k, v in d.items()) + ")"


def split_address(text: str) -> tuple[str, int]:
    """"host:port" or "[v6]:port" -> (host, port); raises ValueError saying what is wrong."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"an address must be a \"host:port\" string; got {text!r}")
    text = text.strip()
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ValueError(f"{text!r}: write an IPv6 address as \"[addr]:port\"")
        port_text = rest[1:]
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            raise ValueError(f"{text!r} has no port (\"host:port\")")
        if ":" in host:
            raise ValueError(f"{text!r}: write an IPv6 address as \"[addr]:port\"")
    if not host or any(c.isspace() for c in host):
        raise ValueError(f"{text!r} has no valid host")
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"{text!r}: the port must be an integer in 1..65535")
    return host, int(port_text)


def join_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_afd_config_arg(text: str) -> AFDConfig:
    """argparse ``type=`` for ``--afd-config``: errors surface at parse time."""
    import argparse

    try:
        return AFDConfig.from_json(text)
    except AFDConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
