"""AFD benchmark modes per FFN schedule (``connector_extra_config.ffn_schedule``,
docs/ping-pong.md): a benchmark runs every AFD mode once per schedule asked for, the
default schedule (join) under the mode's own name, another as ``MODE_SCHEDULE``
(``afd_pingpong``, ``afd_dbo_auto``)."""

from __future__ import annotations

import json

# vllm.afd.connector_spec.FFN_SCHEDULES (this package imports no vLLM), the default first
FFN_SCHEDULES = ("join", "pingpong", "auto")


def parse_schedules(text: str) -> list[str]:
    """``--ffn-schedule``: a comma list of distinct schedules; ValueError otherwise."""
    schedules = [s.strip() for s in text.split(",") if s.strip()]
    if not schedules or set(schedules) - set(FFN_SCHEDULES) or len(set(schedules)) < len(
        schedules
    ):
        raise ValueError(f"--ffn-schedule {text}: a comma list of distinct values of "
                         f"{', '.join(FFN_SCHEDULES)}")  # fmt: skip
    return schedules


def with_schedules(modes: list[str], schedules: list[str]) -> list[str]:
    """Every AFD mode of ``modes`` once per schedule (in the schedules' order), the other
    modes once."""
    return [m if s == "join" else f"{m}_{s}"
            for m in modes for s in (schedules if m.startswith("afd") else ["join"])]  # fmt: skip


def split_mode(mode: str) -> tuple[str, str]:
    """A mode's base (plain, plain_one, afd, afd_dbo...) and FFN schedule: ``afd_pingpong``
    is ``afd`` with ffn_schedule pingpong, ``afd_auto`` with auto; every other mode's
    schedule is join."""
    for schedule in FFN_SCHEDULES[1:]:
        if mode.startswith("afd") and mode.endswith("_" + schedule):
            return mode[: -len(schedule) - 1], schedule
    return mode, "join"


def schedule_extra(connector_extra: str | None, mode: str) -> dict:
    """The connector_extra_config of an AFD mode's roles: ``connector_extra`` (JSON, or
    None) with the mode's FFN schedule where it is not the default. ValueError when the
    JSON names a schedule itself (a benchmark gives it with --ffn-schedule)."""
    extra = json.loads(connector_extra) if connector_extra else {}
    if "ffn_schedule" in extra:
        raise ValueError("give the FFN schedule with --ffn-schedule, not in --connector-extra")
    schedule = split_mode(mode)[1]
    if schedule != "join":
        extra["ffn_schedule"] = schedule
    return extra
