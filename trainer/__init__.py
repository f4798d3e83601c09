"""Training side: the default model and the chat-template check today; GRPO on TRL and weight
hot-swap arrive with issue 5.

Imports torch and transformers; the proxy never imports this package.
"""
