"""Precision: which dtype each role uses, fp16 loss scaling, the overflow check, float8 training.

`policy.py` (`PrecisionPolicy`, resolved once from the config with DeepSpeed's defaults; strategies read
it and allocate accordingly), `loss_scaler.py` (static and DeepSpeed's dynamic scaler; the caller passes
an overflow flag already agreed across ranks), `overflow.py` (one fused inf/nan check, no host sync),
`float8.py` (the `float8` section: torchao's `Float8Linear` swapped in by `initialize()` before the
strategy is built, the same Parameter objects kept, so masters, optimizer and every ZeRO stage are
unchanged; torchao is the `float8` extra), `module_dtypes.py` (the model's parameters to the training dtype,
its buffers kept in theirs unless `data_types.buffer_dtype`, and the buffers `data_types.keep_in_fp32_modules`
names kept in fp32: DeepSpeed 0.19.8's rules, run once at set-up). Must not: cast or allocate the strategies'
buffers, or communicate.
"""
