"""Model parallelism shared by training and inference: the tensor-parallel plan (`tp_plan.py`), the
recognition of the layers a plan names (`module_kinds.py`), and the training transform that splits
a model into Megatron-style column- and row-parallel layers (`tensor_parallel.py`).

Sits below runtime/ and inference/, above comm/: collectives go through comm/ only."""
