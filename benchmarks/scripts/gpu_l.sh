#!/usr/bin/env bash
# A/B on one machine: the c=256 Orpheus TTS bench on the package in ab_old/ (git archive of an
# older commit) and on the working tree, alternating; then the long-context step profile.
set -u; source benchmarks/scripts/setup_device.sh
ROOT=$PWD
TTS="bench --tts --model $ROOT/benchmarks/orpheus-3b --load-format dummy --max-num-seqs 256 --max-model-len 2048 --output-len 700 --ignore-eos --seed 0 --no-progress --concurrency 256,256 --num-requests 256 --warmup 8"
for round in 1 2; do
  for side in old new; do
    dir=$ROOT; [ $side = old ] && dir=$ROOT/ab_old
    (cd $dir && PYTHONPATH=/tmp/site:$dir timeout -s INT 140 python3 -m omniwalk.cli $TTS --json $OUT/ab_${side}_$round.json > $OUT/ab_${side}_$round.log 2>&1)
    echo "== $side round $round"; grep -E "TTFA  |RTF \(|audio thr|viab|Error" $OUT/ab_${side}_$round.log
  done
done
PHASE_WARM=330 timeout -s INT 90 python3 benchmarks/scripts/phase_orpheus.py 256 > $OUT/orpheus_phase_long.log 2>&1
grep -E "ms/step|Error" $OUT/orpheus_phase_long.log
