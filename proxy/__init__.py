"""The recording proxy: an OpenAI-compatible FastAPI app in front of an upstream (vLLM).

It never imports torch or vLLM; it speaks HTTP to the upstream and hands each finished call
to the recorder before answering the client.
"""
