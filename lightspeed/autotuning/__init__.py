"""The autotuner: `lightspeed --autotuning tune|run script.py ...` (also `lightspeed autotune`) finds the
fastest ds_config for a training script with short experiments, as DeepSpeed's autotuner does, reading
the same ``autotuning`` section.

Modules: `space.py` (the candidates and their ds_configs), `memory.py` (the memory model that prunes
what cannot fit before it runs), `driver.py` (calibration, experiments through the launcher, the
search, the results). The measuring inside each experiment is the engine's
(runtime/autotuning_probe.py). Must not be imported by the training packages: it sits above the
launcher's level, starting processes.
"""
