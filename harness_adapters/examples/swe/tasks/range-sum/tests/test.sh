#!/bin/bash
# The hidden tests of this folder (the agent never saw them) against the agent's /app: the reward is
# 1 when every one passes, else 0. python3 -I: nothing the agent left in /app (a unittest.py, a
# sitecustomize.py) stands in for the standard library; the tests put /app after it on the path.
if python3 -I -m unittest discover -s /tests -t /tests >/logs/verifier/unittest.txt 2>&1; then
  echo 1
else
  echo 0
fi >/logs/verifier/reward.txt
