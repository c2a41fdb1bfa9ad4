"""extensions/__init__.py: what this project adds beyond the BOOST paper (arXiv 2512.12131).

The files at the repository's root tell BOOST's story and never import this package; these extend
it, and train.py (through plumbing/placement.py), the tools and the tests import them:

  lax_layers     LaX's crossing under TP: a mixin before a layout's layer class (registers itself)
  muon           --optimizer=muon: Muon for the low-rank factors, three distributed paths
  buckets        Muon's collectives: several matrices' pieces gathered at once, or made whole
                 on one owner rank each (all-to-all)
  dp_shard       --dp_shard=grad|full: FSDP2 on the data-parallel dimension
  kernel_ops     the local ops as torch.compile sees them: custom ops around the Triton kernels,
                 their autograd (registers itself as local_ops.py's Triton side)
  kernel_choice  --kernels=auto: each op and shape timed both ways, agreed across ranks
  schedule_sim   a pipeline schedule's actions and timeline, built without processes
  cuda_graph     --cuda_graph=true: the training step captured as one CUDA graph, replayed
"""
