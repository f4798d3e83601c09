"""A small terminal agent that runs inside a task's container: only python3's standard library,
so any image with python3 runs it (the Harbor example mounts it read-only at
/opt/rl-proxy/agent.py). It asks the model (through the proxy, at OPENAI_BASE_URL with
OPENAI_API_KEY and OPENAI_MODEL, as every episode sets them) for one shell command at a time,
runs it in the working directory, shows it the output, and stops when the model says DONE or
after `--steps` commands.

    python3 agent.py "the task's instruction" [--steps 4]
"""

import argparse
import json
import os
import re
import subprocess
import urllib.request

SYSTEM = (
    "You are in a Linux shell. Reply with exactly one shell command in a ```bash block```. "
    "When the task is done, reply DONE."
)


def ask(messages: list[dict[str, str]]) -> str:
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions",
        data=json.dumps({"model": os.environ["OPENAI_MODEL"], "messages": messages, "max_tokens": 96}).encode(),
        headers={"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.load(response)["choices"][0]["message"]["content"] or ""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("instruction")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": args.instruction}]
    for _ in range(args.steps):
        reply = ask(messages)
        messages.append({"role": "assistant", "content": reply})
        found = re.search(r"```(?:bash|sh)?\n(.*?)```", reply, re.S)
        if not found:  # DONE, or no command to run
            break
        done = subprocess.run(["sh", "-c", found.group(1)], capture_output=True, text=True, timeout=60)
        output = (done.stdout + done.stderr)[-2000:]
        print(f"$ {found.group(1).strip()}\n{output}", flush=True)
        messages.append({"role": "user", "content": f"exit code {done.returncode}\n{output}"})


if __name__ == "__main__":
    main()
