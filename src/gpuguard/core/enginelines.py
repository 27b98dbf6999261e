"""What inference servers print when their engine dies or a start phase begins (data, pure).

A unit whose HTTP server outlives its engine stays "active" for systemd (vLLM's API server keeps
answering ``/version``; SGLang's outlives its scheduler). The server says so itself, in one line
of its output: this table lists those lines, and the lines that mark each phase of a start
(weights, CUDA graphs, ready), each with the source it was read from (docs/liveness.md).

Each pattern is a case-sensitive regex in the syntax Python ``re`` and PCRE2 share, linear in
both (literals and bounded repetitions only), so the journal adapter can hand the alternation
to ``journalctl --grep`` and Python never sees the rest of a chatty server's output. The text is
foreign: a matched line is evidence about the run that printed it (journald's trusted
``_SYSTEMD_UNIT`` / ``_SYSTEMD_INVOCATION_ID`` say which), never more.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from gpuguard.core.values import StrEnum


class Phase(StrEnum):
    """A phase of a start, in the order a start goes through them (a bounded metric label)."""

    STARTING = "starting"
    """From systemd's start until the server's first phase line."""
    LOADING_WEIGHTS = "loading-weights"
    INITIALISING = "initialising"
    """Profiling, KV-cache allocation and whatever else runs between weights and graphs."""
    CAPTURING_CUDA_GRAPHS = "capturing-cuda-graphs"
    WARMING_UP = "warming-up"
    """After the engine is built: warm-up requests, the HTTP server coming up."""
    READY = "ready"


PHASE_ORDER: Final[tuple[Phase, ...]] = tuple(Phase)
PHASE_WORDS: Final[dict[Phase, str]] = {
    Phase.STARTING: "starting",
    Phase.LOADING_WEIGHTS: "loading weights",
    Phase.INITIALISING: "initialising the engine",
    Phase.CAPTURING_CUDA_GRAPHS: "capturing CUDA graphs",
    Phase.WARMING_UP: "warming up",
    Phase.READY: "ready",
}
"""Each phase as ``status`` says it."""


@dataclass(frozen=True, slots=True)
class EngineLine:
    """One line a server prints: its engine died (``phase`` None), or a start entered ``phase``."""

    key: str
    """Stable name, kept on events and in explain's rows."""
    server: str
    """``sglang`` or ``vllm``: phase lines count only for a unit of that server."""
    pattern: str
    cause: str
    """For people: "EngineCore fatal error"."""
    source: str
    """Where the text comes from in the server's source."""
    phase: Phase | None = None


