"""The README's summary tables and docs/results.md (every full table), regenerated from the committed
CSVs in results/.

    python launch/results_table.py                       # print the tables of results/*.csv
    python launch/results_table.py results/demo.csv      # print one
    python launch/results_table.py --readme README.md    # redraw the README's summary tables (and docs/trainers.md's)
                                                         # and write docs/results.md beside it, from results/*.csv

results/demo.csv (UPDATE_RESULTS=1 launch/demo.sh; one row per run as integrations/fsdp/train.py --summary-csv
writes them) becomes the table of final val loss, replicate-axis bytes per step and wall time;
bytes are those one rank sends per step on the replicate axis (the slow, between-node links),
counted by shardopt's communication layer for every optimizer alike, and "vs AdamW" divides
by the AdamW row of the same file. Any other CSV is shown column for column. In the README a table
goes between the lines <!-- NAME:begin (results/X.csv) --> and <!-- NAME:end -->, drawn from
results/X.csv by README_BLOCKS[NAME]; docs/results.md holds every CSV's full table with the command
that reruns it (SOURCES: the one place that names the benchmark commands). The tables themselves are
drawn by launch/markdown_tables.py.
"""

import argparse
import re
from pathlib import Path

import torchft_table
from integrations.results import read_csv
from markdown_tables import (headline_table, localsteps_summary, sizes_gap_table, sizes_horizon_table, sizes_summary,
                             sizes_topk_table, slowlink_summary, table, trainer_bytes_table, training_table)

ROOT = Path(__file__).resolve().parents[1]

