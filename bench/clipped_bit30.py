"""The issue-35 check: the default UpdateDetector on the nanoGPT-shaped loop, 20 bit-30 flips
(the exponent's top bit) in one element of a random backward operator's output each, at a
random step from 10, one upset each, 20 steps per run; clip_grad_norm_(1.0) on or off.

    PYTHONPATH=. python bench/clipped_bit30.py on      # this checkout
    PYTHONPATH=/path/to/older/checkout python bench/clipped_bit30.py on

Prints the sdcreplay package it ran, the faults that fired, those detected and the alarms
before a fault fired.
"""

from __future__ import annotations

import random
import sys

import torch
from clipping_campaign import UpsetStep, builder, draw_fault, parse_args
from detection_campaign import run_trial, step_sites

import sdcreplay


def main() -> None:
    torch.set_num_threads(1)
    args = parse_args(["--loops", "nanogpt"])
    clip = sys.argv[1:] != ["off"]
    build = builder("nanogpt", clip, args)
    workload = build(0)
    sites = [site for site in step_sites(workload) if site.phase == "backward"]
    draw = random.Random("oldnew")
    faults = [
        draw_fault(draw, sites, workload, "bitflip exponent top (30)", args) for _ in range(20)
    ]
    fired = detected = early = 0
    for number, fault in enumerate(faults):
        result = run_trial("UpdateDetector", fault, 1 + number, args, build, UpsetStep)
        fired += result["first_fired"] is not None
        detected += result["first_fired"] is not None and result["detected"]
        early += result["false_alarms"]
    print(f"{sdcreplay.__file__} clip={clip} fired {fired} detected {detected} early {early}")


if __name__ == "__main__":
    main()
