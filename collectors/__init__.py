"""Hardware collectors (GPU, MPS, RDMA, ethtool, NCCL): one module per source."""
