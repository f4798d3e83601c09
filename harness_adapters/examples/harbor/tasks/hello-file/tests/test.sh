#!/bin/bash
# 1 when /app/hello.txt holds the word hello (and nothing else), else 0.
if [ "$(tr -d '[:space:]' < /app/hello.txt 2>/dev/null)" = "hello" ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
