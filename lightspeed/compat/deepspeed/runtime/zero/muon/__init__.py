"""`deepspeed.runtime.zero.muon`: DeepSpeed's Muon modules, over lightspeed.optim.muon and lightspeed.ops.muon."""
