"""Environments for multi-turn rollouts: what answers the policy between its turns."""

from lppo.envs.base import Environment, Episode, Observation, Turn
from lppo.envs.hidden_digit import HiddenDigitEnvironment, HiddenDigitTask
from lppo.envs.jail import Bubblewrap, Jail, JailError, Unjailed
from lppo.envs.python_tool import PythonTool, run_jailed, run_python
from lppo.envs.templates import HERMES_CHATML
from lppo.envs.tool_env import ToolEnvironment
from lppo.envs.tool_formats import (
    HermesCalls,
    Llama3JsonCalls,
    MistralCalls,
    ResponseTemplateCalls,
    ToolCallFormat,
)
from lppo.envs.tools import ToolBox, ToolCall, ToolResult, format_tool_call, parse_tool_calls

__all__ = [
    "HERMES_CHATML",
    "Bubblewrap",
    "Environment",
    "Episode",
    "HermesCalls",
    "HiddenDigitEnvironment",
    "HiddenDigitTask",
    "Jail",
    "JailError",
    "Llama3JsonCalls",
    "MistralCalls",
    "Observation",
    "PythonTool",
    "ResponseTemplateCalls",
    "ToolBox",
    "ToolCall",
    "ToolCallFormat",
    "ToolEnvironment",
    "ToolResult",
    "Turn",
    "Unjailed",
    "format_tool_call",
    "parse_tool_calls",
    "run_jailed",
    "run_python",
]