FATAL_LINES: Final[tuple[EngineLine, ...]] = (
    EngineLine(
        "vllm-engine-fatal",
        "vllm",
        r"EngineCore encountered a fatal error",
        "EngineCore fatal error",
        "vllm/v1/engine/core.py, run_engine_core: logger.exception('EngineCore encountered a "
        "fatal error.') when the engine's busy loop raises",
    ),
    EngineLine(
        "vllm-worker-died",
        "vllm",
        r"Worker proc [A-Za-z0-9_.:-]{1,64} died unexpectedly",
        "vLLM worker process died",
        "vllm/v1/executor/multiproc_executor.py, the worker monitor: 'Worker proc %s died "
        "unexpectedly, shutting down executor.' (Worker proc VllmWorker-0 …)",
    ),
    EngineLine(
        "vllm-engine-proc-died",
        "vllm",
        r"Engine core proc [A-Za-z0-9_.:-]{1,64} died unexpectedly",
        "vLLM EngineCore process died",
        "vllm/v1/engine/core_client.py, monitor_engine_cores: 'Engine core proc %s died "
        "unexpectedly, shutting down client.'",
    ),
    EngineLine(
        "vllm-engine-dead-error",
        "vllm",
        r"EngineDeadError",
        "EngineDeadError",
        "vllm/v1/engine/exceptions.py, class EngineDeadError ('EngineCore encountered an issue. "
        "See stack trace (above) for the root cause.'), raised to every request once the "
        "engine is gone",
    ),
    EngineLine(
        "sglang-scheduler-dead",
        "sglang",
        r"Rank \d{1,5} scheduler is dead",
        "SGLang scheduler dead",
        "python/sglang/srt/entrypoints/engine.py, _launch_subprocesses: 'Rank {i} scheduler is "
        "dead. Please check if there are relevant logs.'",
    ),
    EngineLine(
        "sglang-scheduler-exception",
        "sglang",
        r"Scheduler hit an exception",
        "SGLang scheduler exception",
        "python/sglang/srt/managers/scheduler.py, run_scheduler_process: 'Scheduler hit an "
        "exception: {traceback}', then SIGQUIT to the parent",
    ),
    EngineLine(
        "sglang-dp-controller-exception",
        "sglang",
        r"DataParallelController hit an exception",
        "SGLang data-parallel controller exception",
        "python/sglang/srt/managers/data_parallel_controller.py: 'DataParallelController hit an "
        "exception: {traceback}'",
    ),
    EngineLine(
        "sglang-scheduler-terminated",
        "sglang",
        r"Scheduler or DataParallelController \d{1,10} terminated with",
        "SGLang scheduler terminated",
        "python/sglang/srt/entrypoints/engine.py and data_parallel_controller.py: 'Scheduler or "
        "DataParallelController {pid} terminated with {exitcode}'",
    ),
    EngineLine(
        "sglang-child-failed",
        "sglang",
        r"Received sigquit from a child process",
        "SGLang child process failed",
        "python/sglang/srt/entrypoints/engine.py, the SIGQUIT handler: 'Received sigquit from a "
        "child process. It usually means the child failed.'",
    ),
    EngineLine(
        "sglang-sigquit-received",
        "sglang",
        r"SIGQUIT received\. signum=",
        "SGLang child process failed",
        "python/sglang/srt/managers/tokenizer_manager.py, SignalHandler."
        "running_phase_sigquit_handler: 'SIGQUIT received. {signum=}, {frame=}. It usually "
        "means one child failed.', then kill_process_tree",
    ),
    EngineLine(
        "sglang-scheduler-watchdog",
        "sglang",
        r"Scheduler watchdog timeout \(self\.watchdog_timeout=",
        "SGLang scheduler hung (watchdog)",
        "python/sglang/srt/utils/watchdog.py: 'Scheduler watchdog timeout "
        "(self.watchdog_timeout=300, self.soft=False)', then SIGQUIT to the parent (soft=True: "
        "the line alone, the scheduler left hung)",
    ),
)
"""Lines that say the engine of a running server is dead (docs/liveness.md)."""

