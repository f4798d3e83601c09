"""A small CLI agent for the command adapter's tests (run as a script, like any harness).

It reads only the variables harnesses read (OPENAI_BASE_URL, OPENAI_API_KEY), asks the model
two turns, prints its final answer, and with --post-reward posts a reward for its own session
to the proxy's admin API (RLP_BASE_URL, RLP_SESSION_ID). --ignore-base-url sends its calls
elsewhere, as a misconfigured harness would.
"""

from __future__ import annotations

import argparse
import os

import httpx
from openai import OpenAI

parser = argparse.ArgumentParser()
parser.add_argument("question")
parser.add_argument("--post-reward", type=float)
parser.add_argument("--ignore-base-url", action="store_true")
args = parser.parse_args()

base_url = "http://127.0.0.1:9/v1" if args.ignore_base_url else os.environ["OPENAI_BASE_URL"]
client = OpenAI(base_url=base_url, max_retries=0)
messages = [{"role": "user", "content": args.question}]
reply = ""
for _ in range(2):
    try:
        answer = client.chat.completions.create(
            model=os.environ["OPENAI_MODEL"], messages=messages, max_tokens=12, temperature=0
        )
    except Exception as exc:  # a harness that cannot reach its model gives up, saying why
        print(f"no model: {exc}")
        break
    reply = answer.choices[0].message.content or ""
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Say it again, shorter."}]
if args.post_reward is not None:
    session = os.environ["RLP_SESSION_ID"]
    posted = httpx.post(
        f"{os.environ['RLP_BASE_URL']}/admin/sessions/{session}/reward",
        json={"value": args.post_reward, "source": "harness"},
    )
    posted.raise_for_status()
print(reply)
