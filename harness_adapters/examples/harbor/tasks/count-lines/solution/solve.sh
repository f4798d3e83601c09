#!/bin/bash
wc -l < data.txt > count.txt
