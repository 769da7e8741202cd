"""Benchmarks of zerofn against DDP, ZeroRedundancyOptimizer, FSDP2 and DeepSpeed (see README.md)."""
