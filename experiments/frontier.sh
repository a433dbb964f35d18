#!/usr/bin/env bash
# Re-measure every row of docs/frontier.md (docs/quality.md, "The frontier") (12-53 s per point on a 2-core CPU, one thread per process).
# The rows not named "rotated" were measured on artifacts converted before latent rotation became the default,
# which --no-rotate-latents reproduces. ${A/80/128} etc. are row A with key rank 128, 192, 16-bit coefficients, and
# plain pre-RoPE keys (diagnostics). frontier_merge.py refuses a JSON measured against another full cache.
set -euo pipefail
cd "$(dirname "$0")/.."
tale-convert smollm2 --group 3 --key-basis --no-rotate-latents --out kb     # the paper preset plus the key basis (low-rank keys read it)
tale-convert smollm2 --group 3 --preset tale --no-rotate-latents --out tp   # key bands: its calibrated channel order serves key_hi
LR='key_rope=pre,key_axis=channel/channel/token,residual=1,key_meta=8-8,value_meta=8-8,r0=0.5'
A="key_rank=80/0/0,bits=3/4/8,key_bits=4/4/8,recent=0.1/0,$LR"     # --preset lowrank at r0 R/2
B="key_rank=56/0/0,bits=3/4/8,key_bits=4/4/8,recent=0.05/0,$LR"
C="key_rank=64/0/0,bits=3/4/8,key_bits=3/4/8,recent=0.05/0,$LR"
V="bits=4/4,r0=1.0; key_bits=4/4; -; key_bits=3/4,r0=0.34,key_meta=8-16,value_meta=8-8;
   key_bits=3/4,r0=0.17,key_meta=8-16,value_meta=8-8; r0=0.34,key_meta=8-16,value_meta=8-8;
   r0=0.17,key_meta=8-16,value_meta=8-8; r0=0.17,key_meta=8-8,value_meta=8-8,recent=0.05; key_rope=pre; $A; $B; $C;
   ${A/80/128}; ${A/80/192}; ${A/key_bits=4/key_bits=16}; ${A/80/0}"                  # the last four: diagnostics
tale-eval kb --frontier --preset full --threads 1 --families tale,kivi --tale-variants "$V" --json a.json
tale-eval kb --frontier --preset full --threads 1 --families quanto,hqq,streaming,palu --json b.json
T8='recent=0.1/0,bits=2/4/8,key_axis=channel/channel/token,residual=1,key_meta=8-16,value_meta=8-8'
E8='r0=0.17,key_hi=3/16,recent=0.05/0,bits=2/4/8,key_axis=channel/channel/token,residual=1,key_meta=8-8,value_meta=8-8'
tale-eval tp --frontier --preset full --threads 1 --families tale --json c.json --tale-variants "-;
   r0=0.34,key_hi=3/16,key_meta=8-16,value_meta=8-8; key_hi=3/32,r0=0.34,key_meta=8-16,value_meta=8-8;
   r0=0.34,key_hi=3/16,$T8; r0=0.34,key_hi=3/32,$T8; r0=0.5,key_hi=3/32,$T8; $E8; $E8,keep=salient;
   r0=0.5,key_hi=3/16,$T8; r0=0.5,key_hi=3/32,$T8,key_rope=pre; r0=0.5,key_hi=3/16,$T8,key_rope=pre"
python experiments/frontier_merge.py docs/frontier a.json b.json "c.json:tale-preset artifact: "
# the lowrank preset at r0 2R/3, SVD basis
tale-convert smollm2 --group 3 --preset lowrank --no-rotate-latents --out lr
tale-eval lr --frontier --preset full --threads 1 --families tale --json p1.json --tale-variants "-; r0=0.5;
   key_rank=56/0/0; r0=0.84,bits=2/4/8,key_bits=4/4/8"
tale-eval lr --frontier --preset full --threads 1 --families tale --json p2.json --tale-variants "key_rank=56/0/0,
   recent=0.05/0,r0=1.0,bits=2/4/8,key_bits=4/4/8; key_rank=64/0/0,recent=0.05/0,key_bits=3/4/8;
   key_rank=40/0/0,key_bits=3/4/8,recent=0.03/0,r0=0.5; key_rank=40/0/0,key_bits=3/4/8,recent=0.03/0,r0=0.34"
python experiments/frontier_merge.py docs/frontier docs/frontier.md "p1.json:lowrank artifact (r0 2R/3): " \
   "p2.json:lowrank artifact (r0 2R/3): "
# the paper and lowrank presets as converted now (latents rotated), and the 3x rows
tale-convert smollm2 --group 3 --out pr; tale-convert smollm2 --group 3 --preset lowrank --out lrr
tale-eval pr --frontier --preset full --threads 1 --families tale --tale-variants "-" --json q1.json
tale-eval pr --frontier --preset full --threads 1 --families tale --json q4.json --tale-variants "bits=4/4,r0=1.0;
   bits=4/4,r0=1.0,key_meta=8/8,value_meta=8/8; bits=4/4,r0=1.0,key_meta=8/16,value_meta=8/8"
tale-eval lrr --frontier --preset full --threads 1 --families tale --json q2.json --tale-variants "-;
   r0=0.84,bits=2/4/8,key_bits=4/4/8; r0=1.0,bits=2/4/8,key_bits=4/4/8; key_rank=56/0/0,recent=0.05/0,r0=0.5;
   key_rank=56/0/0,recent=0.05/0,bits=2/4/8,key_bits=4/4/8; key_rank=56/0/0,recent=0.05/0,r0=0.84,bits=2/4/8,key_bits=4/4/8;
   key_rank=64/0/0,recent=0.05/0,key_bits=3/4/8; key_rank=40/0/0,key_bits=3/4/8,recent=0.03/0,r0=0.5"
python experiments/frontier_merge.py docs/frontier docs/frontier.md "q1.json:rotated paper artifact: " "q4.json:rotated paper artifact: " \
   "q2.json:rotated lowrank artifact (r0 2R/3): "
tale-convert smollm2 --group 3 --preset lowrank --value-group 64 --out lr64      # rotation blocks and latent groups of 64
tale-eval lr64 --frontier --preset full --threads 1 --families tale --json q3.json --tale-variants "-;
   key_rank=56/0/0,recent=0.05/0,bits=2/4/8,key_bits=4/4/8"
python experiments/frontier_merge.py docs/frontier docs/frontier.md "q3.json:rotated lowrank artifact, latent groups of 64: "
