"""How blocks of attention run: the engines, their layouts, the kernels and the tuning table.

- ``softmax``: softmax attention of a batch of blocks (eager, torch's fused CPU kernel) forward and
  backward, and the log-sum-exp merge that joins blocks over disjoint keys.
- ``layouts``: which blocks a pattern computes (``Group``: band, segments, gathered), each checked.
- ``blocksparse``: the block-sparse engine of sparse, pattern and local, one autograd Function; its
  chunks (``blocksparse_chunks``), forward (``blocksparse_forward``) and backward
  (``blocksparse_backward``) in modules of their own.
- ``tiles``: exact attention of query blocks to windows of a key table (routing), one Function.
- ``band``: the sliding window (and sinks) on the block-sparse engine.
- ``flex``: on CUDA, torch's FlexAttention (compiled) for the mask mechanisms instead of the engine.
- ``cluster_tiles``: routing's layouts, balanced tiles and causal cluster tiles.
- ``native``: the opt-in C kernel for short blocks (compiled on first use).
- ``memory``: output assembly and buffers that cost no page faults.
- ``threads``: calls on the free cores while other processes keep cores busy.
- ``tuning``: every block size and element budget, documented and overridable.

Modules here import nothing from ``mechanisms``; mechanisms import them.
"""
