#!/bin/bash
# figures.sh: the runs behind docs/figures/*.png and the plots drawn from them (tools/plot.py).
#
#   bash tools/figures.sh [RUNS_DIR [FIGURES_DIR]]   # default runs/ and docs/figures/; about 16 minutes
#
# It replaces FIGURES_DIR/archs.png, layouts.png, traffic.png, btp_layer.png and schedules.png
# (tools/draw.py), the committed figures by default (it says so first); name another FIGURES_DIR
# to keep them.
#
# archs.png: dense, CoLA, svd and CoLA with LaX at the default shape, 1000 steps each on the embedded
# corpus (BOOST arXiv 2512.12131 §7 compares at equal steps). layouts.png: CoLA at tp=1 and under
# btp and vanilla at tp=2, the dense model under Megatron at tp=2, 300 steps, one thread a process.
# Run it on an idle machine: the tokens/s panels are timings.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
R=${1:-runs}
FIG=${2:-docs/figures}
mkdir -p "$R" "$FIG"
echo "figures.sh: the runs go to $R/; this replaces $FIG/archs.png, layouts.png, traffic.png," \
     "btp_layer.png, schedules.png" \
     "$([ "$FIG" = docs/figures ] && echo '(the committed figures: git diff shows the change)')"
ONE="--max_iters=1000 --eval_interval=100 --sample_tokens=0"
for a in full cola svd; do
  OMP_NUM_THREADS=2 $PY train.py --arch=$a --out_dir="$R/$a" $ONE
done
OMP_NUM_THREADS=2 $PY train.py --arch=cola --lax=true --out_dir="$R/lax" $ONE
TP="--max_iters=300 --eval_interval=50 --sample_tokens=0"
export OMP_NUM_THREADS=1
$PY train.py --arch=cola --out_dir="$R/tp1" $TP
for m in btp vanilla; do
  $PY -m torch.distributed.run --standalone --nproc_per_node=2 train.py --arch=cola --tp=2 --layout=$m --out_dir="$R/$m" $TP
done
$PY -m torch.distributed.run --standalone --nproc_per_node=2 train.py --arch=full --tp=2 --layout=megatron --out_dir="$R/megatron" $TP
$PY tools/plot.py "$R/full" "$R/cola" "$R/svd" "$R/lax" --labels="dense,CoLA,svd,CoLA + LaX" \
    --title="The default shape (d=128, 4 layers, r=32), 1000 steps of 16 x 128 byte tokens" -o "$FIG/archs.png"
$PY tools/plot.py "$R/tp1" "$R/btp" "$R/vanilla" "$R/megatron" \
    --labels="CoLA tp=1,CoLA btp tp=2,CoLA vanilla tp=2,dense megatron tp=2" \
    --title="The layouts: the same batches, 300 steps" --diff -o "$FIG/layouts.png"
$PY tools/draw.py traffic -o "$FIG/traffic.png"
$PY tools/draw.py layer -o "$FIG/btp_layer.png"
$PY tools/draw.py schedules -o "$FIG/schedules.png"
