#!/usr/bin/env bash
# An A/B of two versions of some source files on one GPU machine (device time is scarce and
# numbers move from machine to machine): gpu_check stages on the working tree (A), then on
# the tree with the files under $AB_DIR in place of theirs (B), then the tree restored.
# $AB_DIR mirrors the repository's paths (e.g. $AB_DIR/kernels/csrc/decode_step.cuh); it
# must travel with the tree (untracked and not ignored, or carried).
# $B_ENV: NAME=VALUE words (no spaces in a value) set for B only, e.g. B_ENV=ENGINE_ARGS=--batches=1
# where A's arguments name settings B lacks.
# Results: $OUT/ab.tgz (a/ and b/: each side's gpu_check output; only 8 files come back).
#   AB_DIR=ab_b STAGES_A="build pytest engine" STAGES_B="build engine" PYTEST_K=decode_step \
#     ENGINE_ARGS="--models llama3-8b --batches 1,16" bash benchmarks/ab_files.sh
set -u
cd "$(dirname "$0")/.."
: "${AB_DIR:?AB_DIR: a folder with the B files at their repository paths}"
FINAL=${OUT:-/tmp/woq-out}
WORK=$(mktemp -d)
STAGES_A=${STAGES_A:-build engine}
STAGES_B=${STAGES_B-build engine}
export TAIL=${TAIL:-6}

OUT=$WORK/a bash benchmarks/gpu_check.sh $STAGES_A
if [ -n "$STAGES_B" ]; then
  files=$(cd "$AB_DIR" && find . -type f | sed 's|^\./||')
  for f in $files; do mkdir -p "$WORK/saved/$(dirname "$f")"; cp "$f" "$WORK/saved/$f"; cp "$AB_DIR/$f" "$f"; done
  OUT=$WORK/b env ${B_ENV:-} bash benchmarks/gpu_check.sh $STAGES_B
  for f in $files; do cp "$WORK/saved/$f" "$f"; done
fi
rm -rf "$WORK/saved" "$WORK"/*/pip.log
mkdir -p "$FINAL" && tar czf "$FINAL/ab.tgz" -C "$WORK" .
