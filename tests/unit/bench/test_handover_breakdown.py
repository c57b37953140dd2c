"""benchmarks/handover.py: the nixl device path's table of where a hand-over goes, from
the proxy's own summary over the timed steps (nixl_device.ProxyStats)."""

from __future__ import annotations

import handover  # benchmarks/handover.py

from vllm.distributed.afd import nixl_device as nd


def test_the_breakdown_table_reads_the_proxys_summary_per_size():
    rows = {}
    for tokens, (post, turn, wait) in {16: (20e-6, 40e-6, 70e-6), 256: (22e-6, 45e-6, 74e-6)}.items():
        st = nd.ProxyStats()
        st.post.extend([post] * 3)
        st.poll.extend([5e-6] * 3)
        st.turn.extend([900e-6] * (10 if tokens == 16 else 0) + [turn] * 3)  # long ones first
        st.posts, st.replies = 54, 27
        waited = nd.HostWords(2 * nd.WAIT_KEEP)
        waited.words[:3] = int(wait * 1e9) + 1  # as the wait kernel stores them
        st.take_waits(waited)
        rows[f"nixl/{tokens}"] = st.summary()
    table = handover.breakdown_table(rows).splitlines()
    assert table[5].split() == ["tokens", "post", "poll", "turn", "wait", "wait-turn", "writes"]
    # wait - turn sets the waits (the last three) against the last three turns
    assert table[6].split() == ["16", "20.0", "5.0", "900.0", "70.0", "30.0", "54"]
    assert table[7].split() == ["256", "22.0", "5.0", "45.0", "74.0", "29.0", "54"]
