"""Agent frameworks run durably on the agent runtime's journal (issue 35): each integration turns
a framework's agent into a handler ``handler(ctx) -> output`` for ``run_agent_worker``."""
