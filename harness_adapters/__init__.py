"""Harness adapters run agent harnesses as RL episodes against the proxy.

The episode interface and the adapters (command, python, OpenAI Agents SDK, LangChain) come
with issue 6; until then `proxy.demo` drives the example session with the openai SDK.
"""
