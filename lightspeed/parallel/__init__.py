"""Model parallelism shared by training and inference: where each parameter lives on the mesh
(`placement.py`), the tensor-parallel plan (`tp_plan.py`), the recognition of the layers a plan names
(`module_kinds.py`), the training transform that splits a model into Megatron-style column- and
row-parallel layers (`tensor_parallel.py`), and DeepSpeed's AutoTP training section and `tp_model_init`
(`autotp.py`).

Sits below zero/, runtime/ and inference/, above comm/: collectives go through comm/ only, and nothing
here imports inference/ (inference imports the plan from here). Tensor parallelism is tested against
one process in tests/distributed/test_tensor_parallel_training.py and, with sequence parallelism,
test_tensor_sequence_parallel.py."""
