"""Compatibility packages that present lightspeed under another library's name.

`deepspeed/` is the `deepspeed` module tree that `register_as_deepspeed()` exposes: thin re-exports and
adapters of lightspeed's own objects, with DeepSpeed's names and signatures, and no logic of its own.
It is the top layer (it may import every other package of lightspeed); nothing in lightspeed imports it
except the registration and the launcher's `--as_deepspeed` entry point (`lightspeed/as_deepspeed.py`:
register, then run the script as `__main__`, for torchrun and accelerate launch). `lightspeed.comm`,
`.compat` and `.zero` are lazy attributes of `import lightspeed`.
"""

from lightspeed.compat.registration import (DEEPSPEED_VERSION, RegistrationError, is_registered,
                                            register_as_deepspeed, unregister_as_deepspeed)

__all__ = ["DEEPSPEED_VERSION", "RegistrationError", "is_registered", "register_as_deepspeed",
           "unregister_as_deepspeed"]
