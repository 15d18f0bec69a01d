"""The papers' published figures the model is set against, each held once, with where
it is printed. `paper` (their scaling figures) and `measurements` (the table of
published measurements) both read them here. torch's own DDP benchmark, a README
rather than a paper, keeps its figures beside its servers in `torch_bench`.
"""

from __future__ import annotations

# Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training"
# (VLDB 2020, arXiv 2006.15704). Section 5: an exclusive cluster of 32 V100 (4 servers
# of 8), where the overlap and bucket-size experiments ran. Section 5.1 (Figure 6): the
# overlapping approach "helps ResNet and BERT on NCCL attain 38.0% and 35.2% speedup"
# over all-reducing after backward (26.8% and 21.5% on Gloo).
LI_GPUS = 32
LI_OVERLAP = {"resnet50": 0.380, "bert_large": 0.352}  # NCCL
LI_OVERLAP_SOURCE = "Li et al. 2020, section 5.1 (Figure 6)"

# Goyal et al., "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour" (arXiv
# 1706.02677). Sections 1 and 5.5: ~90% scaling efficiency for ResNet-50 from 8 to 256
# P100 (32 Big Basin servers of 8). Section 4: between the 32 servers, recursive
# halving-doubling was much faster than the ring for buffers up to about a million
# elements, and 3x faster.
GOYAL_E256 = 0.90  # E(256) against 8 GPUs
GOYAL_E256_SOURCE = "Goyal et al. 2017, sections 1 and 5.5: ~90% from 8 to 256 GPUs"
GOYAL_SERVERS = 32
GOYAL_SPEEDUP = 3.0  # halving-doubling over the ring, 32 servers: ring time / h-d time
