"""A stop of SGLang that drained in full and ended in its own SIGKILL, as systemd 252 logs it.

SGLang's graceful drain (python/sglang/srt/managers/tokenizer_manager.py,
``TokenizerManager.sigterm_watchdog``) waits until no request is left, then calls
``kill_process_tree(os.getpid(), include_parent=True)``: the main process dies of SIGKILL by its
own hand, before any timeout of systemd's. PID 1 then logs "Main process exited, code=killed,
status=9/KILL" and "Failed with result 'signal'" with no "State 'stop-sigterm' timed out" and no
"Killing process" line. Built from the recorded ``stop-sigterm-timeout`` sample (systemd 252):
its timeout and kill lines dropped, its unit result 'timeout' made 'signal'.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SAMPLES = Path(__file__).resolve().parent.parent / "journal_samples"


def drained_then_self_killed(release: str = "bookworm") -> list[dict[str, Any]]:
    """The sample's entries, reshaped into SGLang's clean stop ending in exit 137."""
    lines = (SAMPLES / release / "stop-sigterm-timeout.jsonl").read_text().splitlines()
    shaped: list[dict[str, Any]] = []
    for recorded in map(json.loads, lines):
        message = str(recorded.get("MESSAGE", ""))
        pid1 = recorded.get("_PID") == "1"
        if pid1 and ("timed out" in message or "Killing process" in message):
            continue
        if pid1 and recorded.get("UNIT_RESULT") == "timeout":
            said = message.replace("'timeout'", "'signal'")
            recorded |= {"UNIT_RESULT": "signal", "MESSAGE": said}
        shaped.append(recorded)
    return shaped
