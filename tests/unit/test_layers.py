"""Only the signals adapter sends signals: a rule import-linter cannot express, checked on the AST.

import-linter (the contracts in pyproject.toml, run by ``make lint``) sees imports, not calls:
every module imports ``os``. So this walks each module's syntax tree for the calls that send a
signal, by name, whatever they are bound to.
"""

from __future__ import annotations

import ast
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[2] / "src" / "gpuguard"
SIGNALS_ADAPTER = SOURCE / "adapters" / "signals.py"
SENDERS = frozenset(
    {"kill", "killpg", "pidfd_send_signal", "pthread_kill", "send_signal", "terminate"}
)


def signal_calls(source: str) -> list[str]:
    """The signal-sending calls in ``source``, as ``name@line``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name in SENDERS:
            found.append(f"{name}@{node.lineno}")
    return found


def test_the_walk_finds_each_way_of_sending_a_signal() -> None:
    """The check itself can fail: each spelling of a signal call in a sample is found."""
    sample = (
        "import os, signal\nfrom os import kill\n"
        "os.kill(1, 9)\nkill(1, 9)\nos.killpg(1, 9)\nsignal.pidfd_send_signal(3, 9)\n"
        "proc.send_signal(9)\nproc.terminate()\nos.getpid()\n"
    )
    assert signal_calls(sample) == [
        "kill@3",
        "kill@4",
        "killpg@5",
        "pidfd_send_signal@6",
        "send_signal@7",
        "terminate@8",
    ]


def test_only_the_signals_adapter_sends_signals() -> None:
    """No module of gpuguard but adapters/signals.py calls anything that sends a signal."""
    modules = sorted(SOURCE.rglob("*.py"))
    assert SIGNALS_ADAPTER in modules
    senders = {
        str(path.relative_to(SOURCE)): calls
        for path in modules
        if (calls := signal_calls(path.read_text(encoding="utf-8")))
    }
    assert set(senders) == {"adapters/signals.py"}, senders
