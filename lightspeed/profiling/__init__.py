"""Profiling (DeepSpeed's `deepspeed.profiling`): the flops profiler on torch.utils.flop_counter, peak
throughput of known devices for MFU, and the engine's profiled step.

Layer: above config, below runtime; imports only `_utils`.
"""
