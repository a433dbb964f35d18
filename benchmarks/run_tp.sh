#!/bin/bash
# bench_tp.py's rows at Llama-3.1-70B shapes over N GPUs (default 4), in one time budget (seconds, default 540):
#
#     bash benchmarks/run_tp.sh OUT_DIR [BUDGET_S] [STEPS]      # STEPS: any of "tale hf largest tale128", in order
#
#   tale     TALE, batch 1 at 32K; tokens/s at the largest batch that fits at 32K (THROUGHPUT=, empty: not run);
#            the largest context at batch 1 (byte model, from the 32K prefill's peak)
#   hf       transformers' TP, batch 1 at 128K (static cache + compile); tokens/s at the largest batch that fits at
#            32K (DynamicCache, then static cache + compile); its largest context at batch 1 (from the 128K prefill)
#   largest  TALE, batch 1 at the largest context the tale step computed (or LARGEST_CTX; at most LARGEST_CAP), when
#            the time left covers its prefill (estimated from the two prefills above: t = a T + b T^2)
#   tale128  TALE, batch 1 at 128K
#
# BENCH_ARGS replaces "--model 70b --no-check --output-path factored" (the CPU: BENCH_ARGS="--device cpu --tiny
# --no-check" N=2 LARGEST_CTX=128 runs every step on the tiny model). Each step runs under its own `timeout`; every measured row is logged as it comes (OUT_DIR/STEP.log, lines "[ time]"),
# so a step cut short still leaves what it measured. NCCL's settings come from the environment (docs/runtime.md).
set -u
OUT=${1:?usage: run_tp.sh OUT_DIR [BUDGET_S] [STEPS]}
BUDGET=${2:-540}
STEPS=${3:-tale hf largest}
N=${N:-4}
read -r -a BENCH <<< "${BENCH_ARGS:---model 70b --no-check --output-path factored}"
OUT=$(realpath "$OUT")
mkdir -p "$OUT"
cd "$(dirname "$0")"
T0=$(date +%s)
PORT=29611
left() { echo $((BUDGET - ($(date +%s) - T0))); }
min() { echo $(($1 < $2 ? $1 : $2)); }

step() {  # step NAME LIMIT_S ARGS...: one torchrun of bench_tp.py
    local name=$1 limit=$2 s=$(date +%s)
    shift 2
    if [ "$limit" -lt 60 ]; then
        echo "$name: not run ($limit s left)"
        return
    fi
    PORT=$((PORT + 1))
    timeout -k 15 "$limit" torchrun --nproc-per-node "$N" --master-port "$PORT" bench_tp.py "${BENCH[@]}" "$@" \
        --out "$OUT/$name.md" > "$OUT/$name.log" 2>&1
    echo "== $name: rc=$? in $(($(date +%s) - s)) s (limit $limit s)"
    grep "^\[" "$OUT/$name.log" | cut -c1-400
    grep -m3 -E "Error|error:" "$OUT/$name.log"
    sleep 3  # the killed ranks' GPU memory
}

for s in $STEPS; do
    case $s in
        tale)
            TPUT=${THROUGHPUT-32768}
            step tale "$(min 170 "$(left)")" --ctx 32768 --no-hf ${TPUT:+--throughput "$TPUT"}
            ;;
        hf) step hf "$(min 400 "$(($(left) - 5))")" --ctx 131072 --no-tale --throughput 32768 ;;
        largest)
            X=${LARGEST_CTX:-$(grep -ho "largest context at batch 1, TALE: [0-9]*" "$OUT/tale.log" 2>/dev/null | grep -o "[0-9]*$")}
            if [ -z "$X" ]; then
                echo "largest: not run (no context from the tale step)"
                continue
            fi
            X=$((X >= 2048 ? X / 1024 * 1024 : X))
            if [ -n "${LARGEST_CAP:-}" ] && [ "$X" -gt "$LARGEST_CAP" ]; then
                echo "largest: $X tokens (byte model), run at LARGEST_CAP=$LARGEST_CAP (the time a prefill takes)"
                X=$LARGEST_CAP
            fi
            # the prefill's seconds at X from the TALE 32K and transformers 128K prefills (the same base forward)
            EST=$(python3 - "$OUT" "$X" << 'EOF'
import re
import sys

out, X = sys.argv[1], int(sys.argv[2])
pts = {}
for name, who in (("tale", "TALE"), ("hf", "transformers")):
    try:
        text = open(f"{out}/{name}.log").read()
    except OSError:
        continue
    for ctx, d in re.findall(r"\] \S+ (\d+) " + who + r" (\{.*\})$", text, re.M):
        if m := re.search(r"'prefill_s': ([0-9.e+-]+)", d):
            pts[int(ctx)] = float(m.group(1))
if len(pts) < 2:
    print(-1)
    sys.exit()
(T1, t1), (T2, t2) = sorted(pts.items())[:2]
b = max(0.0, (t2 / T2 - t1 / T1) / (T2 - T1))
a = max(0.0, t1 / T1 - b * T1)
print(int(a * X + b * X * X))
EOF
)
            echo "largest: $X tokens, prefill estimated at ${EST} s (-1: no estimate), $(left) s left"
            NEED=$((EST < 0 ? 240 : 60 + EST * 13 / 10 + 30))  # start and build, the prefill, compile and steps
            if [ "$(left)" -lt "$NEED" ]; then
                echo "largest: not run (needs about $NEED s)"
                continue
            fi
            step largest "$(($(left) - 5))" --ctx "$X" --no-hf --new 8 --warm 2
            ;;
        tale128) step tale128 "$(($(left) - 5))" --ctx 131072 --no-hf ;;
        *) echo "unknown step $s" ;;
    esac
done
echo "run_tp.sh: $(($(date +%s) - T0)) s"
