"""vLLM's shared-memory MessageQueue (engine core -> worker RPCs, worker -> engine core
answers): an idle reader whose writer's ping was dropped still reads the block the writer
wrote, within IDLE_POLL_MAX_MS (the patch shm-reader-recheck).

The ping is a zmq PUB message with SNDHWM=1: it is dropped while the pipe is full, which
happened under CPU contention in the Ray deploy test (an attention server's worker slept in
its poll over the sample_tokens RPC its engine core had written, and the server stalled with
no error). Here the writer's pings are dropped on purpose."""

from __future__ import annotations

import threading
import time

from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

RECHECK_S = 5.0  # the patch's bound on an idle reader's poll (IDLE_POLL_MAX_MS)


def test_an_idle_reader_reads_a_written_block_whose_ping_was_dropped():
    writer = MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=2)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    ready = threading.Thread(target=reader.wait_until_ready)
    ready.start()
    writer.wait_until_ready()
    ready.join(10)
    assert not ready.is_alive()

    writer._spin_condition.notify = lambda: None  # every ping lost
    reader._spin_condition.busy_loop_s = 0.0  # idle at once: it polls for a ping
    got: list[object] = []
    worker = threading.Thread(target=lambda: got.append(reader.dequeue(indefinite=True)))
    worker.start()
    try:
        time.sleep(0.3)  # the reader is in its poll now
        t0 = time.monotonic()
        writer.enqueue(("sample_tokens", (), {}, 0))
        worker.join(RECHECK_S + 3)
        took = time.monotonic() - t0
        assert got == [("sample_tokens", (), {}, 0)], "the reader slept over a written block"
        assert took <= RECHECK_S + 1, took
    finally:
        if worker.is_alive():
            reader.shutdown()  # wakes the stuck poll (its cancel socket)
            worker.join(5)
