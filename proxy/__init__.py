"""The recording proxy: an OpenAI-compatible FastAPI app in front of an upstream (vLLM).

It speaks HTTP to the upstream and hands each finished call to the recorder before answering
the client. vllm.py owns everything about vLLM itself (launching it, the default model, the
weight hot swap); server.py runs the app; cli.py is `serve` and `demo`. Imports only the
recorder; never torch or vLLM at import time.
"""