PHASE_LINES: Final[tuple[EngineLine, ...]] = (
    EngineLine(
        "sglang-load-weight-begin",
        "sglang",
        r"Load weight begin",
        "loading weights",
        "python/sglang/srt/model_executor/model_runner.py, load_model: 'Load weight begin. "
        "avail mem=… GB'",
        Phase.LOADING_WEIGHTS,
    ),
    EngineLine(
        "sglang-load-weight-end",
        "sglang",
        r"Load weight end",
        "weights loaded",
        "model_runner.py, load_model: 'Load weight end. type=…, dtype=…, avail mem=… GB, mem "
        "usage=… GB.'",
        Phase.INITIALISING,
    ),
    EngineLine(
        "sglang-capture-cuda-graph-begin",
        "sglang",
        r"Capture cuda graph begin",
        "capturing CUDA graphs",
        "model_runner.py, init_device_graphs: 'Capture cuda graph begin. This can take up to "
        "several minutes. avail mem=… GB'",
        Phase.CAPTURING_CUDA_GRAPHS,
    ),
    EngineLine(
        "sglang-capture-cuda-graph-end",
        "sglang",
        r"Capture cuda graph end",
        "CUDA graphs captured",
        "model_runner.py, init_device_graphs: 'Capture cuda graph end. Time elapsed: … s. mem "
        "usage=… GB. avail mem=… GB.'",
        Phase.WARMING_UP,
    ),
    EngineLine(
        "sglang-ready",
        "sglang",
        r"The server is fired up and ready to roll!",
        "ready",
        "python/sglang/srt/entrypoints/http_server.py, _wait_and_warmup: 'The server is fired "
        "up and ready to roll!' after the warm-up request",
        Phase.READY,
    ),
    EngineLine(
        "vllm-load-begin",
        "vllm",
        r"Starting to load model",
        "loading weights",
        "vllm/v1/worker/gpu_model_runner.py, load_model: 'Starting to load model %s...'",
        Phase.LOADING_WEIGHTS,
    ),
    EngineLine(
        "vllm-weights-took",
        "vllm",
        r"Loading weights took",
        "weights loaded",
        "vllm/model_executor/model_loader/default_loader.py: 'Loading weights took %.2f seconds'",
        Phase.INITIALISING,
    ),
    EngineLine(
        "vllm-model-loading-took",
        "vllm",
        r"Model loading took",
        "model loaded",
        "vllm/v1/worker/gpu_model_runner.py, load_model: 'Model loading took %.4f GiB and "
        "%.6f seconds' (newer: '… GiB memory and … seconds')",
        Phase.INITIALISING,
    ),
    EngineLine(
        "vllm-init-engine-took",
        "vllm",
        r"init engine \(profile, create kv cache, warmup model\) took",
        "engine initialised",
        "vllm/v1/engine/core.py, EngineCore.__init__: 'init engine (profile, create kv cache, "
        "warmup model) took %.2f seconds'",
        Phase.WARMING_UP,
    ),
    EngineLine(
        "vllm-ready",
        "vllm",
        r"Application startup complete\.",
        "ready",
        "uvicorn's lifespan startup line, printed once vLLM's API server accepts requests "
        "(SGLang prints it too, before its warm-up: there only 'fired up' counts)",
        Phase.READY,
    ),
)
"""Lines that mark the phases of a start, per server (docs/liveness.md)."""

ENGINE_LINES: Final[tuple[EngineLine, ...]] = FATAL_LINES + PHASE_LINES
BY_KEY: Final[dict[str, EngineLine]] = {line.key: line for line in ENGINE_LINES}
ENGINE_PATTERNS: Final[tuple[str, ...]] = tuple(line.pattern for line in ENGINE_LINES)
"""The patterns for ``journalctl --grep`` (with the start-failure signatures)."""
ENGINE_REGEX: Final[str] = "|".join(f"(?:{pattern})" for pattern in ENGINE_PATTERNS)
FATAL_REGEX: Final[str] = "|".join(f"(?:{line.pattern})" for line in FATAL_LINES)
"""The fatal lines only (``explain`` shows a death, not every phase of every start)."""
READY_LINES: Final[tuple[EngineLine, ...]] = tuple(
    line for line in PHASE_LINES if line.phase is Phase.READY
)


def is_ready_line(key: str | None, server: str) -> bool:
    """Whether the engine line ``key`` is ``server``'s ready line (uvicorn's is vLLM's only)."""
    line = BY_KEY.get(key or "")
    return line is not None and line.phase is Phase.READY and line.server == server


READY_REGEX: Final[str] = "|".join(f"(?:{line.pattern})" for line in READY_LINES)
"""The ready lines (``explain`` tells a run that served and then failed from a failed start)."""

_MATCHERS: Final = tuple((re.compile(line.pattern), line) for line in ENGINE_LINES)
_ANY: Final = re.compile(ENGINE_REGEX)


def match_line(text: str) -> EngineLine | None:
    """The first table line ``text`` contains (fatal lines first), or None; linear in ``text``."""
    if _ANY.search(text) is None:
        return None
    for matcher, line in _MATCHERS:
        if matcher.search(text):
            return line
    return None
