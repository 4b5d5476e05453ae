"""Library warnings that open every job log and tell its owner nothing to act on.

bitsandbytes logs "Failed to load CPU gemm_4bit_forward from kernels-community" when it is
imported on a CPU with AVX512-BF16 and the optional ``kernels`` package is missing: a faster
4-bit kernel it does without. diffusers imports bitsandbytes whenever it is installed (through
its peft integration), so a script that never quantizes anything carried the warning too.
Errors of that logger still show. Used by the bootstrap (a command job's processes) and by the
built-in runner; standard library only.
"""

import logging

QUIET_LOGGERS = ("bitsandbytes.backends.cpu.ops",)


def quiet_optional_kernel_warnings():
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
