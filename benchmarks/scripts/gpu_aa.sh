#!/usr/bin/env bash
# Where the host time of a one-wave TTFA goes on the device's host: py-spy over the
# timeline (every thread, GIL holders only, then all samples), the timeline with a 0.5 ms
# GIL switch interval, and the step's phases + kernels at 256 rows early in the wave.
set -u; source benchmarks/scripts/setup_device.sh
PYSPY=/tmp/site/bin/py-spy
TL="benchmarks/scripts/ttfa_timeline.py 256 140 --budgets 16384 --quantization fp8 --steps 40"
timeout -s INT 100 $PYSPY record --threads --gil --nonblocking -r 1000 -f raw -o $OUT/spy_gil.txt -- python3 $TL > $OUT/spy_gil.log 2>&1
echo "== py-spy --gil rc $?"; head -1 $OUT/spy_gil.log; grep -E "^ +(0|1|2|25|26|27|28|29|30|31) " $OUT/spy_gil.log; tail -2 $OUT/spy_gil.log
timeout -s INT 100 $PYSPY record --threads --idle --nonblocking -r 1000 -f raw -o $OUT/spy_idle.txt -- python3 $TL > $OUT/spy_idle.log 2>&1
echo "== py-spy --idle rc $?"; head -1 $OUT/spy_idle.log
timeout -s INT 80 python3 $TL --switch-interval-ms 0.5 > $OUT/timeline_switch.log 2>&1
echo "== switch 0.5 ms"; head -1 $OUT/timeline_switch.log; grep -E "^ +(0|1|2|25|26|27|28|29|30|31) " $OUT/timeline_switch.log
ORPHEUS_QUANTIZATION=fp8 PHASE_WARM=2 PHASE_STEPS=20 timeout -s INT 90 python3 benchmarks/scripts/phase_orpheus.py 256 > $OUT/phase_early.log 2>&1
echo "== phase"; grep -E "^c=" $OUT/phase_early.log
