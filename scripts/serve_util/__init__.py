"""Start, probe, query and stop `vllm serve` processes and the engines of the tests (stdlib
only). Used by ``scripts/demo.py``, the CPU and GPU end-to-end tests and the benchmarks;
importable with no dependency beyond the standard library::

    import serve_util as su

    su.install_cleanup()                       # SIGTERM/SIGHUP/atexit stop every server
    api, afd = su.free_ports(2)
    srv = su.Server.start(
        "ffn", model, api, log_dir / "ffn.log",
        afd_config=su.afd_config("ffn", afd), python=sys.executable,
    )
    srv.wait_healthy(timeout=300)
    status, body = su.completion(srv.url, "Hello", max_tokens=8)
    srv.stop()

One module per concern, every public name also here:

* :mod:`serve_util.ports`: listen ports below the kernel's ephemeral range (``free_ports``,
  ``AFD_PORT_WINDOW``), an engine's ``VLLM_PORT`` base, ``port_bindable``;
* :mod:`serve_util.engine`: the ``vllm serve`` command line, ``--afd-config``, devices, MoE
  routing, and ``engine_env``, the environment of every engine;
* :mod:`serve_util.procs`: processes in groups of their own, stopped as a group, and
  ``install_cleanup``;
* :mod:`serve_util.logs`: log tails, the root-cause traceback, waiting for a line;
* :mod:`serve_util.client`: HTTP GET/POST, completions (streamed or not), their choices;
* :mod:`serve_util.stats`: logprob differences, the order of rounds, the median run;
* :mod:`serve_util.server`: :class:`Server`, one ``vllm serve`` process;
* :mod:`serve_util.modes`: a benchmark's AFD modes once per FFN schedule.

Every server runs in a process group of its own (``start_new_session=True``) so that
``stop_process_group`` reaches the API server and its engine-core children, and every
started server is kept in a registry until stopped so that ``stop_all`` (run by
``install_cleanup`` at exit and on SIGTERM/SIGHUP; Ctrl-C raises KeyboardInterrupt, so
``finally`` runs) leaves no process behind on any exit path.
"""

from __future__ import annotations

from serve_util.client import (  # noqa: F401
    completion,
    error_message,
    http_get,
    parse_choice,
    post_json,
    stream_completion,
    token_ids,
)
from serve_util.engine import (  # noqa: F401
    CPU_SERVE_ARGS,
    CPU_SERVE_ENV,
    ENGINE_ENV,
    ROUTING_ENV,
    afd_config,
    cuda_visible_devices,
    dummy_routing_note,
    engine_env,
    mla_disabled,
    routing_env,
    serve_command,
    shared_gpu_note,
    vllm_cli,
    vllm_python,
)
from serve_util.logs import (  # noqa: F401
    failure_excerpt,
    find_traceback,
    log_tail,
    wait_for_log,
)
from serve_util.modes import (  # noqa: F401
    FFN_SCHEDULES,
    parse_schedules,
    schedule_extra,
    split_mode,
    with_schedules,
)
from serve_util.ports import (  # noqa: F401
    LISTEN_WINDOW_START,
    PORT_WINDOW_ENV,
    ephemeral_port_range,
    free_port,
    free_ports,
    internal_port_base,
    listen_window,
    port_bindable,
)
from serve_util.procs import (  # noqa: F401
    group_members,
    group_rss_kib,
    install_cleanup,
    start_process,
    stop_all,
    stop_process_group,
    stop_processes,
    wait_for_exit,
)
from serve_util.server import (  # noqa: F401
    Server,
    ServerDied,
    stop_servers,
    wait_all_healthy,
)
from serve_util.stats import (  # noqa: F401
    max_logprob_diff,
    median_run,
    rounds_of,
)