# results/<name>: (the command that writes it, or a tuple of them run in turn; what its table shows)
SOURCES = {
    "demo.csv": ("UPDATE_RESULTS=1 bash launch/demo.sh  # (without UPDATE_RESULTS=1 the table goes to runs/demo/ only)",
                 "The README's first command: the 828k-parameter byte-level GPT on Shakespeare, 300 steps, 4 CPU "
                 "processes (2 replicas × 2 FSDP2 shards). Bytes: what one rank sends per step on the replicate "
                 "axis, counted by shardopt's communication layer for every optimizer alike (AdamW's are its "
                 "float32 gradient all-reduce); every step also carries the non-finite check, one float32 "
                 "all-reduced per axis."),
    "checkpoint_momenta.csv": ("python launch/bench/checkpoint_momenta.py --data-dir .cache/data/shakespeare",
                               "What a checkpoint does to the replicas' decoupled momenta, side by side in one run "
                               "(issue 39.1): integrations/fsdp/train.py, Sign-Muon + Lion's vote, 2 replicas × 1 "
                               "shard (2 CPU processes, gloo), the byte-level GPT, 200 steps, seed 0, a checkpoint "
                               "every 20 steps (none: no checkpoint). Bytes: one rank's on the replicate axis, counted "
                               "by shardopt's comm layer; checkpoint_over_step: one checkpoint's bytes over one "
                               "step's. own: each replica saves its own momenta (nothing sent, training unchanged). "
                               "The framework adapters' default (\"auto\") follows it: sign_mean at 2 replicas, "
                               "sign_vote from 3 up."),
    "comm.csv": ("python launch/bench/comm_bytes.py",
                 "Replicate-axis bytes per step for five models, whole model (every parameter, tied weights once; "
                 "the formula of `shardopt.optim.traffic`), with ✓ where real gloo runs of the two demo GPTs at 2 and 4 "
                 "processes counted exactly the formula's bytes and left the replicas identical."),
    "compile.csv": ("python launch/bench/polar_compile.py",
                    "Newton–Schulz through `torch.compile` against eager, per stack of matrices (CPU, one thread): "
                    "why `compile=True` is off by default."),
    "convergence.csv": ("python launch/bench/convergence.py",
                        "Equal steps (200, 2 × 2 ranks, the 1.3M-parameter GPT on BPE-4096): every (lr, non-matrix "
                        "lr) each method ran, its seeds in order; the best by seed 0 marked. The grid was built in "
                        "parts (docs/benchmarks.md)."),
    "convergence_best.csv": ("python launch/bench/convergence.py",
                             "Per method, the (lr, non-matrix lr) with the lowest mean final val loss over the seeds "
                             "it ran, and the replicate-axis bytes of the whole run."),
    "deepspeed_zero.csv": ("torchrun --nproc_per_node 4 launch/bench/deepspeed_zero.py",
                           "The DeepSpeed plugin at ZeRO stages 0, 1, 2 and 3 (CPU, gloo, 4 ranks: 4 replicas, or 2 "
                           "nodes × 2): optimizer state, gradient, master and weight bytes per rank, bytes per step "
                           "on each axis, whether the replicas stayed identical, the first and last loss."),
    "fashion_mnist.csv": ("python launch/bench/fashion_mnist.py",
                          "Fashion-MNIST test accuracy (a CNN, conv weights as matrices, 2 replicas): every lr each "
                          "method ran, its seeds in order; the best by seed 0 marked."),
    "localsteps.csv": (("python launch/bench/localsteps.py  # (the grid as docs/benchmarks.md ran it)",
                        "python launch/bench/localsteps.py --configs local_defaults --lr-factors 1 --seeds 0 1 2",
                        "python launch/bench/localsteps.py --configs local_muon_H30_sign_vote_b128 --outer-lrs 0.7 "
                        "--outer-momenta 0 --lr-factors 1 --seeds 1 2",
                        "python launch/bench/localsteps.py --configs ddp_adamw --replicas 8 --lr-factors 0.25 0.5 1  "
                        "# and --replicas 3; then at --lr-factors 1: ddp_muon, local_defaults, local_muon_H30_sign_mean_b128 "
                        "--outer-lrs 0.7 --outer-momenta 0",
                        "python launch/bench/localsteps.py --configs local_muon_H10_sign_vote_b128 --outer-lrs 0.7 "
                        "--outer-momenta 0 --replicas 8 --lr-factors 1  # and on 3 replicas: local_muon_H20_sign_vote_b128 "
                        "--horizons 20"),
                       "Local steps (shardopt.LocalSteps) against the per-step methods, DiLoCo and a MuLoCo-style "
                       "peer, 2 × 2 ranks (the replicas column: 4 × 1; 3 or 8 nodes of one rank, against the per-step "
                       "methods on as many ranks, …_M3 / …_M8), the 1.3M-parameter GPT on BPE-4096, equal steps and "
                       "tokens per horizon and replica count. "
                       "Link bytes: one node's on the link between the two nodes (one rank's counted bytes × 2 for "
                       "shardopt's two replicate groups, × 1 for DDP's ring); x fewer: ddp_adamw's link bytes at the "
                       "same steps and tokens over the row's. Time to target (ddp_adamw's final val loss at the same "
                       "steps and tokens) is computed: steps × the method's step time in the quiet pass "
                       "(localsteps_step_ms.csv) + link bytes × 8 / rate, no overlap, no latency."),
    "localsteps_step_ms.csv": (
        ("python launch/bench/localsteps.py --step-times --steps 30 --eval-every 30 --configs …  "
         "# (the configs of the README's local-steps table; docs/benchmarks.md)",),
        "The quiet pass of the local-steps benchmark: each method alone on the machine, 30 steps, one after "
        "another; its median step time is what localsteps.csv's time to target counts per step."),
    "overlap_backward.csv": ("python launch/bench/overlap_backward.py --rounds 1 --steps 5 --tokenizer byte",
                             "Exchange during backward off and on, side by side: step time and the time from the end "
                             "of backward to the end of step() (2 replicas, one process each, CPU, no link limit)."),
    "polar_convergence.csv": (
        ("python launch/bench/convergence.py --methods signmuon_lion --lr-factors 0.5 --seeds 0 1 --ns-steps 1 2 3 5 "
         "--ns-coefficients quintic --csv results/polar_convergence.csv",
         "python launch/bench/convergence.py --methods signmuon_lion --lr-factors 0.5 --seeds 0 1 --ns-steps 1 2 3 5 "
         "--ns-coefficients polar_express --csv results/polar_convergence.csv"),
        "Sign-Muon + Lion at its best lr (results/convergence_best.csv) with 1, 2, 3 and 5 Newton–Schulz steps "
        "of each coefficient schedule (`ns_coefficients`: Muon's quintic, Polar Express's per-step quintics), "
        "the convergence benchmark's 200 steps on 2 × 2 ranks, two seeds. 10 rows ran at ba7c696, 6 at 7d44caa "
        "(replicate bytes 800 more: the zero-momentum flag bytes of stop 31; the Newton–Schulz code is the same)."),
    "polar_convergence_best.csv": (
        "python launch/bench/convergence.py … --csv results/polar_convergence.csv (above)",
        "Per variant of the table above, the mean, min and max final val loss over its two seeds."),
    "polar_quality.csv": ("python launch/bench/polar_quality.py",
                          "The polar step on real momenta of the benchmark GPT (Sign-Muon + Lion, steps 10, 50, 100), "
                          "whole matrices and the row blocks of 2 FSDP2 shards: the fraction of signs equal to the "
                          "exact polar factor's (float64 SVD), its relative error, and the fp32 CPU time per call "
                          "(one thread, all variants interleaved in one run; time_vs_default: over 5 quintic steps "
                          "on the same shape)."),
    "scalar_quality.csv": ("python launch/bench/nonmatrix_quality.py",
                           "Lion-vote against AdamW for the non-matrix parameters (BPE-4096: the tied embedding/head "
                           "is 40 % of the 1.3 M parameters; 2 replicas × 2 FSDP2 shards, 200 steps): the best "
                           "non-matrix lr of four at seed 0, its two seeds, and the ratio to AdamW's val loss."),
    "scalar_quality_lion_beta2_099.csv": (
        "python launch/bench/nonmatrix_quality.py --lion-betas 0.9 0.99 --csv results/scalar_quality_lion_beta2_099.csv",
        "The same with Lion's betas (0.9, 0.99) instead of (0.9, 0.95)."),
    "slowlink.csv": ("sudo python launch/bench/slowlink.py --lr-from results/convergence.csv",
                     "Time to target on two emulated nodes, the earlier machine, the link's fixed 256 KiB token "
                     "bucket (its 10 Mbit/s times of the methods that send ≤ 256 KiB a step are too short: "
                     "docs/benchmarks.md). The target is `ddp_adamw`'s final val loss without a limit; the ratio "
                     "is to `ddp_adamw` at the same rate; the step is the median step time."),
    "slowlink_4ms_bucket.csv": (
        ("sudo python launch/bench/slowlink.py --lr-from results/convergence.csv --rates 100mbit 10mbit "
         "--methods ddp_adamw localsgd powersgd_rank1 signmuon_lion --csv results/slowlink_4ms_bucket.csv",
         "sudo python launch/bench/slowlink.py --lr-from results/convergence.csv --rates 100mbit "
         "--methods ddp_adamw signmuon dion_1/4 --csv results/slowlink_4ms_bucket.csv"),
        "The same on the later machine, the token bucket 4 ms of the rate (at least 16 KiB)."),
    "slowlink_overlap.csv": (
        ("sudo python launch/bench/slowlink.py --lr-from results/convergence.csv --procs-per-node 1 --rates 100mbit "
         "--methods ddp_adamw dion_1/4 signmuon signmuon_lion --overlap-backward --csv results/slowlink_overlap.csv",
         "sudo python launch/bench/slowlink.py --lr-from results/convergence.csv --procs-per-node 1 --rates 100mbit "
         "10mbit --methods ddp_adamw dion_1/4_lion signmuon_lion --ns-steps 3 --ns-coefficients polar_express "
         "--overlap-backward --csv results/slowlink_overlap.csv",
         "sudo python launch/bench/slowlink.py --lr-from results/convergence.csv --procs-per-node 2 --rates 100mbit "
         "10mbit --methods ddp_adamw signmuon_lion local_muon_H10_sign_mean_b128 --outer-lrs 0.7 --outer-momenta 0 "
         "--csv results/slowlink_overlap.csv",
         "… the same with --outer-overlap (--methods ddp_adamw local_muon_H10_sign_mean_b128)"),
        "The exchange hidden, on two emulated nodes (the 4 ms token bucket), one campaign on one day: with 1 process "
        "per node the per-step methods with the exchange during backward off and on (…_overlap; bitwise the same "
        "losses) and Sign-Muon with 3 Polar Express steps (…_ns3_polar_express); with 2, the local-steps config of "
        "the README (H = 10, sign_mean block 128, outer lr 0.7, momentum 0) with the exchange waited on and one "
        "round late (…_overlap). Target: `ddp_adamw`'s final val loss without a limit at the same procs per node."),
    "slowlink_vote_bits.csv": (
        "sudo python launch/bench/slowlink.py --lr-from results/convergence.csv --procs-per-node 1 --rates 100mbit "
        "10mbit --methods ddp_adamw signmuon_lion --ns-steps 3 --ns-coefficients polar_express "
        "--csv results/slowlink_vote_bits.csv",
        "Sign-Muon + Lion against `ddp_adamw` on two emulated nodes (the 4 ms token bucket, 1 process per node), "
        "one campaign after the vote's bit work got cheaper (5462172: the same values, less CPU time), with "
        "Sign-Muon + Lion on 3 Polar Express steps (…_ns3_polar_express)."),
    "trainers.csv": ("python launch/bench/trainer_bytes.py",
                     "The replicate-axis bytes one rank sends under Lightning and torchtitan (tests/lightning_scenarios.py, "
                     "tests/torchtitan_scenarios.py: 2 CPU processes, a tiny GPT, Sign-Muon + Lion-vote, max_grad_norm "
                     "1.0, a save after step 3): an ordinary step, step 1 (+ the double-averaging check) and the step "
                     "after the save (+ the momentum average), beside an fp32 all-reduce of every parameter. "
                     "docs/trainers.md quotes them; tests/test_lightning.py and tests/test_torchtitan.py compare their "
                     "own runs with this file."),
    "step_split.csv": ("python launch/bench/step_split.py --ns-steps 3 --ns-coefficients polar_express",
                       "Where the optimizer step's time goes (2 replicas of one process, this machine, no link "
                       "limit): each op's self CPU time in the profiled steps (torch.profiler), summed by category, "
                       "and its share of the profiled optimizer step; step_ms and opt_step_ms are the unprofiled "
                       "steps' medians (the DDP script logs no optimizer time)."),
    "orthonormalize.csv": ("python launch/bench/orthonormalize.py",
                           "Dion's orthonormalization per qr_method in float32 on the CPU, stacks of 2 P (a×r) per "
                           "matrix class: the worst ‖QᵀQ − I‖₂ and ‖P − Q·QᵀP‖_F/‖P‖_F, the fewest singular values "
                           "of Q above 1/2 (r = full rank) and the matrices zeroed on the device (an all-zero P is "
                           "always zeroed). None of the methods reads a value back to the host."),
    "orthonormalize_dion.csv": ("python launch/bench/orthonormalize.py",
                                "Dion (rank_fraction 1/4, r = 64) fitting a 3-layer MLP student to a random teacher, "
                                "one run per qr_method from the same weights and batches; batch 8 makes the first "
                                "P exactly rank deficient. weights_vs_qr: the largest ‖X − X_qr‖/‖X_qr‖ over the "
                                "layers against the Householder run."),
    "step_collectives.csv": ("python launch/bench/step_ops.py",
                             "The collectives of the steps in step_ops.csv: kind, dtype and device of the tensor "
                             "handed to torch.distributed, calls per step (GPT-2 small, fake process group; on a "
                             "GPU the device is the params')."),
    "step_ops.csv": ("python launch/bench/step_ops.py",
                     "Aten ops dispatched and host syncs (device values read back: .item(), .tolist(), bool(t)) per "
                     "optimizer step, the second step, rank 0 of M on torch's fake process group, GPT-2 small "
                     "(Sign-Muon with Lion, Dion 1/4 with AdamW for the non-matrix params; matmuls counted, not "
                     "computed). On a GPU each op is a kernel launch, each sync a stall."),
    "step_memory.csv": ("python launch/bench/step_memory.py --llama1b",
                        "The RSS high-water mark of one step above the steady state, a fresh process per row, one "
                        "thread."),
    "torchft_localsteps.csv": ("H=10 EXCHANGE=sign_mean SEED=7 TODAY=1 CSV=results/torchft_localsteps.csv bash "
                               "launch/torchft_local.sh --tokenizer bpe",
                               "Fault tolerance on torchft (docs/design.md §13): 3 replica groups of "
                               "integrations/fsdp/train.py --fault-tolerant, local steps (sign_mean, H = 10), one group "
                               "SIGKILLed and restarted; the same job without the failure; today's figure: one torchrun "
                               "world without torchft, the same kill (launch/torchft_table.py)."),
    "torchft_perstep.csv": ("H=0 SEED=40 TODAY=1 CSV=results/torchft_perstep.csv bash launch/torchft_local.sh "
                            "--tokenizer bpe --optimizer signmuon --nonmatrix-algorithm lion",
                            "As torchft_localsteps.csv, per-step Sign-Muon + Lion: a round per step, a step whose "
                            "round is not committed runs again (launch/torchft_table.py)."),
    "deepspeed_zero_memory.csv": ("bash launch/deepspeed_memory_history.sh",
                                  "Bytes per parameter per rank, the DeepSpeed plugin's Sign-Muon bf16 at ZeRO 2 against "
                                  "DeepSpeed's own ZeRO 2 AdamW bf16 measured in the same launch (GPT of 12.7M params, 4 "
                                  "CPU ranks, largest over the ranks), all rows in one run: `before` the plugin at 3ff95c7 "
                                  "(the stage-0 wrapper's masters), `owned-masters` at b72af4c, `node-mean` at 160f850 (the fp32 "
                                  "node mean on the owned masters), `after` this code (bf16 masters packed between steps), on "
                                  "the 2 × 2 mesh and on 1 × 4 (one partition over the 4 ranks, as DeepSpeed's). weights.."
                                  "total: the tensors held (a walk of the engine, wrapper and optimizer; largest over 3 "
                                  "moments); step_peak: the optimizer step's RSS high-water mark above what was held "
                                  "before it (shardopt's bucket_bytes 1 MiB); device_peak: the allocator's peak, CUDA only."),
    "sizes.csv": (("python launch/bench/sizes.py --sizes S --steps 200 --configs ddp_adamw "
                   "local_muon_H30_sign_mean_b128 muloco_H30 local_muon_H30_topk",
                   "python launch/bench/sizes.py --sizes S --steps 400 --configs local_muon_H5_sign_mean_b128 "
                   "local_muon_H10_sign_mean_b128 local_muon_H30_sign_mean_b128 --outer-lrs 0.7 1 --outer-momenta 0",
                   "python launch/bench/sizes.py --sizes S --steps 400 --configs ddp_adamw --lr-factors 0.5 1",
                   "python launch/bench/sizes.py --sizes S --steps 400 --configs local_muon_H5_mean "
                   "local_muon_H30_topk_as_sign_mean_b128 --outer-lrs 0.7 --outer-momenta 0",
                   "python launch/bench/sizes.py --sizes S --steps 400 --configs local_muon_H30_sign_mean_b128 "
                   "--outer-lrs 0.7 --outer-momenta 0 --lr-factors 0.5",
                   "python launch/bench/sizes.py --sizes S M --steps 200 --configs ddp_muon local_defaults",
                   "python launch/bench/sizes.py --sizes S M --steps 200 --configs local_muon_H30_sign_vote_b128 "
                   "--outer-lrs 0.7 --outer-momenta 0",
                   "python launch/bench/sizes.py --sizes S M --steps 200 --configs ddp_adamw --lr-factors 0.25 0.5 1",
                   "python launch/bench/sizes.py --sizes M --steps 200 --configs ddp_adamw --lr-factors 0.125",
                   "python launch/bench/sizes.py --sizes L --steps 200 --configs ddp_adamw --lr-factors 0.25",
                   "python launch/bench/sizes.py --sizes L --steps 200 --configs local_muon_H10_sign_mean_b128 "
                   "--outer-lrs 0.7 --outer-momenta 0",
                   "python launch/bench/sizes.py --sizes S --steps 200 --configs local_muon_H30_sign_vote "
                   "local_muon_H30_sign_vote_b128 --outer-lrs 0.7 1 --outer-momenta 0 --seeds 0 1",
                   "python launch/bench/sizes.py --sizes S --steps 200 --configs local_muon_H30_sign_vote --seeds 0 1",
                   "python launch/bench/sizes.py --sizes S --steps 200 --configs signmuon_lion dion_1/4_lion",
                   "python launch/bench/sizes.py --sizes S --steps 400 --configs muloco_H30 "
                   "local_muon_H30_topk_as_int4 --outer-lrs 0.7 --outer-momenta 0",
                   "python launch/bench/sizes.py --sizes L --steps 200 --configs ddp_adamw ddp_muon --lr-factors 0.5 1",
                   "python launch/bench/sizes.py --sizes S M L --steps 200 --configs local_defaults --seeds 0 1 "
                   "--lr-factors 0.5 1 2",
                   "python launch/bench/sizes.py --sizes S M L --steps 200 --configs local_muon_H40_sign_vote_b128 "
                   "--outer-lrs 0.7 --outer-momenta 0",
                   "python launch/bench/sizes.py --sizes S --steps 200 --configs local_muon_H40_sign_vote_b128 "
                   "--outer-lrs 0.7 --outer-momenta 0 --seeds 0 1 --lr-factors 0.5 1 2",
                   "python launch/bench/sizes.py --sizes S --steps 200 --configs local_muon_H10_sign_vote_b128 "
                   "local_muon_H50_sign_vote_b128 local_muon_H100_sign_vote_b128 --outer-lrs 0.7 --outer-momenta 0",
                   "python launch/bench/sizes.py --sizes S --steps 1000 --configs local_muon_H40_sign_vote_b128 "
                   "--outer-lrs 0.7 --outer-momenta 0",
                   "python launch/bench/sizes.py --sizes S --steps 1000 --configs ddp_adamw --lr-factors 0.5",
                   "python launch/bench/sizes.py --sizes M L --steps 200 --configs signmuon_lion",
                   "python launch/bench/sizes.py --sizes S --steps 200 --configs ddp_muon --lr-factors 0.5 1 2 --seeds 0 1",
                   "python launch/bench/sizes.py --sizes L --steps 200 --configs ddp_muon --lr-factors 0.5",
                   "python launch/bench/sizes.py --sizes S --steps 200 --configs ddp_adamw --lr-factors 0.5 --seeds 1",
                   "python launch/bench/sizes.py --sizes L --steps 200 --configs ddp_adamw --lr-factors 0.125 0.0625 0.03125",
                   "python launch/bench/sizes.py --sizes S --steps 200 --configs diloco_m0.6_H30 diloco_m0.6_H100",
                   "python launch/bench/sizes.py --sizes M --steps 200 --configs dion_1/4_lion",
                   "python launch/bench/sizes.py --sizes M --steps 200 --configs diloco_m0.6_H30 --lr-factors 0.5",
                   "python launch/bench/sizes.py --sizes S M --steps 200 --configs muloco_H30 local_muon_H30_sign_mean_b128 "
                   "local_muon_H30_topk_as_sign_mean_b128 local_muon_H30_topk_as_int4 --outer-lrs 0.7 --outer-momenta 0",
                   "python launch/bench/sizes.py --sizes M --steps 200 --configs local_muon_H100_sign_vote_b128 "
                   "--outer-lrs 0.7 --outer-momenta 0",
                   "python launch/bench/sizes.py --sizes L --steps 200 --configs dion_1/4_lion",
                   "python launch/bench/sizes.py --sizes L --steps 200 --configs muloco_H30 --outer-lrs 0.7 "
                   "--outer-momenta 0",
                   "python launch/bench/sizes.py --sizes L --steps 200 --configs diloco_m0.6_H30 --lr-factors 0.125",
                   "python launch/bench/sizes.py --sizes M --steps 200 --configs ddp_muon local_defaults --seeds 1",
                   "python launch/bench/sizes.py --sizes M --steps 200 --configs ddp_adamw --lr-factors 0.25 --seeds 1",
                   "python launch/bench/sizes.py --sizes M --steps 200 --configs local_muon_H40_sign_vote_b128 "
                   "--outer-lrs 0.7 --outer-momenta 0 --seeds 0 1 --lr-factors 0.5 1 2",
                   "python launch/bench/sizes.py --sizes M --steps 200 --configs ddp_muon local_defaults --lr-factors 0.5 2",
                   "python launch/bench/sizes.py --sizes M --steps 200 --configs signmuon_lion --lr-factors 0.5",
                   "python launch/bench/sizes.py --sizes L --steps 200 --configs ddp_adamw --lr-factors 0.0625 --seeds 1",
                   "python launch/bench/sizes.py --sizes L --steps 200 --configs signmuon_lion --lr-factors 0.5",
                   "python launch/bench/sizes.py --sizes L --steps 200 --configs ddp_muon --seeds 1",
                   "python launch/bench/sizes.py --sizes L --steps 200 --configs signmuon_lion --lr-factors 0.25",
                   "python launch/bench/sizes.py --sizes L --steps 200 --configs local_muon_H40_sign_vote_b128 "
                   "--outer-lrs 0.7 --outer-momenta 0 --seeds 1",
                   "python launch/bench/sizes.py --sizes S --steps 200 --configs signmuon_lion --lr-factors 0.5 2",
                   "python launch/bench/sizes.py --sizes M --steps 200 --configs signmuon_lion --lr-factors 0.25",
                   "python launch/bench/sizes.py --sizes M --steps 200 --configs signmuon_lion --lr-factors 0.5 --seeds 1",
                   "python launch/bench/sizes.py --sizes S --steps 200 --configs signmuon_lion --seeds 1",
                   "python launch/bench/sizes.py --sizes L --steps 200 --configs signmuon_lion --lr-factors 0.125",
                   "python launch/bench/sizes.py --sizes L --steps 200 --configs ddp_muon --lr-factors 2",
                   "python launch/bench/sizes.py --sizes L --steps 200 --configs local_muon_H40_sign_vote_b128 --outer-lrs 0.7 --outer-momenta 0 --lr-factors 0.5 2",
                   "python launch/bench/sizes.py --sizes L --steps 200 --configs signmuon_lion --lr-factors 0.25 --seeds 1",
                   "python launch/bench/sizes.py --sizes L --steps 200 --configs local_defaults --lr-factors 0.5 2",
                   "python launch/bench/sizes.py --sizes L --steps 200 --configs local_muon_H30_sign_mean_b128 "
                   "--outer-lrs 0.7 --outer-momenta 0",
                   "python launch/bench/sizes.py --sizes L --steps 200 --configs local_muon_H40_sign_vote_b128 "
                   "--outer-lrs 0.7 --outer-momenta 0 --lr-factors 4",
                   "python launch/bench/sizes.py --sizes L --steps 200 --configs local_muon_H100_sign_vote_b128 "
                   "--outer-lrs 0.7 --outer-momenta 0",
                   "python launch/bench/sizes.py --sizes L --steps 200 --configs local_muon_H30_topk_as_sign_mean_b128 "
                   "--outer-lrs 0.7 --outer-momenta 0",
                   "python launch/bench/sizes.py --sizes L --steps 200 --configs local_muon_H30_topk_as_int4 "
                   "--outer-lrs 0.7 --outer-momenta 0"
                   "   # (each resumes: rows already there are kept; the figure: results/sizes.png)"),
                  "Issue 42's campaign: the benchmark GPT at sizes S, M, L (integrations/model.SIZES), 4 replicas × "
                  "1 rank; x_fewer_bytes against ddp_adamw of the same size and steps (its best lr). Not every row "
                  "of these grids ran (the runs column of docs/benchmarks.md's table counts those that did). "
                  "local_defaults_m0.6 and local_defaults_b4096_m0: the rows of the earlier defaults (outer momentum "
                  "0.6, block 4096), run as local_defaults then; final_model: the model a row evaluated (rows from "
                  "before train.py's final sync, where H does not divide the steps, evaluated rank 0's). The "
                  "summary by size, with the gaps: docs/benchmarks.md \"Model sizes\"."),
    "step_time.csv": ("python launch/bench/step_time.py",
                      "Optimizer step time and state memory per matrix (one GPT-2-small layer's four shapes and "
                      "2048²), all optimizers in one interleaved run, as ratios to fp32 Muon on the same matrix (CPU "
                      "compute only, on a 2-core machine shared with other jobs: the ratios mean more than the "
                      "milliseconds)."),
}
RESULTS_HEADER = """# Results

Every table below is drawn from the CSV under `results/` that heads it, by
`python launch/results_table.py --readme README.md` (which also redraws the README's summary
tables); do not edit it by hand. How the benchmarks ran and what they found:
[benchmarks.md](benchmarks.md).
"""


