"""Harness adapters run agent harnesses as RL episodes against the proxy.

tasks.py reads tasks; episode.py runs one episode with an adapter (command, python, OpenAI
Agents SDK, LangChain); rewards.py scores it; runner.py runs many through the proxy's admin API;
rollouts.py groups episodes for GRPO; config.py, collect.py and cli.py are `rl-proxy collect`.
examples/arithmetic and examples/shell are the shipped tasks. Imports the proxy (to start it for
a run, and its typed admin client) and the recorder; never the trainer.
"""
