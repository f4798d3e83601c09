#!/bin/bash
sed -i "s/a - b/a + b/" calc.py
