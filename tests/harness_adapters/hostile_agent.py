"""A hostile agent (tests/harness_adapters/test_containers.py): run in an episode's container, it
makes its model calls, then tries every way it has to a reward it did not earn, and writes what
each attempt got to /logs/agent/probe.json. Python's standard library only."""

import json
import os
import subprocess
import urllib.error
import urllib.request

BASE, KEY, SESSION = os.environ["RLP_BASE_URL"], os.environ["RLP_SESSION_KEY"], os.environ["RLP_SESSION_ID"]


def ask(url: str, body: dict | None = None, headers: dict | None = None) -> object:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError) as exc:
        return f"unreachable: {exc}"


chat = {"model": "any", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4}
mine = {"authorization": f"Bearer {KEY}"}
probe = {
    "model": ask(f"{BASE}/v1/chat/completions", chat, mine),
    # Another session's key, by header and by path: the gateway records the call under its own.
    "other_key": ask(f"{BASE}/v1/chat/completions", chat, {"authorization": "Bearer id=other", "x-session-id": "x"}),
    "other_path": ask(f"{BASE}/s/other/v1/chat/completions", chat, mine),
    "admin_list": ask(f"{BASE}/admin/sessions"),
    "admin_reward": ask(f"{BASE}/admin/sessions/{SESSION}/reward", {"value": 1.0, "source": "tests"}),
    "admin_traversal": ask(f"{BASE}/v1/../admin/sessions"),
    "vllm": ask(f"{os.environ['VLLM_URL']}/v1/models"),
}
os.makedirs("/logs/agent", exist_ok=True)
with open("/logs/agent/probe.json", "w") as out:
    json.dump(probe, out)
# The reward files the tests would write, tests of its own, and a job that rewrites the reward
# after the tests ran.
os.makedirs("/logs/verifier", exist_ok=True)
os.makedirs("/tests", exist_ok=True)
for name, text in [("/logs/verifier/reward.json", '{"reward": 1}'), ("/logs/verifier/reward.txt", "1")]:
    with open(name, "w") as out:
        out.write(text)
with open("/tests/test.sh", "w") as out:
    out.write("echo 1 > /logs/verifier/reward.txt\n")
planted = "echo 1 > /logs/verifier/reward.txt; echo '{\"reward\": 1}' > /logs/verifier/reward.json"
rewrite = f"while :; do {planted}; sleep 0.05; done"
subprocess.Popen(["sh", "-c", rewrite], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
