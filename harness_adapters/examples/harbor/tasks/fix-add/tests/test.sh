#!/bin/bash
# Two named rewards (reward.json): positive numbers, and negative ones.
cd /app
check() { python3 -c "import calc; assert $1" 2>/dev/null && echo 1 || echo 0; }
echo "{\"positive\": $(check 'calc.add(2, 3) == 5'), \"negative\": $(check 'calc.add(-1, -1) == -2')}" > /logs/verifier/reward.json
