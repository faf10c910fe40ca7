"""AgentFlow: white-box agents (`async def run(ctx, task)` over exact token ids) and black-box agents
(any OpenAI-API program, through the recording gateway), both producing the same trajectories."""
