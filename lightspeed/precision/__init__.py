"""Precision: which dtype each role uses, fp16 loss scaling, the overflow check, float8 training.

`policy.py` (`PrecisionPolicy`, resolved once from the config with DeepSpeed's defaults; strategies read
it and allocate accordingly), `loss_scaler.py` (static and DeepSpeed's dynamic scaler; the caller passes
an overflow flag already agreed across ranks), `overflow.py` (one fused inf/nan check, no host sync),
`float8.py` (the `float8` section: torchao's `Float8Linear` swapped in by `initialize()` before the
strategy is built, the same Parameter objects kept, so masters, optimizer and every ZeRO stage are
unchanged; torchao is the `float8` extra). Must not: cast or allocate the strategies' buffers, or
communicate.
"""
