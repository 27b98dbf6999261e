"""What a server prints when its start fails on its GPUs, and what kind of failure that is (pure).

The signatures are data: each a pattern, the program that prints it, where its text comes from,
and its class, which says what helps:

- ``held-by-others``: the text itself says other processes hold the GPU (SGLang's unbalanced
  memory, CUDA's "busy or unavailable"): free the GPU (the gate, the daemon), then start again.
- ``memory``: the start ran out of GPU memory, which fits both stories: held by others when a
  foreign holder is on the unit's GPUs, else the server does not fit as configured (``judge``).
- ``does-not-fit``: the server's own sizing failed whoever holds the GPU (SGLang's "increase
  --mem-fraction-static"): no reap and no restart helps; ``knob`` names the setting to change.
- ``hardware``: the GPU itself failed (an uncorrectable ECC error, the GPU lost): a reset or a
  reboot, never a restart.

Every pattern is a case-sensitive regex in the syntax Python ``re`` and PCRE2 share
(``journalctl --grep``), linear in both: literals and bounded repetitions, never an unbounded gap.
Long messages are matched by fragments, so a line a log collector or a terminal wrapped, or one
journald split at ``LineMax``, is still recognised by either half. The texts and their sources
are in docs/facts.md §7; ``tests/start_failure_samples/`` holds a sample of each, with its origin.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from gpuguard.core.values import StrEnum


class FailureClass(StrEnum):
    """What a start-failure line says about its cause (see the module doc)."""

    HELD_BY_OTHERS = "held-by-others"
    MEMORY = "memory"
    DOES_NOT_FIT = "does-not-fit"
    HARDWARE = "hardware"


@dataclass(frozen=True, slots=True)
class Signature:
    """A line a server prints when its start fails on its GPUs, where it is from, what it means."""

    pattern: str
    server: str
    source: str
    failure: FailureClass = FailureClass.MEMORY
    knob: str | None = None
    """The setting that makes the server fit, when the text names one."""


_VLLM_UTIL = "--gpu-memory-utilization"

START_FAILURE_SIGNATURES: Final[tuple[Signature, ...]] = (
    Signature(
        r"torch\.(?:cuda\.)?OutOfMemoryError",
        "PyTorch",
        "torch.OutOfMemoryError (2.1+), torch.cuda.OutOfMemoryError (1.13-2.0)",
    ),
    Signature(
        r"CUDA out of memory",
        "PyTorch",
        "the caching allocator's message: 'CUDA out of memory. Tried to allocate 20.00 MiB. "
        "GPU 0 has a total capacity of …' (older: '… (GPU 0; 7.93 GiB total capacity; …)')",
    ),
    Signature(
        r"CUDA error: out of memory",
        "PyTorch",
        "a CUDA runtime error surfaced as text (cudaErrorMemoryAllocation), current form",
    ),
    Signature(
        r"CUDA error \(2\): out of memory",
        "PyTorch",
        "legacy form of the same error (code 2 = cudaErrorMemoryAllocation), e.g. from "
        "torch.cuda.Stream() on PyTorch 1.x",
    ),
    Signature(
        r"cuda runtime error \(2\) ?: out of memory",
        "PyTorch",
        "THC's THCudaCheck before PyTorch 1.5: 'cuda runtime error (2) : out of memory at …'",
    ),
    Signature(
        r"cudaErrorMemoryAllocation|CUDA_ERROR_OUT_OF_MEMORY",
        "CUDA",
        "the runtime's and the driver API's names of the out-of-memory error, as libraries "
        "print them (cudaGetErrorName / cuGetErrorName; the text of both is 'out of memory')",
    ),
    Signature(
        r"all CUDA-capable devices are busy or unavailable"
        r"|CUDA-capable device\(s\) is/are busy or unavailable"
        r"|cudaErrorDevicesUnavailable|CUDA_ERROR_DEVICES_UNAVAILABLE",
        "CUDA",
        "cudaErrorDevicesUnavailable's text (before CUDA 12, then its CUDA 12 form): a GPU in "
        "exclusive-process compute mode already has another process's context",
        FailureClass.HELD_BY_OTHERS,
    ),
    Signature(
        r"uncorrectable ECC error encountered|CUDA_ERROR_ECC_UNCORRECTABLE"
        r"|cudaErrorECCUncorrectable",
        "CUDA",
        "cudaErrorECCUncorrectable's text: the GPU's memory failed (an Xid 48/94/95 class "
        "fault), no restart helps",
        FailureClass.HARDWARE,
    ),
    Signature(
        r"GPU is lost",
        "NVML",
        "NVML_ERROR_GPU_IS_LOST's text ('GPU is lost'), as servers and nvidia-smi print it: "
        "the GPU fell off the bus (Xid 79)",
        FailureClass.HARDWARE,
    ),
    Signature(
        r"The memory capacity is unbalanced\. Some GPUs may be occupied by other processes",
        "SGLang",
        "model runner, TP > 1, before loading weights",
        FailureClass.HELD_BY_OTHERS,
    ),
    Signature(
        r"Not enough memory\. Please try to increase --mem-fraction-static",
        "SGLang",
        "KV-cache sizing (python/sglang/srt/model_executor/pool_configurator.py, "
        "MemoryPoolConfig; older: model_runner.py)",
        FailureClass.DOES_NOT_FIT,
        "--mem-fraction-static",
    ),
    Signature(
        r"Not enough memory to allocate KV cache",
        "SGLang",
        "the same check as reworded in sgl-project/sglang pull request 23181",
        FailureClass.DOES_NOT_FIT,
        "--mem-fraction-static",
    ),
    # vLLM V1's ValueError "Free memory on device cuda:0 (6.9/79.2 GiB) on startup is less than
    # desired GPU memory utilization (0.9, 71.3 GiB). Decrease GPU memory utilization or reduce
    # GPU memory used by other processes." (older: "on device (6.9/8.0 GiB)"), often behind a
    # "(EngineCore_DP0 pid=…)" prefix. Four literal fragments: the whole line matches each, a
    # line wrapped anywhere matches in at least one half; no gap.
    Signature(
        r"Free memory on device(?: cuda:\d{1,3})?(?: \(|$)",
        "vLLM",
        "the startup memory check of the GPU worker (vllm/v1/worker/utils.py, request_memory): "
        "its start, also when wrapped right after the device name",
        FailureClass.MEMORY,
        _VLLM_UTIL,
    ),
    Signature(
        r"GiB\) on startup is less than desired",
        "vLLM",
        "the same message, its middle (a line wrapped after the figures)",
        FailureClass.MEMORY,
        _VLLM_UTIL,
    ),
    Signature(
        r"is less than desired GPU memory utilization",
        "vLLM",
        "the same message, its middle (a line wrapped before 'is less')",
        FailureClass.MEMORY,
        _VLLM_UTIL,
    ),
    Signature(
        r"reduce GPU memory used by other processes",
        "vLLM",
        "the same message, its end (a line wrapped before the advice)",
        FailureClass.MEMORY,
        _VLLM_UTIL,
    ),
    Signature(
        r"No available memory for the cache blocks",
        "vLLM",
        "KV-cache sizing after profiling: 'Try increasing `gpu_memory_utilization` when "
        "initializing the engine.'",
        FailureClass.DOES_NOT_FIT,
        _VLLM_UTIL,
    ),
    Signature(
        r"larger than the available KV [Cc]ache memory",
        "vLLM",
        "the max-model-len check ('… GiB KV cache is needed, which is larger than the available "
        "KV cache memory (… GiB). … Try increasing `gpu_memory_utilization` or decreasing "
        "`max_model_len` …'; 0.8 wrote 'KV Cache')",
        FailureClass.DOES_NOT_FIT,
        f"{_VLLM_UTIL} or --max-model-len",
    ),
    Signature(
        r"CUDA out of memory occurred when warming up (?:sampler|pooler)",
        "vLLM",
        "the GPU model runner's warm-up: 'Please try lowering `max_num_seqs` or "
        "`gpu_memory_utilization` when initializing the engine.'",
        FailureClass.DOES_NOT_FIT,
        f"--max-num-seqs or {_VLLM_UTIL}",
    ),
)
"""Every start-failure signature, most specific last: ``classify`` takes the last that matches
(vLLM's warm-up OOM contains PyTorch's "CUDA out of memory")."""

GPU_OOM_PATTERNS: Final[tuple[str, ...]] = tuple(s.pattern for s in START_FAILURE_SIGNATURES)
"""The patterns of ``START_FAILURE_SIGNATURES``."""

GPU_OOM_REGEX: Final[str] = "|".join(f"(?:{pattern})" for pattern in GPU_OOM_PATTERNS)
"""``GPU_OOM_PATTERNS`` as one alternation (the journal's pre-filter)."""

_COMPILED: Final = tuple((re.compile(s.pattern), s) for s in START_FAILURE_SIGNATURES)


_HOLDER_PID: Final = re.compile(r"\bProcess (\d{1,10}) has ")


def named_holders(text: str) -> tuple[int, ...]:
    """The PIDs PyTorch's out-of-memory message names as holding memory on the device, in order.

    "Process 192 has 119.34 GiB memory in use": the server's word, the only trace in the
    journal of a holder that left the unit's cgroup.
    """
    return tuple(dict.fromkeys(int(match[1]) for match in _HOLDER_PID.finditer(text)))


@dataclass(frozen=True, slots=True)
class Recognised:
    """A line matched: the signature, where its phrase is, where the message's first phrase is."""

    signature: Signature
    start: int
    end: int
    first: int
    """Where the earliest matched phrase starts: vLLM's one-line message matches its last
    fragment ("reduce GPU memory used by other processes") as the most specific, 170 characters
    after the "cuda:0" it names; the device and the shown text are read from here."""


def classify(text: str) -> Recognised | None:
    """The most specific signature ``text`` matches (the last of the table), or None."""
    found: Recognised | None = None
    first = len(text)
    for pattern, signature in _COMPILED:
        match = pattern.search(text)
        if match is not None:
            first = min(first, match.start())
            found = Recognised(signature, match.start(), match.end(), first)
    return found


@dataclass(frozen=True, slots=True)
class Judged:
    """A failure's class as the evidence decides it, and what to say about the way out."""

    failure: FailureClass
    advice: str


def judge(failure: FailureClass, knob: str | None, *, foreign_holders: bool) -> Judged:
    """The final class of a start failure, given whether anything else holds the unit's GPUs.

    Out of memory, or a sizing that failed, with a holder on the GPUs is held by others (the
    server sized itself on what was left); with none, the server does not fit as configured, and
    looping on it only repeats the model load.
    """
    if failure in (FailureClass.MEMORY, FailureClass.DOES_NOT_FIT):
        failure = FailureClass.HELD_BY_OTHERS if foreign_holders else FailureClass.DOES_NOT_FIT
    tune = f"change {knob}" if knob else "give the server less to hold (a smaller model, more GPUs)"
    advice = {
        FailureClass.HELD_BY_OTHERS: "free the GPUs (the gate or the daemon reaps what it can "
        "prove is left over), then start again",
        FailureClass.DOES_NOT_FIT: "no process holds the unit's GPUs: the server does not fit "
        f"as configured and every restart fails the same way; {tune}",
        FailureClass.HARDWARE: "the GPU itself failed: no restart helps; reset the GPU or "
        "reboot (docs/runbook.md, GPU needs a reset)",
    }[failure]
    return Judged(failure, advice)
