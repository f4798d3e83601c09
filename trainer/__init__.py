"""The trainer: GRPO on TRL over recorded episodes, with the new weights hot-swapped into the
running vLLM.

config.py is a run's YAML; grpo.py the learner (TRL's loss and model wrapper); loop.py takes
finished groups from the store, steps, swaps and checkpoints; run.py is `rl-proxy train`;
template_check.py is `rl-proxy doctor`; viewer/ is `rl-proxy ui`; cli.py holds these commands and the root `rl-proxy`
command. The top of the import order: it may use the harness adapters, the proxy and the
recorder, and nothing imports it. Imports torch and TRL (lazily where a command needs none).
"""
