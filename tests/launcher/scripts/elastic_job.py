"""An elastic training job: resume from SAVE_DIR's latest checkpoint when there is one, train to step
TOTAL with the batch the `elasticity` section gives at this world size, saving after every step; rank 0
appends one JSON line per step to LOG. At world size 2, after step 2 the ranks all-reduce in a loop
until a peer disappears (the test kills one node); each rank first writes its pid to
LOG.worker_of_agent<agent pid>. Usage: elastic_job.py SAVE_DIR LOG TOTAL."""

import json
import os
import sys
import time

import torch

import lightspeed
from lightspeed.comm.collectives import Communicator

save_dir, log, total = sys.argv[1], sys.argv[2], int(sys.argv[3])
config = {"optimizer": {"type": "SGD", "params": {"lr": 0.1}},
          "elasticity": {"enabled": True, "max_train_batch_size": 8, "micro_batch_sizes": [2, 4], "min_gpus": 1,
                         "max_gpus": 2, "version": 0.1}}
lightspeed.init_distributed()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
engine, _, _, _ = lightspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
if os.path.exists(os.path.join(save_dir, "latest")):
    engine.load_checkpoint(save_dir)
world, rank = engine.world_size, engine.global_rank
x = torch.arange(64, dtype=torch.float32).reshape(16, 4) / 64
while engine.global_steps < total:
    for _ in range(engine.gradient_accumulation_steps()):
        micro = engine.train_micro_batch_size_per_gpu()
        loss = engine(x[rank * micro:(rank + 1) * micro]).pow(2).mean()
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(save_dir)
    if rank == 0:
        with open(log, "a") as f:
            f.write(json.dumps({"world": world, "step": engine.global_steps, "batch": engine.train_batch_size(),
                                "micro": engine.train_micro_batch_size_per_gpu(),
                                "gas": engine.gradient_accumulation_steps(), "pid": os.getpid()}) + "\n")
    if world == 2 and engine.global_steps >= 2:
        comm = Communicator()
        with open(f"{log}.worker_of_agent{os.environ['LIGHTSPEED_AGENT_PID']}", "w") as f:
            f.write(str(os.getpid()))  # the test kills one node: its agent and this worker
        while True:  # until the other node is killed: this collective then fails and the agent restarts us
            comm.all_reduce(torch.ones(1))
            time.sleep(0.1)
