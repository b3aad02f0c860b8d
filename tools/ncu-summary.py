#!/usr/bin/env python3
"""Sums Nsight Compute's `--print-summary per-kernel` output by kernel name:
invocations, total and mean time, share of the total. Usage: ncu-summary.py LOG"""
import re
import sys
from collections import defaultdict

UNIT = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6, "second": 1e6}
calls = defaultdict(int)
total_us = defaultdict(float)
name = None
count = 0
for line in open(sys.argv[1], errors="replace"):
    # Our kernels are extern "C" (a bare name); llama.cpp's are C++: `void name<T...>(params)`.
    head = re.match(r"^\s+(?:void )?(\w+)(?:<.*>)?(?:\(.*\))? \([\d, ]+\)x\([\d, ]+\).*Invocations (\d+)", line)
    if head:
        name, count = head.group(1), int(head.group(2))
        continue
    metric = re.match(r"^\s+gpu__time_duration\.sum\s+(\w+)\s+([\d.,]+)\s+([\d.,]+)\s+([\d.,]+)", line)
    if metric and name:
        if metric.group(1) not in UNIT:
            sys.exit(f"unknown time unit {metric.group(1)!r} in: {line.strip()}")
        avg = float(metric.group(4).replace(",", "")) * UNIT[metric.group(1)]
        calls[name] += count
        total_us[name] += avg * count
        name = None
grand = sum(total_us.values()) or 1.0
print(f"{'kernel':<28} {'calls':>7} {'mean us':>8} {'total us':>10} {'share':>6}")
for k in sorted(total_us, key=total_us.get, reverse=True):
    print(f"{k:<28} {calls[k]:>7} {total_us[k] / calls[k]:>8.2f} {total_us[k]:>10.1f} {100 * total_us[k] / grand:>5.1f}%")
print(f"{'all':<28} {sum(calls.values()):>7} {'':>8} {grand:>10.1f}")
