"""A sweep trial's own script: reports `score` = (step + 1) x $SCALE once per step, through clusterfit.session,
so a trial with a smaller SCALE is worse at every step."""

from __future__ import annotations

import os
import time

import clusterfit.session as cf

STEPS = 12

scale = float(os.environ["SCALE"])
for step in range(STEPS):
    cf.report(step=step, total_steps=STEPS, score=(step + 1) * scale)
    time.sleep(0.4)
