"""Harness adapters run agent harnesses as RL episodes against the proxy.

Its rooms, lowest first: tasks/ (what an episode is asked to do) <- environments/ (where it
runs: host, bubblewrap, a container) <- harnesses/ (what runs the agent) <- rewards.py (how it is
scored) <- runner.py (many episodes through the proxy's admin API) <- engines.py (Ray) <-
rollouts.py, config.py, collect.py, cli.py (`rl-proxy collect`). examples/ holds the shipped
tasks. Imports the proxy (to start it for a run, and its typed admin client) and the recorder;
never the trainer. docs/development.md has each room's rule.
"""
