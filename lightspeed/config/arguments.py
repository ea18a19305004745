"""`add_config_arguments(parser)`: DeepSpeed's command-line flags that name the config file.

Owns the four flags of `deepspeed.add_config_arguments`: `--deepspeed` and `--deepscale` (switches for
the user's own code; nothing in lightspeed reads them), `--deepspeed_config` and its deprecated
spelling `--deepscale_config` (the file `initialize(args=...)` loads). Standard library only.
"""

from __future__ import annotations

import argparse


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's config flags to `parser` in a group named "DeepSpeed"; returns the parser."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="enable DeepSpeed (a switch for the script itself; the library does not read it)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed JSON configuration file")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help="deprecated spelling of --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str,
                       help="deprecated spelling of --deepspeed_config")
    return parser
