"""Model parallelism shared by training and inference: where each parameter lives on the mesh
(`placement.py`), the tensor-parallel plan (`tp_plan.py`), the recognition of the layers a plan names
(`module_kinds.py`), the training transform that splits a model into Megatron-style column- and
row-parallel layers (`tensor_parallel.py`), DeepSpeed's AutoTP training section and `tp_model_init`
(`autotp.py`), and DeepSpeed's mixture-of-experts layer with expert parallelism (`experts/`).

Sits below zero/, runtime/ and inference/, above comm/: collectives go through comm/ only, and nothing
here imports inference/ (inference imports the plan from here). Tensor parallelism is tested against
one process in tests/distributed/test_tensor_parallel_training.py and, with sequence parallelism,
test_tensor_sequence_parallel.py; experts in tests/unit/parallel/test_moe_gating.py (against DeepSpeed's
own outputs) and tests/distributed/test_moe_training.py."""
