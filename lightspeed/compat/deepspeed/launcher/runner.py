"""`deepspeed.launcher.runner`: `DEEPSPEED_ENVIRONMENT_NAME`, the file of KEY=VALUE lines a multi-node
launch exports to every node (read by `lightspeed`'s multi-node launcher, lightspeed/launcher/multinode.py)."""

import os

from lightspeed.launcher.multinode import env_file_names

DEEPSPEED_ENVIRONMENT_NAME = env_file_names(dict(os.environ))[0]

__all__ = ["DEEPSPEED_ENVIRONMENT_NAME"]
