"""Harnesses: what runs the agent of one episode, talking to the proxy under the episode's own
session: a command (any CLI harness; presets.py runs mini-swe-agent, Claude Code and Codex in a
container), a Python agent, an Agents SDK agent, a LangChain runnable. A harness runs where its
environment puts it (a `Box`, for a container) and knows nothing of rewards or engines.
"""

from harness_adapters.harnesses.base import FROM_FILES, Adapter, Endpoint, Outcome, command_env, load_callable
from harness_adapters.harnesses.command import CommandAdapter
from harness_adapters.harnesses.presets import PresetError, PresetName, preset
from harness_adapters.harnesses.python import AgentsSdkAdapter, LangChainAdapter, PythonAdapter

__all__ = [
    "FROM_FILES",
    "Adapter",
    "AgentsSdkAdapter",
    "CommandAdapter",
    "Endpoint",
    "LangChainAdapter",
    "Outcome",
    "PresetError",
    "PresetName",
    "PythonAdapter",
    "command_env",
    "load_callable",
    "preset",
]
