"""`python -m lightspeed.as_deepspeed [--override] (script.py | -m module) [args ...]`: run an unchanged
DeepSpeed script with lightspeed registered as `deepspeed` (see `lightspeed.register_as_deepspeed`).

The script runs as `python script.py args` would run it: as `__main__`, with `sys.argv` = [script,
*args] and the script's directory first on `sys.path` (with -m: `python -m module args`). This is the
form for launchers that start Python themselves:
    torchrun --nproc_per_node 2 -m lightspeed.as_deepspeed train.py --deepspeed ds_config.json
The `lightspeed` launcher's `--as_deepspeed` makes every rank run through this module.
Must not: do anything but register and hand over (no torch import of its own).
"""

from __future__ import annotations

import os
import runpy
import sys

USAGE = "usage: python -m lightspeed.as_deepspeed [--override] (script.py | -m module) [args ...]"


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    override = False
    if argv and argv[0] == "--override":
        override = True
        argv.pop(0)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return
    module = None
    if argv and argv[0] == "-m":
        if len(argv) < 2:
            sys.exit(f"lightspeed.as_deepspeed: error: -m needs a module name\n{USAGE}")
        module, argv = argv[1], argv[2:]
    elif not argv:
        sys.exit(f"lightspeed.as_deepspeed: error: no script given\n{USAGE}")
    elif not os.path.isfile(argv[0]):
        sys.exit(f"lightspeed.as_deepspeed: error: script not found: {argv[0]}")

    from lightspeed.compat.registration import RegistrationError, register_as_deepspeed

    try:
        register_as_deepspeed(override=override)
    except RegistrationError as e:
        sys.exit(f"lightspeed.as_deepspeed: error: {e}")
    if module is not None:
        sys.argv = [module, *argv]  # runpy puts the module's path in argv[0], as python -m does
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script = argv[0]
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(script))  # where `python script.py` would look first
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
