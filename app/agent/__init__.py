"""The agent that drives one attempt through an `AttemptContext`; it never touches engines or lanes."""

from app.agent.loop import AgentError, ShellAgent, ShellAgentConfig
from app.agent.parse import is_done, parse_command

__all__ = ["AgentError", "ShellAgent", "ShellAgentConfig", "is_done", "parse_command"]