def shown(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.resolve().is_relative_to(ROOT) else path.as_posix()


def default_csvs() -> list[Path]:
    """results/*.csv, demo.csv first (the curves are drawn in the PNGs, not tabled)."""
    return sorted((p for p in (ROOT / "results").glob("*.csv") if not p.name.endswith("_curves.csv")),
                  key=lambda p: (p.name != "demo.csv", p.name))


def results_document(paths: list[Path]) -> str:
    """docs/results.md: per CSV, what its table shows, the command that reruns it, the table."""
    missing = [p.name for p in paths if p.name not in SOURCES]
    if missing:
        raise SystemExit(f"no command for {', '.join(missing)}: add it to SOURCES in {shown(Path(__file__))}")
    sections = []
    for path in paths:
        commands, caption = SOURCES[path.name]
        rerun = ", then ".join(f"`{c}`" for c in ((commands,) if isinstance(commands, str) else commands))
        sections.append(f"## {shown(path)}\n\n{caption}\n\nRerun: {rerun}\n\n{table(read_csv(path))}\n")
    return "\n".join([RESULTS_HEADER] + sections)


README_BLOCKS = {"headline": headline_table, "demo": training_table, "slowlink": slowlink_summary,
                 "localsteps": localsteps_summary, "sizes": sizes_gap_table, "sizes_horizons": sizes_horizon_table,
                 "sizes_summary": sizes_summary, "sizes_topk": sizes_topk_table,
                 "lightning_bytes": lambda rows: trainer_bytes_table(rows, "lightning"),
                 "torchtitan_bytes": lambda rows: trainer_bytes_table(rows, "torchtitan"), "torchft": torchft_table.markdown}
# other documents with <!-- NAME:begin (results/X.csv) --> blocks, redrawn with the README
DOCS_WITH_TABLES = ("docs/trainers.md", "docs/benchmarks.md")
README_BLOCK = re.compile(r"(<!-- (\w+):begin \((results/[\w./-]+\.csv)\) -->\n).*?(<!-- \2:end -->)", re.S)


def readme_with_tables(content: str) -> str:
    """`content` with every block <!-- NAME:begin (results/X.csv) --> … <!-- NAME:end --> redrawn from
    results/X.csv by README_BLOCKS[NAME]."""
    def redraw(match: re.Match) -> str:
        begin, name, source, end = match.groups()
        if name not in README_BLOCKS:
            raise SystemExit(f"README block {name!r}: no such table; known: {', '.join(README_BLOCKS)}")
        return f"{begin}{README_BLOCKS[name](read_csv(ROOT / source))}\n{end}"
    redrawn, count = README_BLOCK.subn(redraw, content)
    if not count:
        raise SystemExit("the README has no <!-- NAME:begin (results/X.csv) --> … <!-- NAME:end --> block")
    return redrawn


def write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(path.suffix + ".tmp")
    temporary.write_text(text)
    temporary.replace(path)


def regenerate(readme: Path, results: Path) -> None:
    """Redraw `readme`'s summary tables and write `results` (docs/results.md) from results/*.csv."""
    write_atomically(readme, readme_with_tables(readme.read_text()))
    write_atomically(results, results_document(default_csvs()))


def redraw_documents(root: Path) -> None:
    """Redraw the blocks of DOCS_WITH_TABLES under `root` from results/*.csv."""
    for document in DOCS_WITH_TABLES:
        write_atomically(root / document, readme_with_tables((root / document).read_text()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", nargs="*", type=Path, help="default: results/demo.csv, then the other results/*.csv")
    parser.add_argument("--readme", type=Path, help="redraw this README's summary tables (and those of "
                        "docs/trainers.md) and write docs/results.md beside it (from every results/*.csv) instead of printing")
    args = parser.parse_args()
    if args.readme:
        if args.csv:
            parser.error("--readme draws from every results/*.csv; give no CSV with it")
        results = args.readme.parent / "docs" / "results.md"
        regenerate(args.readme, results)
        redraw_documents(args.readme.parent)
        print(f"redrew the tables of {args.readme} and {', '.join(DOCS_WITH_TABLES)}, and wrote {results}")
    else:
        print("\n\n".join(f"{shown(p)}\n{table(read_csv(p))}" for p in [p.resolve() for p in args.csv] or default_csvs()))


if __name__ == "__main__":
    main()
